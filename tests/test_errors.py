"""Which failures are ours: an error raised by memadvisor's own code is a bug to surface, not
an answer (bad input, "does not compile") to relabel."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from memadvisor.errors import BadInputError, is_our_bug
from memadvisor.workload import Workload, train_step
from strategies import _forward
from strategies.precision import AutocastForward


def _raise_in(code: str) -> BaseException:
    try:
        exec(compile(code, "<user code>", "exec"), {})
    except Exception as e:  # noqa: BLE001 - the test wants whatever it raised
        return e
    raise AssertionError("no error")


def test_an_error_raised_in_our_code_is_ours_and_the_users_is_not() -> None:
    wrapper = _forward.ForwardWrapper(nn.Linear(2, 2), inner=1)  # 1 is not callable
    with pytest.raises(TypeError) as ours:
        wrapper(torch.zeros(2))
    assert is_our_bug(ours.value)
    assert not is_our_bug(_raise_in("raise KeyError('user')"))
    assert not is_our_bug(BadInputError("said on purpose"))


def test_train_step_surfaces_our_errors_and_relabels_the_models() -> None:
    """Rule: a KeyError from our own autocast wrapper is a bug (kept as it is); the same kind
    of error from the model is reported as the model rejecting the batch."""
    model = nn.Linear(4, 4)
    workload = Workload(model=model, sample_batch=torch.randn(2, 4), loss_fn=lambda o, b: o.sum())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    _forward.install(model, AutocastForward, precision="no-such-precision")
    with pytest.raises(KeyError, match="no-such-precision"):
        train_step(workload, model, optimizer, torch.randn(2, 4))
    with pytest.raises(BadInputError, match="rejected the batch"):
        train_step(workload, nn.Linear(5, 4), optimizer, torch.randn(2, 4))


def test_graph_walk_skips_only_freed_saved_tensors() -> None:
    """Rule: reading a saved tensor fails as "already freed" only after a backward; any other
    RuntimeError there is ours to see, not activation bytes silently uncounted."""
    from memadvisor.profiler._graph import _saved_by

    class Freed:
        @property
        def _raw_saved_self(self):
            raise RuntimeError(
                "Trying to backward through the graph a second time (or directly access saved "
                "tensors after they have already been freed)."
            )

    class Broken:
        @property
        def _raw_saved_self(self):
            raise RuntimeError("something else went wrong")

    assert list(_saved_by(Freed())) == []
    with pytest.raises(RuntimeError, match="something else"):
        list(_saved_by(Broken()))


def test_a_compile_trial_failing_in_our_code_is_a_bug_not_does_not_compile(monkeypatch) -> None:
    """Rule: try_compile answers "does not compile" for torch's and the model's failures
    only; an error raised by our own code while setting up the compiled run surfaces."""
    from strategies import _compile_trial

    class Broken(_forward.ForwardWrapper):
        def __init__(self, module, inner, choice=None) -> None:
            super().__init__(module, 1)  # our call_inner then calls 1(...): a TypeError

    monkeypatch.setattr(_compile_trial, "_FreshCompiledForward", Broken)
    model = nn.Linear(4, 4)
    workload = Workload(model=model, sample_batch=torch.randn(2, 4), loss_fn=lambda o, b: o.sum())
    with pytest.raises(TypeError, match="not callable"):
        _compile_trial.try_compile(workload, "default", steps=2)
