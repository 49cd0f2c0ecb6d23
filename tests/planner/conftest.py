"""Hand-built profiles, fake strategies and fake devices for the planner's CPU tests.

Nothing here needs the profiler, the real strategies or the simulated device: the planner is
tested against inputs whose right answers are known by construction.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from pydantic import JsonValue
from torch import nn

from memadvisor.device import Device
from memadvisor.estimate import StepModel
from memadvisor.schema.advice import Advice
from memadvisor.schema.candidate import Candidate, Measurement
from memadvisor.schema.device import AutocastPolicy, DeviceCapabilities
from memadvisor.schema.facts import Facts
from memadvisor.schema.profile import (
    BlockActivity,
    BlockInfo,
    DeviceInfo,
    LinearBytes,
    LinearMs,
    Profile,
    StepProfile,
)
from memadvisor.strategy import HandTried, Strategy, TimedEachChoice
from memadvisor.workload import Workload

MIB = 2**20
BLOCKS = 4


def _step(precision: str, scale: float) -> StepProfile:
    """Each block keeps ``scale`` MiB per sample (its input 0.1 MiB), outside 0.5 MiB."""
    blocks = [
        BlockActivity(
            name=f"b{i}",
            activation=LinearBytes(per_sample_bytes=scale * MIB),
            input=LinearBytes(per_sample_bytes=0.1 * MIB),
            forward_ms=LinearMs(per_sample_ms=0.25 * scale),
        )
        for i in range(BLOCKS)
    ]
    return StepProfile(
        precision=precision,
        blocks=blocks,
        activation_total=LinearBytes(per_sample_bytes=(BLOCKS * scale + 0.5) * MIB),
        forward_ms=LinearMs(per_sample_ms=1.0 * scale, constant_ms=1.0),
        backward_ms=LinearMs(per_sample_ms=2.0 * scale, constant_ms=1.0),
        optimizer_ms=1.0,
    )


def make_profile(param_mib: float = 1.0) -> Profile:
    """Weights ``param_mib``, grads the same, AdamW state twice that; bf16 halves activations."""
    p = int(param_mib * MIB)
    return Profile(
        model_name="Toy",
        device=DeviceInfo(kind="cpu", name="cpu", bf16_supported=True),
        batch_sizes=(2, 4),
        param_bytes=p,
        grad_bytes=p,
        optimizer_state_bytes=2 * p,
        blocks=[BlockInfo(name=f"b{i}", type_name="Block") for i in range(BLOCKS)],
        steps={"fp32": _step("fp32", 1.0), "bf16": _step("bf16", 0.5)},
    )


class FakePrecision(Strategy, TimedEachChoice, HandTried):
    """fp32 or bf16; its own hand row (+AMP) and guard, as the built-in precision has."""

    name = "precision"
    effect_order = 10

    def is_neutral(self, choice) -> bool:
        return choice in (None, "off", "fp32")

    def by_hand(self, options):
        return ("+AMP", "bf16") if "bf16" in options else None

    def choices(self, profile, config) -> list[JsonValue]:
        return ["fp32", "bf16"]

    def effect(self, profile, choice, model: StepModel) -> None:
        model.use_precision(str(choice))

    def apply(self, step, choice):
        return step

    def explain(self, choice, profile) -> Advice | None:
        if choice == "fp32":
            return None
        return Advice(strategy=self.name, title=f"Train in {choice}", sentence="Use autocast.")


class FakeCheckpointing(Strategy, HandTried):
    """Any prefix of the blocks; every block is its hand row (+Checkpointing)."""

    name = "checkpointing"

    def by_hand(self, options):
        lists = [c for c in options if isinstance(c, list) and c]
        return ("+Checkpointing", max(lists, key=len)) if lists else None

    def choices(self, profile, config) -> list[JsonValue]:
        names = [b.name for b in profile.blocks]
        return [names[:k] for k in range(len(names) + 1)]

    def effect(self, profile, choice, model: StepModel) -> None:
        index = {b.name: i for i, b in enumerate(profile.blocks)}
        model.checkpoint(index[n] for n in choice)  # type: ignore[union-attr]

    def facts(self, choice) -> Facts:
        """The blocks it recomputes, as the built-in checkpointing states them."""
        return Facts(recomputed_blocks=list(choice or []))

    def apply(self, step, choice):
        return step

    def explain(self, choice, profile) -> Advice | None:
        if not choice:
            return None
        return Advice(strategy=self.name, title=f"Checkpoint {len(choice)}", sentence="Recompute.")


class FakeDevice(Device):
    """Fits a candidate iff its batch is at most ``threshold(candidate)``; counts every run.

    ``sustained`` (optional) is the lower threshold that holds for runs longer than
    ``short_steps``: a batch between the two passes a probe and fails verification, as one
    step overshoots near the limit on a card (docs/design.md, "Fitting near the limit").
    """

    # Its times are a model of a card's: they rank candidates. It autocasts as a card would.
    capabilities = DeviceCapabilities(
        kind="fake",
        tensor_device="cpu",
        step_times_rank=True,
        autocast=AutocastPolicy(device_type="cpu", dtypes=("bf16", "fp16")),
    )

    def __init__(
        self,
        threshold: int | Callable[[Candidate], int] | Callable[[int], bool],
        *,
        sustained: int | None = None,
        short_steps: int = 3,
        error: Exception | None = None,
        error_at: int | None = None,
        inverse_times: bool = False,
        runs_cost_more_than_steps: bool = False,
        reserved_over: float | None = None,
    ) -> None:
        super().__init__(budget_bytes=100 * MIB, name="fake")
        # True models a card: a run's fixed cost dwarfs its steps, so the planner's probes
        # take the verification's steps (memadvisor.planner._plan.run_steps).
        if runs_cost_more_than_steps:
            self.capabilities = type(self).capabilities.model_copy(
                update={"runs_cost_more_than_steps": True}
            )
        self.threshold = threshold
        self.sustained = sustained
        self.short_steps = short_steps
        self.error, self.error_at = error, error_at
        self.inverse_times = inverse_times  # smaller batches "faster": against the estimate
        # A card's reserved peak: this much over the allocated one, held at the budget by the
        # memory cap (the allocator frees its cache there rather than fail). None: no reserve.
        self.reserved_over = reserved_over
        self.calls: list[tuple[int, int, dict]] = []

    def limit(self, candidate: Candidate, steps: int) -> int:
        limit = self.threshold(candidate) if callable(self.threshold) else self.threshold
        if self.sustained is not None and steps > self.short_steps:
            limit = min(limit, self.sustained)
        return limit

    def fits(self, candidate: Candidate, steps: int) -> bool:
        return candidate.batch_size <= self.limit(candidate, steps)

    def reserved_peak(self, peak: int) -> int | None:
        """A run's reserved peak for its allocated ``peak``: ``reserved_over`` above it, held
        at the budget by the cap; None without ``reserved_over``."""
        if self.reserved_over is None:
            return None
        return min(self.budget_bytes, int(peak * (1 + self.reserved_over)))

    def run(self, workload: Workload, candidate: Candidate, steps: int) -> Measurement:
        self.calls.append((candidate.batch_size, steps, dict(candidate.choices)))
        if self.error is not None and candidate.batch_size >= (self.error_at or 0):
            raise self.error
        if not self.fits(candidate, steps):
            raise torch.OutOfMemoryError(f"fake: batch {candidate.batch_size} does not fit")
        b, k = candidate.batch_size, candidate.accumulation_steps
        # Time: 1 ms fixed + 0.1 ms/sample, halved in bf16 (as the profile says).
        per_sample = 0.05 if candidate.choices.get("precision") == "bf16" else 0.1
        step_ms = k * (1.0 + per_sample * b) + 1.0
        if self.inverse_times:
            step_ms = float(b * b)
        # Memory grows linearly with the batch and fills the budget half a sample past the
        # threshold: what a run measures says how far the threshold is, as on a card.
        peak = int(b * self.budget_bytes / (self.limit(candidate, steps) + 0.5))
        return Measurement(
            steps=steps,
            peak_bytes=peak,
            reserved_peak_bytes=self.reserved_peak(peak),
            step_ms=step_ms,
            samples_per_s=b * k / step_ms * 1e3,
        )


class LinearDevice(FakeDevice):
    """Memory and time as lines in the batch, eager and compiled, known by construction.

    A run of batch ``b`` holds ``fixed_bytes + per_sample_bytes(candidate) * b`` and fits iff
    that is within the budget. Eager per-sample bytes come from ``eager_per_sample`` (MiB by
    (precision, checkpointed blocks)); a compiled run (choices with a compile choice) holds
    ``compiled_ratio`` of eager's per sample (or ``compiled_per_sample``'s MiB) and
    ``compiled_fixed_bytes`` more fixed, whatever its form (regional or whole), as fusion frees
    per-sample intermediates. A run's measured peak is at least ``step_peak_bytes`` (a fixed
    phase, the optimizer's update, that the activations overtake only near the edge); what
    fits is the line's alone. Time:
    ``1 ms + b * per_sample_ms * (1 + recompute * blocks / BLOCKS)``, ``per_sample_ms`` halved
    in bf16; compiled ``speedup`` times faster, its regional form ``regional_speed`` of that,
    a dynamic-batch form ``dynamic_slowdown`` times slower than its static one.

    The host: with ``host_ms``, every step takes at least that long to launch (a step whose
    card's time is shorter waits on the host: its step is ``host_ms``), and its measurement
    records the host's time; a compiled form in ``reduce-overhead`` mode (CUDA graphs)
    launches in ``graphs_host_share`` of its card's time, so its step is the card's, and
    holds ``graphs_ratio`` times its form's bytes a sample (the graphs' memory pool).
    """

    def __init__(
        self,
        eager_per_sample: dict[tuple[str, int], float],
        *,
        fixed_bytes: int = 10 * MIB,
        compiled_ratio: float = 0.7,
        compiled_per_sample: dict[tuple[str, int], float] | None = None,
        compiled_fixed_bytes: int = 0,
        step_peak_bytes: int = 0,
        speedup: float = 1.3,
        regional_speed: float = 0.95,
        per_sample_ms: float = 0.1,
        fixed_ms: float = 1.0,
        recompute: float = 0.3,
        uncached_checkpointed: bool = False,
        dynamic_slowdown: float = 1.0,
        host_ms: float | None = None,
        graphs_ratio: float = 1.3,
        graphs_host_share: float = 0.1,
        **kwargs,
    ) -> None:
        super().__init__(self.edge, **kwargs)
        self.host_ms, self.graphs_ratio = host_ms, graphs_ratio
        self.graphs_host_share = graphs_host_share
        # Compiled runs with checkpointed blocks say the cache would not take their graphs
        # (torch 2.11 on a card); the others that they found them there.
        self.uncached_checkpointed = uncached_checkpointed
        # A dynamic-batch form's step takes this many times its static form's (a conv net's
        # regional graph on a card: 1.26x, session 22).
        self.dynamic_slowdown = dynamic_slowdown
        self.eager_per_sample = eager_per_sample
        self.compiled_per_sample = compiled_per_sample
        self.fixed_bytes, self.compiled_fixed_bytes = fixed_bytes, compiled_fixed_bytes
        self.step_peak_bytes = step_peak_bytes
        self.compiled_ratio, self.speedup, self.regional_speed = (
            compiled_ratio,
            speedup,
            regional_speed,
        )
        self.per_sample_ms, self.fixed_ms, self.recompute = per_sample_ms, fixed_ms, recompute

    @staticmethod
    def key(candidate: Candidate) -> tuple[str, int]:
        precision = str(candidate.choices.get("precision", "fp32"))
        return precision, len(candidate.choices.get("checkpointing", []) or [])  # type: ignore[arg-type]

    @staticmethod
    def compiled(candidate: Candidate) -> dict | str | None:
        return candidate.choices.get("compile")  # type: ignore[return-value]

    @classmethod
    def graphs(cls, candidate: Candidate) -> bool:
        """Whether ``candidate`` compiles in reduce-overhead mode (CUDA graphs)."""
        choice = cls.compiled(candidate)
        mode = choice.get("mode") if isinstance(choice, dict) else choice
        return mode == "reduce-overhead"

    def launch_ms(self, candidate: Candidate) -> float | None:
        """The host's time to launch ``candidate``'s step (None: the host is not modelled)."""
        if self.host_ms is None:
            return None
        if self.graphs(candidate):
            return self.graphs_host_share * self.card_ms(candidate)
        return candidate.accumulation_steps * self.host_ms

    def line(self, candidate: Candidate) -> tuple[int, int]:
        """(fixed bytes, bytes per sample) of ``candidate``'s step on this device."""
        key = self.key(candidate)
        per_sample = self.eager_per_sample[key] * MIB
        fixed = self.fixed_bytes
        if self.compiled(candidate) is not None:
            fixed += self.compiled_fixed_bytes
            if self.compiled_per_sample is not None:
                per_sample = self.compiled_per_sample[key] * MIB
            else:
                per_sample *= self.compiled_ratio
            if self.graphs(candidate):
                per_sample *= self.graphs_ratio
        return fixed, round(per_sample)

    def edge(self, candidate: Candidate) -> int:
        """The largest batch that fits: what the planner should find."""
        fixed, per_sample = self.line(candidate)
        return (self.budget_bytes - fixed) // per_sample

    def step_ms(self, candidate: Candidate) -> float:
        """The card's time, or the host's where the host takes longer to launch the step."""
        return max(self.card_ms(candidate), self.launch_ms(candidate) or 0.0)

    def card_ms(self, candidate: Candidate) -> float:
        precision, blocks = self.key(candidate)
        per_sample = self.per_sample_ms * (0.5 if precision == "bf16" else 1.0)
        per_sample *= 1 + self.recompute * blocks / BLOCKS
        ms = self.fixed_ms + candidate.batch_size * per_sample
        choice = self.compiled(candidate)
        if choice is not None:
            regional = isinstance(choice, dict) and choice.get("regional")
            ms /= self.speedup * (self.regional_speed if regional else 1.0)
            if isinstance(choice, dict) and choice.get("dynamic_batch"):
                ms *= self.dynamic_slowdown
        return candidate.accumulation_steps * ms

    def run(self, workload: Workload, candidate: Candidate, steps: int) -> Measurement:
        self.calls.append((candidate.batch_size, steps, dict(candidate.choices)))
        if self.error is not None and candidate.batch_size >= (self.error_at or 0):
            raise self.error
        if candidate.batch_size > self.edge(candidate):
            raise torch.OutOfMemoryError(f"fake: batch {candidate.batch_size} does not fit")
        fixed, per_sample = self.line(candidate)
        step_ms = self.step_ms(candidate)
        cache: dict[str, int] = {}
        if self.uncached_checkpointed and self.compiled(candidate) is not None:
            blocks = self.key(candidate)[1]
            cache = {
                "compile_cache_hits": 0 if blocks else 3,
                "compile_cache_misses": 1 if blocks else 0,
                "compile_cache_bypasses": 2 if blocks else 0,
            }
        peak = max(self.step_peak_bytes, fixed + per_sample * candidate.batch_size)
        return Measurement(
            steps=steps,
            peak_bytes=peak,
            reserved_peak_bytes=self.reserved_peak(peak),
            step_ms=step_ms,
            samples_per_s=candidate.batch_size * candidate.accumulation_steps / step_ms * 1e3,
            host_ms=self.launch_ms(candidate),
            **cache,
        )


