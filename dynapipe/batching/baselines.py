"""The fixed-shape and greedy batching methods DynaPipe is compared with.

Each function groups the samples of one global batch into micro-batches (unpriced
:class:`MicroBatch` objects: samples and padded shape); the planner prices them with the
same cost model as the DP.

- ``padding``: Megatron's behaviour. Fixed ``micro_batch_size`` samples in arrival
  order, each padded to ``seq_length`` (encoder-decoder: the decoder side padded to
  ``dec_seq_length`` when given, as Megatron's ``--decoder-seq-length``, else to the batch's
  longest target, the least fixed decoder length that covers it).
- ``padding-mb``: fixed ``micro_batch_size`` in arrival order, padded to the
  micro-batch's longest sample (rounded up to a multiple of 8).
- ``packing``: samples packed whole (best-fit decreasing, never split) into rows of
  ``seq_length`` tokens (encoder-decoder: input tokens, and at most ``dec_seq_length``
  target tokens), ``micro_batch_size`` rows a micro-batch, priced as full dense rows.
  Whether samples see each other is the runtime's choice, not the planner's: the
  training paths isolate them with a per-sample mask (``segment_ids``; Megatron's
  ``--reset-attention-mask`` baseline), which keeps the loss exact but not the compute, since
  masked attention still computes every (query, key) pair of the row.
  ``cross_sample_attention_pairs`` counts the pairs that cross samples (what an unmasked
  run would attend to, and what a masked one computes and discards).
- ``packing-per-sample``: the same rows run with attention on each sample alone (a varlen
  kernel; ``--dynapipe-packed-attention per-sample``), so they compute none of those pairs:
  each micro-batch carries its attention density, and the cost model prices its attention
  cores and stored scores at it (the linear layers still span the whole rows).
- ``token-budget``: samples sorted by length, each micro-batch greedily filled while its
  padded tokens stay within ``max_tokens``.
"""
from __future__ import annotations

import bisect
from typing import Optional

import numpy as np

from dynapipe.batching.ordering import candidate_orders, padded_length
from dynapipe.batching.types import MicroBatch
from dynapipe.cost.attention_density import packed_density
from dynapipe.errors import DynaPipeError, arg, given


def _dec_padded(lengths: np.ndarray, seq_length: int) -> int:
    return int(padded_length(np.array([lengths[:, 1].max()]), seq_length)[0])


def padding(lengths: np.ndarray, micro_batch_size: int, seq_length: int,
            dec_seq_length: Optional[int] = None) -> list[MicroBatch]:
    """Fixed-size micro-batches in arrival order, every sample padded to ``seq_length`` tokens
    (an encoder-decoder target to ``dec_seq_length`` tokens; ``None``: to the batch's longest
    target, rounded up to a multiple of 8 and at most ``seq_length``)."""
    n = len(lengths)
    if lengths.ndim == 1:
        dec = 0
    else:
        dec = int(dec_seq_length) if dec_seq_length is not None else _dec_padded(lengths, seq_length)
    return [MicroBatch(samples=list(range(s, min(s + micro_batch_size, n))), seqlen=int(seq_length), dec_seqlen=dec)
            for s in range(0, n, micro_batch_size)]


def padding_to_longest(lengths: np.ndarray, micro_batch_size: int, seq_length: int,
                       dec_seq_length: Optional[int] = None) -> list[MicroBatch]:
    """Fixed-size micro-batches in arrival order, each padded to its own longest sample
    (rounded up to a multiple of 8, at most ``seq_length`` tokens; an encoder-decoder target
    at most ``dec_seq_length``, default ``seq_length``)."""
    n = len(lengths)
    out = []
    for s in range(0, n, micro_batch_size):
        chunk = lengths[s: s + micro_batch_size]
        if lengths.ndim == 1:
            out.append(MicroBatch(list(range(s, s + len(chunk))),
                                  int(padded_length(chunk.max(keepdims=True), seq_length)[0])))
        else:
            top = chunk.max(axis=0)
            out.append(MicroBatch(list(range(s, s + len(chunk))), int(padded_length(top[:1], seq_length)[0]),
                                  int(padded_length(top[1:], _or(dec_seq_length, seq_length))[0])))
    return out


def _or(value: Optional[int], default: int) -> int:
    return default if value is None else int(value)


def _pack_rows(sizes: np.ndarray, capacity: int) -> list[list[int]]:
    """Best-fit decreasing: each item (largest first) goes to the fullest row it fits in."""
    rows: list[list[int]] = []
    free: list[tuple[int, int]] = []   # (free tokens, row id), sorted
    for i in np.argsort(-sizes, kind="stable").tolist():
        size = int(sizes[i])
        pos = bisect.bisect_left(free, (size, -1))
        if pos == len(free):
            rows.append([i])
            bisect.insort(free, (capacity - size, len(rows) - 1))
        else:
            room, r = free.pop(pos)
            rows[r].append(i)
            bisect.insort(free, (room - size, r))
    return [sorted(r) for r in rows]


