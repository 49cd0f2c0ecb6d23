"""The strategy contract: a small core plus opt-in protocols the planner asks by isinstance.

Rules: a strategy that defines a protocol's method without subclassing the protocol is
refused at load time (the planner would never call it), naming the protocol; the built-ins
declare the protocols whose methods they define; ``EffectOrder`` orders the built-ins.
"""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path

import pytest

from memadvisor.errors import BadInputError
from memadvisor.strategy import (
    Checked,
    Described,
    EffectOrder,
    HandTried,
    Measured,
    Recorded,
    Strategy,
    TimedAlternatives,
    TimedEachChoice,
    WrapsRanks,
    load_strategies,
)

LOOSE = """
from memadvisor.strategy import Strategy


class Loose(Strategy):
    name = "loose_check"

    def choices(self, profile, config):
        return ["off", "on"]

    def effect(self, profile, choice, model):
        pass

    def apply(self, step, choice):
        return step

    def explain(self, choice, profile):
        return None

    def check(self, workload, choice):  # without Checked: never called
        return None
"""


@pytest.fixture
def loose_installed(tmp_path: Path):
    (tmp_path / "loose_memadvisor.py").write_text(LOOSE)
    info = tmp_path / "loose_memadvisor-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: loose-memadvisor\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(
        textwrap.dedent("""\
            [memadvisor.strategies]
            loose_check = loose_memadvisor:Loose
            """)
    )
    sys.path.insert(0, str(tmp_path))
    try:
        yield
    finally:
        sys.path.remove(str(tmp_path))
        sys.modules.pop("loose_memadvisor", None)


def test_a_protocol_method_without_its_protocol_is_refused(loose_installed) -> None:
    """check() defined on a plain Strategy: BadInputError naming the method and Checked."""
    with pytest.raises(BadInputError, match=r"check \(Checked\).*add the protocol"):
        load_strategies()


PROTOCOL_METHODS = {
    Checked: ("check", "screen"),
    Measured: ("refine",),
    Recorded: ("record",),
    HandTried: ("by_hand",),
    Described: ("describe", "changes_step"),
    WrapsRanks: ("wrap_rank",),
}


@pytest.mark.parametrize("strategy", load_strategies(), ids=lambda s: s.name)
def test_each_builtin_declares_the_protocols_of_what_it_defines(strategy: Strategy) -> None:
    """A built-in that overrides a protocol's method subclasses that protocol, and its
    effect_order is a named place (or between two)."""
    cls = type(strategy)
    for protocol, methods in PROTOCOL_METHODS.items():
        own = [m for m in methods if any(m in vars(k) for k in cls.__mro__ if k not in (protocol,))]
        if own:
            assert isinstance(strategy, protocol), (strategy.name, protocol.__name__, own)
    assert EffectOrder.PRECISION <= strategy.effect_order <= EffectOrder.INFERENCE


def test_the_builtins_timing_markers() -> None:
    """Precision's times are checked per choice (autocast), the ranks' wrap by alternatives."""
    by_name = {s.name: s for s in load_strategies()}
    assert isinstance(by_name["precision"], TimedEachChoice)
    assert isinstance(by_name["parallel"], TimedAlternatives)
    assert not isinstance(by_name["checkpointing"], (TimedEachChoice, TimedAlternatives))
