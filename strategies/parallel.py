"""Data parallelism over ``world_size`` cards: what each rank holds, and how to wrap the model.

Not searched like the others: the user says how many ranks and how they share the model
(``PlanConfig.world_size`` and ``parallel``); this strategy turns the single-card estimate
into the estimate *per rank* at the per-rank batch, and offers FSDP2's one free choice,
``reshard_after_forward``, both ways (and, with ``parallel="auto"``, DDP beside them).
What tells these apart where all fit is communication time, which the estimate does not
price: the strategy is ``measured_alternatives``, so on a device whose times rank the
planner times the estimate's best candidate of each choice and the fastest wins.

A choice is ``{"kind": "ddp" | "fsdp2", "world_size": N, "units": [block names],
"reshard_after_forward": bool}`` (``units`` and the reshard flag for FSDP2 only); the
planner adds ``"param_dtype"`` to the pick's as a record of its precision, for the advice.

What a rank holds (the estimate's edit, :meth:`Parallel.effect`):

* DDP: the full weights, gradients and optimizer state, plus the gradient buckets: DDP's
  reducer allocates one flat copy of every gradient (``bucket_cap_mb`` = 25 MiB only cuts
  it into pieces, and ``gradient_as_bucket_view=False`` is the default), held from the
  wrap on: ``grad_bytes`` more at every moment of the step.
* FSDP2 (``fully_shard`` on each block, then on the root): weights and optimizer state
  sharded 1/N at every moment; gradients sharded 1/N once a unit's reduce-scatter has run
  (the root's at the end of backward); the optimizer step (AdamW's temporaries included)
  is the single card's over N. On top, the all-gathered units. With
  ``reshard_after_forward=False`` the root and every unit stay gathered from their forward
  to their backward (each freed after its own backward): all of them at the loss and at
  the head, units ``0..k`` while block ``k``'s backward runs, and no all-gather in backward.
  With ``True`` the estimate counts the root, the unit being run and its all-gather buffer
  in forward, the root and the last unit at the head, and in backward the unit being run
  and the one prefetched (FSDP2 prefetches the next unit's all-gather by default).
  Whichever, a block's backward holds one unit more for the reduce-scatter's input (a unit's
  gradients copied into it; FSDP2 keeps it until the next unit's reduce-scatter begins),
  in the reduce dtype: fp32, the unit's fp32 bytes, under a bf16 or fp16 ``param_dtype``
  too (``reduce_dtype=float32``), twice a unit gathered in bf16.
* A low precision under FSDP2 is ``MixedPrecisionPolicy(param_dtype=bf16|fp16,
  reduce_dtype=fp32)``: the units are gathered in that dtype and autocast, meeting weights
  already in its dtype, makes no copies: :meth:`StepModel.drop_weight_copies` takes away
  each copy the profile's step held, once (the checkpointed blocks' copies are already
  gone from the walk; taking them away again made the 1B's head 1.8 GiB too low). And
  each unit's floating inputs are cast to that dtype (the policy's ``cast_forward_inputs``,
  on by default): a checkpointed unit keeps its input, the residual stream, at 2 bytes an
  element (:meth:`StepModel.cast_block_inputs`, from the profile's ``input_low``), where the
  profile's autocast step, its weights fp32, kept it in fp32.

Arithmetic for examples/llama.py's 1b at 2 ranks, batch 6, bf16, every block checkpointed,
kept gathered (the fake profile's figures, GiB): the head holds 2.05 of sharded weights,
4.10 of AdamW state, 2.05 of gathered units (22 x 0.082 and the root's 0.244), 1.37 of
activations (of them the 22 kept block inputs in bf16, 22 x 0.023; in fp32 they made
1.88), the logits' gradients 1.47 and 0.07 fixed: 11.10; the optimizer step 2.05 + 2.05 +
4.10 + 2.05 of AdamW's temporaries + 0.07 = 10.32 (docs/design.md, issue 31).

Known limitations:
    * Communication time is not measured. Only ``reshard_after_forward=True``'s extra
      all-gather in backward is priced, at :data:`ALL_GATHER_BYTES_PER_MS` (an assumed
      NVLink-class rate), to rank it against keeping the units gathered; DDP's all-reduce and
      FSDP2's forward all-gathers and reduce-scatters cost both choices alike.
    * The all-gather's own buffers (the flat output, the reduce-scatter input) are counted
      as one unit more in forward and backward; on a card they live on NCCL's streams and may
      overlap the next unit's. On the simulated ranks (gloo, CPU) a collective's output can
      outlive FSDP2's release until the rank next waits (a gloo thread still holds it and,
      it seems, needs the GIL to let go): one unit more at some moments, not counted (the
      backend's timing, not FSDP2's; docs/design.md, issue 31: up to +3.4% on the test's
      residual MLP, against which the estimate is then 2.4% low).
    * The reduce-scatter's input is counted at the weights' bytes: the gradients in fp32 as
      fp32 weights give them (weights kept in bf16 would reduce in fp32 at twice their
      bytes: low). The root's, at the end of backward, is not counted (the residual MLP's
      22 KB come well below its peak; a model whose root dominates could peak there).
    * The optimizer step under FSDP2 is the single card's scaled by 1/N (its batch, a few
      KiB to MiB, is not sharded but is scaled with the rest).
    * Buffers (BatchNorm statistics) are not sharded by FSDP2 and are counted whole.
    * The activations are the profile's autocast step's, whose weights were fp32, but for
      what checkpointed units keep (their inputs, counted cast to 2 bytes). Under a bf16
      ``param_dtype`` the forward meets bf16 weights: what the blocks' own ops save after
      an fp32 weight (a norm's output) and what an uncheckpointed block saves of its input
      are bf16 on the ranks, fp32 in the estimate; a checkpointed block's recompute is the
      profile's too. Errs high (safe). The 1B at 2 ranks, batch 8, resharded (2 x H200):
      10.997 GiB predicted with the kept inputs in fp32, 10.318 now (fake profile), 10.3125
      measured. The tiny Llama at batch 309 (4 blocks checkpointed), fake profile: 0.858
      GiB before, 0.783 now, against about 0.703 held (inferred from its card row): its
      peak is a recompute, whose activations stay the fp32-weight step's. A profiled step
      with the weights in the low dtype would remove the rest.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
from pydantic import JsonValue
from torch import nn

from memadvisor.errors import BadInputError
from memadvisor.schema.advice import Advice, ReportPart
from memadvisor.schema.facts import Facts
from memadvisor.step import Step
from memadvisor.strategy import (
    Described,
    EffectOrder,
    HandTried,
    Recorded,
    Strategy,
    TimedAlternatives,
    WrapsRanks,
    facts_of,
)
from strategies._format import mib, names_text

if TYPE_CHECKING:
    from memadvisor.estimate import StepModel
    from memadvisor.schema.candidate import Candidate
    from memadvisor.schema.config import PlanConfig
    from memadvisor.schema.plan import Plan
    from memadvisor.schema.profile import Profile

__all__ = ["ALL_GATHER_BYTES_PER_MS", "Parallel", "parse_choice", "wrap_for_rank"]

# 100 GB/s: what NCCL's all-gather reaches between two cards of one NVLink host, in round
# figures (an assumption, not a measurement: docs/design.md has none yet).
ALL_GATHER_BYTES_PER_MS = 100e6
_KINDS = ("ddp", "fsdp2")
_LOW = {"bf16": torch.bfloat16, "fp16": torch.float16}


def parse_choice(choice: JsonValue) -> dict[str, Any]:
    """The choice as a dict with every key, checked.

    Raises:
        BadInputError: not a choice this strategy makes.
    """
    if not isinstance(choice, dict) or choice.get("kind") not in _KINDS:
        raise BadInputError(
            "A parallel choice is a dict with kind 'ddp' or 'fsdp2' and world_size, e.g. "
            f"{{'kind': 'fsdp2', 'world_size': 2, 'units': ['h.0']}}, but got {choice=}."
        )
    world = choice.get("world_size")
    if not isinstance(world, int) or isinstance(world, bool) or world < 1:
        raise BadInputError(f"A parallel choice's world_size is an int >= 1, but got {world=}.")
    units = choice.get("units", [])
    if not (isinstance(units, list) and all(isinstance(u, str) for u in units)):
        raise BadInputError(f"A parallel choice's units are block names, but got {units=}.")
    return {
        "kind": choice["kind"],
        "world_size": world,
        "units": list(units),
        "reshard_after_forward": bool(choice.get("reshard_after_forward", True)),
        "param_dtype": choice.get("param_dtype"),
    }


def _low_precision(precision: str | None) -> str | None:
    return precision if precision in _LOW else None


class Parallel(Strategy, HandTried, Recorded, Described, TimedAlternatives, WrapsRanks):
    """What each of ``world_size`` ranks holds under DDP or FSDP2."""

    name = "parallel"
    effect_order = (
        EffectOrder.PARALLEL
    )  # after precision (the dtype of the gathered units) and checkpointing
    # DDP against FSDP2, and resharding after forward or not, differ in communication, which
    # the estimate does not price (but one all-gather): the device's step times decide.

    def choices(self, profile: Profile, config: PlanConfig) -> list[JsonValue]:
        if config.parallel == "none":
            return [None]
        n = config.world_size
        ddp: list[JsonValue] = [{"kind": "ddp", "world_size": n}]
        units: list[JsonValue] = [b.name for b in profile.blocks]
        fsdp2: list[JsonValue] = [
            {"kind": "fsdp2", "world_size": n, "units": units, "reshard_after_forward": r}
            for r in (True, False)
        ]
        if config.parallel == "ddp":
            return ddp
        return fsdp2 if config.parallel == "fsdp2" else ddp + fsdp2

    def is_neutral(self, choice: JsonValue) -> bool:
        return choice is None

    def by_hand(self, options: Sequence[JsonValue]) -> tuple[str | None, JsonValue] | None:
        """The ranks' wrap as a person would write it first (FSDP2's default resharding), in
        every comparison row: every row of a per-rank plan is per rank too."""
        offered = [c for c in options if c is not None]
        return (None, offered[0]) if offered else None

    def record(self, pick: Candidate, config: PlanConfig) -> JsonValue | None:
        """The pick's precision in its parallel choice, for the advice's code (FSDP2 gathers
        its units in that dtype)."""
        choice = pick.choices.get(self.name)
        precision = facts_of(pick).autocast if isinstance(choice, dict) else None
        if precision is None:  # fp32, tf32
            return None
        return {**choice, "param_dtype": precision}

    def describe(self, choice: JsonValue, plan: Plan) -> ReportPart | None:
        """The answer's "Ranks" row: how the ranks share the model, and that the batch and
        every peak of the plan are one rank's."""
        if choice is None:
            return None
        c = parse_choice(choice)
        n = c["world_size"]
        if c["kind"] == "ddp":
            how, brief = f"DDP over {n} ranks (a full replica each)", f"DDP x{n}"
        else:
            kept = (
                "units resharded after forward"
                if c["reshard_after_forward"]
                else "units kept gathered from forward to backward"
            )
            how, brief = f"FSDP2 over {n} ranks, {len(c['units'])} {kept}", f"FSDP2 x{n}"
        return ReportPart(
            label="Ranks",
            words=f"{how}; the batch and the peaks are per rank, each rank a card of the budget",
            brief=brief,
        )

    def effect(self, profile: Profile, choice: JsonValue, model: StepModel) -> None:
        c = parse_choice(choice)
        if c["kind"] == "ddp":
            for phase in ("forward", "backward", "optimizer"):
                model.add_bytes(phase, profile.grad_bytes)  # the buckets: one flat gradient copy
            return
        _fsdp2_effect(profile, c, model)

    def apply(self, step: Step, choice: JsonValue) -> Step:
        """Nothing in this process: the wrap needs each rank's process group
        (:func:`wrap_for_rank` there; the advice shows the code)."""
        parse_choice(choice)
        return step

    states = frozenset({"parallel", "world_size"})

    def facts(self, choice: JsonValue) -> Facts:
        if choice is None:
            return Facts()
        c = parse_choice(choice)
        return Facts(parallel=c["kind"], world_size=c["world_size"])

    def wrap_rank(self, step: Step, choice: JsonValue, facts: Facts, device_id: int | None) -> Step:
        """DDP or FSDP2 around the step's model (:func:`wrap_for_rank`), FSDP2's units
        gathered in the candidate's autocast dtype."""
        return step.replace(model=wrap_for_rank(step.model, choice, facts.autocast, device_id))

    def explain(self, choice: JsonValue, profile: Profile) -> Advice | None:
        if choice is None:
            return None
        c = parse_choice(choice)
        n = c["world_size"]
        if c["kind"] == "ddp":
            return Advice(
                strategy=self.name,
                title=f"DDP over {n} ranks",
                sentence=(
                    f"Each of the {n} ranks keeps the whole model, its gradients and optimizer "
                    "state, plus DDP's gradient buckets (one flat copy of the gradients, "
                    f"{mib(profile.grad_bytes)} MiB): the batch in this plan is per rank. "
                    "gradient_as_bucket_view=True would make the gradients views of the "
                    "buckets and save that copy (not planned here)."
                ),
                snippet=_ddp_snippet(),
                effect=f"estimated: +{mib(profile.grad_bytes)} MiB per rank for the buckets",
            )
        units = c["units"]
        static = profile.param_bytes + profile.optimizer_state_bytes
        reshard = c["reshard_after_forward"]
        how = "resharded after forward" if reshard else "kept gathered after forward"
        low = _low_precision(c["param_dtype"])
        kept = (
            "resharded after forward (gathered again in backward: less memory)"
            if reshard
            else "kept gathered from forward to backward (no all-gather in backward)"
        )
        dtype = (
            f" Weights are gathered in {low} (MixedPrecisionPolicy), gradients reduced in fp32."
            if low
            else ""
        )
        return Advice(
            strategy=self.name,
            title=f"FSDP2 over {n} ranks, {len(units)} units {how}",
            sentence=(
                f"Shard the weights, gradients and optimizer state over {n} ranks with "
                f"fully_shard on each block ({names_text(units)}) and then on the root; each "
                f"unit is {kept}.{dtype} Apply the plan's other strategies (checkpointing, "
                "autocast) first, and build the optimizer after fully_shard. The batch in "
                "this plan is per rank."
            ),
            snippet=_fsdp2_snippet(units, reshard, low),
            effect=(
                f"estimated: {mib(static)} MiB of weights and optimizer state become "
                f"{mib(static / n)} MiB per rank"
            ),
        )


