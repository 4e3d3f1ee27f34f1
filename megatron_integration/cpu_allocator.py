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

A heap kept this way still grows page by page the first time a pass needs more than any pass
before it, and the executor's variable shapes reach new highs later than a fixed-shape 1F1B,
whose warm-up holds its largest working set. On a 2-core virtual machine a stage's forward that
first reached 64 MiB more took 16,385 minor faults and 270 ms of system time in a 1.6 s
iteration (measured 2026-12-05). :func:`pretouch_heap` writes a heap of a given size once at
start-up (``--dynapipe-cpu-pretouch-mb``), so the passes of a short timed run see what a long
run's would: a heap already at its high-water mark.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import sys
import time
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


def _libc() -> ctypes.CDLL:
    """This process's C library (raises ``OSError`` where it cannot be loaded)."""
    return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")


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
        mallopt = _libc().mallopt
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


#: Pre-touched in blocks of this many bytes: below the mmap threshold keep_freed_memory sets
#: (1 GiB, or 32 MiB on an older glibc), so each block comes off the heap top and the freed
#: blocks merge back into it.
PRETOUCH_BLOCK_BYTES = 16 * 1024 * 1024

_pretouched_s: Optional[float] = None


def pretouch_heap(mib: int) -> float:
    """Grow this process's malloc heap by ``mib`` MiB (rounded up to 16 MiB blocks), write
    every page once and free it, so later allocations up to that size reuse memory already
    faulted in. Returns the seconds it took (0.0 for ``mib`` 0; also what
    :func:`pretouched_seconds` reports after). Raises ``ValueError`` where it cannot work:
    before :func:`keep_freed_memory` or off glibc (nothing keeps the pages), with a trim
    threshold (the freed top would go back to the kernel at once), or with an mmap threshold
    at or below the block size (every block would be mapped and unmapped on its own)."""
    global _pretouched_s
    if mib < 0:
        raise ValueError(f"pre-touching {mib} MiB of heap: give a size of at least 0 MiB")
    if mib == 0:
        _pretouched_s = 0.0
        return 0.0
    setting = _applied
    if setting is None or not setting.applied:
        why = "keep_freed_memory() has not run" if setting is None else setting.reason
        raise ValueError(f"pre-touching the heap needs glibc's malloc kept by keep_freed_memory ({why}); "
                         f"give 0 MiB on this host")
    if setting.trim_threshold_bytes != TRIM_NEVER:
        raise ValueError("pre-touching the heap needs it never trimmed (keep_freed_memory's default); it was "
                         f"set to trim at {setting.trim_threshold_bytes} bytes")
    if setting.mmap_threshold_bytes <= PRETOUCH_BLOCK_BYTES:
        raise ValueError(f"pre-touching the heap needs an mmap threshold above its {PRETOUCH_BLOCK_BYTES} byte "
                         f"blocks; keep_freed_memory set {setting.mmap_threshold_bytes} bytes")
    libc = _libc()
    libc.malloc.argtypes, libc.malloc.restype = [ctypes.c_size_t], ctypes.c_void_p
    libc.free.argtypes, libc.free.restype = [ctypes.c_void_p], None
    started = time.perf_counter()
    blocks = []
    try:
        for _ in range(-(-mib * 1024 * 1024 // PRETOUCH_BLOCK_BYTES)):
            block = libc.malloc(PRETOUCH_BLOCK_BYTES)
            if not block:
                raise MemoryError(f"pre-touching {mib} MiB of heap: malloc failed after "
                                  f"{len(blocks) * PRETOUCH_BLOCK_BYTES >> 20} MiB; give a smaller size")
            blocks.append(block)
            ctypes.memset(block, 0, PRETOUCH_BLOCK_BYTES)
    finally:
        # Last first: each freed block joins the heap top, which is never trimmed.
        for block in reversed(blocks):
            libc.free(block)
    _pretouched_s = time.perf_counter() - started
    return _pretouched_s


def pretouched_seconds() -> Optional[float]:
    """Seconds the last :func:`pretouch_heap` of this process took (0.0: asked for 0 MiB), or
    None where it never ran."""
    return _pretouched_s


def current_setting() -> Optional[AllocatorSetting]:
    """What :func:`keep_freed_memory` applied in this process, or None before it ran."""
    return _applied


def describe() -> str:
    """One line for a bench's JSON: the allocator setting every CPU rank applies."""
    trim = "never trimmed" if TRIM_THRESHOLD_BYTES == TRIM_NEVER else f"trim threshold {TRIM_THRESHOLD_BYTES >> 20} MiB"
    return (f"glibc malloc on every CPU rank: mmap threshold {MMAP_THRESHOLD_BYTES >> 20} MiB "
            f"({OLD_GLIBC_MMAP_LIMIT_BYTES >> 20} MiB where an older glibc caps it), heap {trim} "
            f"(megatron_integration.cpu_allocator)")
