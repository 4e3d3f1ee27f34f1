"""The compute floor of a global batch: the least compute any batching of its samples needs.

Every batching method (padding, packing, DynaPipe's cuts) runs a global batch as micro-batches
whose samples are padded to the micro-batch's longest one. By the cost model no such
micro-batch of ``m`` samples can cost less than the sum, over its samples, of each sample's
cost alone at its own length in a micro-batch of ``m`` same-shaped samples (costs grow with
the lengths), and that is no less than each sample's cheapest per-sample cost over
micro-batch sizes. Summed over samples and stages this is the floor: compute with no padding
and every sample at its most efficient batch size. A method's predicted compute over the
floor says how much of its compute is waste; a baseline's predicted compute over the floor is
the most any batching can gain on it through compute alone (the pipeline's bubble,
transfers and optimizer step come on top for every method).

Pure numpy; times in ms, lengths in tokens.
"""
from __future__ import annotations

from typing import Optional, Sequence

import numpy as np

from dynapipe.cost.base import CostModel
from dynapipe.errors import DynaPipeError


#: Every micro-batch size up to this one is tried; beyond it, powers of two and the batch itself.
EVERY_SIZE_UP_TO = 64


def micro_batch_sizes(num_samples: int) -> list[int]:
    """The micro-batch sizes the floor tries (samples): every size up to
    :data:`EVERY_SIZE_UP_TO` (a batching may cut three samples together, and three can cost less
    per sample than two or four: powers of two alone gave no floor), then powers of two and
    ``num_samples`` itself. Beyond measured grids (a few sizes, far below 64) both cost models
    price a micro-batch as a fixed cost plus a step per sample (the analytic one's efficiency
    only grows with tokens), so the cost per sample falls with the size and the largest size
    tried is the cheapest: the sizes between need no pricing (pricing every size up to thousands
    of samples took seconds and GiBs a batch)."""
    if isinstance(num_samples, bool) or not isinstance(num_samples, (int, np.integer)) or num_samples < 1:
        raise DynaPipeError(f"a global batch of {num_samples!r} samples has no compute floor; give at least one.")
    n = int(num_samples)
    powers = {1 << k for k in range(n.bit_length()) if 1 << k <= n}
    return sorted(set(range(1, min(n, EVERY_SIZE_UP_TO) + 1)) | powers | {n})


def compute_floor_ms(cost_model: CostModel, lengths, *, recompute: str = "none",
                     max_micro_batch: Optional[int] = None) -> float:
    """Forward + backward ms, summed over every stage of ``cost_model``, that one global batch
    needs at the least: every sample (a row of ``lengths``: tokens, or (input, target) tokens
    for an encoder-decoder model) priced alone at its own length, at the micro-batch size
    (every size up to ``max_micro_batch`` and the batch's sample count) where its cost per
    sample is lowest. No batching of these samples computes less by this cost model."""
    arr = np.asarray(lengths)
    encdec = cost_model.model.is_encoder_decoder
    if arr.ndim != (2 if encdec else 1) or (encdec and arr.shape[1] != 2) or len(arr) == 0:
        want = "(n, 2) input and target lengths" if encdec else "a 1-D list of sample lengths"
        raise DynaPipeError(f"compute floor: lengths of shape {arr.shape} given; give {want} (tokens).")
    if arr.dtype.kind not in "iu" and not (arr.dtype.kind == "f" and np.all(np.isfinite(arr))
                                           and np.all(arr == np.round(arr))):
        raise DynaPipeError(f"compute floor: lengths {arr.ravel()[:4].tolist()}... are not whole numbers of tokens.")
    if np.any(arr <= 0):
        raise DynaPipeError(f"compute floor: a sample length {int(arr.min())} is not positive; every sample "
                            f"has at least one token.")
    if np.any(arr > cost_model.model.max_seq_length):
        raise DynaPipeError(f"compute floor: a sample length {int(arr.max())} exceeds the model's max_seq_length "
                            f"{cost_model.model.max_seq_length}; truncate the lengths as the run does.")
    sizes = np.asarray(micro_batch_sizes(min(max_micro_batch or len(arr), len(arr))), dtype=np.float64)[:, None]
    # Each distinct length priced once, weighted by how many samples have it.
    shapes, counts = np.unique(arr.reshape(len(arr), -1), axis=0, return_counts=True)
    seq = shapes[:, 0][None, :].astype(np.float64)
    dec = shapes[:, 1][None, :].astype(np.float64) if encdec else None
    total = 0.0
    for stage in range(cost_model.num_stages):
        cost = cost_model.stage_cost(sizes, seq, dec, recompute=recompute, stage=stage)
        per_sample = np.asarray(cost.time_ms, dtype=np.float64) / sizes
        total += float(per_sample.min(axis=0) @ counts)
    return total


def shapes_compute_ms(cost_model: CostModel, shapes: Sequence[tuple], *, recompute: str = "none",
                      attention: Optional[Sequence] = None) -> float:
    """Forward + backward ms of micro-batches of ``shapes`` (``(rows, seqlen[, dec_seqlen])``,
    tokens), summed over every stage of ``cost_model``: what a method's batching of a global
    batch computes, to set against :func:`compute_floor_ms`. ``attention``: per shape, the
    :class:`~dynapipe.cost.attention_density.AttentionDensity` of packed rows run per sample
    (None: dense)."""
    if attention is not None and len(attention) != len(shapes):
        raise DynaPipeError(f"{len(attention)} attention densities for {len(shapes)} shapes; give one a shape "
                            f"(None for dense attention).")
    width = 3 if cost_model.model.is_encoder_decoder else 2
    for shape in shapes:
        if (len(shape) != width or any(isinstance(v, bool) or not isinstance(v, (int, np.integer)) for v in shape)
                or min(shape) < 1):
            want = "(rows, seqlen, dec_seqlen)" if width == 3 else "(rows, seqlen)"
            raise DynaPipeError(f"shape {tuple(shape)!r}: give {want}, whole numbers of at least 1 (rows, tokens).")
    dens = list(attention) if attention is not None else [None] * len(shapes)
    return sum(float(cost_model.stage_cost(*shape, recompute=recompute, stage=k, attention=d).time_ms)
               for shape, d in zip(shapes, dens) for k in range(cost_model.num_stages))


def floor_over_batches(cost_model: CostModel, batches: Sequence, *, recompute: str = "none") -> float:
    """Mean :func:`compute_floor_ms` (ms) over ``batches`` (one global batch's lengths each)."""
    if not batches:
        raise DynaPipeError("compute floor: no global batches given.")
    return float(np.mean([compute_floor_ms(cost_model, b, recompute=recompute) for b in batches]))
