"""The strategy contract: a small core plus opt-in protocols the planner asks by isinstance.

Rules: a strategy that defines a protocol's method without subclassing the protocol is
refused at load time (the planner would never call it), naming the protocol; the built-ins
declare the protocols whose methods they define; ``EffectOrder`` orders the built-ins.
"""

from __future__ import annotations

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
def loose_installed(install_plugin) -> None:
    install_plugin("loose_memadvisor", LOOSE, {"loose_check": "loose_memadvisor:Loose"})


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