def _fsdp2_effect(profile: Profile, c: dict[str, Any], model: StepModel) -> None:
    """FSDP2's per-rank bytes as edits of the single card's walk (the module docstring)."""
    n = c["world_size"]
    shard = 1.0 - 1.0 / n
    model.hold_share(1.0 / n)  # the breakdown's weights, gradients and state: a rank's
    reshard = c["reshard_after_forward"]
    low = _low_precision(model.precision)
    ratio = 0.5 if low else 1.0  # the gathered units' dtype against fp32 weights
    blocks = profile.blocks
    if low:
        # The units are gathered in the low dtype: they replace autocast's weight copies,
        # which the walk then drops wherever it held them (once, checkpointing or not).
        model.drop_weight_copies()
        # And each unit's floating inputs are cast to it (cast_forward_inputs): a
        # checkpointed unit keeps its input, the residual stream, in bf16.
        index = {b.name: i for i, b in enumerate(blocks)}
        model.cast_block_inputs(index[u] for u in c["units"] if u in index)
    block_params = [b.param_bytes for b in blocks]
    root = max(0, profile.param_bytes - sum(block_params))
    units = [int(p * ratio) for p in block_params]
    reduced = block_params  # a unit's reduce-scatter input: its gradients in fp32
    root_unit = int(root * ratio)
    grads_per_param = profile.grad_bytes / profile.param_bytes if profile.param_bytes else 0.0
    held_grads = profile.grad_bytes * shard if model.accumulation_steps > 1 else 0.0

    # Everywhere: weights and optimizer state sharded (their bytes less the other ranks').
    sharded = int((profile.param_bytes + profile.optimizer_state_bytes) * shard + held_grads)
    largest = max(units, default=0)
    gathered_all = sum(units)
    # Forward: the root and the unit being run (its all-gather buffer beside it), or all.
    in_forward = root_unit + (2 * largest if reshard else gathered_all + largest)
    model.add_bytes("forward", in_forward - sharded)
    model.add_bytes("backward", -sharded)
    per_block = []
    for k in range(len(blocks)):
        # The unit being run and the one prefetched, or every unit not yet past backward.
        previous = units[k - 1] if k > 0 else 0
        gathered = units[k] + previous if reshard else sum(units[: k + 1])
        # Later blocks' gradients were reduce-scattered to a shard; a unit's full gradients
        # are copied into the reduce-scatter's input, one unit more, in the reduce dtype:
        # fp32 whatever the gathered units' dtype (reduce_dtype=float32 beside a bf16 or
        # fp16 param_dtype, the weights' own fp32 without one), twice a bf16 unit. FSDP2
        # keeps that input until the next unit's reduce-scatter begins, so it is there
        # while the block before runs.
        later_grads = sum(block_params[k + 1 :]) * grads_per_param
        per_block.append(root_unit + gathered + reduced[k] - int(later_grads * shard))
    head = root_unit + (units[-1] if reshard and units else gathered_all)
    model.add_backward_bytes(per_block, head)
    optimizer = model.numbers.phases.get("optimizer")
    if optimizer is None:
        optimizer = profile.static_bytes + profile.param_bytes
    model.add_bytes("optimizer", -int(max(0, optimizer - profile.buffer_bytes) * shard))
    if reshard and n > 1:
        model.add_ms(gathered_all * shard / ALL_GATHER_BYTES_PER_MS)


