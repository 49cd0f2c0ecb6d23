"""The chunked loss head (loss_head): its memory against the estimate on the CPU, and issue 28's
rows on a card.

``peaks`` (CPU): examples/gpt.py as shipped (a 50304-token vocabulary, 64 tokens a row),
profiled in fp32 and bf16 under CUDA's autocast policy; for each precision, batch and chunk
count ('off', 4, 8, 32) two steps on the simulated device, its measured peak beside the
estimate's, with the error (the table in docs/design.md, "The chunked loss head");
``--target file.py:factory`` another model (the CI smoke's: the Llama example, 6 s against
the GPT example's 29 s).

``cells`` (a card; ``--device simulated`` is its CPU smoke): a decoder LM at a budget (default
``lm350m``, examples/llama.py's 0.35B preset at 1024 tokens, at 8 GiB). Each cell is one JSON
line, appended to ``--json`` (default ``bench/results/loss_head.jsonl``) as soon as it is done:

* ``eager``, ``eager+chunked``, ``compiled``, ``compiled+chunked``: the base choices
  (``--base``: bf16 autocast, every block checkpointed) with compile off or ``--compile``
  (default the regional form, which the plan's compile search measures in: 7 s a probe for
  lm350m against 42-66 s for the whole model), and loss_head off or ``--chunks`` (8). Each at
  its own largest batch, found on the device as the plan's pick is
  (``memadvisor.planner.measure_configuration``: the estimate's bracket, probes in fresh
  processes under the budget's memory cap, the margin below the lowest failure), and its
  steps measured there: samples/s, tokens/s, allocated and reserved peak.
* ``plan``: ``plan_workload`` of the model at the budget on the device (compile searched,
  loss_head screened), as ``memadvisor plan lm350m --budget-gb 8`` makes it: its pick, its
  verified tokens/s and peak, whether it takes the chunked loss (read from its facts,
  ``loss_changed``) and whether it compiles.

``table``: the cells of a JSON lines file side by side, per model and device, with the verdict
the issue asks for: in the plan's compile state (eager or compiled), whether the chunked loss
measured faster than without, and whether the plan's pick takes it.

    python bench/loss_head.py peaks                            # the docs' table (~2 min CPU)
    python bench/loss_head.py peaks --batches 4 --precisions fp32
    python bench/loss_head.py cells --cells eager,eager+chunked     # on a card, ~3-4 min
    python bench/loss_head.py cells --cells compiled,compiled+chunked
    python bench/loss_head.py cells --cells plan
    python bench/loss_head.py table bench/results/loss_head.jsonl
    python bench/loss_head.py cells --device simulated --models llama --budget-gib 0.05 \\
        --cells eager,eager+chunked,compiled,plan --json /tmp/lh.jsonl   # the CPU smoke

Each ``cells`` command profiles the model once on its device (the planner's own profiling
step) and skips cells that would start past ``--deadline-s`` (default 420), saying which:
split the cells over commands (``--cells``, ``--models``) to keep each one well under a
10-minute limit. Needs ``loss_head`` registered (``pip install -e .`` from this checkout).

Known limitations:
    * The cells fix precision and checkpointing (``--base``): they measure what the chunked
      loss buys at those, not the best configuration with and without it. The plan's pick may
      checkpoint another set; the verdict compares its loss_head choice with the cells of its
      compile state only.
    * The chunked loss runs outside the compiled region (the workload's loss always does), so
      ``compiled+chunked`` compiles the model without its head.
    * A compiled cell's device (the simulated one) that cannot compile is a line saying so.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from _targets import targets  # bench/, first on sys.path when run as a script

HERE = Path(__file__).resolve()
ROOT = HERE.parents[1]
RESULTS = HERE.parent / "results" / "loss_head.jsonl"
GIB = 2**30
MIB = 2**20

MODELS = targets("lm350m", "llama", "gpt")
#: The cells: (compiled, chunked) each.
CELLS: dict[str, tuple[bool, bool]] = {
    "eager": (False, False),
    "eager+chunked": (False, True),
    "compiled": (True, False),
    "compiled+chunked": (True, True),
}
REGIONAL = {"mode": "default", "regional": True}


# -- peaks: the simulated device against the estimate ----------------------------------------


def peaks(args: argparse.Namespace) -> None:
    from memadvisor.device._autocast import cuda_autocast_policy
    from memadvisor.device.simulated import SimulatedDevice
    from memadvisor.estimate import estimate
    from memadvisor.profiler import profile_workload
    from memadvisor.schema.candidate import Candidate
    from memadvisor.strategy import load_strategies
    from memadvisor.target import load_target

    workload = load_target(args.target)
    with cuda_autocast_policy():
        profile = profile_workload(workload, device="cpu", precisions=args.precisions)
    strategies = load_strategies(["precision", "loss_head"])
    device = SimulatedDevice(2**40)
    print("precision batch chunks  estimate MiB  measured MiB  error")
    for precision in args.precisions:
        for b in args.batches:
            for chunks in args.chunks:
                choice = "off" if chunks == "off" else int(chunks)
                candidate = Candidate(
                    batch_size=b, choices={"precision": precision, "loss_head": choice}
                )
                est = estimate(profile, candidate, strategies).peak_bytes
                measured = device.run(workload, candidate, 2).peak_bytes
                print(
                    f"{precision:9} {b:5} {chunks:>6}  {est / MIB:12.1f}  {measured / MIB:12.1f}"
                    f"  {(est - measured) / measured:+.1%}",
                    flush=True,
                )


# -- cells: each configuration at its own largest batch on the device ------------------------


def _profile(workload: Any, kind: str) -> Any:
    """The workload profiled as the planner profiles it for a plan on ``kind``."""
    from memadvisor.device._factory import planned_capabilities
    from memadvisor.planner import Progress
    from memadvisor.planner._plan import _profile as planners_profile

    return planners_profile(workload, planned_capabilities(kind), Progress(enabled=False))


def _device(kind: str, budget_bytes: int, target: str, profile: Any, timeout_s: float) -> Any:
    if kind == "simulated":
        from memadvisor.device.simulated import SimulatedDevice

        return SimulatedDevice(budget_bytes, profile=profile)
    from memadvisor.device.cuda import CudaDevice

    return CudaDevice(
        budget_bytes, target=target, profile=profile, fork_server=True, timeout_s=timeout_s
    )


def _choices(cell: str, args: argparse.Namespace, blocks: list[str]) -> dict[str, Any]:
    compiled, chunked = CELLS[cell]
    base = json.loads(args.base)
    if base.get("checkpointing") == "all":
        base["checkpointing"] = blocks
    return {
        **base,
        "compile": json.loads(args.compile) if compiled else "off",
        "loss_head": args.chunks if chunked else "off",
    }


def _measured_cell(
    cell: str, choices: dict[str, Any], workload: Any, profile: Any, device: Any, config: Any
) -> dict[str, Any]:
    """One configuration's largest batch on ``device`` and its measured step there."""
    from memadvisor.planner import measure_configuration
    from memadvisor.planner._space import largest_batch
    from memadvisor.strategy import load_strategies

    row, probes = measure_configuration(
        workload, config, choices, profile=profile, device=device, label=cell
    )
    tokens = profile.tokens_per_sample or 0
    chosen = load_strategies(config.strategies)
    out: dict[str, Any] = {
        "choices": choices,
        "batch": row.largest_batch or 0,
        "estimated_batch": largest_batch(
            profile, choices, chosen, config.usable_bytes, config.max_batch
        ),
        "probes": [[p.batch_size, p.fits] for p in probes],
    }
    if row.measured is not None:
        m = row.measured
        out.update(
            samples_per_s=round(m.samples_per_s, 2),
            tokens_per_s=round(m.samples_per_s * tokens),
            step_ms=round(m.step_ms, 2),
            peak_bytes=m.peak_bytes,
            reserved_peak_bytes=m.reserved_peak_bytes,
            steps=m.steps,
        )
    out["estimated_peak_bytes"] = row.estimate.peak_bytes
    return out


