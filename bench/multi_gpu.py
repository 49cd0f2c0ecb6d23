"""Per-rank plans on several cards: FSDP2 and DDP, predicted per-rank peak against measured.

For each model, way of sharing (``--parallel``) and world size (``--world-sizes``), one JSON
line as soon as it is done (stdout, and appended to ``--json PATH``), then the table. A
progress line (``[  12s] ...``) is printed before each stage, so a slow card shows where it is.

* one card: ``plan_workload`` for one card of ``--budget-gb`` (compile off: the per-rank
  plan does not weigh it); its batch the reference, or its refusal (exit 3's message) when
  one card cannot train the model.
* plan: the same with ``world_size`` and ``parallel``. Where this machine has that many
  cards (or ``--device simulated``) the per-rank estimate is searched, and its probes and
  verification run as that many processes (rank r on card r, NCCL; gloo on the CPU), each
  capped to the budget; the fullest rank decides. Where it has fewer, the plan is made on
  the estimate device (fake tensors, nothing run) and the row says ``estimated``.
* predicted vs measured: the pick's estimated per-rank peak (``Estimate.peak_bytes``:
  allocated; the row keeps where it falls, each phase's top and the breakdown) against the
  fullest rank's measured ``max_memory_allocated`` over the verification's steps: all the
  rank holds (its shards, the gathered units, activations), counted from before the model
  reached the card, the peak reset once the model is wrapped (the unsharded model's moment
  before ``fully_shard`` is the loading's, not the step's). Rows written before that
  measurement was fixed (bench/results/multi_gpu.jsonl up to the ``fsdp`` branch) read the
  baseline after the unsharded fp32 model was on the card: their measured peaks are short
  by the whole model's weights (llama_1b: 4.10 GiB). The bar is within 5%.
* long run: the pick trained ``--long-steps`` steps by the ranks from a clean state; OOMs
  counted; tokens/s over all ranks (the median step's, the first excluded) for a language
  model (samples/s x sequence length x world size).
* ``--parallel auto``: DDP and FSDP2 (resharded after forward or not) are each timed on
  the ranks and the fastest is the pick; the row keeps what each measured.
* refused: a plan the budget cannot hold (DDP of a model whose replica does not fit) is a row
  with the minimum it names; it costs no device run.

The issue's run (2 cards, about 6-7 minutes on 2 x H100):

    python bench/multi_gpu.py --models llama_1b --parallel fsdp2,ddp --world-sizes 2,4,8 \\
        --budget-gb 12 --json bench/results/multi_gpu.jsonl
    python bench/multi_gpu.py --models llama_tiny --parallel fsdp2 --budget-gb 1 \\
        --long-steps 20 --json /tmp/multi_gpu_check.jsonl        # a 2-card check, ~1-2 min
    python bench/multi_gpu.py --models gpt --parallel auto --world-sizes 2 --budget-gb 8 \
        --long-steps 50 --json bench/results/multi_gpu.jsonl   # DDP vs FSDP2, measured
    python bench/multi_gpu.py --table bench/results/multi_gpu.jsonl
    python bench/multi_gpu.py --smoke --json /tmp/smoke.jsonl     # CPU smoke (CI)

Models: llama_1b (examples/llama.py:build_1b, TinyLlama-1.1B's shape at 1024 tokens: 17.6 GB
of weights, gradients and AdamW state), llama_tiny (examples/llama.py:build), gpt
(examples/gpt.py), bert (bench/_models.py, transformers needed), mlp
(tests/fixtures/factories.py).

Known limitations:
    * Every rank trains the same batch; tokens/s counts each rank's batch once.
    * The long run starts fresh processes: the figures include none of the plan's warm state.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch

HERE = Path(__file__).resolve()
ROOT = HERE.parents[1]
sys.path.insert(0, str(ROOT))  # tests.fixtures for the smoke model
GIB = 2**30
STARTED = time.perf_counter()

MODELS = {
    "llama_1b": f"{ROOT}/examples/llama.py:build_1b",
    "llama_tiny": f"{ROOT}/examples/llama.py:build",
    "gpt": f"{ROOT}/examples/gpt.py:build",
    "bert": f"{HERE.parent / '_models.py'}:bert_base_b4",
    "mlp": "tests.fixtures.factories:residual_mlp",
}
# The smoke: the residual MLP (its weights and AdamW state fill most of the budget), 2 gloo
# ranks on the simulated device, small batches, a few steps; 4 ranks by the estimate alone.
# Every stage of the GPU run, in seconds.
SMOKE = {
    "models": "mlp",
    "parallel": "fsdp2,ddp",
    "world_sizes": "2,4",
    "budget_gb": 0.011,
    "long_steps": 2,
    "verify_steps": 2,
    "max_batch": 16,
    "device": "simulated",
}


def say(text: str) -> None:
    """A progress line: seconds since the bench started, then what it is doing."""
    print(f"[{time.perf_counter() - STARTED:5.0f}s] {text}", flush=True)


def _gib(nbytes: float | None) -> float | None:
    return None if nbytes is None else round(nbytes / GIB, 4)


def _tokens_per_sample(sample_batch: Any) -> int | None:
    """Tokens in one sample of a language model's batch (its inputs' dim 1), else None."""
    first = sample_batch[0] if isinstance(sample_batch, (tuple, list)) else sample_batch
    if isinstance(first, dict):
        first = first.get("input_ids")
    if isinstance(first, torch.Tensor) and first.dim() == 2 and not first.is_floating_point():
        return int(first.shape[1])
    return None


def _profile(workload: Any, device: str) -> Any:
    """One card's profile, made once per model and shared by its plans (as a plan makes it)."""
    import contextlib

    from memadvisor.device._autocast import cuda_autocast_policy
    from memadvisor.memory import release_cached_memory
    from memadvisor.profiler import profile_workload

    policy = contextlib.nullcontext() if device == "cuda" else cuda_autocast_policy()
    with policy:
        profile = profile_workload(workload, device="cuda" if device == "cuda" else "cpu")
    release_cached_memory(workspaces=True)  # card 0 is rank 0's: this process keeps nothing
    return profile


