"""Best eager plan vs best compiled plan under one budget, per model (the lead's GPU run).

For each model: profile it once on CUDA, then plan
    * eager: every registered strategy except compile, as ``memadvisor plan`` would;
    * compiled, once per compile choice (``default``, and the partitioner's activation memory
      budget 0.5): the same search with that choice forced on every candidate, so each
      probe is a fresh process that compiles. The compiled plans run inside one shared
      inductor cache (``memadvisor.compile_cache``), whose added size is reported.
Before a compiled plan, ``try_compile`` checks at the sample batch that the model compiles;
a model that does not is reported and kept eager. After it, ``try_compile`` at the pick
times the one-off first compiled step (``--no-pick-trial`` skips it).

The table: batch, measured samples/s of the verified pick (and against eager), allocated and
reserved peak, plan wall time (compiles included), the compile time at the pick, and what the
pick chose (precision, checkpointed blocks: is block checkpointing ever picked under compile?).

    python bench/compile_vs_eager.py --models gpt,cnn                  # ~8 min on an H200
    python bench/compile_vs_eager.py --models vit_b_16 --choices default
    python bench/compile_vs_eager.py --models resnet18 --cache-test    # cold vs warm cache

``--cache-test`` runs the first model's compiled step at the sample batch in two fresh
processes sharing an empty cache directory: the first compiles cold, the second loads.

Models: gpt, cnn, llama (examples/); resnet18, convnext_tiny, vit_b_16 (torchvision); bert
(transformers BertForMaskedLM, bert-base config); llama_small (transformers LlamaForCausalLM,
a small config); each built from its config, no downloads. Known limits: the compiled plans
force one compile choice each (the planner does not yet mix eager and compiled candidates);
the compiled search re-ranks fewer candidates (``--rerank-top-compiled``) since each probe
compiles.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from pydantic import JsonValue

HERE = Path(__file__).resolve()
ROOT = HERE.parents[1]
GIB = 2**30

# name -> target ("file.py:factory"): probe processes rebuild the workload from it.
MODELS = {
    "gpt": f"{ROOT}/examples/gpt.py:build",
    "cnn": f"{ROOT}/examples/cnn.py:build",
    "llama": f"{ROOT}/examples/llama.py:build",
    "resnet18": f"{HERE}:resnet18",
    "convnext_tiny": f"{HERE}:convnext_tiny",
    "vit_b_16": f"{HERE}:vit_b_16",
    "bert": f"{HERE}:bert",
    "llama_small": f"{HERE}:llama_small",
}
DEFAULT_MODELS = "gpt,cnn,resnet18,convnext_tiny,vit_b_16,bert,llama_small"
CHOICES: dict[str, JsonValue] = {  # --choices name -> the compile choice
    "default": "default",
    "budget0.5": {"mode": "default", "activation_memory_budget": 0.5},
    "budget0.25": {"mode": "default", "activation_memory_budget": 0.25},
    "max-autotune-no-cudagraphs": "max-autotune-no-cudagraphs",
}


# -- model factories (no downloads: built from configs) ------------------------------------


def classification_loss(logits: torch.Tensor, batch: Any) -> torch.Tensor:
    return F.cross_entropy(logits, batch[1])


def _vision(name: str, batch_size: int = 8) -> dict:
    import torchvision

    torch.manual_seed(0)
    model = getattr(torchvision.models, name)(weights=None)
    images = torch.randn(batch_size, 3, 224, 224)
    labels = torch.randint(0, 1000, (batch_size,))
    return {"model": model, "sample_batch": (images, labels), "loss_fn": classification_loss}


def resnet18() -> dict:
    return _vision("resnet18")


def convnext_tiny() -> dict:
    return _vision("convnext_tiny")


def vit_b_16() -> dict:
    return _vision("vit_b_16")


def _tokens(vocab: int, batch_size: int, seq: int) -> dict:
    ids = torch.randint(0, vocab, (batch_size, seq))
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}


def bert(batch_size: int = 4, seq: int = 512) -> dict:
    """BertForMaskedLM with bert-base's config (12 layers, 768 wide, 30522 tokens)."""
    from transformers import BertConfig, BertForMaskedLM

    torch.manual_seed(0)
    model = BertForMaskedLM(BertConfig())
    return {"model": model, "sample_batch": _tokens(model.config.vocab_size, batch_size, seq)}


