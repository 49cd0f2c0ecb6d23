"""Monitor: per-layer numbers by hand arithmetic, totals, CSV, printing, leak check, CUDA."""

from __future__ import annotations

import csv
import io

import pytest
import torch
from rich.console import Console
from torch import nn

from memadvisor import BadInputError, Monitor
from memadvisor.monitor import LeakCheck


class Tiny(nn.Module):
    """Linear(4, 8) -> ReLU -> Linear(8, 2) on batch 2, fp32: every byte countable by hand."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(4, 8)
        self.act = nn.ReLU()
        self.fc2 = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class CachingLinear(nn.Module):
    """A layer that keeps every output it makes: the leak the check must name."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.kept: list[torch.Tensor] = []
        self.leak = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.fc(x)
        if self.leak:
            self.kept.append(y.detach())
        return y


def _quiet() -> Console:
    return Console(file=io.StringIO(), width=160)


def _train(model: nn.Module, monitor: Monitor, steps: int, *, keep=None) -> None:
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with monitor:
        for _ in range(steps):
            out = model(torch.randn(2, 4))
            loss = out.pow(2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            if keep is not None:
                keep.append(out)
            monitor.record()


def test_per_layer_numbers_match_hand_arithmetic():
    """fc1: W 4x8 + b 8 = 160 B (grads the same), saves x (2x4 = 32 B); act saves its output
    (2x8 = 64 B); fc2: 8x2 + 2 = 72 B, saves act's output too, which counts once (to act)."""
    torch.manual_seed(0)
    model = Tiny()
    monitor = Monitor(model, print_period=1, console=_quiet())
    _train(model, monitor, 2)
    layers = {la.module: la for la in monitor.layers}
    got = {
        name: (la.weight_bytes, la.grad_bytes, la.saved_tensors, la.saved_bytes)
        for name, la in layers.items()
    }
    assert got == {
        "": (0, 0, 0, 0),
        "fc1": (160, 160, 1, 32),
        "act": (0, 0, 1, 64),
        "fc2": (72, 72, 1, 0),
    }
    rec = monitor.history[-1]
    assert rec.layers_measured and monitor.layers_iteration == 2
    assert (rec.weight_bytes, rec.grad_bytes, rec.saved_activation_bytes) == (232, 232, 96)
    assert layers["fc1"].forward_ms is not None and layers["fc1"].forward_ms >= 0
    assert layers["fc2"].backward_ms is not None
    # Forward of fc1 allocates exactly one tensor (addmm's output) on the CPU meter.
    assert layers["fc1"].allocations == 1


def test_optimizer_state_and_other_bytes_add_up_to_the_peak():
    """Adam keeps exp_avg and exp_avg_sq (2 x 232 B) and a 4-byte step per parameter (4);
    other = peak - weights - grads - optimizer state - saved activations."""
    torch.manual_seed(0)
    model = Tiny()
    opt = torch.optim.Adam(model.parameters())
    monitor = Monitor(model, print_period=1, optimizer=opt, console=_quiet())
    with monitor:
        for _ in range(2):
            model(torch.randn(2, 4)).sum().backward()
            opt.step()
            opt.zero_grad()
            monitor.record()
    rec = monitor.history[-1]
    assert rec.optimizer_state_bytes == 2 * 232 + 4 * 4
    assert rec.other_bytes == rec.peak_allocated_bytes - 232 - 232 - 480 - 96
    # What the meter holds at record(): weights and optimizer state (grads set to None);
    # the step counters, made from Python data, are adopted at the first measured record().
    assert rec.allocated_bytes == 232 + 480


def test_light_iterations_install_no_hooks():
    """Between printed iterations the model carries no hook of the monitor."""
    model = Tiny()
    monitor = Monitor(model, print_period=5, console=_quiet())
    _train(model, monitor, 3)
    assert not any(m._forward_pre_hooks for m in model.modules())
    assert not any(r.layers_measured for r in monitor.history)


def test_prints_every_print_period_and_writes_csv_rows(tmp_path):
    """print_period=2 over 4 iterations: 2 tables; CSV: 4 step rows, layer rows twice, 1 epoch."""
    path = tmp_path / "memory.csv"
    out = io.StringIO()
    model = Tiny()
    monitor = Monitor(model, print_period=2, csv=path, console=Console(file=out, width=160))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with monitor:
        for _ in range(4):
            model(torch.randn(2, 4)).sum().backward()
            opt.step()
            opt.zero_grad()
            monitor.record()
        monitor.epoch_end()
    text = out.getvalue()
    assert text.count("memadvisor · Tiny · iteration") == 2
    assert "fc1" in text and "epoch 0: 4 iterations" in text
    rows = list(csv.DictReader(path.open()))
    scopes = [r["scope"] for r in rows]
    assert scopes.count("step") == 4 and scopes.count("epoch") == 1
    layer_rows = [r for r in rows if r["scope"] == "layer"]
    assert {r["iteration"] for r in layer_rows} == {"2", "4"}
    assert {r["module"]: r["weight_bytes"] for r in layer_rows if r["iteration"] == "4"}[
        "fc1"
    ] == "160"
    # A second monitor appends to the same file without a second header.
    Monitor(Tiny(), print_period=0, csv=path, console=_quiet()).close()
    assert path.read_text().count("scope,iteration") == 1


def test_cpu_record_outside_the_meter_says_what_to_do():
    """On the CPU nothing is tracked outside `with monitor:`; record() says so."""
    monitor = Monitor(Tiny(), print_period=0, console=_quiet())
    with pytest.raises(BadInputError, match="with monitor"):
        monitor.record()


def test_bad_periods_are_rejected():
    """Negative periods and a leak window below 2 raise BadInputError naming the value."""
    with pytest.raises(BadInputError, match="print_period"):
        Monitor(Tiny(), print_period=-1)
    with pytest.raises(BadInputError, match="leak_window"):
        Monitor(Tiny(), leak_window=1)


# -- leak check -------------------------------------------------------------------------------


def test_leak_is_flagged_with_the_layer_that_keeps_its_outputs():
    """A layer that appends its output to a list each step: flagged, naming that layer."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), CachingLinear(), nn.Linear(8, 1))
    monitor = Monitor(model, print_period=100, console=_quiet())
    _train(model, monitor, 10)
    leak = monitor.leak
    assert leak.flagged
    assert leak.growth_bytes == leak.iterations * 2 * 8 * 4  # one (2, 8) fp32 output per step
    assert leak.suspects[0].module == "2.fc"
    assert "2.fc" in leak.message


def test_leak_is_flagged_where_the_loop_keeps_the_models_outputs():
    """The loop keeps every output (with its graph): flagged, naming the last layer."""
    torch.manual_seed(0)
    model = Tiny()
    monitor = Monitor(model, print_period=100, console=_quiet())
    _train(model, monitor, 10, keep=[])
    assert monitor.leak.flagged
    assert monitor.leak.suspects[0].module == "fc2"


def test_clean_loop_is_not_flagged():
    """The same loops without the kept references: never flagged."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), CachingLinear(), nn.Linear(8, 1))
    model[2].leak = False
    monitor = Monitor(model, print_period=3, console=_quiet())
    _train(model, monitor, 12)
    assert not monitor.leak.flagged
    # ...and memory never rose, so no extra iteration was measured for the leak check.
    assert [r.iteration for r in monitor.history if r.layers_measured] == [3, 6, 9, 12]


@pytest.mark.parametrize(
    ("ends", "flagged"),
    [
        ([10, 20, 30, 40, 50, 60, 70], True),  # warmup 10, then 5 rises
        ([10, 20, 30, 40, 50, 60], False),  # only 4 rises after warmup
        ([10, 20, 30, 40, 40, 50, 60, 70], False),  # a flat step resets the count
        ([100, 20, 20, 20, 20, 20, 20], False),  # first step's optimizer state is warmup
    ],
)
def test_leak_check_needs_window_consecutive_rises(ends, flagged):
    """window=5: five consecutive rises after the warmup record flag; a flat step resets."""
    check = LeakCheck(5)
    for b in ends:
        check.add(b)
    assert check.flagged is flagged


# -- CUDA ---------------------------------------------------------------------------------------


@pytest.mark.gpu
def test_cuda_monitor_matches_allocator_and_cpu_layer_numbers():
    """On a card: allocated at record() is the allocator's; per-layer bytes equal the CPU's."""
    torch.manual_seed(0)
    model = Tiny().cuda()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    monitor = Monitor(model, print_period=1, console=_quiet())
    for _ in range(3):
        model(torch.randn(2, 4, device="cuda")).sum().backward()
        opt.step()
        opt.zero_grad()
        monitor.record()
        rec = monitor.last
        assert rec.allocated_bytes == torch.cuda.memory_allocated()
        assert rec.reserved_bytes == torch.cuda.memory_reserved()
        assert rec.peak_allocated_bytes >= rec.allocated_bytes
    layers = {la.module: (la.weight_bytes, la.saved_bytes) for la in monitor.layers}
    assert layers == {"": (0, 0), "fc1": (160, 32), "act": (0, 64), "fc2": (72, 0)}
    monitor.close()


def test_measuring_layers_keeps_no_tensor_alive():
    """Iterations measured per layer end at the same allocated bytes as unmeasured ones."""
    torch.manual_seed(0)
    model = Tiny()
    monitor = Monitor(model, print_period=2, console=_quiet())
    _train(model, monitor, 6)
    ends = {r.layers_measured: r.allocated_bytes for r in list(monitor.history)[1:]}
    assert ends[True] == ends[False]


def test_checkpointed_blocks_hide_their_saved_tensors_but_not_their_weights():
    """A checkpointed Linear saves nothing the monitor sees (recomputed in backward); its
    weights and gradients are still counted, and backward still runs."""
    from torch.utils.checkpoint import checkpoint

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = nn.Linear(4, 8)
            self.head = nn.Linear(8, 2)

        def forward(self, x):
            return self.head(checkpoint(self.inner, x, use_reentrant=False))

    torch.manual_seed(0)
    model = Net()
    monitor = Monitor(model, print_period=1, console=_quiet())
    _train(model, monitor, 2)
    layers = {la.module: la for la in monitor.layers}
    assert (layers["inner"].saved_bytes, layers["inner"].weight_bytes) == (0, 160)
    assert layers["inner"].grad_bytes == 160
    assert layers["head"].saved_bytes == 2 * 8 * 4  # inner's output, saved by head


def test_monitor_timeline_exports_like_the_profiler():
    """The monitor's timeline (samples every iteration, module events when measured) is the
    shared Timeline: both speedscope exports validate against the schema."""
    import json
    from pathlib import Path

    import jsonschema

    schema = json.loads((Path(__file__).parents[1] / "data" / "speedscope_schema.json").read_text())
    model = Tiny()
    monitor = Monitor(model, print_period=2, console=_quiet())
    _train(model, monitor, 4)
    tl = monitor.timeline()
    assert sum(e.kind == "sample" for e in tl.events) == 4
    assert any(e.kind == "enter" and e.pass_ == "backward" for e in tl.events)
    for weight in ("bytes", "ms"):
        jsonschema.validate(tl.to_speedscope(weight), schema)
