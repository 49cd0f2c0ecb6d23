"""The precision numerics check on real-size models: its verdict, fp32's measured spread,
the low precision's gap, and what it costs.

Issue 26: an encoder-decoder LM (T5 base config, 512 input and 128 label tokens, random
weights) on an H100 at 8 GiB had bf16 refused by a fixed 5% rule although bf16 ended lower.
This bench runs ``strategies.precision.check_numerics`` as a plan on the card does (the
user's model on the CPU, the check's copies on the card, the process capped at the budget)
for that model and four more architectures of the zoo at base size (GPT-2 124M, a Llama of
160M, BERT base, Swin-T), in bf16, fp16 (with its GradScaler) and TF32 where the card has
it; then the planted failures, fp16 without a scaler among them, which must be refused.

    python bench/precision_check.py                     # on a card: the table above, 8 GiB
    python bench/precision_check.py --device cpu --tiny  # smoke: tiny configs, on the CPU
    python bench/precision_check.py --device cpu --tiny --seeds 5  # false-alarm sweep
    python bench/precision_check.py --device cpu --tiny --seeds 5 --steps 4 --spread needed
                                                         # the same, as a CPU plan checks

It prints a progress line per check and a table at the end, and writes one JSON line per
check (model, precision, verdict, fp32_spread, low_precision_gap, check_s, device, and the
gradient numbers) to ``bench/results/precision_check.jsonl`` (``precision_check_cpu.jsonl``
on the CPU; ``--out`` to choose).

``fp32_spread`` / ``low_precision_gap``: the mean |loss| difference of fp32's perturbed run
from fp32, and the low precision's signed loss difference from fp32 (positive: higher),
over the last quarter of the check's steps; ``grad_distance_fp32`` / ``grad_distance``:
the first step's gradients' distance from fp32's, relative to its norm.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve()
ROOT = HERE.parents[1]
sys.path.insert(0, str(ROOT))  # tests.fixtures: the zoo and the planted failures
sys.path.insert(0, str(HERE.parent))

import torch  # noqa: E402
from _recorder import Recorder  # noqa: E402  (bench/, first on sys.path)

GIB = 2**30


# -- models at base size (random weights, no downloads) -------------------------------------


def t5_base(samples: int) -> dict:
    """T5 with t5-base's config (12+12 layers of 768), 512 input and 128 label tokens."""
    from transformers import T5Config, T5ForConditionalGeneration

    torch.manual_seed(0)
    config = T5Config(  # t5-base's sizes (T5Config()'s defaults are t5-small's)
        d_model=768,
        d_kv=64,
        d_ff=3072,
        num_layers=12,
        num_heads=12,
        decoder_start_token_id=0,
        pad_token_id=0,
    )
    model = T5ForConditionalGeneration(config)
    batch = {
        "input_ids": torch.randint(0, 32128, (samples, 512)),
        "labels": torch.randint(0, 32128, (samples, 128)),
    }
    return {"model": model, "sample_batch": batch}


