"""A fresh process for one CUDA run: ``python -m memadvisor.device._worker REQUEST``.

CudaDevice's fallback where its fork server (:mod:`memadvisor.device._zygote`) cannot serve
(no ``os.fork``, the zygote died, or CUDA would not start in a forked child), and what the
GPU bench's 200-step runs use, as a user's own job would start.

It caps the card at the budget before anything is allocated, rebuilds the workload (from
the user's factory, or from the parent's ``torch.save``'d copy), trains the candidate and
prints one line, ``MEMADVISOR_RESULT {json}``, with a status:

* ``ok``: ``measurement`` holds a :class:`Measurement`;
* ``oom``: it ran out of memory (``message``, ``steps_completed``);
* ``unloadable``: the saved workload could not be loaded here (the parent then probes in
  its own process);
* ``error``: anything else (``type``, ``message``, ``traceback``), exit code 1.
"""

from __future__ import annotations

import json
import sys
import traceback
from pathlib import Path
from typing import Any


def _say(answer: dict[str, Any]) -> None:
    from memadvisor.device._train import RESULT_MARKER

    sys.stdout.write("\n" + RESULT_MARKER + json.dumps(answer) + "\n")
    sys.stdout.flush()


def _load_workload(request: dict[str, Any]) -> Any:
    import torch

    from memadvisor.target import load_target, load_target_file
    from memadvisor.workload import Workload

    if request["target"]:
        return load_target(request["target"])
    for path in request.get("target_files", []):
        load_target_file(Path(path))  # under the name the parent's pickles refer to
    parts = torch.load(request["workload_path"], map_location="cpu", weights_only=False)
    return Workload(
        model=parts["model"],
        sample_batch=parts["sample_batch"],
        loss_fn=parts["loss_fn"],
        optimizer_factory=parts["optimizer"],
        make_batch=parts["make_batch"],
        forward_fn=parts["forward_fn"],
    )


def main(argv: list[str] | None = None) -> int:
    from memadvisor.device._lifetime import die_with_parent

    die_with_parent()  # SIGTERM or SIGKILL to the planner ends this run too
    args = sys.argv[1:] if argv is None else argv
    request = json.loads(Path(args[0]).read_text())
    for p in request.get("sys_path", []):
        if p not in sys.path:
            sys.path.append(p)  # the parent's imports (a user's package), never shadowing ours

    import torch

    from memadvisor.device._train import train_candidate
    from memadvisor.errors import BadInputError, is_oom
    from memadvisor.schema.candidate import Candidate
    from memadvisor.schema.profile import Profile

    index = int(request["device_index"])
    torch.cuda.set_device(index)
    total = torch.cuda.get_device_properties(index).total_memory
    # Before the first allocation: the cap holds for everything this process reserves.
    torch.cuda.set_per_process_memory_fraction(min(1.0, request["budget_bytes"] / total), index)
    try:
        workload = _load_workload(request)
    except Exception as e:  # noqa: BLE001 - reported to the parent, which falls back
        if request["target"]:
            _say(
                {
                    "status": "error",
                    "type": type(e).__name__,
                    "bad_input": isinstance(e, BadInputError),
                    "message": str(e),
                    "traceback": traceback.format_exc(),
                }
            )
            return 1
        _say({"status": "unloadable", "message": f"{type(e).__name__}: {e}"})
        return 0
    profile = None
    if request.get("profile_path"):
        profile = Profile.model_validate_json(Path(request["profile_path"]).read_text())
    candidate = Candidate.model_validate(request["candidate"])
    try:
        measured = train_candidate(
            workload,
            candidate,
            int(request["steps"]),
            device=torch.device("cuda", index),
            strategy_names=request.get("strategies"),
            profile=profile,
            copy_model=False,  # this process owns the model: no second copy on the card
        )
    except Exception as e:  # noqa: BLE001 - every outcome goes back to the parent as JSON
        if is_oom(e):
            _say(
                {
                    "status": "oom",
                    "message": str(e).strip().splitlines()[0] if str(e) else "OOM",
                    "steps_completed": int(getattr(e, "memadvisor_steps_completed", 0)),
                }
            )
            return 0
        _say(
            {
                "status": "error",
                "type": type(e).__name__,
                "bad_input": isinstance(e, BadInputError),
                "message": str(e),
                "traceback": traceback.format_exc(),
            }
        )
        return 1
    _say({"status": "ok", "measurement": measured.model_dump(mode="json")})
    return 0


if __name__ == "__main__":
    sys.exit(main())
