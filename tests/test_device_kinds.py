"""Devices are asked what they can do, not what they are called.

A device's kind compared as a string (``device.kind == "cuda"``, ``plan.device_kind in
("simulated", "estimate")``) is a rule a third party's device of another kind silently
misses: it was profiled on the CPU and failed validation after every probe had run. Stages
read :class:`~memadvisor.schema.device.DeviceCapabilities` instead. The names users pass
(``device="cpu"``) and the kinds old plan files hold are read in one module,
``memadvisor/schema/device.py``; this scan keeps every other module of ``memadvisor/`` and
``strategies/`` free of kind comparisons, so they do not creep back.

What the scan calls a kind comparison: ``==``, ``!=``, ``in``, ``not in`` between a kind
word (cuda, gpu, cpu, simulated, fake, estimate) and an expression that reads a kind (a
name or attribute ``kind``, ``*_kind``, or a config's ``device``); and a dict keyed by kind
words looked up by one. A torch device type (``tensor.device.type == "cuda"``,
``capabilities.tensor_device``) is torch's fact, not our kind, and is not counted.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
KIND_WORDS = {"cuda", "gpu", "cpu", "simulated", "fake", "estimate"}
#: The input-parsing module: user names (DEVICE_NAMES) and old files' kinds.
ALLOWED = {"memadvisor/schema/device.py"}


def _reads_a_kind(node: ast.AST) -> bool:
    """``kind``, ``device_kind``, ``x.kind``, ``plan.device_kind``, ``config.device``."""
    if isinstance(node, ast.Name):
        name = node.id
    elif isinstance(node, ast.Attribute):
        name = node.attr
        if name == "device" and "config" in ast.unparse(node.value):
            return True  # PlanConfig.device: a device name
    else:
        return False
    return name == "kind" or name.endswith("_kind")


def _kind_words(node: ast.AST) -> bool:
    if isinstance(node, ast.Constant):
        return isinstance(node.value, str) and node.value.lower() in KIND_WORDS
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return any(_kind_words(e) for e in node.elts)
    return False


def _keyed_by_kinds(node: ast.AST) -> bool:
    return isinstance(node, ast.Dict) and any(k is not None and _kind_words(k) for k in node.keys)


def kind_comparisons(source: str, where: str = "<code>") -> list[str]:
    """Each kind comparison in ``source``, as 'where:line code'."""
    hits = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Compare):
            ops_ok = all(isinstance(o, (ast.Eq, ast.NotEq, ast.In, ast.NotIn)) for o in node.ops)
            sides = [node.left, *node.comparators]
            if ops_ok and any(_kind_words(s) for s in sides) and any(map(_reads_a_kind, sides)):
                hits.append(f"{where}:{node.lineno} {ast.unparse(node)}")
        elif isinstance(node, ast.Subscript) and _keyed_by_kinds(node.value):
            if _reads_a_kind(node.slice):
                hits.append(f"{where}:{node.lineno} {ast.unparse(node)}")
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr == "get"
            and _keyed_by_kinds(node.func.value)
            and node.args
            and _reads_a_kind(node.args[0])
        ):
            hits.append(f"{where}:{node.lineno} {ast.unparse(node)}")
    return hits


def _sources() -> list[Path]:
    packages = ("memadvisor", "strategies")
    return sorted(p for package in packages for p in (ROOT / package).rglob("*.py"))


def test_the_scan_finds_the_comparisons_it_names() -> None:
    """Each form a kind comparison took before capabilities is found; a torch device type is
    not, so the empty scan below means something."""
    before = """
device.kind == "cuda"
plan.device_kind in ("simulated", "estimate")
profile.device.kind != "fake"
kind == "simulated" and device is None
config.device == "estimate"
{"cuda": "cuda", "simulated": "cpu"}.get(plan.device_kind, "auto")
{"simulated": "cpu"}[kind]
"""
    assert len(kind_comparisons(before)) == 7
    torch_types = """
t.device.type == "cuda"
capabilities.tensor_device == "cuda"
caps.trains_on == "cpu"
{"cpu": "AutocastCPU", "cuda": "AutocastCUDA"}[device_type]
"""
    assert kind_comparisons(torch_types) == []


def test_the_input_parsing_module_is_where_names_are_read() -> None:
    """The allowed module does compare names (users' and old files'): the scan sees it."""
    path = ROOT / "memadvisor" / "schema" / "device.py"
    assert kind_comparisons(path.read_text(), "device.py")


def test_no_module_compares_device_kinds() -> None:
    """Outside memadvisor/schema/device.py no module of memadvisor/ or strategies/ compares a
    device kind: each asks the capability it needs (``step_times_rank``, ``can_compile``,
    ``measures_memory``, ``trains_on``, ...)."""
    files = _sources()
    assert len(files) > 100
    hits = [
        hit
        for path in files
        if str(path.relative_to(ROOT)) not in ALLOWED
        for hit in kind_comparisons(path.read_text(), str(path.relative_to(ROOT)))
    ]
    assert hits == []