def gpt2_124m(samples: int) -> dict:
    """GPT2LMHeadModel with gpt2's config (12 layers of 768, vocab 50257), 1024 tokens."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config())
    ids = torch.randint(0, 50257, (samples, 1024))
    return {"model": model, "sample_batch": {"input_ids": ids, "labels": ids.clone()}}


def llama_160m(samples: int) -> dict:
    """LlamaForCausalLM, 160M parameters: 8 layers of 1024 (GQA), vocab 32000, 1024 tokens,
    its cache on as shipped (``bench/_models.py``'s ``hf_llama``)."""
    from _models import hf_llama

    return hf_llama(samples, 1024, max_positions=2048, use_cache=True)


def bert_base(samples: int) -> dict:
    """BertForMaskedLM with bert-base's config, 512 tokens."""
    from transformers import BertConfig, BertForMaskedLM

    torch.manual_seed(0)
    model = BertForMaskedLM(BertConfig())
    ids = torch.randint(0, 30522, (samples, 512))
    return {"model": model, "sample_batch": {"input_ids": ids, "labels": ids.clone()}}


def swin_tiny(samples: int) -> dict:
    """SwinForImageClassification with swin-tiny's config, 224x224 images, 1000 classes."""
    from transformers import SwinConfig, SwinForImageClassification

    torch.manual_seed(0)
    model = SwinForImageClassification(SwinConfig(num_labels=1000))
    batch = {
        "pixel_values": torch.randn(samples, 3, 224, 224),
        "labels": torch.randint(0, 1000, (samples,)),
    }
    return {"model": model, "sample_batch": batch}


BASE: dict[str, Callable[[int], dict]] = {
    "t5-base": t5_base,
    "gpt2-124m": gpt2_124m,
    "llama-160m": llama_160m,
    "bert-base": bert_base,
    "swin-tiny": swin_tiny,
}


def _tiny() -> dict[str, Callable[[int], dict]]:
    """The smoke mode's models: the zoo's entries whose package is here, at their tiny
    configs, and transformers' own ResNet, ConvNeXt and Swin (the zoo's are torchvision's)."""
    import importlib.util

    from tests.fixtures import tiny_hf, zoo

    def from_zoo(entry: zoo.ZooEntry) -> Callable[[int], dict]:
        def build(_samples: int) -> dict:
            model, batch, loss_fn = entry.build()
            return {"model": model, "sample_batch": batch, "loss_fn": loss_fn}

        return build

    here = [e for e in zoo.entries() if importlib.util.find_spec(e.needs) is not None]
    return {
        **{e.name: from_zoo(e) for e in here},
        **{name: (lambda _samples, f=f: f()) for name, (_, f) in tiny_hf.MODELS.items()},
    }


# (planted model, precision, GradScaler): each must be refused.
PLANTED = [
    ("gradients_past_fp16", "fp16", False),
    ("activations_past_fp16", "fp16", True),
    ("log_of_rounded_probability", "bf16", True),
    ("cancelling_variance", "bf16", True),
    ("offset", "bf16", True),
]


# -- running --------------------------------------------------------------------------------


def _precisions(device: torch.device) -> list[str]:
    if device.type != "cuda":
        return ["bf16", "fp16"]  # the CPU has no TF32
    tf32 = torch.cuda.get_device_capability(device) >= (8, 0)
    return ["bf16", "fp16", *(["tf32"] if tf32 else [])]


def _row(model: str, label: str, check: Any, device_name: str) -> dict[str, Any]:
    m = check.metrics
    return {
        "model": model,
        "precision": label,
        "verdict": "pass" if check.passed else "refused",
        "fp32_spread": m.get("loss_spread_fp32"),
        "low_precision_gap": m.get("loss_gap"),
        "loss_limit": m.get("loss_limit"),
        "grad_distance_fp32": m.get("grad_distance_fp32"),
        "grad_distance": m.get("grad_distance"),
        "grad_distance_limit": m.get("grad_distance_limit"),
        "spread_runs": m.get("spread_runs"),  # 2: judged against another dropout draw
        "spread_steps": m.get("spread_steps"),  # fewer than steps: the floors decided the rest
        "steps": m.get("steps"),
        "samples": m.get("batch_size"),
        "check_s": round(m["wall_ms"] / 1e3, 2),
        "device": device_name,
        "summary": check.summary,
    }


def _fmt(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.3g}" if math.isfinite(value) else str(value)
    return str(value)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--tiny", action="store_true", help="the zoo's tiny configs (smoke)")
    parser.add_argument("--budget-gb", type=float, default=8.0, help="cap on the card (GiB)")
    parser.add_argument("--samples", type=int, default=2, help="the sample batch's rows")
    parser.add_argument("--models", default="", help="comma-separated subset")
    parser.add_argument("--seeds", type=int, default=1, help="check each with seeds 0..N-1")
    parser.add_argument("--steps", type=int, default=8, help="the check's steps (a CPU plan: 4)")
    parser.add_argument(
        "--spread",
        choices=["all", "needed"],
        default="all",
        help="spread runs as long as the check's ('all': every spread reported) or only as "
        "the verdict needs ('needed', a plan's screen: the same verdicts)",
    )
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()

    warnings.filterwarnings("ignore")
    try:
        import transformers

        transformers.logging.set_verbosity_error()
    except ImportError:
        pass
    from memadvisor.workload import Workload
    from strategies.precision import check_numerics
    from tests.fixtures import precision_failures

    device = torch.device(args.device)
    if device.type == "cuda" and device.index is None:  # the memory fraction needs an index
        device = torch.device("cuda", torch.cuda.current_device())
    if device.type == "cuda":
        total = torch.cuda.get_device_properties(device).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, args.budget_gb * GIB / total), device)
        device_name = f"{torch.cuda.get_device_name(device)}, {args.budget_gb:g} GiB"
    else:
        # Tiny models gain nothing from threads, and on a shared machine lose many times
        # over (a Swin check 0.3 s on one thread, 12 s on all at load 11).
        torch.set_num_threads(1)
        device_name = "cpu, 1 thread"
    models = _tiny() if args.tiny else BASE
    if args.models:
        models = {n: models[n] for n in args.models.split(",")}
    out = args.out or ROOT / "bench/results" / (
        "precision_check.jsonl" if device.type == "cuda" else "precision_check_cpu.jsonl"
    )
    recorder = Recorder(out, is_row=lambda r: "verdict" in r)
    started = time.perf_counter()
    print(f"precision check on {device_name}, torch {torch.__version__}", flush=True)

    def run(
        name: str, workload: Workload, precision: str, scaler: bool = True, seed: int = 0
    ) -> None:
        label = precision if scaler or precision != "fp16" else "fp16 (no scaler)"
        try:
            check = check_numerics(
                workload,
                precision,
                steps=args.steps,
                seed=seed,
                device=device,
                scaler=scaler,
                spread=args.spread,
            )
        except torch.OutOfMemoryError as e:
            # The check's fp32 runs hold more than the plan's pick (fp32, and the exact weights
            # beside the perturbed ones): a model near the budget can fail them. A row, not a
            # stop.
            first = str(e).splitlines()[0]
            recorder.write({"model": name, "precision": label, "error": first, "seed": seed})
            print(f"[{time.perf_counter() - started:6.1f} s] {name} {label}: out of memory "
                  f"in the check ({first})", flush=True)  # fmt: skip
            torch.cuda.empty_cache()
            return
        row = {**_row(name, label, check, device_name), "seed": seed}
        recorder.write(row)
        print(
            f"[{time.perf_counter() - started:6.1f} s] {name} {label}: {row['verdict']} "
            f"(gap {_fmt(row['low_precision_gap'])}, spread {_fmt(row['fp32_spread'])}, "
            f"{row['check_s']} s)",
            flush=True,
        )

    for name, build in models.items():
        t = time.perf_counter()
        workload = Workload(**build(args.samples))
        print(f"[{time.perf_counter() - started:6.1f} s] built {name} in "
              f"{time.perf_counter() - t:.1f} s", flush=True)  # fmt: skip
        for precision in _precisions(device):
            for seed in range(args.seeds):
                run(name, workload, precision, seed=seed)
        del workload
    for factory, precision, scaler in PLANTED:
        run(f"planted:{factory}", Workload(**getattr(precision_failures, factory)()), precision,
            scaler)  # fmt: skip
    recorder.close()

    columns = ["model", "precision", "verdict", "fp32_spread", "low_precision_gap", "loss_limit",
               "grad_distance_fp32", "grad_distance", "spread_runs", "spread_steps", "steps",
               "check_s"]  # fmt: skip
    print()
    print(" | ".join(columns))
    for row in recorder.rows:
        print(" | ".join(_fmt(row[c]) for c in columns))
    print()
    for line in _summary(recorder.rows):
        print(line)
    print(f"\n{len(recorder.rows)} checks in {time.perf_counter() - started:.1f} s -> {out}")


