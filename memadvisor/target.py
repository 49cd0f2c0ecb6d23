"""Load ``path/to/file.py:factory`` or ``package.module:factory`` into a Workload.

The factory returns either ``(model, sample_batch)`` or a mapping with the keys ``model``
and ``sample_batch`` and, optionally, ``loss_fn``, ``optimizer`` (a ``params -> Optimizer``
factory), ``make_batch`` and ``forward_fn``. Probe processes call the same factory, so
each probe starts from the same model a fresh process would build.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from memadvisor.errors import BadInputError, root_cause
from memadvisor.workload import Workload, build_workload

__all__ = [
    "TARGET_MODULE_PREFIX",
    "load_factory",
    "load_target",
    "load_target_file",
    "workload_from_result",
]

# Files loaded by path become modules named PREFIX + stem + hash of the resolved path: the same
# name in every process, so a CUDA probe process can unpickle what the parent's targets define.
TARGET_MODULE_PREFIX = "memadvisor_target_"
_KEYS = {"model", "sample_batch", "loss_fn", "optimizer", "make_batch", "forward_fn"}


def load_factory(target: str) -> Callable[[], Any]:
    """The factory function that ``target`` names.

    Raises:
        BadInputError: the target is malformed, its file or module does not import, or it has
            no such callable.
    """
    module_part, sep, attr = target.rpartition(":")
    if not sep or not module_part or not attr:
        raise BadInputError(
            f"TARGET must be 'path/to/file.py:factory' or 'package.module:factory', but got "
            f"{target!r}."
        )
    if module_part.endswith(".py") or "/" in module_part or "\\" in module_part:
        module = _import_file(Path(module_part))
    else:
        try:
            module = importlib.import_module(module_part)
        except ImportError as e:
            raise BadInputError(f"Cannot import module {module_part!r} from {target!r}: {e}") from e
    factory = getattr(module, attr, None)
    if not callable(factory):
        raise BadInputError(
            f"{module_part!r} has no callable {attr!r}; it defines "
            f"{sorted(n for n in vars(module) if not n.startswith('_'))[:12]}."
        )
    return factory


def _import_file(path: Path) -> Any:
    if not path.is_file():
        raise BadInputError(f"No such file: {str(path)!r} (resolved to {str(path.resolve())!r}).")
    # A stable, unique module name: dataclasses and pickling look the module up by name.
    digest = hashlib.sha1(str(path.resolve()).encode()).hexdigest()[:8]
    name = f"{TARGET_MODULE_PREFIX}{path.stem}_{digest}"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise BadInputError(f"Cannot load {str(path)!r} as a Python module.")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    sys.path.insert(0, str(path.resolve().parent))  # the file's own sibling imports
    try:
        spec.loader.exec_module(module)
    except SystemExit as e:
        del sys.modules[name]
        raise BadInputError(
            f"Importing {str(path)!r} called sys.exit({e.code!r}): code that runs a script "
            "belongs under `if __name__ == '__main__':`."
        ) from e
    except Exception as e:
        del sys.modules[name]
        raise BadInputError(f"Importing {str(path)!r} failed: {type(e).__name__}: {e}") from e
    finally:
        sys.path.remove(str(path.resolve().parent))
    return module


def load_target_file(path: Path) -> Any:
    """Import the file at ``path`` under the module name :func:`load_factory` gives it.

    Raises:
        BadInputError: no such file, or importing it failed.
    """
    return _import_file(path)


def workload_from_result(result: Any, origin: str = "the factory") -> Workload:
    """A Workload from what a factory returned.

    Raises:
        BadInputError: the result is neither ``(model, batch)`` nor a mapping with those keys.
    """
    if isinstance(result, Mapping):
        unknown = set(result) - _KEYS
        if unknown or "model" not in result or "sample_batch" not in result:
            raise BadInputError(
                f"{origin} returned a mapping with keys {sorted(result)}; it needs 'model' and "
                f"'sample_batch', and may have {sorted(_KEYS - {'model', 'sample_batch'})}."
            )
        return build_workload(
            result["model"],
            result["sample_batch"],
            loss_fn=result.get("loss_fn"),
            optimizer=result.get("optimizer"),
            make_batch=result.get("make_batch"),
            forward_fn=result.get("forward_fn"),
        )
    if isinstance(result, tuple) and len(result) == 2:
        return build_workload(result[0], result[1])
    raise BadInputError(
        f"{origin} must return (model, sample_batch) or a dict with 'model' and 'sample_batch', "
        f"but returned {type(result).__name__}."
    )


def load_target(target: str) -> Workload:
    """Import ``target``, call its factory, and make a Workload of the result."""
    factory = load_factory(target)
    try:
        result = factory()
    except SystemExit as e:
        # An argparse error or a guard in the factory: exiting with its code and no word
        # would leave the user guessing.
        raise BadInputError(
            f"{target} called sys.exit({e.code!r}) instead of returning; a factory returns "
            "(model, sample_batch) or a dict, and takes no command-line arguments."
        ) from e
    except Exception as e:
        raise BadInputError(f"{target} raised {type(e).__name__}: {e}{_cause_words(e)}") from e
    return workload_from_result(result, origin=target)


def _cause_words(error: BaseException) -> str:
    """`` (caused by Type: first line)`` for the innermost error ``error`` was raised from
    (:func:`~memadvisor.errors.root_cause`), '' where it was raised from none.

    Why: a library's lazy import hides what failed behind its own message. transformers says
    "Could not import module 'GPT2LMHeadModel'. Are this object's requirements defined
    correctly?" where the cause was torchvision's ops failing to load beside a torch they
    were not built for ("RuntimeError: operator torchvision::nms does not exist"): the user
    is told to look at transformers."""
    root = root_cause(error)
    if root is error:
        return ""
    text = str(root).strip()
    first = text.splitlines()[0] if text else ""
    return f" (caused by {type(root).__name__}{': ' + first if first else ''})"
