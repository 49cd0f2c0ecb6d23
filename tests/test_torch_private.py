"""The inductor backend's patches: what ``torch._functorch.config`` reads inside a graph's
compile, and only there."""

from __future__ import annotations

from typing import Any

import pytest
import torch._functorch.config as functorch_config

from memadvisor import _torch_private

HAS_SETTING = hasattr(functorch_config, "graphsafe_rng_functionalization")
needs_setting = pytest.mark.skipif(
    not HAS_SETTING,
    reason=f"torch {__import__('torch').__version__} has no graphsafe_rng_functionalization",
)


@needs_setting
@pytest.mark.parametrize("mode", ["default", "max-autotune-no-cudagraphs"])
def test_switched_on_a_mode_without_cuda_graphs_compiles_random_state_the_cache_takes(
    mode: str, monkeypatch
) -> None:
    """Rule: with MEMADVISOR_CACHED_RNG=1, a mode that replays no CUDA graphs turns the
    graph-safe random state off."""
    monkeypatch.setenv(_torch_private.CACHED_RNG_ENV, "1")
    assert _torch_private.backend_patches(mode) == {"graphsafe_rng_functionalization": False}


@needs_setting
@pytest.mark.parametrize("mode", sorted(_torch_private.GRAPH_MODES))
def test_a_mode_with_cuda_graphs_keeps_torchs_random_state(mode: str, monkeypatch) -> None:
    """Rule: CUDA graphs need the graph-safe random state, switched on or not; only the
    budget is patched."""
    monkeypatch.setenv(_torch_private.CACHED_RNG_ENV, "1")
    assert _torch_private.backend_patches(mode) == {}
    assert _torch_private.backend_patches(mode, 0.5) == {"activation_memory_budget": 0.5}


@needs_setting
@pytest.mark.parametrize("value", [None, "0"])
def test_unless_switched_on_torchs_default_stays(value: str | None, monkeypatch) -> None:
    """Rule: without MEMADVISOR_CACHED_RNG=1 nothing but the budget is patched."""
    if value is None:
        monkeypatch.delenv(_torch_private.CACHED_RNG_ENV, raising=False)
    else:
        monkeypatch.setenv(_torch_private.CACHED_RNG_ENV, value)
    assert _torch_private.backend_patches("default") == {}
    assert _torch_private.backend_patches("default", 0.3) == {"activation_memory_budget": 0.3}


class _Recorder:
    """Stands in for torch's inductor wrapper: records the settings a compile would read."""

    seen: list[dict[str, Any]] = []

    def __init__(self, mode: str, options: Any, dynamic: Any) -> None:
        self.mode = mode
        self.compiler_name = "inductor"

    def __call__(self, gm: Any, example_inputs: Any) -> str:
        _Recorder.seen.append(
            {
                "graphsafe": getattr(functorch_config, "graphsafe_rng_functionalization", None),
                "budget": functorch_config.activation_memory_budget,
            }
        )
        return "compiled"


@needs_setting
def test_the_patches_hold_inside_a_compile_and_are_put_back_after(monkeypatch) -> None:
    """Rule: the settings are patched around each graph's compile, not for the process."""
    monkeypatch.setenv(_torch_private.CACHED_RNG_ENV, "1")
    monkeypatch.setattr(_torch_private, "_BACKENDS", {})
    monkeypatch.setattr("torch._TorchCompileInductorWrapper", _Recorder)
    _Recorder.seen = []
    before = (
        functorch_config.graphsafe_rng_functionalization,
        functorch_config.activation_memory_budget,
    )
    default = _torch_private.inductor_backend("default", 0.4)
    graphs = _torch_private.inductor_backend("reduce-overhead")
    assert default("gm", []) == "compiled" and graphs("gm", []) == "compiled"
    assert _Recorder.seen == [
        {"graphsafe": False, "budget": 0.4},
        {"graphsafe": before[0], "budget": before[1]},
    ]
    after = (
        functorch_config.graphsafe_rng_functionalization,
        functorch_config.activation_memory_budget,
    )
    assert after == before
    # dynamo asks the backend for inductor's attributes through the wrapper
    assert default.compiler_name == "inductor"
    # one object per (mode, budget): dynamo tells backends apart by identity
    assert _torch_private.inductor_backend("default", 0.4) is default