def _ratio(row: dict[str, Any], num: str, den: str) -> float:
    """``row[num] / row[den]``; -inf where either is missing (a check that ended at inf/nan)."""
    if row.get(num) is None or not row.get(den):
        return -math.inf
    return row[num] / row[den]


def _summary(rows: list[dict[str, Any]]) -> list[str]:
    """Per precision, over the models that are not planted failures: how many were refused
    (false alarms) and the worst ratios of the low precision to fp32's spread."""
    lines = []
    for precision in dict.fromkeys(r["precision"] for r in rows):
        mine = [r for r in rows if r["precision"] == precision and ":" not in r["model"]]
        if not mine:
            continue
        refused = [f"{r['model']} seed {r['seed']}" for r in mine if r["verdict"] != "pass"]
        loss = max(mine, key=lambda r: _ratio(r, "low_precision_gap", "fp32_spread"))
        grad = max(mine, key=lambda r: _ratio(r, "grad_distance", "grad_distance_fp32"))
        margin = max(
            max(_ratio(r, "low_precision_gap", "loss_limit"), _ratio(r, "grad_distance",
                "grad_distance_limit")) for r in mine
        )  # fmt: skip
        lines.append(
            f"{precision}: {len(refused)} of {len(mine)} refused"
            f"{(' (' + ', '.join(refused) + ')') if refused else ''}; worst loss "
            f"gap/spread {_ratio(loss, 'low_precision_gap', 'fp32_spread'):.3g} "
            f"({loss['model']} seed {loss['seed']}), worst gradient distance/fp32's "
            f"{_ratio(grad, 'grad_distance', 'grad_distance_fp32'):.3g} "
            f"({grad['model']} seed {grad['seed']}); closest to a limit {margin:.2f} of it; "
            "check_s up to "
            f"{max(r['check_s'] for r in mine)}"
        )
    return lines


if __name__ == "__main__":
    main()
