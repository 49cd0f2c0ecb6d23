"""The ``memadvisor`` command: one thin module per subcommand."""

from __future__ import annotations

import sys

from memadvisor.cli import plan as _plan  # noqa: F401 - registers the command on app
from memadvisor.cli import profile as _profile  # noqa: F401
from memadvisor.cli._app import app

__all__ = ["app", "main"]


def main() -> None:
    """Console-script entry point."""
    sys.exit(app())