def llama_small(batch_size: int = 2, seq: int = 1024) -> dict:
    """LlamaForCausalLM, ~200M parameters: 8 layers, 1024 wide, 32000 tokens."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=32000,
        hidden_size=1024,
        intermediate_size=2816,
        num_hidden_layers=8,
        num_attention_heads=16,
        num_key_value_heads=16,
        max_position_embeddings=seq,
        use_cache=False,
    )
    model = LlamaForCausalLM(config)
    return {"model": model, "sample_batch": _tokens(config.vocab_size, batch_size, seq)}


# -- one model --------------------------------------------------------------------------------


def _compiled_only(choice: JsonValue) -> Any:
    """The compile strategy offering ``choice`` alone: every candidate of the search compiles."""
    from strategies.compile import Compile

    class CompiledOnly(Compile):
        def choices(self, profile: Any, config: Any) -> list[JsonValue]:
            return list(self.offered)

        def check(self, workload: Any, choice: JsonValue) -> None:
            return None  # the bench times the compile at the pick itself

    return CompiledOnly(choices=[choice])


def _row(label: str, plan: Any, compile_s: float | None, note: str = "") -> dict:
    m = plan.verified
    c = plan.candidate
    ckpt = c.choices.get("checkpointing") or []
    return {
        "plan": label,
        "batch": c.batch_size * c.accumulation_steps,
        "micro": c.batch_size,
        "samples_per_s": m.samples_per_s if m else float("nan"),
        "peak_gib": m.peak_bytes / GIB if m else float("nan"),
        "reserved_gib": (m.reserved_peak_bytes or 0) / GIB if m else float("nan"),
        "plan_s": plan.plan_wall_ms / 1e3,
        "probes": len(plan.probes),
        "compile_s": compile_s,
        "precision": c.choices.get("precision", "fp32"),
        "checkpointed": f"{len(ckpt)}/{len(plan.profile.blocks) if plan.profile else '?'}",
        "offload": c.choices.get("offload", "off"),
        "note": note,
    }


def _compiled_row(
    workload: Any, profile: Any, target: str, choice: JsonValue, label: str, args: Any
) -> dict:
    """Screen ``choice`` at the sample batch, plan with it forced, time its compile at the pick."""
    from memadvisor.config import PlanConfig, gib_to_bytes
    from memadvisor.estimate import Candidate
    from memadvisor.planner import plan_workload
    from memadvisor.strategy import load_strategies
    from strategies.compile import try_compile

    trial = try_compile(workload, choice, device="cuda")
    if not trial.ok:
        return {"plan": label, "note": trial.summary}
    config = PlanConfig(
        budget_bytes=gib_to_bytes(args.budget_gb),
        device="cuda",
        verify_steps=args.verify_steps,
        rerank_top=args.rerank_top_compiled,
    )
    eager_strategies = [s for s in load_strategies() if not s.measured_only]
    plan = plan_workload(
        workload,
        config,
        target=target,
        profile=profile,
        progress=False,
        strategies=[*eager_strategies, _compiled_only(choice)],
    )
    compile_s = None
    if not args.no_pick_trial:
        c = plan.candidate
        pick = Candidate(
            batch_size=c.batch_size, accumulation_steps=c.accumulation_steps, choices=c.choices
        )
        at_pick = try_compile(workload, choice, candidate=pick, device="cuda")
        compile_s = (at_pick.compile_ms or 0.0) / 1e3 if at_pick.ok else None
    return _row(label, plan, compile_s, note=f"at sample batch: {trial.summary}")


def bench_model(name: str, args: argparse.Namespace) -> list[dict]:
    from memadvisor.compile_cache import shared_compile_cache
    from memadvisor.config import PlanConfig, gib_to_bytes
    from memadvisor.planner import plan_workload
    from memadvisor.profiler import profile_workload
    from memadvisor.strategy import load_strategies
    from memadvisor.target import load_target

    target = MODELS[name]
    workload = load_target(target)
    t0 = time.perf_counter()
    profile = profile_workload(workload, device="cuda")
    print(f"[{name}] profiled in {time.perf_counter() - t0:.1f} s", flush=True)
    config = PlanConfig(
        budget_bytes=gib_to_bytes(args.budget_gb), device="cuda", verify_steps=args.verify_steps
    )
    eager_strategies = [s for s in load_strategies() if not s.measured_only]
    rows = []
    try:
        plan = plan_workload(
            workload,
            config,
            target=target,
            profile=profile,
            progress=False,
            strategies=eager_strategies,
        )
        rows.append(_row("eager", plan, None))
    except Exception as e:  # noqa: BLE001 - reported in the table, the other plans still run
        rows.append({"plan": "eager", "note": f"failed: {type(e).__name__}: {str(e)[:300]}"})
    print(f"[{name}] {json.dumps(rows[-1])}", flush=True)

    with shared_compile_cache() as cache:
        for key in args.choices.split(","):
            label, choice = f"compiled:{key}", CHOICES[key]
            try:
                rows.append(_compiled_row(workload, profile, target, choice, label, args))
            except Exception as e:  # noqa: BLE001 - as above
                rows.append({"plan": label, "note": f"failed: {type(e).__name__}: {str(e)[:300]}"})
            print(f"[{name}] {json.dumps(rows[-1])}", flush=True)
        print(f"[{name}] {cache.report().note}", flush=True)
    torch.cuda.empty_cache()
    return rows


# -- cold vs warm cache in fresh processes ----------------------------------------------------


def _child(target: str, batch: int, choice: str) -> None:
    """A fresh process: the compiled step at ``batch`` (bf16), its first-step time and hits."""
    from memadvisor.estimate import Candidate
    from memadvisor.target import load_target
    from strategies.compile import try_compile

    workload = load_target(target)
    candidate = Candidate(batch_size=batch, choices={"precision": "bf16"})
    result = try_compile(workload, choice, candidate=candidate, device="cuda")
    print("RESULT " + result.model_dump_json(), flush=True)


def cache_test(name: str) -> None:
    from memadvisor.compile_cache import shared_compile_cache
    from memadvisor.target import load_target

    batch = load_target(MODELS[name]).sample_batch_size
    with tempfile.TemporaryDirectory() as tmp, shared_compile_cache(tmp) as cache:
        for run in ("cold", "warm"):
            t0 = time.perf_counter()
            done = subprocess.run(
                [sys.executable, str(HERE), "--child", MODELS[name], str(batch), "default"],
                capture_output=True,
                text=True,
                timeout=600,
            )
            wall = time.perf_counter() - t0
            line = next((s for s in done.stdout.splitlines() if s.startswith("RESULT ")), None)
            if line is None:
                print(f"[{name}] {run}: no result; stderr ends:\n{done.stderr[-2000:]}")
                continue
            r = json.loads(line[len("RESULT ") :])
            print(
                f"[{name}] cache {run}: process {wall:.1f} s, first compiled step "
                f"{r['first_step_ms'] / 1e3:.1f} s, steady {r['compiled_step_ms']:.1f} ms "
                f"(eager {r['eager_step_ms']:.1f} ms), graphs from cache {r['cache_hits']}/"
                f"{r['cache_hits'] + r['cache_misses']}",
                flush=True,
            )
        print(f"[{name}] {cache.report().note}", flush=True)


# -- table ------------------------------------------------------------------------------------


def _fmt(value: Any, spec: str) -> str:
    if value is None or (isinstance(value, float) and value != value):  # None or nan
        return "-".rjust(len(format(0.0, spec)))
    return format(value, spec)


def print_table(results: dict[str, list[dict]]) -> None:
    header = (
        f"{'model':14s} {'plan':19s} {'batch':>6s} {'samples/s':>10s} {'vs eager':>8s} "
        f"{'peak GiB':>8s} {'rsv GiB':>7s} {'plan s':>7s} {'probes':>6s} {'compile s':>9s} "
        f"{'prec':>5s} {'ckpt':>6s} {'offload':>7s}"
    )
    print("\n" + header + "\n" + "-" * len(header))
    for model, rows in results.items():
        eager = next((r for r in rows if r["plan"] == "eager"), None)
        for r in rows:
            if "batch" not in r:
                print(f"{model:14s} {r['plan']:19s} {r.get('note', '')}")
                continue
            speed = r["samples_per_s"] / eager["samples_per_s"] if eager else None
            print(
                f"{model:14s} {r['plan']:19s} {r['batch']:>6d} {_fmt(r['samples_per_s'], '10.1f')} "
                f"{_fmt(speed, '7.2f')}x {_fmt(r['peak_gib'], '8.2f')} "
                f"{_fmt(r['reserved_gib'], '7.2f')} {_fmt(r['plan_s'], '7.1f')} {r['probes']:>6d} "
                f"{_fmt(r['compile_s'], '9.1f')} {r['precision']:>5s} {r['checkpointed']:>6s} "
                f"{r['offload']:>7s}"
            )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default=DEFAULT_MODELS, help=f"of {', '.join(MODELS)}")
    parser.add_argument("--budget-gb", type=float, default=8.0)
    parser.add_argument("--verify-steps", type=int, default=10)
    parser.add_argument("--rerank-top-compiled", type=int, default=1)
    parser.add_argument(
        "--choices", default="default,budget0.5", help=f"compile choices, of {', '.join(CHOICES)}"
    )
    parser.add_argument("--no-pick-trial", action="store_true", help="skip timing the compile")
    parser.add_argument("--cache-test", action="store_true", help="cold vs warm cache instead")
    parser.add_argument(
        "--child", nargs=3, metavar=("TARGET", "BATCH", "CHOICE"), help=argparse.SUPPRESS
    )
    args = parser.parse_args()
    if args.child:
        _child(args.child[0], int(args.child[1]), args.child[2])
        return 0
    if not torch.cuda.is_available():
        print("This benchmark needs a CUDA device (compiled candidates are measured on it).")
        return 1
    names = [n.strip() for n in args.models.split(",") if n.strip()]
    unknown = [n for n in names if n not in MODELS]
    if unknown:
        parser.error(f"unknown models {unknown}; choose from {sorted(MODELS)}")
    bad = [c for c in args.choices.split(",") if c not in CHOICES]
    if bad:
        parser.error(f"unknown compile choices {bad}; choose from {sorted(CHOICES)}")
    if args.cache_test:
        cache_test(names[0])
        return 0
    started = time.perf_counter()
    results: dict[str, list[dict]] = {}
    for name in names:
        try:
            results[name] = bench_model(name, args)
        except Exception as e:  # noqa: BLE001 - one model's failure must not lose the others
            results[name] = [{"plan": "error", "note": f"{type(e).__name__}: {str(e)[:300]}"}]
            print(f"[{name}] failed: {type(e).__name__}: {e}", flush=True)
    print_table(results)
    print(
        f"\n{torch.cuda.get_device_name()}, torch {torch.__version__}, budget {args.budget_gb} "
        f"GiB; total {time.perf_counter() - started:.0f} s"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
