"""The plan targets the benches share, by name: the examples and ``bench/_models.py``'s
zero-argument factories, as ``file.py:factory`` strings (probe processes load them by path).

Each bench takes the names it runs (``targets(...)``); a factory renamed is renamed here once.
"""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MODELS_FILE = Path(__file__).resolve().parent / "_models.py"

TARGETS = {
    "gpt": f"{ROOT}/examples/gpt.py:build",
    "cnn": f"{ROOT}/examples/cnn.py:build",
    "llama": f"{ROOT}/examples/llama.py:build",
    "resnet18": f"{MODELS_FILE}:resnet18_b8",
    "convnext_tiny": f"{MODELS_FILE}:convnext_tiny_b8",
    "vit_b_16": f"{MODELS_FILE}:vit_b_16",
    "resnet50": f"{MODELS_FILE}:resnet50",
    "gpt2": f"{MODELS_FILE}:gpt2",
    "bert": f"{MODELS_FILE}:bert_base_b4",
    "llama_small": f"{MODELS_FILE}:llama_small",
    "lm350m": f"{MODELS_FILE}:lm350m",
}


def targets(*names: str) -> dict[str, str]:
    """``TARGETS`` for ``names``, in that order."""
    return {name: TARGETS[name] for name in names}