class Bench:
    """One model's rows: its workload and profile, made once."""

    def __init__(self, model: str, args: argparse.Namespace) -> None:
        from memadvisor.target import load_target

        self.model, self.args = model, args
        self.target = MODELS[model]
        self.measured_ranks = args.cards
        say(f"{model}: building the workload")
        self.workload = load_target(self.target)
        self.tokens = _tokens_per_sample(self.workload.sample_batch)
        say(f"{model}: profiling on one {'card' if args.device == 'cuda' else 'CPU'}")
        self.profile = _profile(self.workload, args.device)
        self.fake: Any = None

    def config(self, world_size: int, parallel: str, device: str) -> Any:
        from memadvisor.schema.config import PlanConfig, gib_to_bytes

        return PlanConfig(
            budget_bytes=gib_to_bytes(self.args.budget_gb),
            device=device,
            world_size=world_size,
            parallel=parallel,
            verify_steps=self.args.verify_steps,
            rerank_top=self.args.rerank_top,
            max_batch=self.args.max_batch,
            options={"compile": "off"},  # the per-rank plan does not weigh compiling
        )

    def one_card(self) -> dict[str, Any]:
        from memadvisor.errors import InfeasibleBudgetError
        from memadvisor.planner import plan_workload

        say(f"{self.model}: planning one card of {self.args.budget_gb} GiB")
        config = self.config(1, "none", self.args.device)
        try:
            plan = plan_workload(
                self.workload, config, target=self.target, profile=self.profile, progress=False
            )
        except InfeasibleBudgetError as e:
            return {"batch": None, "refused": str(e), "names_world_size": e.sharded_world_size}
        return {"batch": plan.candidate.batch_size, "refused": None, "names_world_size": None}

    def row(self, parallel: str, world_size: int, single: dict[str, Any]) -> dict[str, Any]:
        from memadvisor.errors import InfeasibleBudgetError

        measured = world_size <= self.measured_ranks
        base = {
            "model": self.model,
            "parallel": parallel,
            "world_size": world_size,
            "budget_gib": self.args.budget_gb,
            "basis": "measured" if measured else "estimated",
            "single_card_batch": single["batch"],
            "single_card_names_world_size": single["names_world_size"],
            "torch": torch.__version__,
        }
        started = time.perf_counter()
        say(f"{self.model}: planning {parallel} over {world_size} ranks ({base['basis']})")
        try:
            plan = self._plan(parallel, world_size, measured)
        except InfeasibleBudgetError as e:
            return {**base, "refused": str(e), "minimum_gib": e.minimum_gib}
        row = {
            **base,
            "refused": None,
            "batch_per_rank": plan.candidate.batch_size,
            "choices": plan.candidate.choices,
            "predicted_peak_gib": _gib(plan.estimate.peak_bytes),
            "predicted_limit_gib": _gib(plan.estimate.limit_bytes),
            # Where the estimate's peak falls, and what it holds there: term by term.
            "predicted_peak_at": plan.estimate.peak_at,
            "predicted_phase_peaks_gib": {
                k: _gib(v) for k, v in (plan.estimate.phase_peak_bytes or {}).items()
            },
            "predicted_breakdown_gib": {k: _gib(v) for k, v in plan.estimate.breakdown.items()},
            "plan_s": round(time.perf_counter() - started, 1),
            "device": plan.device_name,
        }
        if not measured:
            samples = plan.estimate.samples_per_s * world_size
            tokens = self._tokens(samples)
            return {**row, "tokens_per_s": tokens, "estimated_samples_per_s": round(samples, 2)}
        verified = plan.verified
        row.update(
            measured_peak_gib=_gib(verified.peak_bytes),
            measured_reserved_gib=_gib(verified.reserved_peak_bytes),
            rank_peaks_gib=[_gib(b) for b in verified.rank_peak_bytes or []],
            error=round(plan.estimate.peak_bytes / verified.peak_bytes - 1, 4),
            # parallel=auto, or FSDP2's resharding: what each way measured, as the plan chose
            measured_alternatives=[n for n in plan.notes if n.startswith("Measured against")],
        )
        return {**row, **self._long_run(plan, world_size)}

    def _plan(self, parallel: str, world_size: int, measured: bool) -> Any:
        from memadvisor.planner import plan_workload

        if measured:
            config = self.config(world_size, parallel, self.args.device)
            return plan_workload(
                self.workload, config, target=self.target, profile=self.profile, progress=False
            )
        from memadvisor.device.fake import fake_workload
        from memadvisor.planner._estimated import estimated_profile, plan_estimated
        from memadvisor.target import load_factory

        if self.fake is None:  # the fake model and its profile, once per model
            say(f"{self.model}: profiling as fake tensors for the estimate device")
            self.fake = fake_workload(load_factory(self.target))
            self.fake_profile = estimated_profile(self.fake)
        config = self.config(world_size, parallel, "estimate")
        return plan_estimated(self.fake, config, profile=self.fake_profile, progress=False)

    def _long_run(self, plan: Any, world_size: int) -> dict[str, Any]:
        from memadvisor.device.ranks import Ranks
        from memadvisor.errors import is_oom

        steps = self.args.long_steps
        say(f"{self.model}: {steps} steps of the pick over {world_size} ranks")
        ranks = Ranks(
            plan.config.budget_bytes,
            world_size,
            backend="cuda" if self.args.device == "cuda" else "simulated",
            target=self.target,
            profile=plan.profile,
            strategy_names=plan.config.strategies,
        )
        ooms, run = 0, None
        started = time.perf_counter()
        try:
            run = ranks.run(self.workload, plan.candidate, steps)
        except Exception as e:
            if not is_oom(e):
                raise
            ooms = 1
            say(f"{self.model}: out of memory: {str(e).splitlines()[0]}")
        samples = run.samples_per_s * world_size if run is not None else None
        return {
            "long_steps": steps,
            "ooms": ooms,
            "long_measured_peak_gib": _gib(run.peak_bytes) if run else None,
            "long_step_ms": round(run.step_ms, 2) if run else None,
            "samples_per_s": round(samples, 2) if samples is not None else None,
            "tokens_per_s": self._tokens(samples),
            "long_run_s": round(time.perf_counter() - started, 1),
        }

    def _tokens(self, samples_per_s: float | None) -> float | None:
        if samples_per_s is None or self.tokens is None:
            return None
        return round(samples_per_s * self.tokens, 1)


