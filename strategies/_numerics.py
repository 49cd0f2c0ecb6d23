"""The precision numerics check: is training in a lower precision worse than fp32 disagrees
with itself?

A few training steps from random weights on a few samples are chaotic: two fp32 runs whose
weights differ in the last bit part within a dozen steps (an encoder-decoder LM on an H100:
fp32 7.963 and 7.864 after 16 steps, bf16 7.754). A fixed percentage of such a curve says
little, so the threshold is measured on the workload itself:

* **A**, the reference: fp32 from the model's weights.
* **B**, fp32's own spread: fp32 again, its forward and backward seeing each weight times
  (1 + u z), z standard normal and fresh each step as rounding is, u the low precision's
  unit roundoff (:data:`ROUNDING`: 2^-8 for bf16, 2^-11 for fp16 and TF32), while the
  weights the optimizer updates stay exact, as autocast's fp32 master weights do. Same
  seed as A (the same dropout masks).
* **L**: the low precision from the same weights and seed.

Where L fails against B, a fourth run **B'** (B with the next seed: another dropout draw)
judges it again, and that verdict stands: on a card the low precision's dropout need not
draw A's masks even from A's seed (fp32 attention takes another SDPA kernel than bf16, with
its own random stream), so L may differ from A by a dropout draw, which B does not show. A
model without dropout gets B's spread again from B', and the same verdict; one with
dropout is judged at the resolution its dropout leaves.

All runs take the same batch. L fails when it is
worse than B is: inf/nan where fp32 is finite; a higher loss over the last steps beyond
:data:`LOSS_SPREADS` times fp32's spread; a gradient norm that explodes beyond
:data:`NORM_SPREADS` times fp32's; a first-step gradient that points elsewhere beyond
:data:`DIRECTION_SPREADS` times fp32's own distance. A *lower* loss never fails: converging
faster is not a numerics problem.

What a plan runs (issue 26: the check costs at most 10% of the plan's wall). Each limit is
a multiple of B's spread plus a floor of a few roundoffs, so a spread can only widen a
limit. Where L is within a rule's floor, no spread can fail it, and B's steps for that rule
change nothing: the plan's screen (``spread="needed"``) runs B not at all where L is within
every floor, only its first step where just the gradient direction is beyond its floor (that
rule reads the first step alone; a run of k steps is the first k steps of a longer one),
and whole where the loss or the norm rule needs fp32's spread: the verdict a whole B gives,
by construction, with the spreads not run left out of the report (it names the floor
that decided instead). On the CPU every stage of a plan is steps of the model, so the
check's share is its steps' share whatever they cost; the screen there takes
:data:`CPU_PLAN_STEPS` (4) steps where a card's takes 8, the fewest the time bound already
allowed (with 8, the README's CNN and GPT-2 spent 21% and 24% of their CPU plans in the
check). One screen's checks share their fp32 runs (:class:`FP32Runs`): A is the same for
every precision.

Known limitations:
    The spread is one perturbed run, so it is a sample, not a bound: the multipliers (and the
    floors under them, a few roundoffs of the loss and gradient) leave room for its scatter;
    docs/design.md has the ratios they were chosen from. The check trains for a few steps;
    a precision that fails only after thousands (a slowly growing activation in fp16) is
    not caught. Weight perturbation stands in for rounding everywhere; activations are not
    perturbed, so a model whose activations alone lose their meaning in the low precision
    fails it through the loss or the gradient, not through B. B holds one more copy of the
    weights on the device while it steps (the exact ones, put back before the update).
    A plan on the CPU checks 4 steps where a card's checks 8: over the zoo's 120 checks the
    verdicts were the same at 4 as at 8, the closest to a limit 0.19 and 0.58 of it (bf16,
    fp16) against 0.18 and 0.58 (docs/design.md), and every planted failure fails at 4. But
    a failure that shows only from the 5th step on is caught on a card, not in a CPU plan,
    and the loss rule's floor weighs more against a gap that has had 3 updates to grow than
    against one that has had 7. That floor is in roundoffs of the largest loss fp32
    trained through (so a lag on a steep fall is not a failure), which makes the loss rule
    lenient where the loss falls by orders of magnitude within the check: a low precision
    that stalls above fp32's end by less than 4 roundoffs of the start (1.6% in bf16) there
    fails only through the gradient rules (the planted offset, whose rounding caps the fit,
    fails its first gradient at 15x the limit).
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

import torch
from torch import nn

from memadvisor import _torch_private
from memadvisor._log import logger
from memadvisor.errors import BadInputError
from memadvisor.profiler._state import clone_module
from memadvisor.schema.advice import Check
from memadvisor.workload import train_step
from strategies import _forward
from strategies._autocast import AutocastForward, grad_scaler_for

if TYPE_CHECKING:
    from memadvisor.workload import Workload

__all__ = [
    "CPU_PLAN_STEPS",
    "ROUNDING",
    "FP32Runs",
    "Weights",
    "check_device",
    "check_numerics",
    "tf32_matmuls",
]

#: Unit roundoff (half the spacing of the numbers just above 1) of each precision checked:
#: bf16 keeps 8 significant bits, fp16 11, TF32's matmul inputs 11.
ROUNDING: dict[str, float] = {"bf16": 2.0**-8, "fp16": 2.0**-11, "tf32": 2.0**-11}

# How much worse than fp32's own spread a precision may be before it fails. The spread is
# one sample (one perturbed run), and rounding everywhere is not the same perturbation as
# noise on the weights, so the multipliers leave room: over 12 tiny architectures x 5 seeds
# on the CPU (docs/design.md, "Precision check") bf16's gradient distance reached 1.2x fp32's
# and fp16's 3.6x; no check came within 0.58 of its limit, and the planted failures that are
# not inf/nan sit at 2.7x their limit and beyond.
LOSS_SPREADS = 4.0
DIRECTION_SPREADS = 6.0
NORM_SPREADS = 4.0
# Floors under the measured spreads, in roundoffs of the compared quantity: where fp32's
# spread is ~0 (a convex model that does not amplify a perturbation), a difference of a few
# roundoffs is the rounding itself, not a failure. The loss's are roundoffs of the largest
# loss fp32 trained through, not of where it ended: a relative rounding of each update moves
# the end of a falling curve by about that share of the fall. A small ResNet that fits its 4
# samples from 2.37 to 0.0099 in 4 steps ended 0.0117 in bf16 on a CPU with AMX (0.0097
# without): 44 roundoffs of where it ended, 0.19 of one of where it started (docs/design.md,
# "Precision check").
LOSS_FLOOR_ROUNDOFFS = 4.0
DIRECTION_FLOOR_ROUNDOFFS = 8.0

# 8 steps at up to 8 samples: enough for a curve to show where it goes, cheap at 3 runs
# (24 small steps) on a card. Where steps are slow run A stops once its steps after the
# first (which carries one-off costs: allocator, cuBLAS, autotuning) have taken
# NUMERICS_TIME_S and at least NUMERICS_MIN_STEPS are done, and B and L take as many.
NUMERICS_STEPS = 8
NUMERICS_MIN_STEPS = 4
NUMERICS_MAX_BATCH = 8
NUMERICS_TIME_S = 2.0
# A plan on the CPU checks this many steps, the fewest the time bound above allows, and
# runs the spread only as long as the verdict needs: there every stage of the plan is steps
# of the model, so the check's share of the plan is its steps' share however fast they are.
# With 8 the README's CNN spent 21% of its plan in the check, with 4 ~9% (docs/design.md,
# "Precision check"). Over the zoo's 120 checks and the planted failures the verdicts at 4
# steps were those at 8. 3 was tried and is too few: a model whose low precision draws
# other dropout masks (a card's kernels) was refused for 1 of 10 seeds, at 2.2x its limit,
# where 4 and 8 passed all 10, none above 0.61 of it.
CPU_PLAN_STEPS = NUMERICS_MIN_STEPS
# The last steps whose losses are compared: where training has gone, not the first step,
# which starts from the same weights in every run.
LOSS_WINDOW = 0.25
# fp16's GradScaler starts at 2^16 and halves on each overflow: steps it skips find its
# scale, they are not numerics. L runs up to this many extra steps to take as many as A;
# a scaler that skips more (its scale below 2^-8) has not found a scale that works: the
# gradients themselves overflow fp16.
MAX_SKIPPED_STEPS = 24


def check_device() -> torch.device | None:
    """Where a screen's checks run their copies of the model: CUDA when available (a card
    runs a 0.35B model's steps in a second, its CPU in tens), else None (the model's)."""
    return torch.device("cuda") if torch.cuda.is_available() else None


@contextlib.contextmanager
def tf32_matmuls(enabled: bool = True) -> Iterator[None]:
    """fp32 matmuls in TF32 (``torch.set_float32_matmul_precision("high")``) inside the
    block, or in full fp32 (``"highest"``) with ``enabled=False``; the process's previous
    setting restored after. A no-op on the CPU, whose matmuls have no TF32."""
    before = _torch_private.matmul_precision_state()
    torch.set_float32_matmul_precision("high" if enabled else "highest")
    try:
        yield
    finally:
        # Exactly as found: a fresh process's state, where it was one (the compile cache's key).
        _torch_private.restore_matmul_precision(before)


# Models up to this size are staged in pinned host memory for their copies (Weights): the
# pinned copy is host memory held while a screen runs, and page-locked memory is scarcer.
STAGE_MAX_BYTES = 4 * 2**30


class Weights:
    """Fresh copies of a model on a card, its parameters and buffers staged once in pinned
    host memory and copied from there for each run.

    Why: each numerics run trains its own copy from the model's weights, and a deep copy
    of a model on the CPU then ``.to("cuda")`` copies every byte twice, the second time
    from pageable memory. On an H100 host shared with other plans, a 0.35B decoder's copies
    took 2.2-7.7 s each and t5-base's 2.6-9.4 s (26.8 s of a 43.5 s screen); from pinned
    memory the bytes reach the card at the bus's speed and only the module's structure is
    copied on the CPU (``docs/design.md``, "Four cards at once, the screen's copies and
    paired probes").

    Known limitations:
        * Only a model on the CPU copied to a card, of at most :data:`STAGE_MAX_BYTES`, is
          staged; anything else is cloned straight to the device (``clone_module``).
        * A tensor held in a plain attribute (neither parameter nor buffer) is cloned where
          it is and moved by ``Module.to``, as before.
        * The pinned copy is made at the first run and held until this object goes.
    """

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self._pinned: dict[int, torch.Tensor] | None = None

    def _stages(self, device: torch.device) -> bool:
        if device.type != "cuda" or not torch.cuda.is_available():
            return False
        tensors = _tensors(self.model)
        on_cpu = all(t.device.type == "cpu" for t in tensors)
        size = sum(t.numel() * t.element_size() for t in tensors)
        return bool(tensors) and on_cpu and size <= STAGE_MAX_BYTES

    def copy_to(self, device: torch.device) -> nn.Module:
        """A copy of the model on ``device`` that shares nothing with it (``clone_module``:
        tied weights stay tied, a parameter stays a parameter with its ``requires_grad``)."""
        if not self._stages(device):
            return clone_module(self.model, device).to(device)
        if self._pinned is None:
            self._pinned = {id(t): t.detach().pin_memory() for t in _tensors(self.model)}
        pinned = self._pinned
        model = clone_module(self.model, make=lambda t: pinned[id(t)].to(device, non_blocking=True))
        # The copies are ordered before any kernel on this stream and the pinned source is
        # not written while this object lives: the wait only makes the copy's time honest.
        torch.cuda.current_stream(device).synchronize()
        return model.to(device)


def _tensors(model: nn.Module) -> list[torch.Tensor]:
    """The model's parameters and buffers, each once (a tied weight is one tensor)."""
    seen: dict[int, torch.Tensor] = {}
    for t in [*model.parameters(), *model.buffers()]:
        seen.setdefault(id(t), t)
    return list(seen.values())


@dataclass
class _Run:
    """What one training run of the check recorded."""

    losses: list[float] = field(default_factory=list)
    grad_norms: list[float] = field(default_factory=list)  # each step's, unscaled
    grads: list[torch.Tensor] = field(default_factory=list)  # the first step's, fp32, CPU
    skipped: int = 0  # steps the GradScaler skipped (overflowed gradients)

    @property
    def finite(self) -> bool:
        return all(math.isfinite(v) for v in self.losses) and all(
            math.isfinite(v) for v in self.grad_norms
        )


def _train(
    workload: Workload,
    precision: str,
    steps: int,
    *,
    seed: int,
    batch: Any,
    device: torch.device,
    jitter: float = 0.0,
    scaler: bool = True,
    time_s: float | None = None,
    weights: Weights | None = None,
) -> _Run:
    """Train a copy of the workload's model ``steps`` optimizer steps in ``precision``
    ('fp32', 'tf32', 'bf16' or 'fp16') on ``batch``, its dropout drawn from ``seed``.

    ``jitter``: each step's forward and backward see the weights times (1 + jitter * z), z
    standard normal and fresh each step; the optimizer updates the exact weights.
    ``scaler``: fp16 trains with a GradScaler (as the plan's advice says); its skipped steps
    are not counted. With ``time_s``, stop once the steps after the first have taken that
    long and :data:`NUMERICS_MIN_STEPS` are done. A non-finite loss ends the run.
    ``weights``: where the copy comes from (:class:`Weights`; default, a deep copy).
    """
    t_copy = time.perf_counter()
    model = (weights or Weights(workload.model)).copy_to(device)
    copy_s = time.perf_counter() - t_copy
    if precision in ("bf16", "fp16"):
        _forward.install(model, AutocastForward, precision=precision)
    grad_scaler = grad_scaler_for(precision, device.type) if scaler else None
    optimizer = workload.make_optimizer(model)
    params = [p for p in model.parameters() if p.requires_grad]
    run = _Run()
    exact: list[torch.Tensor] = []
    noise = torch.Generator(device=device).manual_seed(seed)

    def on_phase(phase: str) -> None:
        if phase == "forward" and jitter > 0.0:
            with torch.no_grad():
                exact[:] = [p.detach().clone() for p in params]
                for p in params:
                    z = torch.randn(p.shape, generator=noise, device=device, dtype=p.dtype)
                    p.mul_(1.0 + jitter * z)
        elif phase == "optimizer":  # after backward, before the step: the gradients are whole
            with torch.no_grad():
                # The exact weights back (none to put back without jitter).
                for p, w in zip(params, exact, strict=False):
                    p.copy_(w)
                exact.clear()
                _record_grads(run, params, grad_scaler)

    started = time.perf_counter()
    taken = 0
    # fp32 is fp32 whatever the process has set: TF32 only in the TF32 run.
    mode = tf32_matmuls(precision == "tf32")
    with mode, torch.random.fork_rng(devices=_cuda(device)):  # the caller's RNG untouched
        torch.manual_seed(seed)
        while taken < steps and run.skipped <= MAX_SKIPPED_STEPS:
            scale = grad_scaler.get_scale() if grad_scaler is not None else 1.0
            loss = float(
                train_step(
                    workload, model, optimizer, batch, scaler=grad_scaler, on_phase=on_phase
                ).float()
            )
            if grad_scaler is not None and grad_scaler.get_scale() < scale:
                # Overflowed gradients: the scaler skipped the step and halved its scale.
                run.skipped += 1
                run.grad_norms.pop()
                if run.grads and taken == 0:
                    run.grads.clear()
                if math.isfinite(loss):
                    continue
            run.losses.append(loss)
            taken += 1
            if not math.isfinite(loss):
                break
            if taken == 1:
                started = time.perf_counter()  # the first step's one-off costs not counted
            late = time_s is not None and time.perf_counter() - started > time_s
            if late and taken >= NUMERICS_MIN_STEPS:
                break
    # Where a screen's seconds go (lm350m's took 33-46 s of a card plan, not yet explained):
    # the copy, the first step (with its gradients to the CPU), the rest.
    logger.debug(
        "numerics run %s (seed %d, jitter %g): copy to %s %.1f s, first step %.1f s, "
        "%d more steps %.1f s",
        precision, seed, jitter, device, copy_s, started - t_copy - copy_s, max(0, taken - 1),
        time.perf_counter() - started,
    )  # fmt: skip
    return run


def _cuda(device: torch.device) -> list[int]:
    """The CUDA devices whose RNG a run on ``device`` draws from (for ``fork_rng``)."""
    return [device.index or 0] if device.type == "cuda" else []


def _record_grads(run: _Run, params: list[nn.Parameter], scaler) -> None:
    scale = float(scaler.get_scale()) if scaler is not None else 1.0
    grads = [p.grad.detach().float() / scale for p in params if p.grad is not None]
    # One norm of the per-parameter norms: one device sync a step, not one a parameter.
    norms = [torch.linalg.vector_norm(g, dtype=torch.float64) for g in grads]
    norm = float(torch.linalg.vector_norm(torch.stack(norms))) if norms else 0.0
    run.grad_norms.append(norm)
    if not run.grads:
        run.grads.extend(g.cpu() for g in grads)


def _distance(
    a: list[torch.Tensor], b: list[torch.Tensor], device: torch.device | None = None
) -> float:
    """||a - b|| / ||b|| over all parameters, in float64; 0 where both are zero. Computed on
    ``device`` (default: where the tensors are), one parameter's pair there at a time."""
    where = device if device is not None else (b[0].device if b else torch.device("cpu"))
    diff = torch.zeros((), dtype=torch.float64, device=where)
    ref = torch.zeros((), dtype=torch.float64, device=where)
    for x, y in zip(a, b, strict=True):
        x, y = x.to(where), y.to(where)
        diff += torch.linalg.vector_norm(x - y, dtype=torch.float64) ** 2
        ref += torch.linalg.vector_norm(y, dtype=torch.float64) ** 2
    d, r = float(diff), float(ref)  # one device sync for the whole model
    if r == 0.0:
        return 0.0 if d == 0.0 else math.inf
    return math.sqrt(d / r)


class _Distances:
    """The gradient distances of one check, each pair of runs once, on the check's device.

    Why: the first gradients are kept on the CPU (a card's memory is the plan's), and there
    the float64 sums over lm350m's 0.35B values took 1.6-5 s a pair, asked up to three times
    a pair by one check: 14 s of a 33 s screen on an H100 (docs/design.md, "Five things the
    card showed (session 13)"). On the card, a parameter's pair at a time, they take 0.0-0.4 s.
    """

    def __init__(self, device: torch.device | None = None) -> None:
        self.device = device
        self._known: dict[tuple[int, int], float] = {}

    def __call__(self, x: _Run, y: _Run) -> float:
        """||x's first gradient - y's|| / ||y's||."""
        key = (id(x.grads), id(y.grads))  # the lists live as long as the check's runs
        if key not in self._known:
            self._known[key] = _distance(x.grads, y.grads, self.device)
        return self._known[key]


def _window(run: _Run, n: int) -> slice:
    k = max(1, math.ceil(n * LOSS_WINDOW))
    return slice(n - k, n)


def _mean(values: list[float]) -> float:
    return sum(values) / len(values)


@dataclass
class _Verdict:
    passed: bool
    why: str
    metrics: dict[str, float]
    failed: frozenset[str] = frozenset()  # the rules L broke: "loss", "norm", "direction"


def _compare(
    precision: str, a: _Run, b: _Run | None, low: _Run, distance: _Distances | None = None
) -> _Verdict:
    """L against A, in units of B's distance from A.

    ``b`` may have run fewer steps than A (its first: the gradient direction's spread only)
    or be None (no spread run): a spread it did not measure counts as 0, so that rule's limit
    is its floor, and the spread is not in the metrics. That is the verdict of a whole B only
    where L is within those floors (every limit is its floor plus a multiple of a spread, so
    a measured spread only widens it): :func:`_spread_steps_needed` runs B that short only
    there.
    """
    u = ROUNDING[precision]
    n = len(a.losses)
    w = _window(a, n)
    ref = a.losses[w]
    whole = b is not None and len(b.losses) == n  # the loss and norm spreads measured
    first = b is not None and bool(b.grads)  # the direction's spread measured
    loss_spread = (
        _mean([abs(x - y) for x, y in zip(b.losses[w], ref, strict=True)]) if whole else 0.0
    )
    loss_gap = _mean([x - y for x, y in zip(low.losses[w], ref, strict=True)])
    loss_floor = LOSS_FLOOR_ROUNDOFFS * u * max(abs(y) for y in a.losses)
    loss_limit = LOSS_SPREADS * loss_spread + loss_floor

    distance = distance if distance is not None else _Distances()
    t0 = time.perf_counter()
    dir_spread = distance(b, a) if first else 0.0
    dir_gap = distance(low, a)
    logger.debug("numerics %s: gradient distances %.1f s", precision, time.perf_counter() - t0)
    dir_limit = DIRECTION_SPREADS * dir_spread + DIRECTION_FLOOR_ROUNDOFFS * u

    norm_a = max(a.grad_norms)
    norm_spread = abs(math.log(max(b.grad_norms) / norm_a)) if whole and norm_a > 0 else 0.0
    norm_gap = math.log(max(low.grad_norms) / norm_a) if norm_a > 0 else 0.0
    norm_limit = NORM_SPREADS * norm_spread + math.log(2.0)

    metrics = {
        "loss_gap": loss_gap,
        "loss_limit": loss_limit,
        "grad_distance": dir_gap,
        "grad_distance_limit": dir_limit,
        "grad_norm_log_ratio": norm_gap,
        "grad_norm_log_limit": norm_limit,
        "loss_fp32_first": a.losses[0],
        "loss_fp32_last": a.losses[-1],
        f"loss_{precision}_last": low.losses[-1],
        "rounding": u,
    }
    if whole:
        metrics["loss_spread_fp32"] = loss_spread
        metrics["grad_norm_log_ratio_fp32"] = norm_spread
        metrics["loss_fp32_perturbed_last"] = b.losses[-1]
    if first:
        metrics["grad_distance_fp32"] = dir_spread
    failures: dict[str, str] = {}
    if loss_gap > loss_limit:
        failures["loss"] = (
            f"its loss over the last {w.stop - w.start} steps is {loss_gap:.4g} above fp32's, "
            f"beyond the limit {loss_limit:.3g} (fp32's own spread {loss_spread:.3g})"
        )
    if norm_gap > norm_limit:
        failures["norm"] = (
            f"its gradient norm grows to {math.exp(norm_gap):.3g}x fp32's (limit "
            f"{math.exp(norm_limit):.3g}x)"
        )
    if dir_gap > dir_limit:
        failures["direction"] = (
            f"its first gradient is {dir_gap:.3g} of fp32's norm away from fp32's, beyond "
            f"the limit {dir_limit:.3g} (fp32's own distance {dir_spread:.3g})"
        )
    return _Verdict(not failures, "; ".join(failures.values()), metrics, frozenset(failures))


def _spread_steps_needed(
    precision: str, a: _Run, low: _Run, distance: _Distances | None = None
) -> int:
    """How many steps of a spread run decide the same verdict as a whole one: 0 where L is
    within every rule's floor (a spread only widens a limit), 1 where only the gradient
    direction is not (its spread is the first step's), else all of A's."""
    floors = _compare(precision, a, None, low, distance).failed
    if not floors:
        return 0
    return 1 if floors == {"direction"} else len(a.losses)


class FP32Runs:
    """The fp32 runs of one workload's checks, kept for the next precision's.

    A plan's screen checks up to three precisions of one model (bf16, fp16 where bf16
    failed, TF32 beside them) whose weights do not change in between. A, the fp32 reference,
    is the same run for each (same weights, batch, seed and steps; fp32 stays fp32 whatever
    precision is checked), and a spread run depends only on the rounding (fp16 and TF32 share
    2^-11) and the seed; a run of k steps is the first k steps of a longer one. So one
    precision's check after another trains its own precision and only the spread steps not
    yet run. The runs' copies of the model come from one :class:`Weights`, staged once.
    Pass one object to the checks of one model, in one screen.
    """

    def __init__(self) -> None:
        self._reference: dict[tuple, tuple[Any, _Run]] = {}
        self._spreads: dict[tuple, _Run] = {}
        self._weights: dict[int, Weights] = {}

    def weights(self, model: nn.Module) -> Weights:
        """Where ``model``'s runs take their copies from (:class:`Weights`), one per model:
        its weights staged once for all of the screen's runs."""
        held = self._weights.get(id(model))
        if held is None or held.model is not model:
            held = self._weights[id(model)] = Weights(model)
        return held

    def reference(self, key: tuple, make: Callable[[], tuple[Any, _Run]]) -> tuple[Any, _Run]:
        """The batch and A for ``key``, made once."""
        if key not in self._reference:
            self._reference[key] = make()
        return self._reference[key]

    def spread(self, key: tuple, steps: int, train: Callable[[int], _Run]) -> _Run:
        """The spread run for ``key`` cut to ``steps`` steps, trained only if no run of as
        many steps is kept."""
        kept = self._spreads.get(key)
        if kept is None or len(kept.losses) < steps:
            kept = self._spreads[key] = train(steps)
        return _Run(
            losses=kept.losses[:steps], grad_norms=kept.grad_norms[:steps], grads=kept.grads
        )


def check_numerics(
    workload: Workload,
    precision: str,
    steps: int = NUMERICS_STEPS,
    seed: int = 0,
    batch_size: int | None = None,
    time_s: float | None = NUMERICS_TIME_S,
    device: torch.device | str | None = None,
    scaler: bool = True,
    spread: Literal["all", "needed"] = "all",
    fp32: FP32Runs | None = None,
) -> Check:
    """Whether training in ``precision`` ('bf16', 'fp16' or 'tf32') is worse than fp32 is
    with itself: runs of ``steps`` steps in fp32 (A), in the precision (L) and in fp32
    perturbed by the precision's rounding (B), and B with another dropout draw (B') where L
    fails against B, compared as this module's docstring says.

    ``spread``: 'all' runs the spread runs as long as A and reports every spread; 'needed'
    (a plan's screen, where the check's steps are a share of the plan's) runs them only as
    far as the verdict needs (:func:`_spread_steps_needed`): none where L is within every
    rule's rounding floor, B's first step where only the gradient direction's spread can
    decide. Both give the same verdict: a spread only widens a limit above its floor. The
    report then names the spreads measured and the floors that decided the others.
    ``fp32``: where one precision's check follows another's on the same model, the fp32
    runs already made (:class:`FP32Runs`).

    ``scaler=False`` checks fp16 without a GradScaler (the plan's advice always has one;
    this is for a loop that does not). The copies train on ``device`` (default: where the
    model is); the user's model, optimizer and RNG are untouched. Its wall time is in the
    metrics (``wall_ms``), and the steps each run took (``steps``, ``spread_steps``).

    Raises:
        BadInputError: ``precision`` is not one of :data:`ROUNDING`, ``steps`` < 1, or
            ``spread`` is neither 'all' nor 'needed'.
    """
    if precision not in ROUNDING:
        raise BadInputError(
            f"Numerics are checked for one of {sorted(ROUNDING)}, but got {precision=}."
        )
    if steps < 1:
        raise BadInputError(f"The numerics check needs at least one step, but got {steps=}.")
    if spread not in ("all", "needed"):
        raise BadInputError(f"spread is 'all' or 'needed', but got {spread=}.")
    b = batch_size or min(workload.sample_batch_size, NUMERICS_MAX_BATCH)
    where = torch.device(device) if device is not None else workload.device
    runs = fp32 if fp32 is not None else FP32Runs()
    weights = runs.weights(workload.model)
    started = time.perf_counter()

    def reference() -> tuple[Any, _Run]:
        with torch.random.fork_rng(devices=_cuda(where)):  # a make_batch may draw: not yours
            batch = workload.batch(b, device=where)  # one batch for every run
        return batch, _train(
            workload,
            "fp32",
            steps,
            seed=seed,
            time_s=time_s,
            batch=batch,
            device=where,
            weights=weights,
        )

    # The model's identity in the keys: one FP32Runs passed to another model's check trains anew.
    model = id(workload.model)
    batch, a = runs.reference((model, seed, steps, b, str(where), time_s), reference)
    common = {"batch": batch, "device": where, "weights": weights}
    steps = len(a.losses)  # fewer than asked where steps are slow: the others take as many
    low = _train(workload, precision, steps, seed=seed, scaler=scaler, **common)
    comparable = a.finite and low.finite and len(low.losses) == steps
    u = ROUNDING[precision]

    def spread_run(draw: int, k: int) -> _Run:
        def train(k: int) -> _Run:
            return _train(workload, "fp32", k, seed=draw, jitter=u, **common)

        return runs.spread((model, draw, u, b, str(where)), k, train)

    verdict, draw, spread_runs, spread_steps = None, None, 0, 0
    if comparable:
        distance = _Distances(where)
        spread_steps = (
            steps if spread == "all" else _spread_steps_needed(precision, a, low, distance)
        )
        # The floors alone: passes where k is 0.
        verdict = _compare(precision, a, None, low, distance)
        if spread_steps:
            same = spread_run(seed, spread_steps)
            spread_runs = 1
            verdict = _compare(precision, a, same, low, distance)
        if not verdict.passed:
            # L may differ from A by a dropout draw (on a card its kernels draw their own
            # masks): judged again against fp32's spread over another draw. A model without
            # dropout gets the same spread again, and the same verdict.
            first = verdict.metrics
            other = spread_run(seed + 1, spread_steps)
            spread_runs = 2
            verdict = _compare(precision, a, other, low, distance)
            draw = {
                f"{k}_same_draw": first[k]
                for k in ("loss_spread_fp32", "grad_distance_fp32")
                if k in first
            }
    wall_ms = (time.perf_counter() - started) * 1e3
    name = f"{precision} without a GradScaler" if precision == "fp16" and not scaler else precision
    perturbed = f"fp32 with weights perturbed by {u:.3g} ({precision}'s rounding)"
    if not spread_runs and comparable:
        against = f"within every rule's rounding floor, so {perturbed} was not run"
    elif 0 < spread_steps < steps:
        against = (
            f"against {perturbed} over its first step (the rounding floors decide the loss "
            "and gradient-norm rules)"
        )
    else:
        against = f"against fp32 vs {perturbed}"
    what = (
        f"{name} vs fp32 over {steps} training steps from the same weights on {b} samples, "
        + against
        + (" and, as that failed it, another dropout draw" if draw else "")
    )
    metrics = {
        "steps": float(steps),
        "batch_size": float(b),
        "wall_ms": wall_ms,
        "spread_runs": float(spread_runs),
        "spread_steps": float(spread_steps),
    }
    if low.skipped:
        metrics["skipped_steps"] = float(low.skipped)

    def check(passed: bool, summary: str, more: dict[str, float] | None = None) -> Check:
        return Check(
            strategy="precision",
            choice=precision,
            summary=summary,
            passed=passed,
            metrics={**metrics, **(more or {})},
        )

    if not a.finite:
        return check(True, f"{what}: fp32 itself reached inf/nan, so the comparison says nothing.")
    if not low.finite:
        return check(
            False,
            f"{what}: {name} reached inf/nan (at step {len(low.losses)}), fp32 did not.",
            {"finite_steps": float(len(low.losses) - 1)},
        )
    if len(low.losses) < steps:
        return check(
            False,
            f"{what}: the GradScaler skipped {low.skipped} steps, its scale halved down to "
            f"2^{16 - low.skipped} (the gradients overflow fp16 at every scale it tried).",
        )
    m = {**verdict.metrics, **(draw or {})}
    perturbed_last = (
        f"{m['loss_fp32_perturbed_last']:.4g} perturbed, "
        if "loss_fp32_perturbed_last" in m
        else ""
    )
    summary = (
        f"{what}: loss {m['loss_fp32_last']:.4g} in fp32, {perturbed_last}"
        f"{m[f'loss_{precision}_last']:.4g} in {name}; "
    )
    if verdict.passed:
        loss_spread = (
            f"fp32's own spread {m['loss_spread_fp32']:.3g}"
            if "loss_spread_fp32" in m
            else "its rounding floor"
        )
        dir_spread = (
            f"fp32's own {m['grad_distance_fp32']:.3g}"
            if "grad_distance_fp32" in m
            else f"within its rounding floor {m['grad_distance_limit']:.3g}"
        )
        summary += (
            f"{name}'s loss gap {m['loss_gap']:.3g} is within {m['loss_limit']:.3g} "
            f"({loss_spread}) and its first gradient is {m['grad_distance']:.3g} away "
            f"({dir_spread})."
        )
    else:
        summary += verdict.why + "."
    return check(verdict.passed, summary, m)
