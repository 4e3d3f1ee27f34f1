"""Megatron's non-interleaved 1F1B schedule, for micro-batches of any shape.

Stage ``s`` of ``S`` runs ``min(S - s - 1, M)`` warm-up forwards, then alternates one
forward and one backward, then drains the remaining backwards. With uniform
micro-batches the iteration takes ``(M + S - 1)`` forward+backward slots; with
variable shapes the op order is the same and the simulator shows the bubbles.
"""
from __future__ import annotations

import functools

import numpy as np

from dynapipe.errors import whole_number
from dynapipe.schedule import _kernels as K
from dynapipe.schedule.types import Op, Schedule


@functools.lru_cache(maxsize=32)
def one_f_one_b_arrays(num_stages: int, num_micro_batches: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(kind, mb, nops)`` of 1F1B as ``[S, 2M]`` arrays (kind 0 = F, 1 = B). Read-only."""
    S, M = num_stages, num_micro_batches
    kind = np.zeros((S, max(2 * M, 1)), dtype=np.int64)
    mb = np.zeros((S, max(2 * M, 1)), dtype=np.int64)
    for s in range(S):
        warm = min(S - s - 1, M)
        steady = M - warm
        k = np.concatenate([np.full(warm, K.F), np.tile([K.F, K.B], steady), np.full(warm, K.B)])
        m = np.concatenate([np.arange(warm), np.stack([np.arange(warm, M), np.arange(steady)], 1).ravel(),
                            np.arange(steady, M)])
        kind[s, :2 * M], mb[s, :2 * M] = k, m
    nops = np.full(S, 2 * M, dtype=np.int64)
    for a in (kind, mb, nops):
        a.flags.writeable = False
    return kind, mb, nops


def one_f_one_b(num_stages: int, num_micro_batches: int, *, recompute: str = "none",
                order: str = "planned", mb_order: tuple[int, ...] = (),
                stage_recompute: tuple[str, ...] = ()) -> Schedule:
    """The 1F1B op order of every stage for micro-batches ``0..M-1``."""
    whole_number("1f1b: num_stages", num_stages)
    whole_number("1f1b: num_micro_batches", num_micro_batches, at_least=0)
    M = num_micro_batches
    f = [Op("F", i) for i in range(M)]
    b = [Op("B", i) for i in range(M)]
    stage_ops = []
    for s in range(num_stages):
        warm = min(num_stages - s - 1, M)
        steady = [None] * (2 * (M - warm))
        steady[0::2], steady[1::2] = f[warm:], b[:M - warm]
        stage_ops.append(tuple(f[:warm] + steady + b[M - warm:]))
    return Schedule("1f1b", num_stages, tuple(stage_ops), recompute=recompute, order=order,
                    mb_order=mb_order or tuple(range(M)), stage_recompute=tuple(stage_recompute))
