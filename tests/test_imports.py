"""The house is one-way: no import circles, and no import that runs back up the pipeline.

Every import in ``memadvisor/`` and ``strategies/`` is read with ``ast`` (top-level,
function-level and ``TYPE_CHECKING`` imports alike: a type-only import is still a
dependency a reader has to follow), and checked against the pipeline's floors, ground first:
the shared vocabulary, the user's workload, the profiler, the estimate, the strategy contract
and the strategies, applying a plan, the devices, the planner, the report and the monitor,
then the API and the CLI on top.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from memadvisor.strategy import registered_names

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("memadvisor", "strategies")

# Floors of the pipeline, ground first; a module may import its own floor or lower ones.
# The longest matching prefix places a module.
FLOORS: list[tuple[str, ...]] = [
    (
        "memadvisor._version",
        "memadvisor._log",
        "memadvisor._torch_private",
        "memadvisor.errors",
        "memadvisor.files",
        "memadvisor.units",
        "memadvisor.schema",
    ),
    (
        "memadvisor.workload",
        "memadvisor.losses",
        "memadvisor.memory",
        "memadvisor.process_state",
        "memadvisor.target",
        "memadvisor.dataloading",
    ),
    ("memadvisor.timeline", "memadvisor.profiler"),
    ("memadvisor.estimate",),
    ("memadvisor.strategy",),
    ("strategies",),
    ("memadvisor.apply",),
    ("memadvisor.device",),
    ("memadvisor.planner",),
    ("memadvisor.report", "memadvisor.monitor"),
    ("memadvisor.api", "memadvisor.integrations"),
    ("memadvisor.cli", "memadvisor.__main__", "memadvisor"),
]
# The package face is placed by its own name only: a new top-level module must get a floor.
FACE = "memadvisor"


def _modules() -> dict[str, Path]:
    out = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join(parts)] = path
    return out


MODULES = _modules()


def _resolve(name: str) -> str | None:
    """The module of ours that importing ``name`` loads (a name inside a module: the module)."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def imports_of(module: str) -> dict[str, int]:
    """Modules of ours that ``module`` imports anywhere in its code -> the first line."""
    path = MODULES[module]
    tree = ast.parse(path.read_text(), filename=str(path))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: dict[str, int] = {}
    for node in ast.walk(tree):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join([*parent, *([node.module] if node.module else [])])
            # ``from pkg import sub`` imports the submodule; ``from mod import name`` the module.
            names = [
                f"{base}.{alias.name}" if f"{base}.{alias.name}" in MODULES else base
                for alias in node.names
            ]
        for name in names:
            target = _resolve(name)
            if target is not None and target != module:
                found.setdefault(target, node.lineno)
    return found


def _cycles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    return found


def floor_of(module: str) -> int:
    best, floor = -1, -1
    for n, prefixes in enumerate(FLOORS):
        for prefix in prefixes:
            inside = prefix != FACE and module.startswith(prefix + ".")
            if (module == prefix or inside) and len(prefix) > best:
                best, floor = len(prefix), n
    return floor


GRAPH = {m: imports_of(m) for m in MODULES}


def test_the_walk_sees_imports_at_every_level() -> None:
    """The reader is not blind: it finds a top-level, a function-level and a TYPE_CHECKING
    import that are known to be there (else an empty graph would pass the tests below)."""
    assert "memadvisor.schema.candidate" in GRAPH["memadvisor.estimate"]  # top level
    assert "memadvisor.device.cuda" in GRAPH["memadvisor.device._factory"]  # in a function
    assert "memadvisor.workload" in GRAPH["memadvisor.strategy"]  # under TYPE_CHECKING
    assert sum(len(v) for v in GRAPH.values()) > 200


def test_no_import_circles() -> None:
    """No set of modules in memadvisor/ and strategies/ imports one another in a loop."""
    assert _cycles(GRAPH) == []


def test_every_module_has_a_floor() -> None:
    """Each module is placed on the pipeline (a new top-level module needs a floor here)."""
    assert [m for m in MODULES if floor_of(m) < 0] == []


def test_no_import_runs_back_up_the_pipeline() -> None:
    """A module imports only its own floor or the floors below (the vocabulary at the ground,
    the API and the CLI on top)."""
    upward = [
        f"{module}:{line} imports {target} (floor {floor_of(target)} > {floor_of(module)})"
        for module, targets in GRAPH.items()
        for target, line in targets.items()
        if floor_of(target) > floor_of(module)
    ]
    assert upward == []


@pytest.mark.parametrize("package", ["memadvisor.planner", "memadvisor.report"])
def test_the_planner_and_the_report_import_no_strategy(package: str) -> None:
    """Strategies are plug-ins: the planner and the report reach them only through the
    contract (memadvisor.strategy), never a module of the strategies package."""
    offenders = [
        f"{module} imports {target}"
        for module, targets in GRAPH.items()
        if module == package or module.startswith(package + ".")
        for target in targets
        if target.split(".")[0] == "strategies"
    ]
    assert offenders == []


def named_strategies(path: Path, names: set[str]) -> list[str]:
    """Where ``path``'s code spells a strategy's registered name as a string (the key a
    choice is read by: ``choices.get("precision")``), as 'file:line "name"'."""
    tree = ast.parse(path.read_text(), filename=str(path))
    return [
        f"{path.relative_to(ROOT)}:{node.lineno} {node.value!r}"
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in names
    ]


STRATEGY_NAMES = set(registered_names())


def test_the_name_scan_is_not_blind() -> None:
    """The scan finds names where they are known to be spelled (an integration reads the
    compile stage by name), else an empty scan of the report would pass the test below."""
    assert {"precision", "checkpointing", "compile", "batch_size"} <= STRATEGY_NAMES
    found = named_strategies(ROOT / "memadvisor" / "integrations" / "_pick.py", STRATEGY_NAMES)
    assert any("'compile'" in hit for hit in found)


@pytest.mark.parametrize("package", ["planner", "report"])
def test_the_planner_and_the_report_name_no_strategy(package: str) -> None:
    """The planner and the report read no strategy's choice by its name: what a choice means
    to them each strategy says through the contract (the report: ``Strategy.describe``,
    ``changes_step``, ``installs``), so a third party's strategy is planned and reported as a
    built-in is. Prose may mention a technique ("blocks can be checkpointed"); a string that
    is a registered name may not appear."""
    files = sorted((ROOT / "memadvisor" / package).rglob("*.py"))
    assert files
    assert [hit for path in files for hit in named_strategies(path, STRATEGY_NAMES)] == []
