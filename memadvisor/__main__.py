"""``python -m memadvisor ...``: the same command as the ``memadvisor`` script."""

from memadvisor.cli import main

main()