def wrap_for_rank(
    model: nn.Module, choice: JsonValue, precision: str | None = None, device_id: int | None = None
) -> nn.Module:
    """``model`` wrapped for this rank: DDP, or ``fully_shard`` on each unit and the root.

    Call it in every rank after ``init_process_group`` and after the plan's other
    strategies are applied; build the optimizer after it.

    Args:
        model: the model, on this rank's device, other strategies applied.
        choice: the plan's parallel choice.
        precision: the plan's precision: bf16/fp16 gathers FSDP2's units in that dtype.
        device_id: this rank's CUDA device index (None on the CPU).

    Raises:
        BadInputError: the choice's units are not submodules of ``model``.
    """
    c = parse_choice(choice)
    if c["kind"] == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        return DistributedDataParallel(
            model, device_ids=[device_id] if device_id is not None else None
        )
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    low = _low_precision(c["param_dtype"] or precision)
    policy = (
        MixedPrecisionPolicy(param_dtype=_LOW[low], reduce_dtype=torch.float32)
        if low
        else MixedPrecisionPolicy()
    )
    reshard = c["reshard_after_forward"]
    for name in c["units"]:
        try:
            unit = model.get_submodule(name)
        except AttributeError as e:
            raise BadInputError(
                f"Cannot shard {name!r}: {type(model).__name__} has no such submodule. Use a "
                "plan made for this model."
            ) from e
        fully_shard(unit, reshard_after_forward=reshard, mp_policy=policy)
    # The root's flag left unset: torch keeps the root gathered after forward (backward
    # needs it first), as the estimate counts it.
    fully_shard(model, mp_policy=policy)
    return model


