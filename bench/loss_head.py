"""The chunked loss (loss_head) on examples/gpt.py: the simulated device's peak, plain and
chunked, against the estimate's.

Profiles examples/gpt.py as shipped (a 50304-token vocabulary, 64 tokens a row) in fp32 and
bf16 under the CUDA autocast policy, then for each precision, batch and chunk count ('off',
4, 8, 32) runs two steps on the simulated device and prints its measured peak beside the
estimate's, with the error.

    python bench/loss_head.py                      # the table in docs/design.md (~2 min CPU)
    python bench/loss_head.py --batches 4 --precisions fp32

Needs ``loss_head`` registered (``pip install -e .`` from this checkout). CPU only: on a card
the bench of the issue (a 0.35B decoder at 8 GiB) is another script's.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from memadvisor.device._autocast import cuda_autocast_policy
from memadvisor.device.simulated import SimulatedDevice
from memadvisor.estimate import estimate
from memadvisor.profiler import profile_workload
from memadvisor.schema.candidate import Candidate
from memadvisor.strategy import load_strategies
from memadvisor.target import load_target

ROOT = Path(__file__).resolve().parents[1]

MIB = 2**20


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[4, 8])
    parser.add_argument("--precisions", nargs="+", default=["fp32", "bf16"])
    parser.add_argument("--chunks", nargs="+", default=["off", "4", "8", "32"])
    args = parser.parse_args()
    workload = load_target(f"{ROOT}/examples/gpt.py:build")
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


if __name__ == "__main__":
    main()
