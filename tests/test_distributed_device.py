"""Which CUDA device a rank takes through ``dynapipe.runtime.init_distributed`` (and the shared
helpers the Megatron path uses): its local rank's, never its global rank's. No GPU is needed:
the device count is faked."""
import pytest

import dynapipe.runtime as runtime
from dynapipe.errors import DynaPipeError
from dynapipe.runtime import distributed


def _torchrun_env(monkeypatch, local_rank, local_world_size=None, visible=None):
    for name, value in (("LOCAL_RANK", local_rank), ("LOCAL_WORLD_SIZE", local_world_size),
                        ("CUDA_VISIBLE_DEVICES", visible)):
        if value is None:
            monkeypatch.delenv(name, raising=False)
        else:
            monkeypatch.setenv(name, str(value))


def test_local_rank_picks_the_device_not_the_global_rank(monkeypatch):
    monkeypatch.setattr(distributed, "cuda_device_count", lambda: 4)
    # Second node of 2 x 2 ranks on hosts with 4 GPUs: global rank 2 is local rank 0 there.
    _torchrun_env(monkeypatch, 0, 2)
    assert distributed.local_cuda_device(default_local_rank=2) == 0
    _torchrun_env(monkeypatch, 1, 2)
    assert distributed.local_cuda_device(default_local_rank=3) == 1
    # No launcher: the default (init_distributed's rank, as before) modulo the devices.
    _torchrun_env(monkeypatch, None)
    assert distributed.local_cuda_device(default_local_rank=5) == 1
    assert distributed.local_cuda_device() == 0
    # A rank the caller knows to be local (the runtime's own spawned ranks) wins over the environment.
    _torchrun_env(monkeypatch, 0, 8)
    assert distributed.local_cuda_device(local_rank=3) == 3


def test_each_rank_shown_one_gpu_takes_device_0(monkeypatch):
    monkeypatch.setattr(distributed, "cuda_device_count", lambda: 1)
    _torchrun_env(monkeypatch, 3, 8, visible="3")
    assert distributed.local_cuda_device(default_local_rank=11) == 0


def test_more_local_ranks_than_gpus_is_refused(monkeypatch):
    monkeypatch.setattr(distributed, "cuda_device_count", lambda: 2)
    _torchrun_env(monkeypatch, 2, 4)
    with pytest.raises(DynaPipeError, match="torchrun started 4 processes on this node but it has 2 visible"):
        distributed.local_cuda_device()


def test_no_cuda_chooses_nothing(monkeypatch):
    monkeypatch.setattr(distributed, "cuda_device_count", lambda: 0)
    _torchrun_env(monkeypatch, 1, 2)
    assert distributed.local_cuda_device() is None
    distributed.select_local_gpu()  # no CUDA call


class _DeviceSet(Exception):
    pass


def test_init_distributed_sets_the_local_ranks_device(monkeypatch):
    """Global rank 3 launched by torchrun as local rank 1 of 2 on a host with 4 visible GPUs
    takes GPU 1 (it took GPU 3, ``rank % device_count``)."""
    import torch

    chosen = []

    def set_device(index):
        chosen.append(index)
        raise _DeviceSet  # stop before any store or NCCL call

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    monkeypatch.setattr(torch.cuda, "set_device", set_device)
    _torchrun_env(monkeypatch, 1, 2)
    with pytest.raises(_DeviceSet):
        runtime.init_distributed(3, 4, store_port=1, backend="nccl", timeout_s=1.0)
    assert chosen == [1]


def test_one_implementation_for_both_launch_paths():
    from megatron_integration import initialize, launch

    assert launch.free_port is distributed.free_port is runtime.free_port
    assert initialize.select_local_gpu is distributed.select_local_gpu
    assert initialize.local_gpu is distributed.local_gpu
    assert 0 < distributed.free_port() < 65536


def test_free_port_stays_out_of_the_ephemeral_range_and_skips_ports_in_use(monkeypatch):
    import socket

    high = distributed._ephemeral_low()
    ports = [distributed.free_port() for _ in range(5)]
    # Below the range outgoing connections draw from, so no gloo connection can take it first.
    assert all(max(1024, high - 12000) <= p < high for p in ports), (ports, high)
    assert len(set(ports)) == 5
    assert not set(ports) & set(distributed._TORCHRUN_DEFAULT_PORTS)
    taken = max(1024, high - 12000) + 10
    with socket.socket() as held:
        held.bind(("127.0.0.1", taken))
        held.listen()
        monkeypatch.setattr(distributed, "_next_port", taken)
        assert taken < distributed.free_port() < high
    # An ephemeral range that leaves no room below it: the kernel's choice, still a free port.
    monkeypatch.setattr(distributed, "_ephemeral_low", lambda: 1500)
    with socket.socket() as s:
        s.bind(("127.0.0.1", distributed.free_port()))
