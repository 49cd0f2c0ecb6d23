"""The answer's sentences, written once for the terminal and the HTML report alike."""

from __future__ import annotations

from memadvisor.report._facts import LOSS_OPS, Answer, Consumer, is_loss, times_rank
from memadvisor.report._mfu import LanguageModelRate
from memadvisor.schema.plan import Plan, StageOutcome
from memadvisor.schema.profile import Profile
from memadvisor.units import fmt_bytes, fmt_ms, fmt_rate, fmt_ratio

__all__ = [
    "comparison_note",
    "OPS_NOTE",
    "OWNERS_NOTE",
    "answer_rows",
    "choices_lead",
    "device_title",
    "fragmentation",
    "kind_words",
    "op_module",
    "owner_notes",
]

OWNERS_NOTE = "Blocks can be checkpointed; other owners (an LM head, the loss) cannot."
OPS_NOTE = (
    "Bytes each op's outputs took when made, summed over its calls (torch.profiler's self "
    "memory, before frees), by the module that ran it; in backward, the module whose backward "
    "was running."
)

_KIND_WORDS = {
    "params": "weights",
    "grads": "gradients",
    "optimizer_state": "optimizer state",
    "activations": "activations (saved for backward)",
    "temporaries": "temporaries (recompute, workspaces)",
}


def op_module(module: str) -> str:
    """An op's module as the tables show it: '' is the model's own forward."""
    return module if module else "(model's own forward)"


def kind_words(kind: str) -> str:
    """``'optimizer_state'`` -> ``'optimizer state'``: a memory kind as a person says it."""
    return _KIND_WORDS.get(kind, kind)


def fragmentation(profile: Profile) -> str | None:
    """The allocator's overhead in a sentence; None off CUDA, where nothing measures it."""
    if profile.fragmentation_ratio is None:
        return None
    return (
        f"Fragmentation: the allocator reserved {profile.fragmentation_ratio:.2f}× what tensors "
        f"held at the peak; {fmt_bytes(profile.fixed_overhead_bytes)} sat outside tensors "
        "(cuBLAS workspaces, block rounding)."
    )


def device_title(a: Answer) -> str:
    """``'NVIDIA H200 (cuda)'``; the kind only where the name does not say it already."""
    if a.device_kind.lower() in a.device_name.lower():
        return a.device_name
    return f"{a.device_name} ({a.device_kind})"


def _margin_words(a: Answer) -> str:
    if a.measured_margin:
        return (
            f"the pick stays {a.headroom_fraction:.0%} of it below the batch that ran out; "
            f"the estimate started at {fmt_bytes(a.usable_bytes)}"
        )
    return f"{fmt_bytes(a.usable_bytes)} planned after the {a.margin_fraction:.0%} margin"


def answer_rows(a: Answer) -> list[tuple[str, str]]:
    """(label, sentence) for each line of the answer, in reading order."""
    rows = [
        (
            "Budget",
            f"{fmt_bytes(a.budget_bytes)} ({_margin_words(a)}) · objective: {a.objective}",
        ),
        *a.choice_rows,
        ("Batch", _batch(a)),
        ("Peak", _peak(a)),
        ("Throughput", _throughput(a)),
    ]
    if a.lm is not None:
        rows.append(("Tokens", _tokens(a, a.lm)))
    rows += [(stage.label, _stage(a, stage)) for stage in a.stages]
    if a.other_choices:
        rows.append(("Also", ", ".join(f"{k}: {v}" for k, v in a.other_choices.items())))
    return rows


def choices_lead(a: Answer) -> str:
    """The pick's choices as the start of a phrase ('bf16, no checkpointing, '), in their
    strategies' words, for the one-line answer and the chart's caption; '' without any."""
    return "".join(f"{words}, " for words in a.briefs)


def _stage(a: Answer, outcome: StageOutcome) -> str:
    """A measured stage's verdict: what its pick bought over the eager pick and its one-off
    costs, or (in the strategy's words) why the eager pick was kept."""
    if not outcome.picked:
        return outcome.answer or "weighed, planned eager (see notes)"
    words = outcome.pick_words
    if a.measured and outcome.eager_samples_per_s > 0:
        eager = f"the eager pick's {fmt_rate(outcome.eager_samples_per_s)} samples/s"
        words += f": {fmt_ratio(a.samples_per_s / outcome.eager_samples_per_s)} {eager}"
    return " · ".join([words, *outcome.costs])


def _batch(a: Answer) -> str:
    if a.accumulation_steps == 1:
        return str(a.batch_size)
    return (
        f"{a.batch_size} × {a.accumulation_steps} accumulation steps = effective batch "
        f"{a.effective_batch}"
    )


def _peak(a: Answer) -> str:
    words = f"estimated {fmt_bytes(a.estimated_peak_bytes)} (in {a.estimated_peak_phase})"
    if a.verified_peak_bytes is None:
        return words + " · not verified on a device"
    words += f" · verified {fmt_bytes(a.verified_peak_bytes)}"
    if a.verified_reserved_peak_bytes is not None:
        words += f" allocated, {fmt_bytes(a.verified_reserved_peak_bytes)} reserved"
    return words + f" over {a.verified_steps} steps"


def comparison_note(plan: Plan, mark: str = "~") -> str:
    """What the comparison's marks mean for this plan: which numbers ran on the device, and
    which rank (the estimate's, where the device's times do not)."""
    red = "A peak in red is over the budget."
    if not plan.capabilities.measures_memory:
        return f"{mark} estimated: nothing ran on a device (--device estimate). {red}"
    if not times_rank(plan):
        return (
            f"{mark} estimated. Step and Samples/s are the estimate's on every row, and rank "
            f"them: this device's times do not (CPU times, slowed by tracking). A peak without "
            f"{mark} was measured. {red}"
        )
    return f"{mark} estimated (not run on the device); other numbers measured. {red}"


