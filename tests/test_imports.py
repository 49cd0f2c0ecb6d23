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
        "memadvisor.step",
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


@pytest.mark.parametrize(
    "package",
    [
        "memadvisor.planner",
        "memadvisor.report",
        "memadvisor.device",
        "memadvisor.integrations",
        "memadvisor.apply",
    ],
)
def test_the_planner_report_devices_and_integrations_import_no_strategy(package: str) -> None:
    """Strategies are plug-ins: the planner, the report, the devices and the integrations
    reach them only through the contract (memadvisor.strategy: ``apply_candidate``,
    ``facts_of``, ``wrap_ranks``), never a module of the strategies package: a rank wraps
    its model through whichever strategy implements ``WrapsRanks``."""
    offenders = [
        f"{module} imports {target}"
        for module, targets in GRAPH.items()
        if module == package or module.startswith(package + ".")
        for target in targets
        if target.split(".")[0] == "strategies"
    ]
    assert offenders == []


def _rel(path: Path) -> Path:
    return path.relative_to(ROOT) if path.is_relative_to(ROOT) else path


def named_strategies(path: Path, names: set[str]) -> list[str]:
    """Where ``path``'s code spells a strategy's registered name as a string (the key a
    choice is read by: ``choices.get("precision")``), as 'file:line "name"'."""
    tree = ast.parse(path.read_text(), filename=str(path))
    return [
        f"{_rel(path)}:{node.lineno} {node.value!r}"
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in names
    ]


STRATEGY_NAMES = set(registered_names())


def test_the_name_scan_is_not_blind(tmp_path: Path) -> None:
    """The scan finds a registered name wherever it is spelled as a string, else an empty
    scan of the report would pass the test below."""
    assert {"precision", "checkpointing", "compile", "batch_size"} <= STRATEGY_NAMES
    code = tmp_path / "named.py"
    code.write_text('label = "compile"\nother = "not a strategy"\n')
    assert [hit.split()[-1] for hit in named_strategies(code, STRATEGY_NAMES)] == ["'compile'"]


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


_READERS = {"get", "choice", "pop"}


def _holds_choices(node: ast.AST) -> bool:
    """A mapping of choices or options by strategy name (``candidate.choices``,
    ``plan.candidate``, ``config.options``), not any dict (a check's metrics)."""
    text = ast.unparse(node).lower()
    return any(word in text for word in ("choice", "option", "candidate", "cand"))


def read_names(path: Path, names: set[str]) -> list[str]:
    """Where ``path``'s code *reads* a choice by a strategy's registered name: a subscript
    key of a mapping of choices (``choices["compile"]``), the key of its
    ``.get``/``.choice``/``.pop``, a comparison
    (``s.strategy == "compile"``, ``name in ("precision", ...)``), or a module constant
    that aliases the name (``COMPILE = "compile"``). A name passed as a label (a
    Lightning setting called "precision") is not a read."""
    tree = ast.parse(path.read_text(), filename=str(path))
    spots: list[ast.AST] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Subscript) and _holds_choices(node.value):
            spots.append(node.slice)
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr in _READERS
            and _holds_choices(node.func.value)
            and node.args
        ):
            spots.append(node.args[0])
        elif isinstance(node, ast.Compare):
            spots.extend([node.left, *node.comparators])
    spots.extend(
        node.value
        for node in tree.body
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant)
    )
    hits = []
    for spot in spots:
        for const in ast.walk(spot):
            if isinstance(const, ast.Constant) and const.value in names:
                hits.append(f"{_rel(path)}:{const.lineno} {const.value!r}")
    return hits


def test_the_read_scan_is_not_blind(tmp_path: Path) -> None:
    """Each read form is found, a label is not."""
    code = tmp_path / "reads.py"
    code.write_text(
        'COMPILE = "compile"\n'
        'a = choices["precision"]\n'
        'b = choices.get("checkpointing")\n'
        'c = stage.strategy == "parallel"\n'
        'd = name in ("batch_size", "x")\n'
        'decide("precision", flag)\n'
    )
    found = {hit.split()[-1] for hit in read_names(code, STRATEGY_NAMES | {"x"})}
    assert found == {"'compile'", "'precision'", "'checkpointing'", "'parallel'", "'batch_size'",
                     "'x'"}  # fmt: skip
    code.write_text('decide("precision", flag)\n')
    assert read_names(code, STRATEGY_NAMES) == []


@pytest.mark.parametrize("package", ["device", "integrations"])
def test_the_devices_and_the_integrations_read_no_strategy_by_name(package: str) -> None:
    """What a candidate does (compiled, recomputed blocks, autocast, a parallel wrap) the
    devices and the integrations read from the strategies' facts (``facts_of``), never a
    choice by a strategy's name, so a third party's strategy stating the same facts is run
    and adopted as the built-in one is."""
    files = [*sorted((ROOT / "memadvisor" / package).rglob("*.py")), ROOT / "memadvisor/apply.py"]
    assert [hit for path in files for hit in read_names(path, STRATEGY_NAMES)] == []


def _owner(path: Path) -> str | None:
    """The strategy a module of strategies/ belongs to: its own name, or the name its
    private module's name starts with (``_compile_stage`` belongs to compile)."""
    stem = path.stem.lstrip("_")
    return next(
        (n for n in sorted(STRATEGY_NAMES, key=len, reverse=True) if stem.startswith(n)), None
    )


def test_no_strategy_reads_another_by_name() -> None:
    """A strategy reads another's choice only through its facts (``facts_of``): the compile
    trial's scaler asks for the candidate's autocast dtype, not for "precision"."""
    hits = []
    for path in sorted((ROOT / "strategies").rglob("*.py")):
        own = _owner(path)
        hits += [h for h in read_names(path, STRATEGY_NAMES) if h.split()[-1] != repr(own)]
    assert hits == []
