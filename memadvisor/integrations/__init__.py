"""memadvisor inside the training frameworks people already use.

* :mod:`memadvisor.integrations.hf`: a Hugging Face ``Trainer`` to a plan, and a plan to the
  ``TrainingArguments`` fields it decides (``pip install 'memadvisor[hf]'``).
* :mod:`memadvisor.integrations.lightning`: ``MemadvisorCallback``, which plans at fit start
  and applies the pick (``pip install 'memadvisor[lightning]'``).

Each module imports without its library; the library is imported when first used, and its
absence is a :class:`~memadvisor.errors.BadInputError` naming the extra to install.
"""

from __future__ import annotations

import importlib
from types import ModuleType

from memadvisor.errors import BadInputError

__all__ = ["require"]


def require(module: str, extra: str) -> ModuleType:
    """Import ``module`` or say which memadvisor extra installs it.

    Raises:
        BadInputError: ``module`` is not installed.
    """
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise BadInputError(
            f"This integration needs {module!r}, which is not installed ({e}); install it with "
            f"pip install 'memadvisor[{extra}]'."
        ) from e
