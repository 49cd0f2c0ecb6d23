"""``memadvisor plan TARGET --budget-gb N``: the fastest configuration that fits the budget."""

from __future__ import annotations

from enum import Enum
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from memadvisor.cli._app import (
    DEBUG_HELP,
    DEVICE_HELP,
    QUIET_HELP,
    TARGET_HELP,
    DeviceOption,
    announce_device,
    app,
    check_output_paths,
    err_console,
    handle_errors,
    out_console,
    raise_if_interrupted,
    resolve_device,
    write_text,
)
from memadvisor.errors import InfeasibleBudgetError

if TYPE_CHECKING:
    from memadvisor.report import PlannedStep
    from memadvisor.schema.config import PlanConfig
    from memadvisor.schema.plan import Plan
    from memadvisor.workload import Workload


#: How this command spells each option in messages (memadvisor.api.plan_config writes them).
FLAGS = {
    "budget_gb": "--budget-gb",
    "objective": "--objective",
    "effective_batch": "--effective-batch",
    "margin_fraction": "--margin",
    "world_size": "--world-size",
    "parallel": "--parallel",
    "device": "--device",
    "max_batch": "--max-batch",
}


class ChecksOption(str, Enum):
    decide = "decide"
    report = "report"


class ParallelOption(str, Enum):
    none = "none"
    ddp = "ddp"
    fsdp2 = "fsdp2"
    auto = "auto"


class ObjectiveOption(str, Enum):
    throughput = "throughput"
    largest_batch = "largest_batch"
    effective_batch = "effective_batch"


EPILOG = """[bold]Examples[/]

  memadvisor plan examples/gpt.py:build --budget-gb 0.25

  memadvisor plan examples/cnn.py:build --budget-gb 0.25 --json plan.json --html plan.html

  memadvisor plan my_project.train:build --budget-gb 8 --effective-batch 64 --device cuda

  memadvisor plan examples/gpt.py:build --budget-gb 8 --world-size 2 --parallel fsdp2

  memadvisor plan examples/llama.py:build_7b --budget-gb 160 --device estimate --json plan.json

A saved plan applies to a fresh model with
memadvisor.apply_plan(model, "plan.json") (or Plan.load("plan.json")).

Exit codes: 0 ok, 2 bad input, 3 nothing fits the budget, 4 planning failed, 1 a bug.
"""


