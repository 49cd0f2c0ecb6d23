"""Try a compiled choice on copies of the workload: does it compile, how long, how close to eager.

A model that does not compile is an answer, not an error: :func:`try_compile` returns a
:class:`CompileResult` whose ``ok`` is False with the reason (an exception while compiling
or running, no graph captured at all, graph breaks everywhere, a non-finite loss), and the
planner keeps that model eager. Only the eager step failing is raised: that is the
workload's problem, not the compiler's.
"""

from __future__ import annotations

import copy
import math
import time
from dataclasses import dataclass, field
from typing import Any

import torch
from pydantic import BaseModel, ConfigDict, Field, JsonValue
from torch import nn

from memadvisor import _torch_private
from memadvisor.errors import BadInputError, is_oom, is_our_bug, root_cause
from memadvisor.schema.candidate import Candidate
from memadvisor.schema.config import steady_ms
from memadvisor.step import base_step, running
from memadvisor.strategy import apply_candidate, facts_of
from memadvisor.workload import Workload, train_step
from strategies import _forward
from strategies._compiled_forward import (
    CompileChoice,
    CompiledForward,
    compile_targets,
    mark_batch_dynamic,
    new_compiled_function,
    parse_choice,
)
from strategies.precision import grad_scaler_for

__all__ = ["MAX_GRAPH_BREAKS", "STRATEGY_NAME", "CompileResult", "try_compile"]

STRATEGY_NAME = "compile"
# Each graph break returns to Python between compiled pieces: no fusion across it, and the
# partitioner cannot recompute across it. Past this many, the "compiled" step is mostly
# glue; the plan keeps such a model eager rather than measure a patchwork.
MAX_GRAPH_BREAKS = 16


class CompileResult(BaseModel):
    """What compiling one choice did on the workload, eager alongside for comparison."""

    model_config = ConfigDict(extra="forbid")

    choice: JsonValue = Field(description="The compile choice tried.")
    ok: bool = Field(description="False: keep this model eager (``reason`` says why).")
    reason: str = Field("", description="Why it is not ok, in a sentence; empty when ok.")
    error: str | None = Field(None, description="The exception, when one was raised.")
    out_of_memory: bool = Field(False, description="The compiled step ran out of memory.")
    batch_size: int = Field(gt=0, description="The batch the steps ran at.")
    steps: int = Field(gt=0, description="Steps run, eager and compiled each.")
    eager_step_ms: float = Field(description="Median eager step, the first excluded.")
    first_step_ms: float | None = Field(
        None, description="The first compiled step: compiling forward and backward, then running."
    )
    compiled_step_ms: float | None = Field(
        None, description="Median compiled step after the first (the steady state)."
    )
    graphs: int = Field(0, description="Graphs dynamo captured.")
    graph_breaks: int = Field(0, description="Graph breaks dynamo reported.")
    break_reasons: list[str] = Field(default_factory=list, description="The first few reasons.")
    cache_hits: int = Field(
        0,
        description="Graphs loaded from the on-disk caches (inductor's FX graph cache and "
        "AOTAutograd's, counted as a compiled run counts them).",
    )
    cache_misses: int = Field(0, description="Graphs looked up in those caches and compiled.")
    cache_bypasses: int = Field(
        0, description="Graphs compiled that those caches would not take (not saved)."
    )
    loss_rel_diff: float | None = Field(None, description="First step's loss vs eager, relative.")
    grad_rel_diff: float | None = Field(
        None, description="First step's gradients vs eager, relative L2 over all parameters."
    )

    @property
    def compile_ms(self) -> float | None:
        """The one-off cost: the first compiled step less a steady one."""
        if self.first_step_ms is None or self.compiled_step_ms is None:
            return None
        return max(0.0, self.first_step_ms - self.compiled_step_ms)

    @property
    def summary(self) -> str:
        """One sentence a person reads."""
        where = f"at batch {self.batch_size}"
        if not self.ok:
            return f"torch.compile {_label(self.choice)} {where}: {self.reason} Planned eager."
        compile_s = (self.compile_ms or 0.0) / 1e3
        text = (
            f"torch.compile {_label(self.choice)} {where}: the first step took "
            f"{(self.first_step_ms or 0.0) / 1e3:.1f} s (about {compile_s:.1f} s of it compiling, "
            f"once per process and input shape; {self.cache_hits} of "
            f"{self.cache_hits + self.cache_misses} graphs from the on-disk cache"
            f"{f', {self.cache_bypasses} it would not take' if self.cache_bypasses else ''}), then "
            f"{self.compiled_step_ms:.1f} ms a step vs {self.eager_step_ms:.1f} ms eager; "
            f"{self.graphs} graph(s), {self.graph_breaks} graph break(s)"
        )
        if self.graph_breaks and self.break_reasons:
            # Where a break comes from is what a person can change: their code, or a
            # library's (transformers' warning_once in a loss, a print in a forward).
            text += f" (the first: {self.break_reasons[0]})"
        if self.loss_rel_diff is not None:
            text += f"; first loss within {self.loss_rel_diff:.1e} of eager's (relative)"
        return text + "."


