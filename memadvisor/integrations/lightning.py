"""Lightning: ``MemadvisorCallback`` plans at fit start and applies the pick, as
``BatchSizeFinder`` tunes the batch at fit start.

    trainer = Trainer(callbacks=[MemadvisorCallback(budget_gb=8)])
    trainer.fit(model, datamodule=dm)      # dm.batch_size, precision, blocks set by the plan

At ``on_fit_start`` it takes one batch from the training DataLoader (the datamodule's or the
module's ``train_dataloader()``), plans the module's own ``training_step`` on it with the
Trainer's optimizer, and applies the pick:

* **batch size**: set where ``BatchSizeFinder`` sets it (``batch_arg_name`` on the module,
  the datamodule or their ``hparams``, by ``lightning_setattr``);
* **precision**: ``bf16-mixed`` / ``16-mixed`` autocast, by the Trainer's precision plugin;
* **accumulate_grad_batches**: the plan's accumulation steps (with ``effective_batch``);
* **checkpointed blocks**: checkpointed on the module in place;
* **torch.compile**: installed on the module in place in the form the plan measured (the
  whole module, or each repeated block), where the plan compiled: a compiled pick's batch
  may not fit the same module run eager. Lightning has no compile switch of its own.

Which wins where you set Lightning's own settings (logged at fit start):

* ``Trainer(precision=...)`` other than the default ``"32-true"``: **yours**. The plan is made
  with your precision's autocast around the step, so its batch fits the step you run; the
  plan's precision is not applied. (An explicit ``precision="32-true"`` cannot be told from
  the default and counts as not given.)
* ``Trainer(accumulate_grad_batches=k)`` with ``k > 1``: **yours**; the plan's micro-batch
  is set and your ``k`` kept.
* ``batch_size`` on the module or datamodule: **the plan's**, as with ``BatchSizeFinder``;
  that is what the callback is for. Pass ``apply_batch_size=False`` to keep yours.
* Checkpointing you applied yourself: both apply; the plan measured your model as it was.

Needs ``lightning`` (``pip install 'memadvisor[lightning]'``); this module imports without
it, and ``MemadvisorCallback`` is built on first use.

Known limitations:
    * Single-device strategies only (as ``BatchSizeFinder``); a distributed run plans per rank
      elsewhere.
    * Dataloaders passed straight to ``trainer.fit(train_dataloaders=...)`` cannot be re-made
      with a new batch size: the plan is made and logged, the batch size left as it is.
    * ``self.log`` in ``training_step`` does nothing while planning (the planner's copies of
      the module have no Trainer), and ``self.trainer`` is not there to read.
"""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING, Any

from torch import nn

from memadvisor.integrations import require

if TYPE_CHECKING:
    from memadvisor.schema.plan import Plan

__all__ = ["MemadvisorCallback", "TrainingStep"]  # noqa: F822 (built by __getattr__)

_EXTRA = "lightning"
_AUTOCAST = {"bf16-mixed": "bf16", "16-mixed": "fp16"}  # Lightning's names -> memadvisor's
_LIGHTNING = {"bf16": "bf16-mixed", "fp16": "16-mixed"}


class TrainingStep:
    """``forward_fn`` that runs the module's ``training_step(batch, 0)``, under the Trainer's
    own autocast when you chose one. A module-level class so a probe process can load it."""

    def __init__(self, autocast: str | None = None, device_type: str = "cpu") -> None:
        self.autocast = autocast
        self.device_type = device_type

    def __call__(self, module: nn.Module, batch: Any) -> Any:
        import torch

        if self.autocast is None:
            return module.training_step(batch, 0)
        dtype = torch.bfloat16 if self.autocast == "bf16" else torch.float16
        with torch.autocast(self.device_type, dtype=dtype):
            return module.training_step(batch, 0)