class ThresholdOf:
    """threshold(candidate) from a table keyed by (precision, number of checkpointed blocks)."""

    def __init__(self, table: dict[tuple[str, int], int]) -> None:
        self.table = table

    def __call__(self, candidate: Candidate) -> int:
        precision = str(candidate.choices.get("precision", "fp32"))
        ckpt = len(candidate.choices.get("checkpointing", []) or [])  # type: ignore[arg-type]
        return self.table.get((precision, ckpt), 0)


def tiny_workload() -> Workload:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    return Workload(model=model, sample_batch=torch.randn(2, 4))


@pytest.fixture
def profile() -> Profile:
    return make_profile()


@pytest.fixture
def fake_device() -> type[FakeDevice]:
    """The FakeDevice class (conftest is not importable under --import-mode=importlib)."""
    return FakeDevice


@pytest.fixture
def linear_device() -> type[LinearDevice]:
    """The LinearDevice class: memory and time lines known by construction, compiled too."""
    return LinearDevice


@pytest.fixture
def threshold_of() -> type[ThresholdOf]:
    return ThresholdOf


@pytest.fixture
def profile_factory() -> Callable[..., Profile]:
    return make_profile


@pytest.fixture
def strategies() -> list[Strategy]:
    return [FakePrecision(), FakeCheckpointing()]


@pytest.fixture
def workload() -> Workload:
    return tiny_workload()


def run_many_batches(device, compiled_only: bool = False) -> list[list[int]]:
    """``device``'s run_many made to note the batches of each call (in the list returned,
    filled as it is called), then answer as before; ``compiled_only``: only calls whose runs
    are all compiled (the compile search's, not the eager timing runs')."""
    calls: list[list[int]] = []
    real = device.run_many

    def recorded(workload, runs):
        if not compiled_only or all("compile" in c.choices for c, _ in runs):
            calls.append([c.batch_size for c, _ in runs])
        return real(workload, runs)

    device.run_many = recorded
    return calls


@pytest.fixture
def record_run_many():
    """:func:`run_many_batches`, for a test's device."""
    return run_many_batches
