"""How to train with a plan in your own loop: the code, with the plan's numbers in it.

What ``apply_plan`` installs runs inside the model's forward (autocast, checkpointed blocks,
the compiled frame), so the loop keeps only what a model cannot carry: the batch size, the
accumulation, and a ``GradScaler`` for fp16. The loss runs outside the forward, so outside
autocast: logits come out in the low precision, exactly as the plan measured them with the
``loss_fn`` it was given.

Known limitations:
    * The loop shown is a plain PyTorch one; Lightning and HF Trainer users set the same
      batch size and accumulation in their own configuration.
"""

from __future__ import annotations

from memadvisor.schema.plan import Plan

__all__ = ["adoption_snippet"]


def adoption_snippet(plan: Plan) -> str:
    """Python a person can paste: the plan applied and a loop at the plan's batch."""
    cand = plan.candidate
    precision = cand.choices.get("precision", "fp32")
    compiled = cand.choices.get("compile") not in (None, False, "off")
    b, k = cand.batch_size, cand.accumulation_steps
    lines = [
        "model = memadvisor.apply_plan(model, plan)  # autocast, checkpointing, compile",
        f"loader = DataLoader(dataset, batch_size={b}, shuffle=True"
        + (", drop_last=True)  # one shape: no second compile" if compiled else ")"),
        "optimizer = torch.optim.AdamW(model.parameters())  # as planned (or yours)",
    ]
    if precision == "fp16":
        lines.append('scaler = torch.amp.GradScaler("cuda")  # fp16 needs one; bf16 does not')
    lines.append("for i, (inputs, targets) in enumerate(loader):")
    if precision in ("bf16", "fp16"):
        lines.append(
            f"    logits = model(inputs.cuda())  # {precision}: autocast runs inside forward"
        )
        how = "estimated" if plan.device_kind == "estimate" else "measured"
        lines.append(
            f"    # The plan {how} your loss_fn on these logits as they come; upcast\n"
            "    # (logits.float()) only if your loss_fn did, or its memory was not planned."
        )
    else:
        lines.append("    logits = model(inputs.cuda())")
    loss = "loss_fn(logits, (inputs, targets.cuda()))"
    lines.append(f"    loss = {loss}" + (f" / {k}" if k > 1 else ""))
    lines.append(
        "    " + ("scaler.scale(loss).backward()" if precision == "fp16" else "loss.backward()")
    )
    body = ["optimizer.zero_grad(set_to_none=True)"]
    body.insert(
        0, "scaler.step(optimizer); scaler.update()" if precision == "fp16" else "optimizer.step()"
    )
    if k > 1:
        lines.append(
            f"    if (i + 1) % {k} == 0:  # {k} micro-batches of {b}: {b * k} samples a step"
        )
        lines += [f"        {line}" for line in body]
    else:
        lines += [f"    {line}" for line in body]
    return "\n".join(lines) + "\n"
