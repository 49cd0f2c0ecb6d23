"""The plan targets the benches share, by name: the examples and ``bench/_models.py``'s
zero-argument factories, as ``file.py:factory`` strings (probe processes load them by path).

Each bench takes the names it runs (``targets(...)``); a factory renamed is renamed here once.
A target whose package is not installed (torchvision, transformers: a CPU environment may
lack them, CI installs both) is skipped by the benches with :func:`missing`'s message.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MODELS_FILE = Path(__file__).resolve().parent / "_models.py"

TARGETS = {
    "gpt": f"{ROOT}/examples/gpt.py:build",
    "cnn": f"{ROOT}/examples/cnn.py:build",
    "llama": f"{ROOT}/examples/llama.py:build",
    "hf_gpt2": f"{ROOT}/examples/hf_gpt2.py:build",
    "resnet18": f"{MODELS_FILE}:resnet18_b8",
    "convnext_tiny": f"{MODELS_FILE}:convnext_tiny_b8",
    "vit_b_16": f"{MODELS_FILE}:vit_b_16",
    "swin_t": f"{MODELS_FILE}:swin_t",
    "resnet50": f"{MODELS_FILE}:resnet50",
    "gpt2": f"{MODELS_FILE}:gpt2",
    "lm350m": f"{MODELS_FILE}:lm350m",
    "t5_base": f"{MODELS_FILE}:t5_base",
    "bert": f"{MODELS_FILE}:bert_base_b4",
    "llama_small": f"{MODELS_FILE}:llama_small",
}

# The package each target needs beyond torch.
NEEDS = {
    "hf_gpt2": "transformers",
    "resnet18": "torchvision",
    "convnext_tiny": "torchvision",
    "vit_b_16": "torchvision",
    "swin_t": "torchvision",
    "resnet50": "torchvision",
    "t5_base": "transformers",
    "bert": "transformers",
    "llama_small": "transformers",
}

# Issue 27's models ("Done when"): a decoder LM of 0.35B at seq 1024 that 8 GiB forces to
# checkpoint, an encoder-decoder LM, a hierarchical vision transformer, a CNN, the examples.
ISSUE_27 = ("lm350m", "t5_base", "swin_t", "resnet50", "gpt", "cnn", "llama", "hf_gpt2")


def targets(*names: str) -> dict[str, str]:
    """``TARGETS`` for ``names``, in that order."""
    return {name: TARGETS[name] for name in names}


def missing(name: str) -> str | None:
    """Why ``name`` cannot be built here (its package is not installed), or None."""
    package = NEEDS.get(name)
    if package is None or importlib.util.find_spec(package) is not None:
        return None
    return (
        f"skipped {name}: it needs {package}, which is not installed here "
        f"(pip install {package}; CI installs it)"
    )