def _tokens(a: Answer, lm: LanguageModelRate) -> str:
    """A language model's tokens/s and MFU, with the formula and the peak it is over."""
    how = "measured" if a.measured else "estimated"
    words = f"{fmt_rate(lm.tokens_per_s)} tokens/s ({how}; {lm.tokens_per_sample} a sample)"
    if lm.mfu is not None:
        return words + (
            f" · MFU {lm.mfu:.1%} = 6 × {lm.parameters / 1e6:,.1f}M parameters × tokens/s ÷ "
            f"the {lm.peak_name} datasheet peak, {lm.peak_tflops:,.0f} TFLOP/s"
        )
    if not a.times_rank:
        return words + " · no MFU: this device has no datasheet peak and its times rank nothing"
    return words + f" · no MFU: {a.device_name} is not in memadvisor's datasheet table"


def _throughput(a: Answer) -> str:
    how = "measured" if a.measured else "estimated"
    words = f"{fmt_rate(a.samples_per_s)} samples/s ({how}), {fmt_ms(a.step_ms)} per step"
    if a.same_as_baseline:
        # A ratio of two runs of the same configuration measures only timing noise.
        return words + " · the baseline configuration itself: nothing to change for speed"
    if a.speedup is not None and a.speedup_basis == "measured":
        words += (
            f" · {fmt_ratio(a.speedup)} the baseline's {fmt_rate(a.baseline_samples_per_s)} "
            f"(fp32 at batch {a.baseline_batch_size}, both measured)"
        )
    elif a.speedup is not None:
        # The baseline only estimated, or the device's times rank nothing: the ratio is
        # estimate over estimate, and says so.
        why = (
            "the baseline was not run"
            if a.times_rank
            else "this device's times do not rank, the estimate's do"
        )
        words += (
            f" · by the estimate {fmt_ratio(a.speedup)} the baseline's (fp32 at batch "
            f"{a.baseline_batch_size}; both sides estimated: {why})"
        )
    return words


_SHRINK_LOSS = (
    "a chunked or fused cross-entropy (one that never holds the log-probabilities of the whole "
    "batch at once) would shrink it, and so would a smaller batch"
)


def owner_notes(consumers: list[Consumer], *, min_share: float = 0.05) -> list[str]:
    """A sentence for each owner that is not a block and holds ``min_share`` or more of the
    activations: who made the bytes and what would shrink them.

    Checkpointing cannot reach these owners, so the report says what can instead; where the
    plan already computes the loss another way (an owner's ``loss_rewrite``), it says how,
    and suggests no other loss.
    """
    fed_loss = {c.after for c in consumers if c.after and _is_loss(c)}
    rewrite = next((c.loss_rewrite for c in consumers if c.loss_rewrite is not None), None)
    notes = []
    for c in consumers:
        if c.owner != "outside" or c.share < min_share or c.name == "<unattributed>":
            continue
        held = f"{fmt_bytes(c.activation_bytes)} ({c.share:.0%})"
        ops = f" ({', '.join(c.made_by)})" if c.made_by else ""
        if c.loss_rewrite is not None:
            what = (
                "your loss_fn over the model's output"
                if c.name == "<loss>"
                else f"the loss over {c.after or 'the output'}'s output"
            )
            notes.append(
                f"{c.name}: {held} is {what}{ops} as profiled; the plan computes the loss "
                f"another way ({c.loss_rewrite.words}) and keeps none of it."
            )
        elif c.name == "<other>":
            where = f"{c.type_name}.forward" if c.type_name else "the model's own forward"
            after = f" after {c.after}" if c.after else ""
            if _is_loss(c):
                notes.append(
                    f"<other>: {held} is the loss over {c.after or 'the output'}'s output, "
                    f"computed in {where}{ops}; {_SHRINK_LOSS}."
                )
            else:
                notes.append(
                    f"<other>: {held} made in {where} outside every submodule{after}{ops}; a "
                    "smaller batch shrinks it, and moving that code into a block lets "
                    "checkpointing reach it."
                )
        elif c.name == "<loss>":
            if _is_loss_op(c):
                shrink = _SHRINK_LOSS
            elif not c.made_by:  # a profile that did not record the ops
                shrink = f"if it is a cross-entropy, {_SHRINK_LOSS}"
            else:
                shrink = "a smaller batch shrinks it"
            notes.append(f"<loss>: {held} is your loss_fn over the model's output{ops}; {shrink}.")
        elif c.name in fed_loss and rewrite is not None:
            notes.append(
                f"{c.name}: {held} is its output ({c.type_name}), which the loss reads; the "
                f"plan computes the loss another way ({rewrite.words})."
            )
        elif c.name in fed_loss:
            notes.append(
                f"{c.name}: {held} is its output ({c.type_name}), which the loss reads; a fused "
                "linear + cross-entropy that computes the loss a chunk of rows at a time never "
                "holds it all, and a smaller batch shrinks it."
            )
        else:
            notes.append(
                f"{c.name}: {held} kept by a {c.type_name or 'module'} outside the blocks; a "
                "smaller batch shrinks it."
            )
    return notes


def _is_loss(c: Consumer) -> bool:
    return is_loss(c.name, c.made_by)


def _is_loss_op(c: Consumer) -> bool:
    return bool(LOSS_OPS.intersection(c.made_by))
