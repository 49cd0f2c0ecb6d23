"""Which failures are ours: an error raised by memadvisor's own code is a bug to surface, not
an answer (bad input, "does not compile") to relabel."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from memadvisor.errors import (
    AllocatorRetriesError,
    BadInputError,
    UserCodeError,
    check_allocator_retries,
    is_oom,
    is_our_bug,
    ran_out_by_retries,
)
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
        def __init__(self, module, inner, choice=None, **options) -> None:  # noqa: ANN003
            # Whatever else the trial passes (main's regional form adds fn=) is ignored.
            super().__init__(module, 1)  # our call_inner then calls 1(...): a TypeError

    monkeypatch.setattr(_compile_trial, "_FreshCompiledForward", Broken)
    model = nn.Linear(4, 4)
    workload = Workload(model=model, sample_batch=torch.randn(2, 4), loss_fn=lambda o, b: o.sum())
    with pytest.raises(TypeError, match="not callable"):
        _compile_trial.try_compile(workload, "default", steps=2)


class _Divides(nn.Module):
    """A block whose forward raises in the user's own Python (not torch, not memadvisor)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * (1 / 0)


class _TwoBlocks(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(4, 4)
        self.second = _Divides()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.second(self.first(x))


def _step(model: nn.Module, loss_fn, **workload) -> None:  # noqa: ANN001
    w = Workload(model=model, sample_batch=torch.randn(2, 4), loss_fn=loss_fn, **workload)
    train_step(w, model, torch.optim.SGD(model.parameters(), lr=0.1), w.batch(2))


def _divide_by_nothing(out: torch.Tensor, batch: torch.Tensor) -> torch.Tensor:
    return out.sum() * (1 / len([]))


def test_a_loss_fn_raising_any_exception_is_the_users_code_with_its_line_and_cause() -> None:
    """Rule: whatever the type, an exception raised in the user's loss_fn is a UserCodeError
    (exit 2) naming loss_fn, the user's line and the shapes it got, with the original as its
    __cause__: not a raw ZeroDivisionError after profiling started."""
    with pytest.raises(UserCodeError) as caught:
        _step(nn.Linear(4, 4), _divide_by_nothing)
    error = caught.value
    assert isinstance(error.__cause__, ZeroDivisionError) and error.exit_code == 2
    assert error.frame is not None and error.frame.filename == __file__
    message = str(error)
    assert message.startswith("loss_fn raised ZeroDivisionError: division by zero")
    assert "return out.sum() * (1 / len([]))" in message and "a tensor of shape (2, 4)" in message


def test_a_loss_fn_whose_shapes_do_not_match_is_the_users_code_though_torch_raised() -> None:
    """Rule: torch raising inside the user's loss (a shape mismatch) is the user's: the
    innermost frame outside torch is their loss_fn."""
    with pytest.raises(UserCodeError, match=r"loss_fn raised RuntimeError") as caught:
        _step(nn.Linear(4, 4), lambda out, batch: (out - batch[:, :3]).sum())
    assert isinstance(caught.value.__cause__, RuntimeError)
    assert caught.value.frame.filename == __file__


def test_a_model_raising_in_its_own_code_names_the_model_and_the_block() -> None:
    """Rule: an exception the model's own code raises in forward (any type) names the model,
    the block it raised in, and the user's line."""
    with pytest.raises(UserCodeError) as caught:
        _step(_TwoBlocks(), lambda out, batch: out.sum())
    message = str(caught.value)
    assert message.startswith("The model (_TwoBlocks) rejected the batch: ZeroDivisionError")
    assert "in block 'second' (_Divides)" in message and "return x * (1 / 0)" in message


class _BadBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:  # noqa: ANN001
        return x * 2

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:  # noqa: ANN001
        raise ValueError("the user's backward is wrong")


def test_a_custom_backward_raising_is_the_users_but_a_torch_only_backward_error_is_not() -> None:
    """Rule: in backward only a frame of the user's code (a custom autograd Function, a hook)
    makes the error theirs; a torch-only error there (the autograd engine, a checkpoint's
    recompute) may come from a strategy and keeps its type."""

    class Custom(nn.Linear):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return _BadBackward.apply(super().forward(x))

    with pytest.raises(UserCodeError, match=r"The backward pass of the model \(Custom\)"):
        _step(Custom(4, 4), lambda out, batch: out.sum())

    class InPlace(nn.Linear):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y = torch.sigmoid(super().forward(x))
            y.add_(1)  # sigmoid saved its output for backward
            return y

    with pytest.raises(RuntimeError, match="modified by an inplace operation") as caught:
        _step(InPlace(4, 4), lambda out, batch: out.sum())
    assert not isinstance(caught.value, UserCodeError)


def test_make_batch_and_the_optimizer_factory_raising_are_the_users_code() -> None:
    """Rule: make_batch and the optimizer factory are the user's code too."""

    def make_batch(b: int) -> torch.Tensor:
        return torch.randn(b, 4)[b]  # index b of b rows: IndexError

    w = Workload(model=nn.Linear(4, 4), sample_batch=torch.randn(2, 4), make_batch=make_batch)
    with pytest.raises(UserCodeError, match=r"make_batch\(3\) raised IndexError"):
        w.batch(3)
    w = Workload(
        model=nn.Linear(4, 4), sample_batch=torch.randn(2, 4), optimizer_factory=lambda p: 1 / 0
    )
    with pytest.raises(UserCodeError, match="The optimizer factory raised ZeroDivisionError"):
        w.make_optimizer(w.model)


def test_the_retries_share_decides_and_a_lone_retry_does_not() -> None:
    """Rule: the count is per step (did the counter move in it), over the timed steps, and
    it takes at least half of them; a retry in the first step and one timed step in four
    are not enough; at batch 1 (nothing smaller to step without them) retries never count."""
    times = [100.0, 10.0, 12.0, 11.0, 10.0]
    check_allocator_retries([0, 7, 7, 7, 8, 8], 300, times)  # first step's 7, then 1 of 4
    with pytest.raises(AllocatorRetriesError) as caught:
        check_allocator_retries([0, 0, 1, 1, 2, 2], 300, times)  # 2 of 4
    assert caught.value.retried_steps == 2 and "11.0 ms a step" in str(caught.value)
    assert is_oom(caught.value)  # every stage that asks is_oom takes it as running out
    check_allocator_retries([0, 5], 300, [100.0])  # one step: nothing timed
    check_allocator_retries([0, 1, 2, 3, 4, 5], 1, times)  # batch 1: nothing smaller to take


def test_retries_that_already_decide_a_run_raise_before_its_last_step() -> None:
    """Rule: called after each step with the run's planned timed steps, the check raises as
    soon as the retried steps reach the share of the planned ones (the rest cannot undo the
    verdict), and not before: 2 retried of 4 planned decide it, 1 of 4 does not (a lone
    late retry must not end a run that would fit), and the message says it stopped early."""
    times = [100.0, 10.0, 12.0]
    check_allocator_retries([0, 0, 1], 300, times[:2], planned_timed=4)  # 1 of 4: open
    with pytest.raises(AllocatorRetriesError) as caught:
        check_allocator_retries([0, 0, 1, 2], 300, times, planned_timed=4)  # 2 of 4: decided
    assert caught.value.retried_steps == 2 and caught.value.timed_steps == 2
    assert "2 of its first 2 timed steps" in str(caught.value) and "4" in str(caught.value)
    assert ran_out_by_retries(str(caught.value))  # the record still reads it back
    # the planned steps done: the same verdict and message as without planned_timed
    with pytest.raises(AllocatorRetriesError, match="in 2 of 4 timed steps"):
        check_allocator_retries([0, 0, 1, 1, 2, 2], 300, [*times, 11.0, 10.0], planned_timed=4)
