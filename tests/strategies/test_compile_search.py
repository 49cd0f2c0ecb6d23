"""strategies/_compile_search.py's helpers (the search: tests/planner/test_compiled_search.py)."""

from __future__ import annotations

import pytest

from memadvisor.errors import PlanningError
from strategies._compile_search import (
    REGIONAL_MAX_SIZES,
    REGIONAL_OUTSIDE_MAX,
    CompileSearch,
    first_line,
    input_sizes,
    outside_share,
    regional_pays,
    search_form,
)
from strategies._compiled_forward import CompileChoice


def _blocks(n: int, inputs_mib: list[float] | None = None) -> list[tuple[float, float, float]]:
    """``n`` blocks of one type keeping 1 MiB a sample each; block i's input
    ``inputs_mib[i]`` MiB a sample (else 0.1)."""
    return [(1.0, x, 0.1) for x in (inputs_mib or [0.1] * n)]


def test_a_failed_compile_is_recorded_with_the_cause_the_backend_raised() -> None:
    """Rule: dynamo's "backend=... raised:" line only introduces the cause; the record keeps
    the cause's line with it (session 17's card records said only "...raised:")."""
    error = PlanningError(
        "A probe process (batch 869) failed with BackendCompilerFailed: backend='inductor' "
        "raised:\n\nAssertionError: a guard on s0 failed\n\nTraceback (most recent call last):\n"
        '  File "x.py", line 1\n'
    )
    line = first_line(error)
    assert line.startswith("PlanningError: A probe process (batch 869) failed with")
    assert line.endswith("raised: AssertionError: a guard on s0 failed")


def test_an_error_whose_first_line_says_it_all_keeps_only_that_line() -> None:
    """Rule: one line per error; a first line not ending in ':' stands alone."""
    assert first_line(RuntimeError("it broke\nand more")) == "RuntimeError: it broke"
    assert first_line(RuntimeError("")) == "RuntimeError"


def test_the_search_compiles_the_whole_model_where_most_activations_lie_outside_the_blocks(
    profile_factory,
) -> None:
    """Rule: the regional form (each repeated block compiled, the rest eager) is searched only
    where the blocks hold more than 1 - REGIONAL_OUTSIDE_MAX of the activations; a small LM
    whose head and loss keep more (hf_gpt2: 0.33) is searched with the whole model compiled,
    which fuses the part the regional form leaves eager. Both keep the dynamic batch."""
    settings = CompileSearch()
    plain = CompileChoice(mode="default")
    blocky = profile_factory(_blocks(4), loss_per_sample=0.4)  # 0.09 outside: many layers
    heavy = profile_factory(_blocks(4), loss_per_sample=2.0)  # 0.33 outside: a small LM
    assert outside_share(blocky) < REGIONAL_OUTSIDE_MAX <= outside_share(heavy)
    assert outside_share(heavy) == pytest.approx(2.0 / 6.0)
    assert search_form(plain, blocky, settings) == CompileChoice(
        mode="default", regional=True, dynamic_batch=True
    )
    assert search_form(plain, heavy, settings) == CompileChoice(mode="default", dynamic_batch=True)
    assert regional_pays(blocky) and not regional_pays(heavy)
    # Blocks of one type, one only: nothing repeats, nothing to compile once for all.
    assert not regional_pays(profile_factory(_blocks(1), loss_per_sample=0.1))


def test_blocks_of_one_type_at_many_input_sizes_are_searched_with_the_whole_model_compiled(
    profile_factory,
) -> None:
    """Rule: the regional form compiles a block type's code once for all its blocks only
    where they share their input's shape; a vision hierarchy's blocks take one size a stage
    (resnet50's Bottlenecks 4, swin_t's 4: their regional form ran 1.02x and 0.95x eager on
    an H100 where the whole model ran 1.9x and 1.8x), so more than REGIONAL_MAX_SIZES sizes
    search the whole model; an encoder's and a decoder's blocks of one class (t5_base: 2)
    stay regional."""
    settings = CompileSearch()
    plain = CompileChoice(mode="default")
    sizes = [3.0, 3.0, 1.5, 1.5, 0.75, 0.75, 0.375, 0.375]  # MiB a sample, a stage each
    stages = profile_factory(_blocks(8, sizes), loss_per_sample=0.2)
    encoder_decoder = profile_factory(_blocks(4, [0.375, 0.375, 1.5, 1.5]), loss_per_sample=0.2)
    assert input_sizes(stages) == {"Block": 4} and input_sizes(encoder_decoder) == {"Block": 2}
    assert REGIONAL_MAX_SIZES < 4 and outside_share(stages) < REGIONAL_OUTSIDE_MAX
    assert not regional_pays(stages) and regional_pays(encoder_decoder)
    assert search_form(plain, stages, settings) == CompileChoice(mode="default", dynamic_batch=True)
    assert search_form(plain, encoder_decoder, settings).regional