def _ddp_snippet() -> str:
    return """\
# torchrun --nproc-per-node N train.py
import os
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

dist.init_process_group("nccl")
rank = int(os.environ["LOCAL_RANK"])
torch.cuda.set_device(rank)
model = DDP(model.cuda(rank), device_ids=[rank])  # after the plan's other strategies
optimizer = torch.optim.AdamW(model.parameters())
# each rank loads its own batch_size samples (DistributedSampler)
"""


def _fsdp2_snippet(units: list[str], reshard: bool, low: str | None) -> str:
    dtype = {"bf16": "torch.bfloat16", "fp16": "torch.float16"}.get(low or "")
    policy = (
        f"MixedPrecisionPolicy(param_dtype={dtype}, reduce_dtype=torch.float32)"
        if dtype
        else "MixedPrecisionPolicy()"
    )
    return f"""\
# torchrun --nproc-per-node N train.py
import os
import torch
import torch.distributed as dist
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

dist.init_process_group("nccl")
torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
model = model.cuda()  # after the plan's other strategies (checkpointing, autocast)
mp_policy = {policy}
for name in {units!r}:
    fully_shard(model.get_submodule(name), reshard_after_forward={reshard}, mp_policy=mp_policy)
fully_shard(model, mp_policy=mp_policy)  # the root stays gathered: backward needs it first
optimizer = torch.optim.AdamW(model.parameters())  # after fully_shard: over the shards
# each rank loads its own batch_size samples (DistributedSampler)
"""
