"""A step's matmul FLOPs, and step times modelled from them where none can be measured.

Under ``FakeTensorMode`` no op takes real time, so a fake-tensor profile has every time 0
and cannot rank a checkpointed configuration against a plain one, or bf16 against fp32.
:func:`count_step_flops` counts what torch's FLOP formulas cover (matmuls, convolutions,
attention) in one forward, per module, and in one backward, split by the dtype each op ran
in; :class:`StepTimeModel` turns the counts into times at stated rates per dtype, and
:func:`with_modelled_times` writes them into the profile's time fields, so the estimate
(which reads only those) charges recompute and precision as a card would, roughly.

Precision: the plain (fp32) step runs each op in its inputs' dtype, so a model whose
weights are bf16 (a frozen LoRA base) is charged bf16's rate even without autocast. Under
autocast every op counted here is on autocast's lower-precision list (CUDA's and the CPU's),
so a bf16 or fp16 step runs all of its counted FLOPs at that dtype's rate.

Known limitations:
    * Only ops with a FLOP formula: elementwise ops, norms, softmax and the loss, which are
      memory-bound on a card, cost nothing here. Models where they dominate (small hidden
      sizes) rank by matmuls anyway.
    * Attention is counted without causal masking (torch's formulas), twice a causal
      kernel's work.
    * Counted at one batch size and taken as proportional to the batch (no constant).
    * One rate per dtype for every matmul, whatever its shape: launch latency and small
      matmuls' low utilisation are not modelled, so a small batch looks as efficient as a
      large one.
    * The optimizer step is its bytes moved at the memory bandwidth (AdamW-like).
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from memadvisor._torch_private import flop_formulas
from memadvisor.schema.precision import DTYPE_NAMES
from memadvisor.schema.profile import LinearMs, Profile, StepFlops, StepTimeModel
from memadvisor.workload import Workload, tensor_leaves

__all__ = ["FlopCounter", "StepTimeModel", "count_step_flops", "with_modelled_times"]


class _Counter(TorchDispatchMode):
    """Adds each counted op's FLOPs to the current phase and to every module whose forward
    runs."""

    def __init__(self) -> None:
        super().__init__()
        self.formulas = flop_formulas()
        self.phases: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
        self.modules: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
        self.phase: str | None = "forward"
        self.running: list[str] = []  # named modules whose forward is running

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        formula = self.formulas.get(func.overloadpacket)
        if formula is not None and self.phase is not None:
            flops = _count(formula, func, args, kwargs, out)
            dtype = _dtype_name(args)
            self.phases[self.phase][dtype] += flops
            if self.phase == "forward":
                for name in set(self.running):
                    self.modules[name][dtype] += flops
        return out


def _count(formula: Any, func: Any, args: Any, kwargs: dict[str, Any], out: Any) -> float:
    """``formula``'s FLOPs for one call; for attention with fewer key/value heads than query
    heads (grouped-query attention), counted as if the key/value heads were repeated.

    torch 2.11's ``sdpa_flop_count`` asserts equal head counts, so a GQA model's profile
    failed there (``examples/llama.py`` with ``n_kv_heads`` below ``n_heads``); 2.13 counts
    it. The retry passes shape-only meta tensors, since the formulas read shapes alone.

    Known limitations:
        * A formula that fails for another reason still raises.
    """
    try:
        return formula(*args, **kwargs, out_val=out)
    except AssertionError:
        expanded = _gqa_expanded(args)
        if expanded is None:
            raise
        return formula(*expanded, **kwargs, out_val=out)


def _gqa_expanded(args: Any) -> tuple[Any, ...] | None:
    """``args`` with each 4-D tensor's head dimension (dim 1) raised to the largest among
    them, as meta tensors; None when the heads already agree or do not divide."""
    heads = [a.shape[1] for a in args if isinstance(a, torch.Tensor) and a.dim() == 4]
    if not heads or len(set(heads)) == 1:
        return None
    most = max(heads)
    if any(most % h for h in heads):
        return None
    return tuple(
        torch.empty((a.shape[0], most, *a.shape[2:]), device="meta", dtype=a.dtype)
        if isinstance(a, torch.Tensor) and a.dim() == 4
        else a
        for a in args
    )


def _dtype_name(args: Any) -> str:
    for t in tensor_leaves(list(args)):
        if t.is_floating_point():
            return DTYPE_NAMES.get(t.dtype, str(t.dtype).removeprefix("torch."))
    return "fp32"


class FlopCounter:
    """Counts one training step's FLOPs by phase, dtype and module.

    Enter it around :func:`~memadvisor.workload.train_step` and pass :meth:`on_phase` as its
    ``on_phase``: the forward and the loss count as forward, backward as backward, the
    optimizer step not at all (no op there has a formula). Then :meth:`result`.
    """

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.counter = _Counter()
        self.handles: list[Any] = []

    def __enter__(self) -> FlopCounter:
        running = self.counter.running
        for name, module in self.model.named_modules():
            if not name:
                continue

            def enter(module: nn.Module, args: Any, name: str = name) -> None:
                running.append(name)

            def leave(module: nn.Module, args: Any, output: Any) -> None:
                running.pop()

            self.handles.append(module.register_forward_pre_hook(enter))
            self.handles.append(module.register_forward_hook(leave, always_call=True))
        self.counter.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self.counter.__exit__(*exc)
        for h in self.handles:
            h.remove()
        self.handles.clear()

    def on_phase(self, phase: str) -> None:
        """``train_step``'s phase callback."""
        self.counter.phase = {"forward": "forward", "loss": "forward", "backward": "backward"}.get(
            phase
        )

    def result(self, batch_size: int) -> StepFlops:
        """What was counted, per sample of ``batch_size``."""

        def per_sample(flops: dict[str, float]) -> dict[str, float]:
            return {d: f / batch_size for d, f in flops.items()}

        phases = self.counter.phases
        return StepFlops(
            batch_size=batch_size,
            forward_per_sample=per_sample(phases.get("forward", {})),
            backward_per_sample=per_sample(phases.get("backward", {})),
            module_forward_per_sample={n: per_sample(f) for n, f in self.counter.modules.items()},
        )


