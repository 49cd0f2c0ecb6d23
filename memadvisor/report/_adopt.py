"""How to train with a plan in your own loop: the code, with the plan's numbers in it.

What ``apply_plan`` installs runs inside the model's forward (autocast, checkpointed blocks,
the compiled frame), so the loop keeps only what a model cannot carry: the batch size and
the accumulation (the planner's own), and what each strategy's choice asks of the loop in
its own words (:class:`memadvisor.schema.advice.LoopLines`: a ``GradScaler`` for fp16, a
loader of one shape for a compiled step). The loss runs outside the forward, so outside
autocast: logits come out in the low precision, exactly as the plan measured them with the
``loss_fn`` it was given.

The loop is written in the workload's own form, as the profile recorded it
(:class:`memadvisor.schema.call.CallForm`): ``model(**batch).loss`` for a Hugging Face model
fed a dict, ``loss_fn(model(batch[0]), batch)`` for an ``(inputs, targets)`` batch; and for
the device the plan is for: a CPU plan (the simulated device) moves nothing, a card's plan
moves the model and each batch to ``"cuda"``. The code is whole: it imports what it uses and
runs as printed once ``model``, ``plan``, ``dataset`` (and ``loss_fn`` or ``forward_fn``
where the workload had one) are defined.

Where the pick changes how the loss is computed (a strategy's facts say ``loss_changed``: a
chunked loss head), the loop calls the rewritten step, ``loss = model.memadvisor_step(batch)``,
which runs the forward and the loss as the plan measured them.

Known limitations:
    * The loop shown is a plain PyTorch one; Lightning and HF Trainer users set the same
      batch size and accumulation in their own configuration.
    * Two strategies that both replace the backward or the optimizer step: the later one in
      effect order wins the line.
    * A ``forward_fn`` workload's batch is passed to it as the loader yields it: on a card,
      moving it is left to the ``forward_fn`` (a comment says so).
    * A plan without a recorded call form (made by hand, or by an older version) gets the
      ``(inputs, targets)`` form with a ``loss_fn``.
"""

from __future__ import annotations

from collections.abc import Sequence

from memadvisor.errors import BadInputError
from memadvisor.report._parts import installs, parts, plan_strategies
from memadvisor.schema.advice import LoopLines
from memadvisor.schema.call import CallForm
from memadvisor.schema.plan import Plan
from memadvisor.strategy import Strategy, changes_step, facts_of

__all__ = ["adoption_snippet", "on_cpu"]

# What a plan without a recorded form is written as: the README's (inputs, targets) + loss_fn.
_DEFAULT_FORM = CallForm(batch="sequence", loss="loss_fn")


def on_cpu(plan: Plan) -> bool:
    """True when the plan is for the CPU (the simulated device): its loop moves nothing.

    A fake-tensor or estimate plan is for a card (it plans under CUDA's policies), and so is
    a plan confirmed on one: what the capabilities say it trains on.
    """
    caps = plan.profile.device.capabilities if plan.profile is not None else plan.capabilities
    return caps.trains_on == "cpu"


