"""How to train with a plan in your own loop: the code, with the plan's numbers in it.

What ``apply_plan`` installs runs inside the model's forward (autocast, checkpointed blocks,
the compiled frame), so the loop keeps only what a model cannot carry: the batch size and
the accumulation (the planner's own), and what each strategy's choice asks of the loop in
its own words (:class:`memadvisor.schema.advice.LoopLines`: a ``GradScaler`` for fp16, a
loader of one shape for a compiled step). The loss runs outside the forward, so outside
autocast: logits come out in the low precision, exactly as the plan measured them with the
``loss_fn`` it was given.

Known limitations:
    * The loop shown is a plain PyTorch one; Lightning and HF Trainer users set the same
      batch size and accumulation in their own configuration.
    * Two strategies that both replace the backward or the optimizer step: the later one in
      effect order wins the line.
"""

from __future__ import annotations

from memadvisor.report._parts import installs, parts, plan_strategies
from memadvisor.schema.advice import LoopLines
from memadvisor.schema.plan import Plan

__all__ = ["adoption_snippet"]


def adoption_snippet(plan: Plan) -> str:
    """Python a person can paste: the plan applied and a loop at the plan's batch."""
    strategies = plan_strategies(plan)
    loops = [p.loop for p in parts(plan, strategies).values() if p.loop is not None]
    loop = _merged(loops)
    b, k = plan.candidate.batch_size, plan.candidate.accumulation_steps
    loader_comment = f"  # {loop.loader_comment}" if loop.loader_comment else ""
    lines = [
        f"model = memadvisor.apply_plan(model, plan)  # {', '.join(installs(strategies))}",
        f"loader = DataLoader(dataset, batch_size={b}, shuffle=True{loop.loader_args})"
        + loader_comment,
        "optimizer = torch.optim.AdamW(model.parameters())  # as planned (or yours)",
        *loop.setup,
        "for i, (inputs, targets) in enumerate(loader):",
        "    logits = model(inputs.cuda())"
        + (f"  # {loop.forward_comment}" if loop.forward_comment else ""),
        *(f"    {note}" for note in loop.forward_notes),
    ]
    loss = "loss_fn(logits, (inputs, targets.cuda()))"
    lines.append(f"    loss = {loss}" + (f" / {k}" if k > 1 else ""))
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
