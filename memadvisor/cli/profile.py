"""``memadvisor profile TARGET``: what one training step holds, by kind, owner and phase."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Annotated

import typer
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    SpinnerColumn,
    TextColumn,
    TimeElapsedColumn,
)

from memadvisor.cli._app import (
    DEBUG_HELP,
    PROFILE_DEVICE_HELP,
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
    say_written,
    write_text,
)
from memadvisor.errors import BadInputError
from memadvisor.schema.device import profiler_device

EPILOG = """[bold]Examples[/]

  memadvisor profile examples/gpt.py:build

  memadvisor profile examples/cnn.py:build --html profile.html --speedscope step.speedscope.json

  memadvisor profile my_project.train:build --blocks "model.layers.*" --timeline step.json

Exit codes: 0 ok, 2 bad input, 4 profiling failed, 1 a bug.
"""


@app.command(epilog=EPILOG)
@handle_errors
def profile(
    target: Annotated[str, typer.Argument(metavar="TARGET", help=TARGET_HELP, show_default=False)],
    device: Annotated[
        DeviceOption, typer.Option("--device", help=PROFILE_DEVICE_HELP)
    ] = DeviceOption.auto,
    blocks: Annotated[
        list[str] | None,
        typer.Option(
            "--blocks",
            help="The blocks to measure (repeatable): a module name, a glob ('layers.*') or a "
            "class name. Default: the largest run of same-type modules.",
            show_default=False,
        ),
    ] = None,
    batch_size: Annotated[
        int | None,
        typer.Option(
            "--batch-size",
            help="Report bytes at this batch (read off the per-sample fits). Default: the larger "
            "batch measured.",
            show_default=False,
        ),
    ] = None,
    json_path: Annotated[
        Path | None,
        typer.Option("--json", help="Write the Profile as JSON here.", show_default=False),
    ] = None,
    html_path: Annotated[
        Path | None,
        typer.Option("--html", help="Write a self-contained HTML report here.", show_default=False),
    ] = None,
    timeline_path: Annotated[
        Path | None,
        typer.Option(
            "--timeline",
            help="Write the step's timeline (events with time, phase, module, bytes) as JSON.",
            show_default=False,
        ),
    ] = None,
    speedscope_path: Annotated[
        Path | None,
        typer.Option(
            "--speedscope",
            help="Write a speedscope flame graph of the step, modules weighted by bytes.",
            show_default=False,
        ),
    ] = None,
    cuda_snapshot_path: Annotated[
        Path | None,
        typer.Option(
            "--cuda-snapshot",
            help="CUDA only: write the allocator snapshot (.pickle) for torch's memory viewer.",
            show_default=False,
        ),
    ] = None,
    debug: Annotated[bool, typer.Option("--debug", metavar="", help=DEBUG_HELP)] = False,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", metavar="", help=QUIET_HELP)] = False,
) -> None:
    """Measure TARGET's training step: memory by kind, per block, per owner and per phase."""
    if batch_size is not None and batch_size <= 0:
        raise BadInputError(f"--batch-size must be positive, but got {batch_size=}.")
    check_output_paths(
        json=json_path,
        html=html_path,
        timeline=timeline_path,
        speedscope=speedscope_path,
        cuda_snapshot=cuda_snapshot_path,
    )
    kind = resolve_device(device)
    on = profiler_device(kind)  # None: "estimate", fake tensors
    if cuda_snapshot_path is not None and on != "cuda":
        raise BadInputError(
            "--cuda-snapshot records the CUDA caching allocator, but this profile runs "
            f"{'under fake tensors' if on is None else 'on the CPU simulated device'}; "
            "drop the option or run on a machine with a GPU."
        )
    from memadvisor.device.fake import load_fake_target
    from memadvisor.profiler import (
        profile_workload,
        record_timeline,
        top_allocations,
        write_memory_snapshot,
    )
    from memadvisor.report import one_line_profile, print_profile
    from memadvisor.target import load_target

    if on is None:
        recorded = {"--timeline": timeline_path, "--speedscope": speedscope_path}
        asked = [flag for flag, path in {**recorded, "--html": html_path}.items() if path]
        if asked:
            raise BadInputError(
                f"{', '.join(asked)} record a step of real tensors, but --device estimate "
                "builds the model as fake tensors; drop them, or profile on a device."
            )
        from memadvisor.device.fake import profile_fake
        from memadvisor.planner import with_flop_times
        from memadvisor.schema.profile import StepTimeModel

        fake = load_fake_target(target)
        announce_device(kind, quiet=quiet)
        with _progress(quiet) as bar:
            result = profile_fake(fake, blocks=blocks or None, progress=bar)
        result = with_flop_times(fake, result, StepTimeModel())
        workload = fake
    else:
        workload = load_target(target)
        announce_device(kind, quiet=quiet)
        with _progress(quiet) as bar:
            result = profile_workload(workload, blocks=blocks or None, device=on, progress=bar)
    if json_path is not None:
        write_text(json_path, result.model_dump_json(indent=2) + "\n", "the profile", quiet=quiet)
    timeline = None
    b = batch_size or max(result.batch_sizes)  # the batch every number below is read at
    if timeline_path or speedscope_path or html_path:
        # One more step, recorded module by module (the profile's own steps are not traced).
        timeline = record_timeline(workload, batch_size=b, device=on)
    if timeline_path is not None:
        write_text(timeline_path, timeline.model_dump_json() + "\n", "the timeline", quiet=quiet)
    if speedscope_path is not None:
        flame = json.dumps(timeline.to_speedscope(weight="bytes")) + "\n"
        write_text(speedscope_path, flame, "the speedscope flame graph", quiet=quiet)
    if cuda_snapshot_path is not None:
        path = write_memory_snapshot(workload, cuda_snapshot_path, batch_size=b)
        say_written("the CUDA allocator snapshot (open it at pytorch.org/memory_viz)", path,
                    quiet=quiet)  # fmt: skip
    # One more step, each op's allocations charged to its module: the op table.
    ops = top_allocations(workload, batch_size=b, device=on) if html_path or not quiet else None
    if html_path is not None:
        from memadvisor.report import render_profile_html, series_from_timeline

        caption = (
            f"One training step of {result.model_name} at batch {b} (fp32), recorded module "
            f"by module on {timeline.device}."
        )
        series = series_from_timeline(timeline, caption=caption)
        page = render_profile_html(result, batch_size=b, series=series, ops=ops)
        write_text(html_path, page, "the HTML report", quiet=quiet)
    raise_if_interrupted()  # a Ctrl-C that a library swallowed: no report
    console = out_console()
    if quiet:
        console.print(one_line_profile(result), highlight=False, soft_wrap=True)
    else:
        print_profile(result, console, batch_size=b, ops=ops)


@contextlib.contextmanager
def _progress(quiet: bool) -> Iterator[Progress | None]:
    """A rich bar on stderr that the profiler advances step by step; none with --quiet."""
    if quiet:
        yield None
        return
    bar = Progress(
        SpinnerColumn(),
        TextColumn("[progress.description]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=err_console,
        transient=True,  # gone when done: the report says how long profiling took
    )
    with bar:
        yield bar
