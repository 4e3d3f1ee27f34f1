"""``interleaved-zb``: interleaved 1F1B with every backward split (zero bubble over chunks).

:mod:`dynapipe.schedule.zero_bubble` splits each backward of a contiguous pipeline into its
input part (``BI``, which the previous stage waits for) and its weight part (``BW``, which
only the optimizer step waits for), and defers the weight parts into the waits. This is the
same idea on a virtual-pipeline (chunked) placement. Rank ``p`` runs
:mod:`dynapipe.schedule.interleaved`'s op order with each ``B`` replaced by ``BI``, and the
``BW`` of a (micro-batch, chunk) right after the ``BI`` that comes ``d_p = min(2p, k)`` input
parts after its own on that rank (``k``: the cap, ``max_delay``); the weight parts still
pending after the last ``BI`` run at the end in the order of their input parts. Rank 0
runs every weight part right after its input part; later ranks, whose gradients arrive later,
keep up to ``2p`` weight parts pending and send each input gradient on sooner. Twice
zb-h1's delay because interleaved 1F1B's warm-up grows by two forwards a rank (1F1B's by
one), so the gradients reach rank ``p`` about ``2p`` ops after rank 0's own: with equal
micro-batches (8 ranks x 2 chunks x 16, F = BI = 1, BW = 0.5 ms) ``2p`` takes 87 ms against
``p``'s 90.5 ms and interleaved 1F1B's 97.5 ms (80 ms of work).

The interleaved order is one that completes (a cycle of waits is impossible, see
:func:`~dynapipe.schedule.interleaved.interleaved_arrays`), and a weight part waits for
nothing but its own rank's input part, so this order completes too. Every rank runs
``3 v M`` ops. Each pending weight part holds memory (the linear layers' inputs and output
gradients), so the search tries every cap (``k = 2 (P - 1)`` down to ``0``, where a rank
holds what interleaved 1F1B holds, except under full recompute, whose weight parts keep the
rematerialised layers) and keeps the fastest that fits. Units: ms, MiB.
"""
from __future__ import annotations

import functools
from typing import Optional

import numpy as np

from dynapipe.errors import DynaPipeError
from dynapipe.schedule import _kernels as K
from dynapipe.schedule.interleaved import interleaved_arrays, schedule_from_chunked_arrays
from dynapipe.schedule.types import Schedule

INTERLEAVED_ZB = "interleaved-zb"


def weight_delay(num_stages: int, stage: int, num_ops: int, max_delay: Optional[int] = None) -> int:
    """``d_p``: how many input parts after its own the weight part of a (micro-batch, chunk)
    runs on rank ``stage`` (``num_ops``: input parts on the rank; at most ``max_delay``)."""
    d = min(2 * stage, num_ops)
    return d if max_delay is None else min(d, max(int(max_delay), 0))


def max_delay_cap(num_stages: int) -> int:
    """The largest delay any rank of ``num_stages`` takes (the search's first cap)."""
    return 2 * (num_stages - 1)


def _rank_order(kind, mb, ch, n: int, delay: int) -> list[tuple[int, int, int]]:
    """``(kind code, micro-batch, chunk)`` of one rank: its interleaved ops (``kind``... of
    length ``2n``) with each ``B`` split and its ``BW`` ``delay`` input parts later."""
    out, done = [], []
    for k, m, c in zip(kind.tolist(), mb.tolist(), ch.tolist()):
        if k == K.F:
            out.append((K.F, m, c))
            continue
        out.append((K.BI, m, c))
        done.append((m, c))
        if len(done) - 1 - delay >= 0:
            out.append((K.BW,) + done[len(done) - 1 - delay])
    out.extend((K.BW,) + x for x in done[max(len(done) - delay, 0):])
    return out


@functools.lru_cache(maxsize=64)
def interleaved_zb_arrays(num_stages: int, chunks: int, num_micro_batches: int,
                          max_delay: Optional[int] = None) -> tuple:
    """``(kind, mb, chunk, nops)`` of interleaved-zb as ``[P, 3 v M]`` arrays (kind 0 = F,
    2 = BI, 3 = BW); ``max_delay`` caps every rank's weight delay. Read-only."""
    P, v, M = num_stages, chunks, num_micro_batches
    n = v * M
    ikind, imb, ich, _ = interleaved_arrays(P, v, M)
    kind = np.zeros((P, max(3 * n, 1)), dtype=np.int64)
    mb, ch = np.zeros_like(kind), np.zeros_like(kind)
    for p in range(P):
        order = _rank_order(ikind[p, :2 * n], imb[p, :2 * n], ich[p, :2 * n], n, weight_delay(P, p, n, max_delay))
        if order:
            kind[p, :3 * n], mb[p, :3 * n], ch[p, :3 * n] = np.array(order, dtype=np.int64).T
    nops = np.full(P, 3 * n, dtype=np.int64)
    for a in (kind, mb, ch, nops):
        a.flags.writeable = False
    return kind, mb, ch, nops


def interleaved_zb(num_stages: int, chunks: int, num_micro_batches: int, *, recompute: str = "none",
                   order: str = "planned", mb_order: tuple[int, ...] = (), stage_recompute: tuple[str, ...] = (),
                   max_delay: Optional[int] = None) -> Schedule:
    """The interleaved-zb op order of every rank for micro-batches ``0..M-1`` (arguments as
    for :func:`~dynapipe.schedule.interleaved.interleaved_1f1b`; ``max_delay`` caps the
    weight delays)."""
    if num_stages < 1 or chunks < 1 or num_micro_batches < 0:
        raise DynaPipeError(f"interleaved-zb needs at least one stage and chunk, got {num_stages} stages, "
                            f"{chunks} chunks and {num_micro_batches} micro-batches.")
    kind, mb, ch, nops = interleaved_zb_arrays(num_stages, chunks, num_micro_batches, max_delay)
    return schedule_from_chunked_arrays(INTERLEAVED_ZB, kind, mb, ch, nops, chunks=chunks, recompute=recompute,
                                        order=order, mb_order=mb_order or tuple(range(num_micro_batches)),
                                        stage_recompute=stage_recompute,
                                        meta={} if max_delay is None else {"max_delay": int(max_delay)})
