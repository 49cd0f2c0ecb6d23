"""The non-example models the benches train, built from configs (no downloads).

One builder per model, with the sample batch as a parameter: ``bench/estimate_accuracy.py``
and ``bench/compile_vs_eager.py`` profile from batches of 2, ``bench/planner.py`` from larger
ones. The zero-argument functions at the end are ``file.py:factory`` targets: probe
processes load this file by path and call them, so it imports nothing of the benches'.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F


def classification_loss(logits: torch.Tensor, batch: Any) -> torch.Tensor:
    return F.cross_entropy(logits, batch[1])


def vision(name: str, batch_size: int = 2) -> dict:
    """A torchvision classifier (1000 classes) on 224x224 images."""
    import torchvision

    torch.manual_seed(0)
    model = getattr(torchvision.models, name)(weights=None, num_classes=1000)
    images = torch.randn(batch_size, 3, 224, 224)
    labels = torch.randint(0, 1000, (batch_size,))
    return {"model": model, "sample_batch": (images, labels), "loss_fn": classification_loss}


def bert_base(batch_size: int = 2, seq: int = 512) -> dict:
    """BertForMaskedLM with bert-base's config (12 layers of 768, vocab 30522)."""
    from transformers import BertConfig, BertForMaskedLM

    torch.manual_seed(0)
    model = BertForMaskedLM(BertConfig())
    ids = torch.randint(0, 30522, (batch_size, seq))
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}
    return {"model": model, "sample_batch": batch}


def hf_llama(
    batch_size: int = 2,
    seq: int = 1024,
    *,
    max_positions: int = 2048,
    use_cache: bool = False,
    attention_mask: bool = False,
) -> dict:
    """LlamaForCausalLM, ~200M parameters: 8 layers of 1024 (GQA, 8 KV heads), vocab 32000."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=32000,
        hidden_size=1024,
        intermediate_size=2816,
        num_hidden_layers=8,
        num_attention_heads=16,
        num_key_value_heads=8,
        max_position_embeddings=max_positions,
        use_cache=use_cache,
    )
    model = LlamaForCausalLM(config)
    ids = torch.randint(0, 32000, (batch_size, seq))
    batch = {"input_ids": ids, "labels": ids.clone()}
    if attention_mask:
        batch["attention_mask"] = torch.ones_like(ids)
    return {"model": model, "sample_batch": batch}


def _example(name: str) -> Any:
    """``examples/<name>.py`` as a module, loaded by path (this file is loaded by path too)."""
    module_name = f"memadvisor_bench_example_{name}"
    if module_name in sys.modules:
        return sys.modules[module_name]
    path = Path(__file__).resolve().parents[1] / "examples" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(module_name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load {path}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module  # its loss_fn pickles by this name
    spec.loader.exec_module(module)
    return module


def t5_sized(
    batch_size: int = 2, source_len: int = 512, target_len: int = 128, **overrides: Any
) -> dict:
    """T5ForConditionalGeneration with t5-base's config (12 + 12 layers of 768, 12 heads, a
    3072-wide ReLU FFN, vocab 32128; 223M parameters), random weights: 512 input tokens, 128
    label tokens (the model shifts the labels into its decoder's inputs, starting from
    ``decoder_start_token_id`` 0 as t5-base's config.json says: transformers 5.x no longer
    defaults it). The config's other fields stay transformers' defaults (dropout 0.1,
    ``use_cache``), as a user's script has them; ``overrides`` change config fields."""
    from transformers import T5Config, T5ForConditionalGeneration

    torch.manual_seed(0)
    fields = dict(
        d_model=768, d_ff=3072, d_kv=64, num_layers=12, num_heads=12, vocab_size=32128,
        decoder_start_token_id=0,
    )  # fmt: skip
    config = T5Config(**{**fields, **overrides})
    model = T5ForConditionalGeneration(config)
    ids = torch.randint(0, config.vocab_size, (batch_size, source_len))
    labels = torch.randint(0, config.vocab_size, (batch_size, target_len))
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": labels}
    return {"model": model, "sample_batch": batch}


def gpt2_124m(batch_size: int = 4, **overrides: int) -> dict:
    """examples/gpt.py at GPT-2 small's size: 12 layers of 768, 12 heads, 1024 tokens, 124M;
    ``overrides`` change its config (a smoke builds it small)."""
    size = dict(block_size=1024, n_layer=12, n_head=12, n_embd=768)
    return _example("gpt").build(batch_size=batch_size, **{**size, **overrides})


# -- file.py:factory targets ------------------------------------------------------------------


def gpt2() -> dict:
    return gpt2_124m()


def resnet18() -> dict:
    return vision("resnet18")


def t5_base() -> dict:
    """The encoder-decoder LM of issue 27: t5-base's config, 512 input and 128 label tokens."""
    return t5_sized()


def swin_t() -> dict:
    """A hierarchical vision transformer (Swin-T, 28M parameters) on 224x224 images: the one
    issue 27 measured first."""
    return vision("swin_t", batch_size=8)


def convnext_tiny() -> dict:
    return vision("convnext_tiny")


def vit_b_16() -> dict:
    return vision("vit_b_16")


def resnet50() -> dict:
    """A ResNet-50-class CNN: the deep CNN of issue 15's user-path measurements."""
    return vision("resnet50", batch_size=8)


# bench/planner.py's sample batches (its profile's batch sizes follow from them).


def resnet18_b8() -> dict:
    return vision("resnet18", batch_size=8)


def convnext_tiny_b8() -> dict:
    return vision("convnext_tiny", batch_size=8)


def bert_base_b4() -> dict:
    return bert_base(batch_size=4)


def llama_small() -> dict:
    return hf_llama(max_positions=1024, use_cache=True, attention_mask=True)


def lm350m(batch_size: int = 2, seq: int = 1024) -> dict:
    """examples/llama.py's "350m" preset: a 0.35B decoder (349M parameters; 24 layers of
    1024, 16 query heads over 8 key/value heads, SwiGLU 2816, vocab 32000) at 1024 tokens,
    its loss a TokenCrossEntropy. The decoder of issue 28's card rows (bench/loss_head.py), and
    issue 27's decoder LM that 8 GiB forces to checkpoint."""
    return _example("llama").build(batch_size=batch_size, seq_len=seq, preset="350m")


def llama_1b(batch_size: int = 1, seq: int = 2048) -> dict:
    """examples/llama.py at TinyLlama-1.1B's shape: 22 layers of 2048, 32 query heads over 4
    key/value heads, a 5632-wide SwiGLU, vocab 32000; 1.10B parameters, 2048 tokens."""
    return _example("llama").build(batch_size=batch_size, seq_len=seq, preset="1b", max_seq_len=seq)
