"""A storage-level live-memory count for devices without allocator statistics (CPUs): the
profiler's ``peak_mib`` on CPU comes from it."""
from __future__ import annotations

import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from dynapipe.runtime.activation_meter import ActivationMeter, storage_key


class LiveMemoryTracker(TorchDispatchMode):
    """Counts the bytes of tensor storages created under it while they are alive.

    A storage is counted when an op creates it (an op output that aliases none of the
    op's inputs) and released when the last tensor object viewing it is collected.
    ``peak`` is the highest count seen. Works on any device; used on CPU, where no
    allocator statistics exist.
    """

    def __init__(self):
        super().__init__()
        # The storage reference counts are the activation meter's (one counter, two feeds: it
        # counts what autograd saves, this what ops create).
        self._counts = ActivationMeter()

    @property
    def live(self) -> int:
        """Bytes of tracked storages alive now."""
        return self._counts.live_bytes

    @property
    def peak(self) -> int:
        """Most bytes alive at once since the start or :meth:`reset_peak`."""
        return self._counts.peak_bytes

    def reset_peak(self) -> None:
        self._counts.reset_peak()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {storage_key(t) for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)}
        for t in tree_flatten(out)[0]:
            if not isinstance(t, torch.Tensor):
                continue
            key = storage_key(t)
            if key == 0 or (key in inputs and not self._counts.holds(key)):
                continue  # no storage, or a view of a storage made before tracking began
            weakref.finalize(t, self._counts.drop, self._counts.hold(t))
        return out
