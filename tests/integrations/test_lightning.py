"""memadvisor.integrations.lightning.MemadvisorCallback: plans at fit start and applies the
pick; where you set Lightning's own setting, it says whose wins."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from memadvisor.integrations._pick import apply_blocks
from memadvisor.schema.plan import Plan
from strategies.checkpointing import CheckpointedForward

pl = pytest.importorskip("lightning.pytorch")

WIDTH = 32
# Small enough that each plan takes a few seconds on a 2-core CPU.
FAST = dict(progress=False, measure_comparison=False, max_batch=32, verify_steps=2)


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.relu(self.fc(x))


class Net(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([Block() for _ in range(4)])
        self.head = nn.Linear(WIDTH, 4)

    def training_step(self, batch, batch_idx):  # noqa: ANN001, ANN201
        x, y = batch
        for block in self.blocks:
            x = block(x)
        loss = nn.functional.cross_entropy(self.head(x), y)
        self.log("loss", loss)  # a no-op while planning
        return loss

    def configure_optimizers(self):  # noqa: ANN201
        return torch.optim.SGD(self.parameters(), lr=0.1)


class Data(pl.LightningDataModule):
    def __init__(self, batch_size: int = 2, samples: int = 256) -> None:
        super().__init__()
        self.batch_size = batch_size
        self.samples = samples

    def train_dataloader(self) -> DataLoader:
        g = torch.Generator().manual_seed(0)
        n = self.samples
        ds = TensorDataset(torch.randn(n, WIDTH, generator=g), torch.randint(0, 4, (n,)))
        return DataLoader(ds, batch_size=self.batch_size)


def _fit(callback, data=None, **trainer_kwargs):
    from lightning.pytorch.plugins.precision import MixedPrecision

    data, model = data or Data(), Net()
    trainer = pl.Trainer(
        max_steps=2, accelerator="cpu", logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, callbacks=[callback],
        **trainer_kwargs,
    )  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Lightning's own advice on workers and logging
        trainer.fit(model, datamodule=data)
    mixed = isinstance(trainer.precision_plugin, MixedPrecision)
    return trainer, data, model, mixed


def _decisions(callback) -> dict[str, tuple]:
    return {setting: (value, whose) for setting, value, whose in callback.decisions}


def test_the_pick_is_applied_at_fit_start_batch_precision_accumulation() -> None:
    from memadvisor.integrations.lightning import MemadvisorCallback

    callback = MemadvisorCallback(budget_gb=0.002, **FAST)
    trainer, data, _model, mixed = _fit(callback)
    plan = callback.plan
    assert isinstance(plan, Plan) and trainer.global_step == 2
    assert data.batch_size == plan.candidate.batch_size != 2
    assert trainer.accumulate_grad_batches == plan.candidate.accumulation_steps
    planned = plan.candidate.choice("precision", "fp32")
    assert mixed == (planned in ("bf16", "fp16"))
    decided = _decisions(callback)
    assert decided["batch_size"] == (plan.candidate.batch_size, "plan")
    assert decided["precision"][1] == "plan"
    # The plan ran the module's own training_step with the Trainer's optimizer.
    assert plan.profile.call_form.batch == "custom"


def test_the_batch_is_capped_at_the_datasets_length_and_no_bars_are_drawn(
    caplog: pytest.LogCaptureFixture, capfd: pytest.CaptureFixture
) -> None:
    """A 24-sample dataset and a budget that holds far more: the plan's largest batch is the
    dataset's length (as Lightning's BatchSizeFinder caps it), and planning draws nothing on
    the terminal by default; its stage lines and notes go to the memadvisor logger."""
    import logging

    from memadvisor.integrations.lightning import MemadvisorCallback

    fast = {k: v for k, v in FAST.items() if k not in ("progress", "max_batch")}
    callback = MemadvisorCallback(budget_gb=0.05, **fast)
    with caplog.at_level(logging.INFO, logger="memadvisor"):
        _fit(callback, data=Data(samples=24))
    assert callback.plan.config.max_batch == 24
    assert 1 <= callback.plan.candidate.batch_size <= 24
    assert "verify" not in capfd.readouterr().err  # no rich stage bar on the terminal
    logged = [r.getMessage() for r in caplog.records if r.name.startswith("memadvisor")]
    assert any(m.startswith("verify took") for m in logged)
    assert any(m.startswith("plan for Net") for m in logged)


def test_your_explicit_precision_wins_and_the_plan_is_made_with_it() -> None:
    from memadvisor.integrations.lightning import MemadvisorCallback

    callback = MemadvisorCallback(budget_gb=0.002, **FAST)
    trainer, _data, _model, mixed = _fit(callback, precision="bf16-mixed")
    assert mixed and trainer.precision_plugin.precision == "bf16-mixed"
    value, whose = _decisions(callback)["precision"]
    assert value == "bf16-mixed" and whose.startswith("yours wins")
    assert "precision" not in callback.plan.candidate.choices  # not searched: yours runs


def test_a_tf32_pick_switches_tf32_on_process_wide_and_says_so(monkeypatch) -> None:
    """Lightning has no TF32 flag: a plan that picked it (faked here: the CPU has none) is
    switched on process-wide by the callback, which logs how to switch it off."""
    import dataclasses

    from memadvisor.integrations import _pick
    from memadvisor.integrations.lightning import MemadvisorCallback

    real = _pick.pick_of
    monkeypatch.setattr(_pick, "pick_of", lambda plan: dataclasses.replace(real(plan), tf32=True))
    before = torch.get_float32_matmul_precision()
    try:
        torch.set_float32_matmul_precision("highest")
        callback = MemadvisorCallback(budget_gb=0.002, **FAST)
        _fit(callback)
        assert torch.get_float32_matmul_precision() == "high"
        value, whose = _decisions(callback)["float32 matmul precision"]
        assert "process-wide" in value and '"highest"' in value and whose == "plan"
    finally:
        torch.set_float32_matmul_precision(before)


def test_your_explicit_accumulation_wins() -> None:
    from memadvisor.integrations.lightning import MemadvisorCallback

    callback = MemadvisorCallback(budget_gb=0.002, **FAST)
    trainer, _data, _model, _mixed = _fit(callback, accumulate_grad_batches=3)
    assert trainer.accumulate_grad_batches == 3
    value, whose = _decisions(callback)["accumulate_grad_batches"]
    assert value == 3 and whose.startswith("yours wins")


def test_the_plans_blocks_are_checkpointed_on_the_module(gpt_plan: Plan, four_blocks) -> None:
    apply_blocks(four_blocks, gpt_plan)
    wrapped = [
        n for n, m in four_blocks.named_modules()
        if isinstance(m.__dict__.get("forward"), CheckpointedForward)
    ]  # fmt: skip
    assert wrapped == ["transformer.h.0", "transformer.h.1", "transformer.h.2"]
    # Only the blocks: the plan's bf16 autocast is Lightning's precision plugin's to apply.
    assert "forward" not in four_blocks.__dict__


def test_the_module_imports_without_lightning_and_names_the_extra(without) -> None:
    result = without(
        "lightning",
        "import memadvisor.integrations.lightning as integration\n"
        "from memadvisor.errors import BadInputError\n"
        "try:\n"
        "    integration.MemadvisorCallback\n"
        "except BadInputError as e:\n"
        "    print('refused:', e)\n",
    )
    assert result.returncode == 0, result.stderr
    assert "refused:" in result.stdout and "pip install 'memadvisor[lightning]'" in result.stdout


def test_a_compiled_pick_is_installed_on_the_module_in_the_form_it_was_measured(
    gpt_plan: Plan, four_blocks
) -> None:
    """Rule: Lightning has no compile switch; with ``compiled`` the plan's compile (each
    repeated block here) is installed in place beside its checkpointed blocks, and without
    it nothing is compiled (the blocks alone, as before)."""
    from strategies._compiled_forward import CompiledForward

    cand = gpt_plan.candidate.model_copy(
        update={"choices": {**gpt_plan.candidate.choices,
                            "compile": {"mode": "default", "regional": True}}}
    )  # fmt: skip
    plan = gpt_plan.model_copy(update={"candidate": cand})

    def compiled(model) -> list[str]:
        return [
            n for n, m in model.named_modules()
            if isinstance(m.__dict__.get("forward"), CompiledForward)
        ]  # fmt: skip

    apply_blocks(four_blocks, plan)
    assert compiled(four_blocks) == []
    apply_blocks(four_blocks, plan, compiled=True)
    assert compiled(four_blocks) == [f"transformer.h.{i}" for i in range(4)]
