"""memadvisor.integrations.hf: a Trainer to a plan, a plan to TrainingArguments fields, and
the example that fine-tunes a small GPT-2 with them."""

from __future__ import annotations

import dataclasses
import sys

import pytest

from memadvisor.errors import BadInputError
from memadvisor.integrations.hf import training_arguments
from memadvisor.schema.plan import Plan
from strategies.checkpointing import CheckpointedForward


def _checkpointed(model) -> list[str]:
    return [
        name
        for name, m in model.named_modules()
        if isinstance(m.__dict__.get("forward"), CheckpointedForward)
    ]


def test_training_arguments_carry_the_batch_precision_and_accumulation(
    gpt_plan: Plan, four_blocks
) -> None:
    fields = training_arguments(gpt_plan, model=four_blocks)
    assert fields["per_device_train_batch_size"] == 12
    assert fields["gradient_accumulation_steps"] == 2
    assert fields["bf16"] is True and fields["fp16"] is False
    assert fields["torch_compile"] is False


def test_a_tf32_pick_sets_the_trainers_tf32_and_fp32_leaves_it_to_the_user(
    gpt_plan: Plan, four_blocks
) -> None:
    """TrainingArguments' tf32 is the Trainer's process-wide switch: set when the plan picked
    TF32, absent otherwise (False would switch off a TF32 the user set)."""
    assert "tf32" not in training_arguments(gpt_plan, model=four_blocks)
    cand = gpt_plan.candidate.model_copy(
        update={"choices": {**gpt_plan.candidate.choices, "precision": "tf32"}}
    )
    fields = training_arguments(gpt_plan.model_copy(update={"candidate": cand}), four_blocks)
    assert fields["tf32"] is True and fields["bf16"] is False and fields["fp16"] is False


def test_some_blocks_are_checkpointed_on_the_model_and_the_trainer_switch_stays_off(
    gpt_plan: Plan, four_blocks
) -> None:
    fields = training_arguments(gpt_plan, model=four_blocks)
    assert fields["gradient_checkpointing"] is False
    assert _checkpointed(four_blocks) == ["transformer.h.0", "transformer.h.1", "transformer.h.2"]


def test_some_blocks_and_no_model_is_refused_rather_than_dropped(gpt_plan: Plan) -> None:
    with pytest.raises(BadInputError, match="pass model="):
        training_arguments(gpt_plan)


def test_every_block_checkpointed_is_the_trainers_own_switch(gpt_plan: Plan, four_blocks) -> None:
    every = [f"transformer.h.{i}" for i in range(4)]
    cand = gpt_plan.candidate.model_copy(
        update={"choices": {**gpt_plan.candidate.choices, "checkpointing": every}}
    )
    fields = training_arguments(gpt_plan.model_copy(update={"candidate": cand}), four_blocks)
    assert fields["gradient_checkpointing"] is True
    assert fields["gradient_checkpointing_kwargs"] == {"use_reentrant": False}
    assert _checkpointed(four_blocks) == []  # the Trainer does it


def test_the_fields_are_training_arguments_fields(gpt_plan: Plan, four_blocks, tmp_path) -> None:
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    args = transformers.TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to="none")
    fields = training_arguments(gpt_plan, model=four_blocks)
    fields["bf16"] = False  # a CPU-only test machine: the values matter less than the names
    tuned = dataclasses.replace(args, **fields)
    assert tuned.per_device_train_batch_size == 12 and tuned.gradient_accumulation_steps == 2


@pytest.mark.slow
def test_the_example_plans_a_trainer_and_fine_tunes_with_the_planned_arguments(
    tmp_path, examples
) -> None:
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    sys.path.insert(0, str(examples))
    try:
        import hf_gpt2
    finally:
        sys.path.remove(str(examples))
    s = hf_gpt2.Settings(n_layer=2, n_embd=32, n_head=2, vocab_size=512, seq_len=16,
                         samples=64, batch_size=2)  # fmt: skip
    tuned, plan = hf_gpt2.main(
        budget_gb=0.004, s=s, progress=False, measure_comparison=False, max_batch=16,
        verify_steps=2,
    )  # fmt: skip
    assert tuned.state.global_step == 5  # trained the example's five steps
    assert tuned.args.per_device_train_batch_size == plan.candidate.batch_size
    assert tuned.args.gradient_accumulation_steps == plan.candidate.accumulation_steps
    # The plan saw the Trainer's own step: a dict batch, the model's own loss.
    assert plan.profile.call_form.batch == "mapping"
    assert plan.profile.call_form.loss == "output.loss"
    assert all("loss_fn" not in a.snippet for a in plan.advice)
    # plan.to_html records the plan's own step on a copy of the model, as the CLI does.
    page = plan.to_html(tmp_path / "plan.html").read_text()
    assert "One step of the plan" in page and 'id="ops"' in page