def _world_sizes(args: argparse.Namespace) -> list[int]:
    return [int(n) for n in str(args.world_sizes).split(",")]


def _table(rows: list[dict]) -> str:
    head = (
        f"{'model':10} {'parallel':8} {'ranks':>5} {'basis':9} {'batch/rank':>10} "
        f"{'1 card':>7} {'pred GiB':>9} {'meas GiB':>9} {'error':>7} {'OOMs':>5} "
        f"{'tokens/s':>10}"
    )
    lines = [head]
    for r in rows:
        if r.get("refused"):
            lines.append(
                f"{r['model']:10} {r['parallel']:8} {r['world_size']:>5} refused: needs "
                f"{r.get('minimum_gib')} GiB a rank"
            )
            continue
        meas = r.get("measured_peak_gib")
        error = r.get("error")
        lines.append(
            f"{r['model']:10} {r['parallel']:8} {r['world_size']:>5} {r['basis']:9} "
            f"{r['batch_per_rank']:>10} {str(r['single_card_batch'] or 'no'):>7} "
            f"{r['predicted_peak_gib']:>9.3f} {'-' if meas is None else f'{meas:.3f}':>9} "
            f"{'-' if error is None else f'{error:+.1%}':>7} {r.get('ooms', '-'):>5} "
            f"{r.get('tokens_per_s') or '-':>10}"
        )
    return "\n".join(lines)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="llama_1b", help=f"of {sorted(MODELS)}")
    parser.add_argument("--parallel", default="fsdp2,ddp")
    parser.add_argument("--world-sizes", default="2,4,8", help="beyond the cards: estimated")
    parser.add_argument("--budget-gb", type=float, default=12.0, help="per rank")
    parser.add_argument("--device", choices=["cuda", "simulated"], default="cuda")
    parser.add_argument(
        "--cards", type=int, default=None, help="ranks run (default: the CUDA cards; 2 on CPU)"
    )
    parser.add_argument("--long-steps", type=int, default=200)
    parser.add_argument("--verify-steps", type=int, default=10)
    parser.add_argument("--max-batch", type=int, default=65536, help="largest batch planned")
    parser.add_argument("--rerank-top", type=int, default=1, help="candidates timed")
    parser.add_argument("--json", type=Path, default=None, help="append JSON lines here")
    parser.add_argument("--table", type=Path, default=None, help="print the table of a file")
    parser.add_argument("--smoke", action="store_true", help="the CPU smoke: " + str(SMOKE))
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.smoke:
        args = parser.parse_args(
            [*(argv or sys.argv[1:]), *(f"--{k.replace('_', '-')}={v}" for k, v in SMOKE.items())]
        )
    if args.cards is None:
        args.cards = torch.cuda.device_count() if args.device == "cuda" else 2
    if args.table is not None:
        rows = [json.loads(line) for line in args.table.read_text().splitlines() if line]
        print(_table(rows))
        return 0
    if args.device == "cuda" and torch.cuda.device_count() < 2:
        print(f"needs 2 CUDA devices, found {torch.cuda.device_count()}")
        return 2
    rows = []
    for model in args.models.split(","):
        bench = Bench(model, args)
        single = bench.one_card()
        say(f"{model}: one card: " + (f"batch {single['batch']}" if single["batch"] else "refused"))
        for parallel in args.parallel.split(","):
            for world_size in _world_sizes(args):
                row = bench.row(parallel, world_size, single)
                rows.append(row)
                line = json.dumps(row)
                print(line, flush=True)
                if args.json is not None:
                    args.json.parent.mkdir(parents=True, exist_ok=True)
                    with args.json.open("a") as f:
                        f.write(line + "\n")
    print(_table(rows))
    say("done")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
