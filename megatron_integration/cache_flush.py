"""Evicting the cache before a timed op, so a profile prices an op as a pipeline runs it.

In a pipeline an op runs after other micro-batches' ops, so its weights and activations are
no longer in the cache. Repeated back to back, a small op keeps them there: on a CPU core with
2 MiB of L2, ops of 4-16 rows of 64-256 tokens measured 20-50% faster than from a cold cache,
a 1,024-token row 6-10% (measured 2026-12-05). The profilers write a :class:`CacheFlush`
buffer, untimed, before every timed forward and backward.
"""
from __future__ import annotations

import os
from typing import Optional

import torch

#: The least buffer a CPU flush writes, bytes: above the L2 of every core we know of.
CPU_MIN_BYTES = 16 << 20
#: The least buffer a GPU flush writes, bytes.
GPU_MIN_BYTES = 64 << 20


class CacheFlush:
    """Evicts what the last op left in the cache: calling it writes a buffer of ``nbytes`` on
    ``device`` (default :meth:`default_bytes`)."""

    def __init__(self, device: torch.device, nbytes: Optional[int] = None):
        self.nbytes = int(nbytes or self.default_bytes(device))
        self._buffer = torch.empty(self.nbytes // 4, dtype=torch.float32, device=device)

    @staticmethod
    def default_bytes(device: torch.device) -> int:
        """The flush size for ``device``, bytes: on a CPU four times one core's L2 for each of
        torch's threads (a fill is split over the threads, so each core writes its share), at
        least :data:`CPU_MIN_BYTES`; on a GPU twice its L2, at least :data:`GPU_MIN_BYTES`."""
        if device.type == "cuda":
            l2 = getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 0) or 0
            return max(2 * int(l2), GPU_MIN_BYTES)
        try:
            l2 = max(int(os.sysconf("SC_LEVEL2_CACHE_SIZE")), 0)
        except (AttributeError, ValueError, OSError):  # not reported on this host
            l2 = 0
        return max(4 * l2 * max(torch.get_num_threads(), 1), CPU_MIN_BYTES)

    def __call__(self) -> None:
        self._buffer.fill_(1.0)