def _plan_cell(workload: Any, target: str, config: Any, profile: Any) -> dict[str, Any]:
    """The plan at the budget on the device, and what its pick does with the loss."""
    from memadvisor.planner import plan_workload
    from memadvisor.strategy import facts_of

    plan = plan_workload(workload, config, target=target, profile=profile, progress=False)
    pick, verified = plan.candidate, plan.verified
    facts = facts_of(pick)
    tokens = profile.tokens_per_sample or 0
    offered = [c.summary for c in plan.checks if c.strategy == "loss_head"]
    return {
        "choices": pick.choices,
        "batch": pick.batch_size,
        "accumulation_steps": pick.accumulation_steps,
        "takes_chunked_loss": facts.loss_changed,
        "compiled": facts.compiled,
        "samples_per_s": round(verified.samples_per_s, 2) if verified else None,
        "tokens_per_s": round(verified.samples_per_s * tokens) if verified else None,
        "peak_bytes": verified.peak_bytes if verified else None,
        "reserved_peak_bytes": verified.reserved_peak_bytes if verified else None,
        "estimated_peak_bytes": plan.estimate.peak_bytes,
        "loss_head_checks": offered,
        "stages": [s.summary for s in plan.stages],
        "plan_wall_s": round(plan.plan_wall_ms / 1e3, 1),
        # The device runs (batch, fits, stage, choices other than the pick's) and the notes:
        # where the batch was decided.
        "plan_probes": [
            [p.batch_size, p.fits, p.stage, _differs(p.candidate, pick)] for p in plan.probes
        ],
        "plan_notes": plan.notes,
    }


