"""Host <-> device bandwidth is measured on CUDA only, in bytes per millisecond."""

from __future__ import annotations

import pytest

from memadvisor.device.bandwidth import measure_host_bandwidth
from memadvisor.errors import BadInputError


def test_a_cpu_device_is_bad_input() -> None:
    with pytest.raises(BadInputError, match="CUDA"):
        measure_host_bandwidth("cpu")


@pytest.mark.gpu
def test_cuda_bandwidth_is_between_1_and_1000_gb_per_s() -> None:
    bandwidth = measure_host_bandwidth("cuda")
    assert 1e6 < bandwidth < 1e9
