"""strategies/_compile_search.py's helpers (the search: tests/planner/test_compiled_search.py)."""

from __future__ import annotations

import pytest

from memadvisor.errors import PlanningError
from memadvisor.schema.profile import (
    BlockActivity,
    BlockInfo,
    DeviceInfo,
    LinearBytes,
    Profile,
    StepProfile,
)
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

MIB = 2**20


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


def _profile(
    outside_mib: float, blocks: int = 4, block_mib: float = 1.0, inputs_kib: list[int] | None = None
) -> Profile:
    """``blocks`` blocks of one type keeping ``block_mib`` MiB a sample each, and
    ``outside_mib`` a sample kept outside them (the head, the loss); block i's input is
    ``inputs_kib[i]`` KiB a sample (else 100 KiB each)."""
    inputs_kib = inputs_kib or [100] * blocks
    step = StepProfile(
        precision="fp32",
        blocks=[
            BlockActivity(
                name=f"h.{i}",
                activation=LinearBytes(per_sample_bytes=int(block_mib * MIB)),
                input=LinearBytes(per_sample_bytes=inputs_kib[i] * 1024),
            )
            for i in range(blocks)
        ],
        activation_total=LinearBytes(
            per_sample_bytes=int((blocks * block_mib + outside_mib) * MIB)
        ),
    )
    return Profile(
        model_name="LM",
        device=DeviceInfo(kind="cpu", name="cpu"),
        batch_sizes=(2, 4),
        param_bytes=MIB,
        grad_bytes=MIB,
        optimizer_state_bytes=2 * MIB,
        blocks=[BlockInfo(name=f"h.{i}", type_name="Block") for i in range(blocks)],
        steps={"fp32": step},
    )


def test_the_search_compiles_the_whole_model_where_most_activations_lie_outside_the_blocks() -> (
    None
):
    """Rule: the regional form (each repeated block compiled, the rest eager) is searched only
    where the blocks hold more than 1 - REGIONAL_OUTSIDE_MAX of the activations; a small LM
    whose head and loss keep more (hf_gpt2: 0.33) is searched with the whole model compiled,
    which fuses the part the regional form leaves eager. Both keep the dynamic batch."""
    settings = CompileSearch()
    plain = CompileChoice(mode="default")
    blocky = _profile(outside_mib=0.4)  # 0.09 outside: a transformer of many layers
    heavy = _profile(outside_mib=2.0)  # 0.33 outside
    assert outside_share(blocky) < REGIONAL_OUTSIDE_MAX <= outside_share(heavy)
    assert outside_share(heavy) == pytest.approx(2.0 / 6.0)
    assert search_form(plain, blocky, settings) == CompileChoice(
        mode="default", regional=True, dynamic_batch=True
    )
    assert search_form(plain, heavy, settings) == CompileChoice(mode="default", dynamic_batch=True)
    assert regional_pays(blocky) and not regional_pays(heavy)
    # Blocks of one type, one only: nothing repeats, nothing to compile once for all.
    assert not regional_pays(_profile(outside_mib=0.1, blocks=1))


def test_blocks_of_one_type_at_many_input_sizes_are_searched_with_the_whole_model_compiled() -> (
    None
):
    """Rule: the regional form compiles a block type's code once for all its blocks only
    where they share their input's shape; a vision hierarchy's blocks take one size a stage
    (resnet50's Bottlenecks 4, swin_t's 4: their regional form ran 1.02x and 0.95x eager on
    an H100 where the whole model ran 1.9x and 1.8x), so more than REGIONAL_MAX_SIZES sizes
    search the whole model; an encoder's and a decoder's blocks of one class (t5_base: 2)
    stay regional."""
    settings = CompileSearch()
    plain = CompileChoice(mode="default")
    stages = _profile(0.2, blocks=8, inputs_kib=[3136, 3136, 1568, 1568, 784, 784, 392, 392])
    encoder_decoder = _profile(0.2, blocks=4, inputs_kib=[384, 384, 1536, 1536])
    assert input_sizes(stages) == {"Block": 4} and input_sizes(encoder_decoder) == {"Block": 2}
    assert REGIONAL_MAX_SIZES < 4 and outside_share(stages) < REGIONAL_OUTSIDE_MAX
    assert not regional_pays(stages) and regional_pays(encoder_decoder)
    assert search_form(plain, stages, settings) == CompileChoice(mode="default", dynamic_batch=True)
    assert search_form(plain, encoder_decoder, settings).regional