def test_the_module_imports_without_transformers_and_names_the_extra(without) -> None:
    result = without(
        "transformers",
        "import memadvisor.integrations.hf as hf\n"
        "from memadvisor.errors import BadInputError\n"
        "try:\n"
        "    hf.plan_trainer(object(), budget_gb=1)\n"
        "except BadInputError as e:\n"
        "    print('refused:', e)\n",
    )
    assert result.returncode == 0, result.stderr
    assert "refused:" in result.stdout and "pip install 'memadvisor[hf]'" in result.stdout


def _compiled(plan: Plan, form) -> Plan:
    cand = plan.candidate.model_copy(
        update={"choices": {**plan.candidate.choices, "compile": form}}
    )
    return plan.model_copy(update={"candidate": cand})


def _compiled_modules(model) -> list[str]:
    from strategies._compiled_forward import CompiledForward

    return [
        name or "(top)"
        for name, m in model.named_modules()
        if isinstance(m.__dict__.get("forward"), CompiledForward)
    ]


def test_a_compile_of_each_block_is_installed_on_the_model_not_the_trainers_switch(
    gpt_plan: Plan, four_blocks
) -> None:
    """Rule: the plan compiled each repeated block (what it measured); the Trainer's
    torch_compile would compile the whole model, another step: the fields leave it False
    and the blocks are compiled on the model, around the plan's checkpointed blocks."""
    plan = _compiled(gpt_plan, {"mode": "default", "regional": True})
    fields = training_arguments(plan, model=four_blocks)
    assert fields["torch_compile"] is False and "torch_compile_mode" not in fields
    assert _compiled_modules(four_blocks) == [f"transformer.h.{i}" for i in range(4)]
    # The plan's three checkpointed blocks stay checkpointed, inside the compile (outer).
    from strategies._forward import wrappers

    kinds = {
        name: [type(w).__name__ for w in wrappers(m)]
        for name, m in four_blocks.named_modules()
        if name.startswith("transformer.h.")
    }
    assert kinds["transformer.h.0"] == ["CompiledForward", "CheckpointedForward"], kinds
    assert kinds["transformer.h.3"] == ["CompiledForward"], kinds


def test_a_compile_of_each_block_and_no_model_is_refused(gpt_plan: Plan) -> None:
    every = [f"transformer.h.{i}" for i in range(4)]
    plan = _compiled(gpt_plan, {"mode": "default", "regional": True})
    cand = plan.candidate.model_copy(
        update={"choices": {**plan.candidate.choices, "checkpointing": every}}
    )
    with pytest.raises(BadInputError, match="torch_compile cannot say"):
        training_arguments(plan.model_copy(update={"candidate": cand}))


def test_a_whole_model_compile_without_a_model_is_the_trainers_switch(gpt_plan: Plan) -> None:
    """Rule: without model=, a whole-model pick is the Trainer's torch_compile (its mode
    where not the default); every block checkpointed stays the Trainer's switch too."""
    every = [f"transformer.h.{i}" for i in range(4)]
    plan = _compiled(gpt_plan, "max-autotune")
    cand = plan.candidate.model_copy(
        update={"choices": {**plan.candidate.choices, "checkpointing": every}}
    )
    fields = training_arguments(plan.model_copy(update={"candidate": cand}))
    assert fields["torch_compile"] is True and fields["torch_compile_mode"] == "max-autotune"
    assert fields["gradient_checkpointing"] is True


def test_a_whole_model_compile_installed_in_place_keeps_what_the_trainer_passes(
    gpt_plan: Plan, four_blocks, tmp_path
) -> None:
    """Rule: the Trainer passes a batch's columns by the names ``model.forward``'s signature
    gives (its RemoveColumnsCollator drops the rest); with the plan's whole-model compile
    installed on the model, that signature is still the model's, so ``input_ids`` and
    ``labels`` reach it (on a card, session 18, they were dropped: "You have to specify
    either input_ids or inputs_embeds")."""
    import inspect

    pytest.importorskip("accelerate")
    import transformers
    from transformers import Trainer, TrainingArguments

    class LM(type(four_blocks)):  # the plan's block names, and a causal LM's forward
        def forward(self, input_ids, labels=None):
            return input_ids

    four_blocks = LM()
    own = inspect.signature(four_blocks.forward)
    assert list(own.parameters) == ["input_ids", "labels"]
    fields = training_arguments(_compiled(gpt_plan, "default"), model=four_blocks)
    assert fields["torch_compile"] is False and _compiled_modules(four_blocks) == ["(top)"]
    assert inspect.signature(four_blocks.forward) == own
    args = TrainingArguments(output_dir=str(tmp_path), report_to="none", use_cpu=True)
    trainer = Trainer(model=four_blocks, args=args)
    # The Trainer's own column filter (private): recognised by name, its absence named with
    # the transformers version met, as CI installs today's release.
    removing = getattr(trainer, "_get_collator_with_removed_columns", None)
    assert removing is not None, (
        f"transformers {transformers.__version__}: Trainer._get_collator_with_removed_columns "
        "is gone; find where this release drops the columns forward does not name"
    )
    collate = removing(lambda rows: rows[0], "training")
    row = {"input_ids": [1, 2], "labels": [1, 2], "unused": 0}
    assert set(collate([row])) == {"input_ids", "labels"}