def _label(choice: JsonValue) -> str:
    parsed = parse_choice(choice)
    if parsed is None:
        return "off"
    return f"({parsed.words()})"


class _FreshCompiledForward(CompiledForward):
    """A CompiledForward with a compiled function of its own, compiled from scratch.

    The trial must compile as a fresh process would, even where this process compiled the
    same model before: otherwise dynamo reuses those graphs (the top frame's, and the user's
    frames after a graph break), the first step shows no compile time and no graph counts.
    """

    def __init__(
        self, module: nn.Module, inner: Any, choice: CompileChoice, fn: Any = None
    ) -> None:
        super().__init__(
            module, inner, choice.mode, choice.activation_memory_budget, choice.dynamic_batch
        )
        # Regional: the blocks of one class share one fresh function, as they share one
        # compiled code object in the user's model.
        self.fn = fn or new_compiled_function(type(module), choice, own_backend=True)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        # The graph the probes compile (a dynamic batch marked as theirs is), so the on-disk
        # cache this trial fills is the one their processes look up.
        if self.dynamic_batch:
            mark_batch_dynamic(args, kwargs)
        return self.fn(self.module, *args, **kwargs)


@dataclass
class _Run:
    losses: list[float] = field(default_factory=list)
    first_grads: torch.Tensor | None = None
    step_ms: list[float] = field(default_factory=list)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _train(
    workload: Workload,
    candidate: Candidate,
    compiled: CompileChoice | None,
    device: torch.device,
    steps: int,
    seed: int,
    run: _Run,
) -> None:
    """Train a copy of the workload's model on ``device`` ``steps`` steps; fill ``run``.

    ``run`` is filled in place so that what finished before an exception is kept.
    """
    workload = running(
        workload,
        apply_candidate(base_step(workload, copy.deepcopy(workload.model).to(device)), candidate),
    )
    model = workload.model
    if compiled is not None:
        fresh: dict[type, Any] = {}
        for module in compile_targets(model, compiled):
            cls = type(module)
            if cls not in fresh:
                fresh[cls] = new_compiled_function(cls, compiled, own_backend=True)
            _forward.install(module, _FreshCompiledForward, choice=compiled, fn=fresh[cls])
    optimizer = workload.make_optimizer(model)
    scaler = grad_scaler_for(facts_of(candidate).autocast or "fp32", device.type)
    params = [p for p in model.parameters() if p.requires_grad]
    batch = workload.batch(candidate.batch_size, device=device)

    def first_grads(phase: str) -> None:
        # "optimizer" comes after backward, before the step: the gradients are whole.
        if phase != "optimizer" or run.first_grads is not None:
            return
        scale = float(scaler.get_scale()) if scaler is not None else 1.0
        flat = [
            p.grad.detach().float().flatten().cpu() / scale for p in params if p.grad is not None
        ]
        run.first_grads = torch.cat(flat) if flat else torch.zeros(0)

    cuda = [device.index or 0] if device.type == "cuda" else []
    # The same seed for eager and compiled; the caller's RNG untouched.
    with torch.random.fork_rng(devices=cuda):
        torch.manual_seed(seed)
        for _ in range(steps):
            _sync(device)
            t0 = time.perf_counter()
            loss = train_step(
                workload,
                model,
                optimizer,
                batch,
                accumulation_steps=candidate.accumulation_steps,
                scaler=scaler,
                on_phase=first_grads,
            )
            run.losses.append(float(loss.float()))
            _sync(device)
            run.step_ms.append((time.perf_counter() - t0) * 1e3)


def _relative(a: float, b: float) -> float:
    if a == b:
        return 0.0
    return abs(a - b) / abs(b) if b != 0 else math.inf


def _describe(error: BaseException) -> str:
    root = root_cause(error)
    text = " ".join(line.strip() for line in str(root).splitlines() if line.strip())
    return f"{type(root).__name__}: {text[:300]}"


def _count(counters: dict[str, dict[str, int]], group: str, key: str) -> int:
    return int(counters.get(group, {}).get(key, 0))


