"""Which GPU a rank takes (``megatron_integration.initialize.local_gpu``): pure logic, so it is
checked here without CUDA."""
import pytest

from dynapipe.errors import DynaPipeError
from megatron_integration.initialize import local_gpu


def test_each_local_rank_takes_its_own_gpu():
    assert [local_gpu(r, "8", 8) for r in range(8)] == list(range(8))
    # A scheduler that shows each task only its GPU (no torchrun): local ranks still count from 0.
    assert [local_gpu(r, None, 1) for r in range(4)] == [0, 0, 0, 0]
    # torchrun under a wrapper that shows each rank its own GPU (CUDA_VISIBLE_DEVICES=$LOCAL_RANK).
    assert [local_gpu(r, "8", 1, str(r)) for r in range(8)] == [0] * 8


def test_more_torchrun_processes_than_gpus_are_refused_in_one_line():
    with pytest.raises(DynaPipeError) as e:
        local_gpu(2, "4", 2)
    assert "4 processes" in str(e.value) and "2 visible GPU(s)" in str(e.value)
    assert "--nproc_per_node 2" in str(e.value) and "\n" not in str(e.value)
    # One GPU a node and no wrapper: every rank would land on it.
    for visible in (None, "0,1"):
        with pytest.raises(DynaPipeError, match="torchrun started 2 processes"):
            local_gpu(1, "2", 1, visible)