def _differs(ran: Any, pick: Any) -> dict[str, Any]:
    """The choices of ``ran`` (a probe's candidate) that are not ``pick``'s."""
    if ran is None:
        return {}
    return {k: v for k, v in ran.choices.items() if pick.choices.get(k) != v}


def cells(args: argparse.Namespace) -> None:
    import torch

    from memadvisor.schema.config import PlanConfig
    from memadvisor.target import load_target

    budget_bytes = round(args.budget_gib * GIB)
    name_of_device = torch.cuda.get_device_name() if args.device == "cuda" else args.device
    out = args.json.open("a") if args.json else None
    start = time.perf_counter()
    wanted = args.cells.split(",")
    unknown = [c for c in wanted if c not in CELLS and c != "plan"]
    if unknown:
        raise SystemExit(f"unknown cells {unknown}: choose from {[*CELLS, 'plan']}")
    for model in args.models.split(","):
        target = MODELS[model]
        workload = load_target(target)
        profiled = time.perf_counter()
        profile = _profile(workload, args.device)
        profile_s = round(time.perf_counter() - profiled, 1)
        blocks = [b.name for b in profile.blocks]
        params = sum(p.numel() for p in workload.model.parameters())
        _say(f"{model}: {params / 1e6:.0f}M parameters, profiled in {_since(start):.0f} s")
        config = PlanConfig(budget_bytes=budget_bytes, device=args.device)
        device = None  # started by the first measured cell (a plan starts its own)
        try:
            for cell in wanted:
                if _since(start) > args.deadline_s:
                    _say(f"deadline: skipped {model} {cell} (pass it in a command of its own)")
                    continue
                line: dict[str, Any] = {
                    "model": model,
                    "cell": cell,
                    "device": name_of_device,
                    "budget_gib": args.budget_gib,
                    "parameters": params,
                    "tokens_per_sample": profile.tokens_per_sample,
                    "profile_s": profile_s,  # this command's, before its cells
                    "torch": torch.__version__,
                }
                t0 = time.perf_counter()
                try:
                    if cell == "plan":
                        line.update(_plan_cell(workload, target, config, profile))
                    elif CELLS[cell][0] and not profile.device.capabilities.can_compile:
                        line["skipped"] = f"the {args.device} device does not compile"
                    else:
                        choices = _choices(cell, args, blocks)
                        device = device or _device(
                            args.device, budget_bytes, target, profile, args.probe_timeout_s
                        )
                        line.update(
                            _measured_cell(cell, choices, workload, profile, device, config)
                        )
                except Exception as e:  # noqa: BLE001 - a cell that fails is a line saying why
                    line["error"] = f"{type(e).__name__}: {str(e)[:300]}"
                line["wall_s"] = round(time.perf_counter() - t0, 1)
                _say(_cell_words(line))
                print(json.dumps(line), flush=True)
                if out:
                    out.write(json.dumps(line) + "\n")
                    out.flush()
        finally:
            if device is not None:
                device.close()
    _say(f"total {_since(start):.0f} s on {name_of_device}")


# -- table: the cells side by side, and the verdict ------------------------------------------