def adoption_snippet(plan: Plan) -> str:
    """Python a person can paste: the plan applied and a loop at the plan's batch, in the
    workload's call form, for the plan's device."""
    strategies = plan_strategies(plan)
    loops = [p.loop for p in parts(plan, strategies).values() if p.loop is not None]
    loop = _merged(loops)
    form = (plan.profile.call_form if plan.profile is not None else None) or _DEFAULT_FORM
    cpu = on_cpu(plan)
    b, k = plan.candidate.batch_size, plan.candidate.accumulation_steps
    loss_changed = _loss_changed(plan, strategies)
    loader_comment = f"  # {loop.loader_comment}" if loop.loader_comment else ""
    model_arg = "model" if cpu else 'model.to("cuda")'
    lines = [
        "import torch",
        "from torch.utils.data import DataLoader",
        "",
        "import memadvisor",
        "",
        f"model = memadvisor.apply_plan({model_arg}, plan{_users_code(form, loss_changed)})"
        + _installed_comment(plan, strategies),
        f"loader = DataLoader(dataset, batch_size={b}, shuffle=True{loop.loader_args})"
        + loader_comment,
        "optimizer = torch.optim.AdamW(model.parameters())  # as planned (or yours)",
        *loop.setup,
        "for i, batch in enumerate(loader):",
    ]
    move = _move(form, cpu)
    if move:
        lines.append(f"    {move}")
    comments = [loop.forward_comment] if loop.forward_comment else []
    if form.loss == "output":
        comments.insert(0, "the model returns the loss")
    forward_comment = f"  # {'; '.join(comments)}" if comments else ""
    call, loss = _call_and_loss(form)
    divided = f" / {k}" if k > 1 else ""
    if loss_changed:  # the step computes the loss its own way: the loop calls the step
        how = "measured" if plan.capabilities.measures_memory else "estimated"
        comments.insert(0, f"forward and loss as the plan {how} them (its loss is not yours)")
        lines.append(f"    loss = model.memadvisor_step(batch){divided}  # {'; '.join(comments)}")
        lines += [f"    {note}" for note in loop.forward_notes]
    elif form.loss == "loss_fn":
        lines.append(f"    output = {call}{forward_comment}")
        lines += [f"    {note}" for note in loop.forward_notes]
        lines.append(f"    loss = {loss}{divided}")
    else:  # the model's own loss: the forward line is the loss line
        lines.append(f"    loss = {loss}{divided}{forward_comment}")
        lines += [f"    {note}" for note in loop.forward_notes]
    lines.append(f"    {loop.backward or 'loss.backward()'}")
    body = [loop.step or "optimizer.step()", "optimizer.zero_grad(set_to_none=True)"]
    if k > 1:
        lines.append(
            f"    if (i + 1) % {k} == 0:  # {k} micro-batches of {b}: {b * k} samples a step"
        )
        lines += [f"        {line}" for line in body]
    else:
        lines += [f"    {line}" for line in body]
    return "\n".join(lines) + "\n"


def _installed_comment(plan: Plan, strategies: Sequence[Strategy]) -> str:
    """``'  # autocast, checkpointing'``: what apply_plan installs for this pick (the
    strategies whose choice in it changes the step), in effect order; '' for none."""
    chosen = [
        s
        for s in strategies
        if s.name in plan.candidate.choices and changes_step(s, plan.candidate.choices[s.name])
    ]
    words = installs(chosen)
    return f"  # {', '.join(words)}" if words else ""


def _loss_changed(plan: Plan, strategies: Sequence[Strategy]) -> bool:
    """Whether the pick computes the loss another way (a strategy's facts say so)."""
    try:
        return facts_of(plan.candidate, strategies).loss_changed
    except BadInputError:  # a strategy of the pick is not installed here: nothing known
        return False


def _users_code(form: CallForm, loss_changed: bool) -> str:
    """apply_plan's arguments for the user's functions the rewritten step calls: a plan
    file holds no code, and the step runs the user's loss_fn / forward_fn inside it."""
    if not loss_changed:
        return ""
    args = ", loss_fn=loss_fn" if form.loss == "loss_fn" else ""
    return args + (", forward_fn=forward_fn" if form.batch == "custom" else "")


def _move(form: CallForm, cpu: bool) -> str:
    """The loop's line that moves a batch to the card; '' on the CPU (nothing to move)."""
    if cpu:
        return ""
    return {
        "tensor": 'batch = batch.to("cuda")',
        "sequence": 'batch = [t.to("cuda") for t in batch]  # (inputs, targets, ...)',
        "mapping": 'batch = {key: value.to("cuda") for key, value in batch.items()}',
        "custom": "# your forward_fn moves the batch to the card, as it did when planning",
    }[form.batch]


def _call_and_loss(form: CallForm) -> tuple[str, str]:
    """The model's call on ``batch`` and the loss expression, both as the workload made them
    (``Workload.forward`` and ``Workload.loss``)."""
    call = {
        "tensor": "model(batch)",
        "sequence": "model(batch[0])",
        "mapping": "model(**batch)",
        "custom": "forward_fn(model, batch)",
    }[form.batch]
    loss = {
        "loss_fn": "loss_fn(output, batch)",
        "output.loss": f"{call}.loss",
        "output['loss']": f'{call}["loss"]',
        "output": call,
    }[form.loss]
    return call, loss


def _merged(loops: list[LoopLines]) -> LoopLines:
    """The strategies' loop lines in one: texts joined, a replaced line the last one's."""
    return LoopLines(
        loader_args="".join(x.loader_args for x in loops),
        loader_comment="; ".join(x.loader_comment for x in loops if x.loader_comment),
        setup=[line for x in loops for line in x.setup],
        forward_comment="; ".join(x.forward_comment for x in loops if x.forward_comment),
        forward_notes=[note for x in loops for note in x.forward_notes],
        backward=next((x.backward for x in reversed(loops) if x.backward), ""),
        step=next((x.step for x in reversed(loops) if x.step), ""),
    )
