"""Host data to a rank's device (dynapipe/runtime/buffers.py ``to_device``).

No GPU here: the CUDA branch is checked by what it asks of torch (a pinned source, a
non-blocking copy), the CPU branch by its result. scripts/gpu_check.py runs it on a GPU.
"""
import numpy as np
import torch

from dynapipe.runtime.buffers import to_device


def test_to_the_cpu_it_is_the_data_itself():
    data = np.arange(6, dtype=np.int64).reshape(2, 3)
    out = to_device(data, torch.device("cpu"))
    assert out.dtype == torch.int64 and out.tolist() == data.tolist()


def test_to_a_gpu_the_host_data_is_pinned_then_copied_without_waiting(monkeypatch):
    # A copy from pageable memory may hold the host behind the GPU's queued work.
    calls = []

    def pin(self):
        calls.append("pin")
        return self.clone()

    def to(self, device, non_blocking=False):
        calls.append(("to", str(device), non_blocking))
        return self

    monkeypatch.setattr(torch.Tensor, "pin_memory", pin)
    monkeypatch.setattr(torch.Tensor, "is_pinned", lambda self: False)
    monkeypatch.setattr(torch.Tensor, "to", to)
    to_device(np.ones(4, dtype=np.float32), torch.device("cuda", 1))
    assert calls == ["pin", ("to", "cuda:1", True)]
    calls.clear()
    monkeypatch.setattr(torch.Tensor, "is_pinned", lambda self: True)  # already pinned: not again
    to_device(torch.ones(4), torch.device("cuda", 0))
    assert calls == [("to", "cuda:0", True)]
