"""Every third-party module the package imports is a dependency it declares.

A fresh install gets only what ``pyproject.toml`` declares: a module that arrives today as
some other package's dependency (``click`` came with typer until typer 0.26 vendored it) is
gone the day that package stops needing it. This test reads the imports from the source
(``memadvisor/`` and ``strategies/``) and maps each import name to its distribution with
``importlib.metadata.packages_distributions()``, so such an import fails here, not in a
user's fresh virtual environment.

The rule: an import the package runs when it is imported (at module level) needs a
``[project] dependencies`` entry; an import inside a function (an optional integration,
imported when used) needs a dependency or an optional extra other than ``dev``. An import
inside ``try: ... except ImportError`` is optional by construction (the code runs without
it) and needs neither.
"""

from __future__ import annotations

import ast
import functools
import re
import sys
from dataclasses import dataclass
from importlib.metadata import packages_distributions
from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib")  # Python 3.11+; CI runs 3.11

ROOT = Path(__file__).resolve().parents[1]
FIRST_PARTY = {"memadvisor", "strategies"}
PACKAGES = ("memadvisor", "strategies")
TEST_ONLY_EXTRAS = {"dev"}


def _normalize(name: str) -> str:
    """PEP 503: distribution names compare case-insensitively, with -, _ and . alike."""
    return re.sub(r"[-_.]+", "-", name).lower()


def _requirement_name(requirement: str) -> str:
    match = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)", requirement)
    assert match, f"cannot read a distribution name from {requirement!r}"
    return _normalize(match.group(1))


@dataclass(frozen=True)
class Import:
    module: str  # the top-level name, e.g. "torch"
    where: str  # file:line
    lazy: bool  # inside a function: runs only when that function is called
    optional: bool  # inside a try whose handler catches ImportError: absence is handled


def _is_type_checking_block(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _catches_import_error(node: ast.Try) -> bool:
    names = {"ImportError", "ModuleNotFoundError"}
    for handler in node.handlers:
        caught = handler.type
        elements = caught.elts if isinstance(caught, ast.Tuple) else [caught]
        if any(isinstance(e, ast.Name) and e.id in names for e in elements):
            return True
    return False


def _imports_of(path: Path, root: Path = ROOT) -> list[Import]:
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    found: list[Import] = []

    def visit(node: ast.AST, *, lazy: bool, optional: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _is_type_checking_block(child):
                continue  # never runs: annotations only
            if isinstance(child, ast.Import):
                names = [alias.name for alias in child.names]
            elif isinstance(child, ast.ImportFrom) and child.level == 0 and child.module:
                names = [child.module]
            else:
                names = []
            for name in names:
                where = f"{path.relative_to(root)}:{child.lineno}"
                found.append(Import(name.split(".")[0], where, lazy, optional))
            if isinstance(child, ast.Try) and _catches_import_error(child):
                for statement in child.body:  # the handlers and else run as usual
                    visit(ast.Module(body=[statement], type_ignores=[]), lazy=lazy, optional=True)
                for part in (*child.handlers, *child.orelse, *child.finalbody):
                    visit(ast.Module(body=[part], type_ignores=[]), lazy=lazy, optional=optional)
                continue
            inner = lazy or isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda)
            visit(child, lazy=inner, optional=optional)

    visit(tree, lazy=False, optional=False)
    return found


def _third_party_imports() -> list[Import]:
    imports = [
        imp
        for package in PACKAGES
        for path in sorted((ROOT / package).rglob("*.py"))
        for imp in _imports_of(path)
    ]
    return [
        imp
        for imp in imports
        if imp.module not in sys.stdlib_module_names
        and imp.module not in FIRST_PARTY
        and imp.module != "__future__"
        and not imp.optional
    ]


def _declared() -> tuple[set[str], set[str]]:
    """(the runtime dependencies, the optional extras' dependencies), normalized names."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    runtime = {_requirement_name(r) for r in project["dependencies"]}
    extras = {
        _requirement_name(r)
        for extra, requirements in project.get("optional-dependencies", {}).items()
        if extra not in TEST_ONLY_EXTRAS
        for r in requirements
    }
    return runtime, extras


@functools.cache
def _installed() -> dict[str, list[str]]:
    return packages_distributions()


def _distributions(module: str) -> set[str]:
    """The distributions that provide a top-level import name (the name itself if none is
    installed: an optional extra's package need not be installed to be declared)."""
    provided = _installed().get(module)
    return {_normalize(d) for d in provided} if provided else {_normalize(module)}


def test_the_source_reads_some_third_party_imports() -> None:
    """The collector finds what is certainly there (torch at module level), so an empty
    result below cannot pass by reading nothing."""
    modules = {(imp.module, imp.lazy) for imp in _third_party_imports()}
    assert ("torch", False) in modules
    assert ("pydantic", False) in modules


def test_every_module_level_import_is_a_declared_dependency() -> None:
    """What runs at import time must be installed by ``pip install memadvisor`` alone."""
    runtime, _ = _declared()
    missing = [
        f"{imp.where}: import {imp.module} (distribution {sorted(_distributions(imp.module))})"
        for imp in _third_party_imports()
        if not imp.lazy and not (_distributions(imp.module) & runtime)
    ]
    assert not missing, (
        "imported at module level but not in pyproject.toml's [project] dependencies:\n"
        + "\n".join(missing)
    )


def test_every_lazy_import_is_a_dependency_or_an_optional_extra() -> None:
    """An import inside a function is allowed to need an extra (``memadvisor[hf]``), never a
    package that nothing declares or that only the test extra installs."""
    runtime, extras = _declared()
    missing = [
        f"{imp.where}: import {imp.module}"
        for imp in _third_party_imports()
        if imp.lazy and not (_distributions(imp.module) & (runtime | extras))
    ]
    assert not missing, (
        "imported inside a function but declared neither as a dependency nor as an optional "
        "extra in pyproject.toml:\n" + "\n".join(missing)
    )


def test_an_import_guarded_by_except_import_error_is_optional(tmp_path: Path) -> None:
    """The collector marks ``try: import x / except ImportError`` as optional, and only it."""
    source = tmp_path / "m.py"
    source.write_text(
        "try:\n    import numpy\nexcept ImportError:\n    numpy = None\n"
        "try:\n    import yaml\nexcept ValueError:\n    pass\n"
        "def f():\n    import lightning\n",
        encoding="utf-8",
    )
    found = {imp.module: imp for imp in _imports_of(source, root=tmp_path)}
    assert found["numpy"].optional and not found["numpy"].lazy
    assert not found["yaml"].optional
    assert found["lightning"].lazy and not found["lightning"].optional


def test_click_is_not_imported_directly() -> None:
    """typer 0.26+ vendors click and no longer installs it: the CLI uses typer's names."""
    assert not [imp.where for imp in _third_party_imports() if imp.module == "click"]
