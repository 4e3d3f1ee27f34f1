"""Keep freed memory in the process on CPU ranks, so a training pass does not page-fault its
activations in anew.

glibc's ``malloc`` serves blocks above its mmap threshold (128 KiB at start, raised
dynamically up to 32 MiB) with fresh ``mmap`` calls and returns them with ``munmap``; it also
trims the top of its heap back to the kernel once 128 KiB are free there. A transformer pass
on CPU allocates and frees activations of a few MiB each, so every pass asks the kernel for
zeroed pages again: measured on a 2-stage GPT, a 512-token pass took thousands of minor page
faults on stage 0, and the executor's variable-shape passes, whose sizes differ from one
micro-batch to the next, defeated glibc's dynamic threshold more often than a fixed-shape
1F1B did. Raising the mmap threshold and turning trimming off once at start-up keeps freed
blocks on the heap for reuse (CUDA ranks are unaffected: PyTorch's caching allocator already
does this for device memory). Trimming is off, not merely raised: a stage whose working set
passes any finite threshold (a T5 encoder at 3,000-4,000 tokens, over 1 GiB of attention
scores) returns its heap top at the end of every backward and faults it in again in the next
forward; on a 2-core virtual machine a 1.2 GiB working set took 1.3-1.4 s a pass to fault back
in, against 0.24-0.30 s to write it kept (measured 2026-12-05).

This is a process-wide setting, applied to every method the bench compares, so the
comparison stays fair.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import sys
from dataclasses import dataclass
from typing import Optional

# mallopt parameter numbers from glibc's <malloc.h>.
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3

#: Blocks above this many bytes still get their own mmap: far above any CPU activation.
MMAP_THRESHOLD_BYTES = 1024 * 1024 * 1024
#: The largest mmap threshold older glibc releases accept on 64-bit hosts (HEAP_MAX_SIZE / 2), bytes;
#: glibc 2.36 (measured) accepts 1 GiB and more.
OLD_GLIBC_MMAP_LIMIT_BYTES = 32 * 1024 * 1024
#: glibc's value for "never trim the heap" (mallopt's M_TRIM_THRESHOLD; a threshold in bytes otherwise).
TRIM_NEVER = -1
#: Free heap top kept before glibc trims it back to the kernel: all of it.
TRIM_THRESHOLD_BYTES = TRIM_NEVER


@dataclass(frozen=True)
class AllocatorSetting:
    """What :func:`keep_freed_memory` did: ``applied`` False (with ``reason``) off glibc."""

    applied: bool
    mmap_threshold_bytes: int = 0
    trim_threshold_bytes: int = 0
    reason: str = ""


_applied: Optional[AllocatorSetting] = None


def keep_freed_memory(mmap_threshold_bytes: int = MMAP_THRESHOLD_BYTES,
                      trim_threshold_bytes: int = TRIM_THRESHOLD_BYTES) -> AllocatorSetting:
    """Raise glibc malloc's mmap threshold and set its trim threshold (bytes;
    :data:`TRIM_NEVER`, the default: never trim) for this process; idempotent.

    Returns what was applied. On a non-glibc C library (macOS, musl) nothing changes and
    ``applied`` is False with the reason. An mmap threshold above what an older glibc accepts
    falls back to its limit (32 MiB); a threshold glibc still refuses raises ``ValueError``.
    """
    global _applied
    if _applied is not None:
        return _applied
    if not sys.platform.startswith("linux"):
        _applied = AllocatorSetting(False, reason=f"not glibc ({sys.platform})")
        return _applied
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError) as exc:
        _applied = AllocatorSetting(False, reason=f"no glibc mallopt ({exc})")
        return _applied
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    if mallopt(_M_MMAP_THRESHOLD, int(mmap_threshold_bytes)) != 1:
        fallback = min(int(mmap_threshold_bytes), OLD_GLIBC_MMAP_LIMIT_BYTES)
        if mallopt(_M_MMAP_THRESHOLD, fallback) != 1:
            raise ValueError(f"glibc refused a malloc mmap threshold of {mmap_threshold_bytes} bytes "
                             f"and of {fallback} bytes; pass a smaller mmap_threshold_bytes")
        mmap_threshold_bytes = fallback
    if mallopt(_M_TRIM_THRESHOLD, int(trim_threshold_bytes)) != 1:
        raise ValueError(f"glibc refused a malloc trim threshold of {trim_threshold_bytes} bytes; "
                         f"pass a smaller trim_threshold_bytes")
    _applied = AllocatorSetting(True, mmap_threshold_bytes=int(mmap_threshold_bytes),
                                trim_threshold_bytes=int(trim_threshold_bytes))
    return _applied


def current_setting() -> Optional[AllocatorSetting]:
    """What :func:`keep_freed_memory` applied in this process, or None before it ran."""
    return _applied


def describe() -> str:
    """One line for a bench's JSON: the allocator setting every CPU rank applies."""
    trim = "never trimmed" if TRIM_THRESHOLD_BYTES == TRIM_NEVER else f"trim threshold {TRIM_THRESHOLD_BYTES >> 20} MiB"
    return (f"glibc malloc on every CPU rank: mmap threshold {MMAP_THRESHOLD_BYTES >> 20} MiB "
            f"({OLD_GLIBC_MMAP_LIMIT_BYTES >> 20} MiB where an older glibc caps it), heap {trim} "
            f"(megatron_integration.cpu_allocator)")