def try_compile(
    workload: Workload,
    choice: JsonValue,
    *,
    candidate: Candidate | None = None,
    steps: int = 3,
    max_graph_breaks: int = MAX_GRAPH_BREAKS,
    seed: int = 0,
    device: torch.device | str | None = None,
) -> CompileResult:
    """Compile ``choice`` on a copy of the workload's model, train a few steps, compare to eager.

    Both runs start from copies of the user's model (which, like the optimizer and the RNG,
    is untouched), with the same seed, on ``device``. Dropout draws differ under
    inductor (its own random number generator), so with dropout the losses differ by more
    than rounding.

    Args:
        workload: the model and its step.
        choice: a compiled choice: ``"default"``, or a mode and an activation memory budget.
        candidate: the batch and the other strategies' choices to apply with it; default the
            sample batch with nothing else applied.
        steps: steps per run (at least 2: the first compiles).
        max_graph_breaks: more breaks than this is "graph breaks everywhere": not ok.
        seed: the seed both runs use.
        device: where to run (the copies are moved there); default the model's device.

    Raises:
        BadInputError: ``choice`` is off or malformed, ``steps`` < 2, or the *eager* step
            fails (the workload itself is broken).
    """
    compiled = parse_choice(choice)
    if compiled is None:
        raise BadInputError(
            f"try_compile needs a compiled choice such as 'default', but got {choice=}."
        )
    if steps < 2:
        raise BadInputError(
            f"try_compile needs at least 2 steps (the first compiles), but got {steps=}."
        )
    base = candidate or Candidate(batch_size=workload.sample_batch_size)
    others = {k: v for k, v in base.choices.items() if k != STRATEGY_NAME}
    eager_candidate = base.model_copy(update={"choices": others})

    where = torch.device(device) if device is not None else workload.device
    eager = _Run()
    _train(workload, eager_candidate, None, where, steps, seed, eager)
    result = {
        "choice": compiled.to_json(),
        "batch_size": base.batch_size,
        "steps": steps,
        "eager_step_ms": steady_ms(eager.step_ms),
    }

    before = _torch_private.dynamo_counters()
    run = _Run()
    failure: BaseException | None = None
    try:
        _train(workload, eager_candidate, compiled, where, steps, seed, run)
    except Exception as e:  # noqa: BLE001 - torch's or the model's failure is the answer
        if is_our_bug(e):
            raise  # not "does not compile": a bug of ours, with its traceback
        failure = e
    result |= _what_dynamo_did(before, _torch_private.dynamo_counters())
    if failure is not None:
        oom = is_oom(root_cause(failure)) or is_oom(failure)
        reason = (
            f"the compiled step ran out of memory at batch {base.batch_size}."
            if oom
            else f"compiling or running the compiled step failed ({_describe(failure)})."
        )
        return CompileResult(
            ok=False, reason=reason, error=_describe(failure), out_of_memory=oom, **result
        )
    result |= {
        "first_step_ms": run.step_ms[0],
        "compiled_step_ms": steady_ms(run.step_ms),
        "loss_rel_diff": _relative(run.losses[0], eager.losses[0]),
        "grad_rel_diff": _grad_rel_diff(run, eager),
    }
    reason = _judge(result, run, eager, max_graph_breaks)
    return CompileResult(ok=not reason, reason=reason, **result)


def _what_dynamo_did(
    before: dict[str, dict[str, int]], after: dict[str, dict[str, int]]
) -> dict[str, Any]:
    """Graphs, graph breaks (with reasons) and cache hits between two counter snapshots."""

    def delta(group: str, key: str) -> int:
        return _count(after, group, key) - _count(before, group, key)

    breaks = {
        reason: n - _count(before, "graph_break", reason)
        for reason, n in after.get("graph_break", {}).items()
        if n > _count(before, "graph_break", reason)
    }
    # Counted as a compiled run counts them (memadvisor.device's Measurement): inductor's FX
    # graph cache and AOTAutograd's together, so the trial's words and the runs' agree.
    hits, misses, bypasses = (
        a - b
        for a, b in zip(
            _torch_private.compile_cache_counts(after),
            _torch_private.compile_cache_counts(before),
            strict=True,
        )
    )
    return {
        "graphs": delta("stats", "unique_graphs"),
        "graph_breaks": sum(breaks.values()),
        "break_reasons": [_break_words(r) for r in list(breaks)[:5]],
        "cache_hits": hits,
        "cache_misses": misses,
        "cache_bypasses": bypasses,
    }


def _break_words(reason: str) -> str:
    """A graph break's reason in a line: dynamo's first line, and where its text names the
    call that broke the graph ("Developer debug context: ..."), that too; 200 characters at
    most. Why: the first line alone ("Attempted to call function marked as skipped") does not
    say which call, and the call is what a person can change."""
    lines = [line.strip() for line in reason.splitlines() if line.strip()]
    if not lines:
        return ""
    words = lines[0]
    context = next((x for x in lines if x.startswith("Developer debug context:")), None)
    if context is not None:
        words += ": " + context.removeprefix("Developer debug context:").strip()
    return words[:200]


def _grad_rel_diff(run: _Run, eager: _Run) -> float | None:
    if eager.first_grads is None or run.first_grads is None:
        return None
    ref = float(eager.first_grads.norm())
    diff = float((run.first_grads - eager.first_grads).norm())
    if ref == 0:
        return 0.0 if diff == 0 else math.inf
    return diff / ref


def _judge(result: dict, run: _Run, eager: _Run, max_graph_breaks: int) -> str:
    """Why a compile that raised nothing is still no use; empty when it is."""
    if result["graphs"] == 0:
        return (
            "dynamo captured no graph, so the step ran eagerly (every frame skipped, or a "
            "recompile limit already reached in this process)."
        )
    if result["graph_breaks"] > max_graph_breaks:
        reasons = "; ".join(result["break_reasons"][:2])
        return (
            f"{result['graph_breaks']} graph breaks (more than {max_graph_breaks}): the step runs "
            f"as many small compiled pieces with Python between them ({reasons})."
        )
    if not all(math.isfinite(x) for x in run.losses) and all(
        math.isfinite(x) for x in eager.losses
    ):
        return "the compiled step gave a non-finite loss where eager's was finite."
    return ""
