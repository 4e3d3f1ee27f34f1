"""``zb-h1``: a zero-bubble schedule for micro-batches of any shape (split backward).

The idea is Qi et al., "Zero Bubble Pipeline Parallelism" (ICLR 2024): a backward is
two computations with different consumers. Its input-gradient part (``BI``) is what the
previous stage waits for; its weight-gradient part (``BW``) only has to finish before the
optimizer step. Running ``BI`` as early as 1F1B runs ``B`` and deferring ``BW`` lets the
weight parts fill the time a stage would otherwise wait for gradients. Their ZB-H1
keeps 1F1B's memory bound; this is our variant of it for variable micro-batches:

- the forwards and the warm-up are 1F1B's: stage ``s`` of ``S`` runs ``min(S - s - 1, M)``
  warm-up forwards, then alternates ``F`` and ``BI``, then drains the remaining ``BI``s
  (exactly 1F1B with ``B`` replaced by ``BI``);
- the ``BW`` of micro-batch ``j`` runs right after the ``BI`` of micro-batch ``j + d_s``
  with ``d_s = min(s, M)``; the ones still pending after the last ``BI`` run at the end
  in micro-batch order. The first stage runs each ``BW`` right after its ``BI``; stage
  ``s`` keeps up to ``s`` weight parts pending. The gradients of a micro-batch start on
  the last stage and must cross every stage, so the later a stage, the more its ``BI``s
  gain from running without a ``BW`` in between; and under 1F1B stage ``s`` holds only
  ``S - s`` micro-batches, so its pending weight parts (each a part of one micro-batch's
  activations) keep it near the first stage's memory; the search checks every stage's
  simulated peak against the capacity.

With uniform costs and a weight part no longer than a forward this gives ZB-H1's idle
time per stage, ``(S - 1)(F + BI - BW)`` against 1F1B's ``(S - 1)(F + BI + BW)``.
Deferring the other way round (``d_s = S - 1 - s``) leaves the last stage paced by
``F + BI + BW`` while the gradients cross it, and simulates no faster than 1F1B.

Each pending weight part holds memory (the layers' inputs and output gradients), so the
last stages of a pipeline whose micro-batches were cut to fill 1F1B's memory may not fit
with ``d_s = s``. The schedule search then caps the delays (``max_delay``: ``d_s = min(s,
k)``), trying every ``k`` from the largest down to ``k = 0``, where every weight part runs
right after its input part, and keeps the fastest that fits (a cap also reorders the ops, so
a smaller one can run faster). A stage then holds what it holds under 1F1B, except under full recompute,
where the weight part keeps the rematerialised layer (``weight_stash_mib``, more than the
layer's input that 1F1B stores), so ``k = 0`` can exceed a limit 1F1B fits (``auto`` then
chooses 1F1B; a forced ``zb-h1`` is refused, naming how far over it is). Even at ``k = 0`` the gradient leaves each stage one weight part sooner
than 1F1B's backward would send it.

Every stage runs ``3M`` ops. How a backward divides into the two parts is the cost
model's FLOPs estimate (:mod:`dynapipe.cost.backward_split`) unless a profile timed it.
``auto`` tries this schedule where the stages can split their backward; on chunked
placements :mod:`dynapipe.schedule.interleaved_zb` is its interleaved form.
"""
from __future__ import annotations

import functools
from typing import Optional

import numpy as np

from dynapipe.errors import whole_number
from dynapipe.schedule import _kernels as K
from dynapipe.schedule.types import Op, Schedule

ZB_H1 = "zb-h1"


def weight_delay(num_stages: int, stage: int, num_micro_batches: int, max_delay: Optional[int] = None) -> int:
    """``d_s``: how many ``BI`` ops after its own the ``BW`` of a micro-batch runs on ``stage``
    (at most ``max_delay``: fewer weight parts pending, less memory held)."""
    d = min(stage, num_micro_batches)
    return d if max_delay is None else min(d, max(int(max_delay), 0))


def _stage_order(S: int, s: int, M: int, max_delay: Optional[int] = None) -> list[tuple[int, int]]:
    """``(kind code, micro-batch)`` of stage ``s``'s ops (see the module docstring)."""
    warm = min(S - s - 1, M)
    d = weight_delay(S, s, M, max_delay)
    out = [(K.F, i) for i in range(warm)]
    f_next, bi_next = warm, 0

    def input_part() -> None:
        nonlocal bi_next
        out.append((K.BI, bi_next))
        if bi_next - d >= 0:
            out.append((K.BW, bi_next - d))
        bi_next += 1

    while f_next < M:
        out.append((K.F, f_next))
        f_next += 1
        input_part()
    while bi_next < M:
        input_part()
    out.extend((K.BW, j) for j in range(max(M - d, 0), M))
    return out


@functools.lru_cache(maxsize=64)
def zb_h1_arrays(num_stages: int, num_micro_batches: int,
                 max_delay: Optional[int] = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(kind, mb, nops)`` of zb-h1 as ``[S, 3M]`` arrays (kind 0 = F, 2 = BI, 3 = BW);
    ``max_delay`` caps every stage's weight delay. Read-only."""
    S, M = num_stages, num_micro_batches
    kind = np.zeros((S, max(3 * M, 1)), dtype=np.int64)
    mb = np.zeros((S, max(3 * M, 1)), dtype=np.int64)
    for s in range(S):
        order = _stage_order(S, s, M, max_delay)
        if order:
            kind[s, :3 * M], mb[s, :3 * M] = np.array(order, dtype=np.int64).T
    nops = np.full(S, 3 * M, dtype=np.int64)
    for a in (kind, mb, nops):
        a.flags.writeable = False
    return kind, mb, nops


_KIND_NAME = {K.F: "F", K.BI: "BI", K.BW: "BW"}


def zb_h1(num_stages: int, num_micro_batches: int, *, recompute: str = "none",
          order: str = "planned", mb_order: tuple[int, ...] = (),
          stage_recompute: tuple[str, ...] = (), max_delay: Optional[int] = None) -> Schedule:
    """The zb-h1 op order of every stage for micro-batches ``0..M-1`` (arguments as for
    :func:`~dynapipe.schedule.one_f_one_b.one_f_one_b`; ``max_delay`` caps the weight
    delays, see :func:`weight_delay`)."""
    whole_number("zb-h1: num_stages", num_stages)
    whole_number("zb-h1: num_micro_batches", num_micro_batches, at_least=0)
    M = num_micro_batches
    ops = {(k, i): Op(name, i) for k, name in _KIND_NAME.items() for i in range(M)}
    stage_ops = tuple(tuple(ops[x] for x in _stage_order(num_stages, s, M, max_delay)) for s in range(num_stages))
    return Schedule(ZB_H1, num_stages, stage_ops, recompute=recompute, order=order,
                    mb_order=mb_order or tuple(range(M)), stage_recompute=tuple(stage_recompute),
                    meta={} if max_delay is None else {"max_delay": int(max_delay)})