def _callback_class() -> type:
    pl = require("lightning.pytorch", _EXTRA)
    from lightning.pytorch.plugins.precision import MixedPrecision, Precision
    from lightning.pytorch.utilities.model_helpers import is_overridden
    from lightning.pytorch.utilities.parsing import lightning_hasattr, lightning_setattr
    from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn

    class MemadvisorCallback(pl.Callback):
        """Plan the LightningModule's training step at fit start and apply the pick.

        Args:
            budget_gb: the memory budget in GiB.
            batch_arg_name: where the batch size lives (as ``BatchSizeFinder``'s argument).
            apply_batch_size: set the planned batch size; False keeps yours (the plan is then
                for information, and may not fit your batch).
            effective_batch: the batch you train with, reached by accumulation (the
                ``effective_batch`` objective).
            **plan_kwargs: any other :func:`memadvisor.plan` argument. ``progress`` defaults
                to False here (the ``memadvisor`` logger carries the notes and stage lines),
                and ``max_batch`` to the training dataset's length, as ``BatchSizeFinder``
                caps it.

        Attributes:
            plan: the plan made at fit start (None before).
            decisions: (setting, value, whose) for each setting the callback decided.
        """

        def __init__(
            self,
            budget_gb: float,
            *,
            batch_arg_name: str = "batch_size",
            apply_batch_size: bool = True,
            effective_batch: int | None = None,
            **plan_kwargs: Any,
        ) -> None:
            super().__init__()
            self.budget_gb = budget_gb
            self.batch_arg_name = batch_arg_name
            self.apply_batch_size = apply_batch_size
            self.effective_batch = effective_batch
            self.plan_kwargs = plan_kwargs
            self.plan: Plan | None = None
            self.decisions: list[tuple[str, Any, str]] = []

        def setup(self, trainer: Any, pl_module: Any, stage: str | None = None) -> None:
            if stage == "fit" and trainer._accelerator_connector.is_distributed:
                rank_zero_warn(
                    "MemadvisorCallback plans a single device; with a distributed strategy it "
                    "does nothing. Remove it, or plan per rank."
                )

        def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
            if trainer._accelerator_connector.is_distributed:
                return
            from memadvisor import api
            from memadvisor.integrations._pick import apply_blocks, pick_of, plan_options

            yours = type(trainer.precision_plugin) is not Precision
            flag = trainer._accelerator_connector._precision_flag if yours else "32-true"
            autocast = _AUTOCAST.get(flag) if yours else None
            device_type = trainer.strategy.root_device.type
            batch, dataset = self._sample_batch(trainer, pl_module)
            optimizer = trainer.optimizers[0] if trainer.optimizers else None
            options = plan_options(self.plan_kwargs, dataset)
            if yours:
                # Your precision runs: plan that step, and nothing else for precision.
                options["strategies"] = _without_precision(options.get("strategies"))
            if self.effective_batch is not None:
                options["effective_batch"] = self.effective_batch
            with warnings.catch_warnings():
                # The planner's copies have no Trainer: self.log warns on every call.
                warnings.filterwarnings("ignore", message=r".*self\.log\(\).*")
                plan = api.plan(
                    pl_module,
                    batch,
                    budget_gb=self.budget_gb,
                    forward_fn=TrainingStep(autocast, device_type),
                    optimizer=optimizer,
                    **options,
                )
            self.plan = plan
            pick = pick_of(plan)
            self.decisions = []
            self._precision(trainer, pick.precision, yours, flag, device_type, MixedPrecision)
            if pick.tf32 and not yours:
                import torch

                # Process-wide, not the Trainer's: Lightning has no flag for it.
                torch.set_float32_matmul_precision("high")
                self._decide(
                    "float32 matmul precision",
                    'high (TF32, process-wide; torch.set_float32_matmul_precision("highest") '
                    "switches it off)",
                    "plan",
                )
            self._batch(trainer, pl_module, pick.batch_size, lightning_hasattr, lightning_setattr,
                        is_overridden)  # fmt: skip
            self._accumulation(trainer, pick.accumulation_steps)
            compiled = pick.compile_mode is not None
            # The compile too, in the form the plan measured (Lightning has no switch for it):
            # a compiled pick's batch trained eager could run out of memory.
            apply_blocks(pl_module, plan, compiled=compiled)
            if pick.checkpointed:
                self._decide("checkpointed blocks", ", ".join(pick.checkpointed), "plan")
            if compiled:
                form = f"{pick.compile_mode} mode, {pick.compile_form}"
                self._decide("torch.compile", form, "plan")
            for setting, value, whose in self.decisions:
                rank_zero_info(f"memadvisor: {setting} = {value} ({whose})")

        # -- each setting --------------------------------------------------------------------

        def _decide(self, setting: str, value: Any, whose: str) -> None:
            self.decisions.append((setting, value, whose))

        def _sample_batch(self, trainer: Any, pl_module: Any) -> Any:
            source = trainer.datamodule if trainer.datamodule is not None else pl_module
            loader = source.train_dataloader()
            return next(iter(loader)), getattr(loader, "dataset", None)

        def _precision(
            self, trainer: Any, precision: str, yours: bool, flag: str, device_type: str,
            mixed: type,
        ) -> None:  # fmt: skip
            if yours:
                why = (
                    "yours wins: the plan was made with it"
                    if flag in _AUTOCAST
                    else (
                        "yours wins; the plan ran without autocast, as memadvisor cannot model it"
                    )
                )
                self._decide("precision", flag, why)  # fmt: skip
            elif precision in _LIGHTNING:
                trainer.strategy.precision_plugin = mixed(_LIGHTNING[precision], device_type)
                self._decide("precision", _LIGHTNING[precision], "plan")
            else:
                self._decide("precision", "32-true", "plan")

        def _batch(
            self, trainer: Any, pl_module: Any, batch_size: int, has: Any, setattr_: Any,
            is_overridden: Any,
        ) -> None:  # fmt: skip
            name = self.batch_arg_name
            if not self.apply_batch_size:
                self._decide(name, f"yours kept (the plan's is {batch_size})", "yours")
                return
            from_module = trainer.datamodule is not None or is_overridden(
                "train_dataloader", pl_module
            )
            if not from_module or not has(pl_module, name):
                where = (
                    "the DataLoader was passed to fit()"
                    if not from_module
                    else f"no {name!r} on the module, the datamodule or their hparams"
                )
                rank_zero_warn(
                    f"memadvisor planned batch {batch_size} but cannot set it: {where}. Build "
                    f"your DataLoader with batch_size={batch_size}."
                )
                self._decide(name, f"not set ({where}); planned {batch_size}", "yours")
                return
            setattr_(pl_module, name, batch_size)
            self._decide(name, batch_size, "plan")

        def _accumulation(self, trainer: Any, steps: int) -> None:
            current = trainer.accumulate_grad_batches
            if current != 1:
                self._decide("accumulate_grad_batches", current,
                             f"yours wins; the plan's is {steps}")  # fmt: skip
                return
            trainer.accumulate_grad_batches = steps
            self._decide("accumulate_grad_batches", steps, "plan")

    MemadvisorCallback.__module__ = __name__
    return MemadvisorCallback


def _without_precision(names: list[str] | None) -> list[str]:
    """``names`` (default: every registered strategy) less those that set the step's
    precision (their ``states`` name autocast or TF32): the Trainer's own precision runs."""
    from memadvisor.strategy import load_strategies

    return [s.name for s in load_strategies(names) if not s.states & {"autocast", "tf32"}]


def __getattr__(name: str) -> Any:
    # The Callback subclass needs lightning: built on first use, so this module imports
    # without it, and using it without lightning says which extra to install.
    if name == "MemadvisorCallback":
        cls = _callback_class()
        globals()[name] = cls
        return cls
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
