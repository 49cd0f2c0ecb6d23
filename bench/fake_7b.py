"""How long a Llama-2-7B-shaped model takes to profile under fake tensors, and the memory used.

Issue 4's target: under a minute on a 2-core, 24 GB machine, with no real weights allocated.

    python bench/fake_7b.py
    python bench/fake_7b.py --preset tiny --seq-len 64      # the CPU smoke (CI)
"""

from __future__ import annotations

import argparse
import resource
import time
from pathlib import Path

from memadvisor.device.fake import fake_workload, profile_fake
from memadvisor.target import load_factory

GIB = 2**30
LLAMA = Path(__file__).resolve().parents[1] / "examples" / "llama.py"  # from any folder


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="7b", help="examples/llama.py's: 7b, 1b or tiny")
    parser.add_argument("--seq-len", type=int, default=2048)
    args = parser.parse_args()
    build = load_factory(f"{LLAMA}:build")
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    started = time.perf_counter()
    workload = fake_workload(lambda: build(batch_size=1, seq_len=args.seq_len, preset=args.preset))
    profile = profile_fake(workload, precisions=["fp32", "bf16"])
    elapsed_s = time.perf_counter() - started
    grown_gib = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss_before) / 2**20
    print(f"{'model':14s} {'params GiB':>10s} {'blocks':>6s} {'profile s':>9s} {'RSS GiB':>8s}")
    print(
        f"{'llama ' + args.preset:14s} {profile.param_bytes / GIB:10.1f} {len(profile.blocks):6d} "
        f"{elapsed_s:9.1f} {grown_gib:8.2f}"
    )


if __name__ == "__main__":
    main()
