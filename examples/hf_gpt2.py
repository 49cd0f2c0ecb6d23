"""Fine-tune a small GPT-2 with the Hugging Face Trainer, with the arguments memadvisor plans.

No download: the GPT-2 config is built here and the weights start random; the data is
random token ids. Needs ``pip install 'memadvisor[hf]'``.

    python examples/hf_gpt2.py                       # plan, then train 5 steps
    python examples/hf_gpt2.py --budget-gb 8         # on a card: its budget
    memadvisor plan examples/hf_gpt2.py:build --budget-gb 0.05
"""

from __future__ import annotations

import dataclasses
import tempfile

import torch
from torch.utils.data import Dataset


@dataclasses.dataclass
class Settings:
    n_layer: int = 4
    n_embd: int = 128
    n_head: int = 4
    vocab_size: int = 8192  # small enough for a CPU; the LM head still outweighs a block
    seq_len: int = 64
    samples: int = 256
    batch_size: int = 4  # the Trainer's per_device_train_batch_size before planning


class RandomTokens(Dataset):
    """Token ids as a causal LM takes them: ``input_ids`` and ``labels`` (the same ids)."""

    def __init__(self, s: Settings, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(0, s.vocab_size, (s.samples, s.seq_len), generator=g)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def gpt2(s: Settings):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(
        n_layer=s.n_layer,
        n_embd=s.n_embd,
        n_head=s.n_head,
        vocab_size=s.vocab_size,
        n_positions=s.seq_len,
        attn_implementation="eager",  # the same on every machine
    )
    return GPT2LMHeadModel(config)


def trainer(s: Settings, output_dir: str, **args):
    from transformers import Trainer, TrainingArguments, default_data_collator

    defaults = dict(
        output_dir=output_dir,
        per_device_train_batch_size=s.batch_size,
        max_steps=5,
        learning_rate=3e-4,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        use_cpu=not torch.cuda.is_available(),
    )
    return Trainer(
        model=gpt2(s),
        args=TrainingArguments(**{**defaults, **args}),
        train_dataset=RandomTokens(s),
        data_collator=default_data_collator,
    )


def build(**overrides) -> dict:
    """For ``memadvisor plan examples/hf_gpt2.py:build``: the model and one collated batch."""
    s = Settings(**overrides)
    ds = RandomTokens(s)
    batch = {k: torch.stack([ds[i][k] for i in range(s.batch_size)]) for k in ("input_ids",
             "labels")}  # fmt: skip
    return {"model": gpt2(s), "sample_batch": batch}


def main(budget_gb: float | None = None, s: Settings | None = None, **plan_kwargs):
    """Plan the Trainer's step, then train with the planned arguments. Returns the Trainer.

    ``budget_gb`` None: 0.05 GiB on a CPU (a plan in seconds), 1 GiB on a card, where the
    CUDA context's workspaces alone take more than 0.05 (an H100 asked 0.11 at batch 1)."""
    from transformers import Trainer

    from memadvisor.integrations.hf import plan_trainer, training_arguments

    s = s or Settings()
    if budget_gb is None:
        budget_gb = 1.0 if torch.cuda.is_available() else 0.05
    with tempfile.TemporaryDirectory() as out:
        first = trainer(s, out)
        plan = plan_trainer(first, budget_gb=budget_gb, **plan_kwargs)
        plan.report()
        fields = training_arguments(plan, model=first.model)
        print("TrainingArguments from the plan:", fields)
        tuned = Trainer(
            model=first.model,
            args=dataclasses.replace(first.args, **fields),
            train_dataset=first.train_dataset,
            data_collator=first.data_collator,
        )
        tuned.train()
        return tuned, plan


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budget-gb", type=float, default=None, help="default: 0.05 CPU, 1 card")
    main(parser.parse_args().budget_gb)