def pack_rows_2d(inputs: np.ndarray, targets: np.ndarray, capacity: int,
                 dec_capacity: Optional[int] = None) -> list[list[int]]:
    """Rows of sample indices (each sorted), first-fit decreasing by input length: a row holds
    at most ``capacity`` input and ``dec_capacity`` (default ``capacity``) target tokens."""
    dec_capacity = _or(dec_capacity, capacity)
    n = len(inputs)
    room_in = np.empty(n, dtype=np.int64)
    room_tg = np.empty(n, dtype=np.int64)
    rows: list[list[int]] = []
    for i in np.lexsort((-targets, -inputs)).tolist():
        a, b = int(inputs[i]), int(targets[i])
        r = len(rows)
        fits = np.flatnonzero((room_in[:r] >= a) & (room_tg[:r] >= b))
        if len(fits):
            r = int(fits[0])
            rows[r].append(i)
            room_in[r] -= a
            room_tg[r] -= b
        else:
            rows.append([i])
            room_in[r], room_tg[r] = capacity - a, dec_capacity - b
    return [sorted(r) for r in rows]


def cross_sample_attention_pairs(lengths: np.ndarray, rows: list[list[int]]) -> int:
    """Attention (query, key) pairs that cross sample boundaries in packed rows: attended to
    without a per-sample mask, computed and discarded with one.

    Decoder (causal) attention: a token sees every earlier token of its row, so each
    pair of samples a, b in a row adds ``l_a * l_b`` pairs. Encoder-decoder rows add the
    encoder's bidirectional pairs (twice that on the input side), the decoder's causal pairs
    on the target side, and the cross-attention's: every target token of a sample sees every
    other sample's input tokens (``sum(tgt) * sum(in) - sum(tgt * in)``).
    """
    total = 0
    for row in rows:
        sides = [lengths[row]] if lengths.ndim == 1 else [lengths[row, 0], lengths[row, 1]]
        for side, l in enumerate(sides):
            l = l.astype(np.int64)
            causal = (int(l.sum()) ** 2 - int((l * l).sum())) // 2
            total += 2 * causal if (lengths.ndim == 2 and side == 0) else causal
        if lengths.ndim == 2:
            inp, tgt = (x.astype(np.int64) for x in sides)
            total += int(tgt.sum()) * int(inp.sum()) - int((tgt * inp).sum())
    return total


def packing(lengths: np.ndarray, micro_batch_size: int, seq_length: int,
            dec_seq_length: Optional[int] = None, per_sample: bool = False) -> tuple[list[MicroBatch], int]:
    """Rows of ``seq_length`` packed tokens, ``micro_batch_size`` rows a micro-batch.

    Returns the micro-batches and the number of attention pairs crossing sample
    boundaries. ``per_sample``: the rows run attention on each sample alone, so each
    micro-batch carries its :func:`~dynapipe.cost.attention_density.packed_density`. Encoder-decoder rows also hold at most ``dec_seq_length`` target tokens, their
    decoder side padded to it as Megatron's ``--decoder-seq-length``; without it, at most
    ``seq_length`` target tokens, padded to the longest row's (rounded up to 8).
    """
    if lengths.ndim == 1:
        rows = _pack_rows(lengths, seq_length)
        dec = 0
    else:
        rows = pack_rows_2d(lengths[:, 0], lengths[:, 1], seq_length, dec_seq_length)
        if dec_seq_length is not None:
            dec = int(dec_seq_length)
        else:
            longest = max(int(lengths[r, 1].sum()) for r in rows)
            dec = int(padded_length(np.array([longest]), seq_length)[0])
    # Rows in order of their first sample, so micro-batches follow the arrival order.
    rows.sort(key=lambda r: r[0])
    out = []
    for s in range(0, len(rows), micro_batch_size):
        group = rows[s: s + micro_batch_size]
        density = packed_density(lengths, group, int(seq_length), dec) if per_sample else None
        out.append(MicroBatch(samples=[i for r in group for i in r], seqlen=int(seq_length), dec_seqlen=dec,
                              rows=group, attention=density))
    return out, cross_sample_attention_pairs(lengths, rows)


def token_budget(lengths: np.ndarray, max_tokens: int, seq_length: int,
                 dec_seq_length: Optional[int] = None) -> list[MicroBatch]:
    """Sorted samples, each micro-batch filled while ``count x padded shape <= max_tokens``
    (padding at most ``seq_length`` tokens, an encoder-decoder target at most
    ``dec_seq_length``, default ``seq_length``)."""
    order = candidate_orders(lengths)[0]
    enc = padded_length(lengths if lengths.ndim == 1 else lengths[:, 0], seq_length)
    dec = (padded_length(lengths[:, 1], _or(dec_seq_length, seq_length)) if lengths.ndim == 2
           else np.zeros(len(lengths), dtype=np.int64))
    need = enc + dec
    if need.max() > max_tokens:
        i = int(np.argmax(need))
        raise DynaPipeError(
            f"sample {i} (length {lengths[i].tolist()} tokens, padded to {int(need[i])}) exceeds "
            f"{given('max_tokens', max_tokens)}, as do {int((need > max_tokens).sum()) - 1} other sample(s); raise "
            f"{arg('max_tokens')} to at least {int(need[i])} or truncate samples with a smaller {arg('seq_length')}.")
    out: list[MicroBatch] = []
    group: list[int] = []
    top_e = top_d = 0
    for i in order.tolist():
        e, d = max(top_e, int(enc[i])), max(top_d, int(dec[i]))
        if group and (len(group) + 1) * (e + d) <= max_tokens:
            group.append(i)
            top_e, top_d = e, d
            continue
        if group:
            out.append(MicroBatch(group, top_e, top_d))
        group, top_e, top_d = [i], int(enc[i]), int(dec[i])
    out.append(MicroBatch(group, top_e, top_d))
    return out
