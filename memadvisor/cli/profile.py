"""``memadvisor profile TARGET``: what one training step holds, by kind, owner and phase."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from memadvisor.cli._app import (
    DEBUG_HELP,
    DEVICE_HELP,
    QUIET_HELP,
    TARGET_HELP,
    DeviceOption,
    announce_device,
    app,
    err_console,
    handle_errors,
    out_console,
    resolve_device,
    say_written,
)
from memadvisor.errors import BadInputError

EPILOG = """[bold]Examples[/]

  memadvisor profile examples/gpt.py:build

  memadvisor profile examples/cnn.py:build --html profile.html --speedscope step.speedscope.json

  memadvisor profile my_project.train:build --blocks "model.layers.*" --timeline step.json

Exit codes: 0 ok, 2 bad input, 4 profiling failed, 1 a bug.
"""


@app.command(epilog=EPILOG)
@handle_errors
def profile(
    target: Annotated[str, typer.Argument(help=TARGET_HELP, show_default=False)],
    device: Annotated[
        DeviceOption, typer.Option("--device", metavar="DEVICE", help=DEVICE_HELP)
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
    debug: Annotated[bool, typer.Option("--debug", help=DEBUG_HELP)] = False,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help=QUIET_HELP)] = False,
) -> None:
    """Measure TARGET's training step: memory by kind, per block, per owner and per phase."""
    if batch_size is not None and batch_size <= 0:
        raise BadInputError(f"--batch-size must be positive, but got {batch_size=}.")
    kind = resolve_device(device)
    if cuda_snapshot_path is not None and kind != "cuda":
        raise BadInputError(
            "--cuda-snapshot records the CUDA caching allocator, but this profile runs on the "
            "CPU; drop the option or run on a machine with a GPU."
        )
    from memadvisor.profiler import profile_workload
    from memadvisor.target import load_target

    workload = load_target(target)
    announce_device(kind, quiet=quiet)
    with (
        err_console.status("Profiling one training step…", spinner="dots")
        if not quiet
        else _nothing()
    ):
        result = profile_workload(workload, blocks=blocks or None, device=_profiler_device(kind))
    from memadvisor.report import print_profile

    if json_path is not None:
        say_written("the profile", _write(json_path, result.model_dump_json(indent=2)), quiet=quiet)
    if html_path is not None:
        from memadvisor.report import render_profile_html, write_html

        page = render_profile_html(result, batch_size=batch_size)
        say_written("the HTML report", write_html(page, html_path), quiet=quiet)
    console = out_console()
    if quiet:
        return
    print_profile(result, console, batch_size=batch_size)


def _profiler_device(kind: str) -> str:
    # The simulated device profiles real CPU tensors with their bytes tracked.
    return "cpu" if kind == "simulated" else kind


def _write(path: Path, text: str) -> Path:
    try:
        path.write_text(text + "\n", encoding="utf-8")
    except OSError as e:
        raise BadInputError(f"Cannot write {str(path)!r}: {e.strerror}.") from e
    return path


class _nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None