def _cell_words(r: dict[str, Any]) -> str:
    head = f"{r['model']:8} {r['cell']:17}"
    if "error" in r or "skipped" in r:
        return f"{head} {r.get('error') or r.get('skipped')}"
    peak = r.get("peak_bytes")
    words = (
        f"{head} batch {r.get('batch', 0):>4}  {r.get('tokens_per_s') or 0:>9,} tokens/s  "
        f"peak {peak / GIB if peak else 0:5.2f} GiB"
    )
    if r["cell"] == "plan":
        words += (
            f"  chunked loss: {'yes' if r['takes_chunked_loss'] else 'no'}, "
            f"{'compiled' if r['compiled'] else 'eager'}"
        )
    return words


def verdict(rows: list[dict[str, Any]]) -> str | None:
    """Whether the plan's pick takes the chunked loss where it measured faster, in the pick's
    compile state (the latest line of each cell counts); None without a plan and its pair."""
    last = {r["cell"]: r for r in rows if "error" not in r and "skipped" not in r}
    plan = last.get("plan")
    if plan is None:
        return None
    state = "compiled" if plan["compiled"] else "eager"
    off, on = last.get(state), last.get(f"{state}+chunked")
    if off is None or on is None or not off.get("tokens_per_s") or not on.get("tokens_per_s"):
        return f"no {state} pair measured: no verdict"
    faster = on["tokens_per_s"] > off["tokens_per_s"]
    agrees = faster == plan["takes_chunked_loss"]
    return (
        f"{state}: chunked {on['tokens_per_s']:,} against {off['tokens_per_s']:,} tokens/s "
        f"({on['tokens_per_s'] / off['tokens_per_s']:.2f}x); the pick "
        f"{'takes' if plan['takes_chunked_loss'] else 'leaves'} it: "
        f"{'as measured' if agrees else 'AGAINST the measurement'}"
    )


def table(args: argparse.Namespace) -> None:
    rows = [json.loads(line) for line in args.file.read_text().splitlines() if line.strip()]
    groups: dict[tuple[str, str, float], list[dict[str, Any]]] = {}
    for r in rows:
        groups.setdefault((r["model"], r["device"], r["budget_gib"]), []).append(r)
    for (model, device, budget), group in groups.items():
        print(f"{model} on {device} at {budget} GiB")
        for r in group:
            print("  " + _cell_words(r))
        said = verdict(group)
        if said is not None:
            print(f"  verdict: {said}")


def _since(start: float) -> float:
    return time.perf_counter() - start


def _say(text: str) -> None:
    print(f"# {text}", file=sys.stderr, flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("peaks", help="the simulated device's peak against the estimate (CPU)")
    p.add_argument("--batches", type=int, nargs="+", default=[4, 8])
    p.add_argument("--precisions", nargs="+", default=["fp32", "bf16"])
    p.add_argument("--chunks", nargs="+", default=["off", "4", "8", "32"])
    p.add_argument(
        "--target",
        default=f"{ROOT}/examples/gpt.py:build",
        help="file.py:factory (the docs' table: the GPT example; the CI smoke: a smaller one)",
    )
    c = sub.add_parser("cells", help="each configuration at its largest batch on a device")
    c.add_argument("--models", default="lm350m", help=f"comma-separated, of {list(MODELS)}")
    c.add_argument("--cells", default="eager,eager+chunked", help=f"of {[*CELLS, 'plan']}")
    c.add_argument("--device", default="cuda", choices=["cuda", "simulated"])
    c.add_argument("--budget-gib", type=float, default=8.0)
    c.add_argument("--base", default='{"precision": "bf16", "checkpointing": "all"}')
    c.add_argument("--compile", default=json.dumps(REGIONAL), help="the compiled cells' choice")
    c.add_argument("--chunks", type=int, default=8)
    c.add_argument("--json", type=Path, default=RESULTS)
    c.add_argument("--deadline-s", type=float, default=420)
    c.add_argument("--probe-timeout-s", type=float, default=240, help="one probe process")
    t = sub.add_parser("table", help="the cells of a JSON lines file, and the verdict")
    t.add_argument("file", type=Path)
    args = parser.parse_args()
    {"peaks": peaks, "cells": cells, "table": table}[args.command](args)


if __name__ == "__main__":
    main()