@app.command(epilog=EPILOG)
@handle_errors
def plan(
    target: Annotated[str, typer.Argument(metavar="TARGET", help=TARGET_HELP, show_default=False)],
    budget_gb: Annotated[
        float,
        typer.Option(
            "--budget-gb",
            help="Memory budget in GiB (2^30 bytes) for weights, gradients, optimizer state and "
            "activations; the CUDA context is not in it.",
            show_default=False,
        ),
    ],
    objective: Annotated[
        ObjectiveOption | None,
        typer.Option(
            "--objective",
            help="throughput (most samples/s), largest_batch, or effective_batch (reach "
            "--effective-batch by accumulation at the fastest micro-batch). Default: throughput, "
            "or effective_batch when --effective-batch is given.",
            show_default=False,
        ),
    ] = None,
    effective_batch: Annotated[
        int | None,
        typer.Option("--effective-batch", help="The batch you train with, kept by accumulation."),
    ] = None,
    device: Annotated[DeviceOption, typer.Option("--device", help=DEVICE_HELP)] = DeviceOption.auto,
    max_batch: Annotated[
        int | None,
        typer.Option(
            "--max-batch",
            help="The largest batch the plan may pick (e.g. your dataset's length). Default: "
            "65536.",
            show_default=False,
        ),
    ] = None,
    margin: Annotated[
        float | None,
        typer.Option(
            "--margin",
            help="Share of the budget the plan keeps free (0 to 0.5); default: sized from the "
            "runs (3% of the budget below the batch that ran out).",
        ),
    ] = None,
    checks: Annotated[
        ChecksOption,
        typer.Option(
            "--checks",
            help="decide: a precision whose numerics check fails (its loss curve against "
            "fp32's) is not picked; report: it may be picked, and the failed check is shown.",
        ),
    ] = ChecksOption.decide,
    world_size: Annotated[
        int,
        typer.Option(
            "--world-size",
            help="Ranks (one card each) that train together; the budget and the batch are "
            "per rank.",
        ),
    ] = 1,
    parallel: Annotated[
        ParallelOption,
        typer.Option(
            "--parallel",
            metavar="PARALLEL",
            help="How the ranks share the model: ddp (a replica each), fsdp2 (fully_shard "
            "on the blocks), or auto (whichever measures fastest where both fit); none for "
            "one card.",
        ),
    ] = ParallelOption.none,
    json_path: Annotated[
        Path | None,
        typer.Option(
            "--json", help="Write the Plan as JSON here (for apply_plan).", show_default=False
        ),
    ] = None,
    html_path: Annotated[
        Path | None,
        typer.Option(
            "--html",
            help="Write a self-contained HTML report here, with one step of the plan recorded "
            "for its memory chart.",
            show_default=False,
        ),
    ] = None,
    debug: Annotated[bool, typer.Option("--debug", metavar="", help=DEBUG_HELP)] = False,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", metavar="", help=QUIET_HELP)] = False,
) -> None:
    """Find the fastest configuration of TARGET's training step that fits the budget.

    Profiles one step, searches checkpointing, precision, batch size and the other
    strategies on the estimate, confirms the batch by OOM probes on the device, verifies the
    pick over sustained steps, and prints the plan with advice you can adopt by hand.
    """
    config = _config(
        budget_gb, objective, effective_batch, margin, device, world_size, parallel, max_batch
    )
    config = config.model_copy(update={"checks": checks.value})
    check_output_paths(json=json_path, html=html_path)
    from memadvisor.device.fake import load_fake_target
    from memadvisor.planner import plan_workload
    from memadvisor.report import one_line, print_plan
    from memadvisor.schema.device import runs_nothing
    from memadvisor.target import load_target

    if runs_nothing(config.device):
        announce_device(config.device, quiet=quiet)
        workload = load_fake_target(target)
    else:
        workload = load_target(target)
    # The planner says in one line when it plans on the CPU simulated device.
    try:
        result = plan_workload(workload, config, target=target, progress=not quiet)
    except InfeasibleBudgetError as e:
        e.option = "--budget-gb "  # the minimum in the form this user passes a budget
        raise
    raise_if_interrupted()  # a Ctrl-C that a library swallowed: no report, no file
    if json_path is not None:
        write_text(json_path, result.model_dump_json(indent=2) + "\n", "the plan", quiet=quiet)
    console = out_console()
    if quiet:
        console.print(one_line(result), highlight=False, soft_wrap=True)
    else:
        print_plan(result, console)
    if html_path is not None:
        from memadvisor.report import render_plan_html

        # Fake tensors have no step worth recording: the chart shows the phase peaks.
        estimated = not result.capabilities.measures_memory
        step = None if estimated else _planned_step(workload, result, debug=debug)
        page = render_plan_html(result, step=step)
        write_text(html_path, page, "the HTML report", quiet=quiet)


def _config(
    budget_gb: float,
    objective: ObjectiveOption | None,
    effective_batch: int | None,
    margin: float | None,
    device: DeviceOption,
    world_size: int = 1,
    parallel: ParallelOption = ParallelOption.none,
    max_batch: int | None = None,
) -> PlanConfig:
    """The PlanConfig the options describe, built and checked by ``memadvisor.api``.

    Raises:
        BadInputError: an option is out of range, or the objective lacks what it needs.
    """
    from memadvisor.api import plan_config  # torch and the planner: only when a plan is made

    options: dict[str, object] = {"world_size": world_size, "parallel": parallel.value}
    if max_batch is not None:
        options["max_batch"] = max_batch
    if margin is not None:
        # Given, the margin is the user's for the pick too; else the runs size it.
        options["margin_fraction"] = margin
    return plan_config(
        budget_gb,
        objective=objective.value if objective is not None else None,
        effective_batch=effective_batch,
        device=resolve_device(device),
        options=options,
        names=FLAGS,
    )


def _planned_step(workload: Workload, plan: Plan, *, debug: bool) -> PlannedStep | None:
    """One micro-batch step of the plan for the HTML chart, applied to the CLI's own model.

    None (the chart then shows the profile's per-phase peaks) when the step cannot be
    recorded: the plan is already made and printed, and a chart is not worth losing it over.
    """
    from memadvisor.report import planned_step

    try:
        return planned_step(workload, plan, in_place=True)
    except Exception as e:
        if debug:
            raise
        err_console.print(
            f"note: the plan's step could not be recorded for the HTML chart ({type(e).__name__}: "
            f"{e}); the chart shows the profile's per-phase peaks instead.",
            highlight=False,
            soft_wrap=True,
        )
        return None
