"""A storage-level live-memory count for devices without allocator statistics (CPUs): the
profiler's ``peak_mib`` on CPU comes from it."""
from __future__ import annotations

import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


class LiveMemoryTracker(TorchDispatchMode):
    """Counts the bytes of tensor storages created under it while they are alive.

    A storage is counted when an op creates it (an op output that aliases none of the
    op's inputs) and released when the last tensor object viewing it is collected.
    ``peak`` is the highest count seen. Works on any device; used on CPU, where no
    allocator statistics exist.
    """

    def __init__(self):
        super().__init__()
        self.live = 0
        self.peak = 0
        self._refs: dict[int, list[int]] = {}

    def reset_peak(self) -> None:
        self.peak = self.live

    def _release(self, key: int) -> None:
        entry = self._refs.get(key)
        if entry is None:
            return
        entry[0] -= 1
        if entry[0] == 0:
            self.live -= entry[1]
            del self._refs[key]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {t.untyped_storage().data_ptr() for t in tree_flatten((args, kwargs))[0]
                  if isinstance(t, torch.Tensor)}
        for t in tree_flatten(out)[0]:
            if not isinstance(t, torch.Tensor):
                continue
            key = t.untyped_storage().data_ptr()
            if key == 0:
                continue
            if key in self._refs:
                self._refs[key][0] += 1
            elif key in inputs:
                continue  # a view of a storage made before tracking began
            else:
                nbytes = t.untyped_storage().nbytes()
                self._refs[key] = [1, nbytes]
                self.live += nbytes
                self.peak = max(self.peak, self.live)
            weakref.finalize(t, self._release, key)
        return out