def count_step_flops(workload: Workload, model: nn.Module, batch_size: int) -> StepFlops:
    """Count one forward and backward of ``model`` at ``batch_size``, no autocast.

    Runs wherever the model's tensors live; under fake tensors (the intended use) it costs
    no memory and takes about as long as one fake step. Call it inside the workload's fake
    mode for a fake workload. Gradients it makes are dropped. (The profiler counts the
    same in its warm-up step under fake tensors: ``Profile.flops``.)
    """
    counter = FlopCounter(model)
    try:
        batch = workload.batch(batch_size, workload.device)
        with counter:
            counter.on_phase("forward")
            output = workload.forward(model, batch)
            loss = workload.loss(output, batch)
            del output
            counter.on_phase("backward")
            loss.backward()
    finally:
        for p in model.parameters():
            p.grad = None
    return counter.result(batch_size)


def with_modelled_times(profile: Profile, flops: StepFlops, model: StepTimeModel) -> Profile:
    """``profile`` with every time field set from ``flops`` at ``model``'s rates.

    Forward, backward and per-module forward times are matmul FLOPs at the step's rates,
    proportional to the batch; the optimizer step moves the trainable weights and their
    gradients once (read the gradient, read and write the weight) and the optimizer state
    twice (read and write), at the memory bandwidth.
    """
    optimizer_bytes = 3 * profile.grad_bytes + 2 * profile.optimizer_state_bytes
    optimizer_ms = model.memory_ms(optimizer_bytes)
    modules = flops.module_forward_per_sample
    steps = {}
    for precision, step in profile.steps.items():

        def per_sample(flops_by_dtype: dict[str, float], precision: str = precision) -> LinearMs:
            return LinearMs(per_sample_ms=model.matmul_ms(flops_by_dtype, precision))

        blocks = [
            blk.model_copy(update={"forward_ms": per_sample(modules.get(blk.name, {}))})
            for blk in step.blocks
        ]
        outside = [
            m.model_copy(update={"forward_ms": per_sample(modules.get(m.name, {}))})
            for m in step.outside
        ]
        forward = per_sample(flops.forward_per_sample)
        backward = per_sample(flops.backward_per_sample)
        steps[precision] = step.model_copy(
            update={
                "blocks": blocks,
                "outside": outside,
                "forward_ms": forward,
                "backward_ms": backward,
                "optimizer_ms": optimizer_ms,
                "step_ms": LinearMs(
                    per_sample_ms=forward.per_sample_ms + backward.per_sample_ms,
                    constant_ms=optimizer_ms,
                ),
            }
        )
    return profile.model_copy(update={"steps": steps})
