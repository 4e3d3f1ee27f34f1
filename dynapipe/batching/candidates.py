"""Every micro-batch the DP may form, priced by the cost model in one vectorised call.

The DP cuts an ordered list of n samples into consecutive micro-batches; the candidate
ending at position j (1-based) with k samples is positions ``j-k .. j-1``. Its cost
depends only on k and its padded shape (the longest sample of each side, rounded up to
a multiple of 8), so the table is stored as *rows*: ``time_ms[offsets[r] + k - 1]``
prices a k-sample micro-batch of row r, and ``row_of_end[j]`` says which row the
micro-batches ending at j use.

- Sorted decoder-only samples: the padded length of a candidate is that of its last
  sample, so all ends with the same padded length share a row (a few hundred rows for
  thousands of samples).
- Any other order (encoder-decoder pairs), or micro-batches run with per-sample attention
  (whose price also depends on which samples they hold): one row per end, shapes from a
  range-maximum table.

Rows stop at the largest count whose stored + peak activations fit the memory budget.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from dynapipe.batching.memory import MemoryBudget, max_fitting_count, oversized_sample_error
from dynapipe.batching.ordering import padded_length
from dynapipe.cost import CostModel
from dynapipe.cost.attention_density import AttentionDensity
from dynapipe.errors import DynaPipeError


@dataclass
class CandidateTable:
    """Priced candidate micro-batches (see the module docstring). Times in ms, memory in MiB."""

    n: int
    row_of_end: np.ndarray   # (n + 1,) int64; entry 0 unused
    offsets: np.ndarray      # (rows,) int64
    row_len: np.ndarray      # (rows,) int64: counts 1..row_len[r] are priced
    time_ms: np.ndarray      # (entries,) float64: forward + backward of the bottleneck stage
    stored_mib: np.ndarray   # (entries,) float64
    peak_mib: np.ndarray     # (entries,) float64
    seqlen: np.ndarray       # (entries,) int64 padded (encoder) length
    dec_seqlen: np.ndarray   # (entries,) int64 padded decoder length; 0 for decoder-only
    monotone: bool           # time never decreases along a row (lets the DP stop a row early)

    def entry(self, end: int, count: int) -> int:
        """Flat index of the micro-batch of ``count`` samples ending at position ``end``."""
        r = int(self.row_of_end[end])
        if not 1 <= count <= min(int(self.row_len[r]), end):
            raise IndexError(f"no candidate of {count} samples ends at position {end}")
        return int(self.offsets[r]) + count - 1


class RangeMax:
    """Maximum of ``values[end - count : end]`` for many (end, count) pairs at once (sparse table)."""

    def __init__(self, values: np.ndarray):
        values = np.asarray(values, dtype=np.int64)
        n = len(values)
        levels = [values]
        while (2 << (len(levels) - 1)) <= n:
            prev, half = levels[-1], 1 << (len(levels) - 1)
            levels.append(np.maximum(prev[:-half], prev[half:]))
        self.table = np.zeros((len(levels), n), dtype=np.int64)
        for i, lv in enumerate(levels):
            self.table[i, :len(lv)] = lv

    def __call__(self, end: np.ndarray, count: np.ndarray) -> np.ndarray:
        end, count = np.asarray(end, dtype=np.int64), np.asarray(count, dtype=np.int64)
        level = np.log2(count).astype(np.int64)
        return np.maximum(self.table[level, end - count], self.table[level, end - (1 << level)])


def _flat_counts(row_len: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Offsets of each row, and the row and count (1-based) of every flat entry."""
    offsets = np.cumsum(row_len) - row_len
    rows = np.repeat(np.arange(len(row_len)), row_len)
    counts = np.arange(int(row_len.sum()), dtype=np.int64) - offsets[rows] + 1
    return offsets.astype(np.int64), rows, counts


def _describe(lengths: np.ndarray, pos: int, enc: np.ndarray, dec: np.ndarray | None) -> str:
    if lengths.ndim == 2:
        return (f"input {int(lengths[pos, 0])} and target {int(lengths[pos, 1])} tokens, "
                f"padded to {int(enc[pos])} and {int(dec[pos])}")
    return f"length {int(lengths[pos])} tokens, padded to {int(enc[pos])}"


def _range_density(ordered: np.ndarray):
    """Prices a candidate's per-sample attention: the :class:`AttentionDensity` of the
    positions ``end - count .. end - 1`` padded to ``s`` (and ``d`` decoder) tokens, from
    prefix sums of each sample's attention pairs (one sample a row)."""
    def prefix(x):
        return np.concatenate(([0.0], np.cumsum(x)))

    lengths = np.asarray(ordered, dtype=np.float64).reshape(len(ordered), -1)
    inp, tgt = lengths[:, 0], lengths[:, -1]
    sq_in, sq_t, cross = prefix(inp ** 2), prefix(tgt ** 2), prefix(inp * tgt)

    def density(end, count, s, d):
        s = np.asarray(s, dtype=np.float64)

        def share(p, dense):
            return np.clip((p[end] - p[end - count]) / (count * dense), 1e-12, 1.0)
        calls = np.asarray(count, dtype=np.float64)  # one sample a row, one call a sample
        if d is None:  # decoder-only: one kind of attention
            return AttentionDensity(input=share(sq_in, s * s), calls=calls)
        d = np.asarray(d, dtype=np.float64)
        return AttentionDensity(input=share(sq_in, s * s), target=share(sq_t, d * d), cross=share(cross, d * s),
                                calls=calls)
    return density


def build_candidate_table(ordered: np.ndarray, order: np.ndarray, cost_model: CostModel, budget: MemoryBudget,
                          recompute: str = "none", cap: int | None = None,
                          dec_cap: int | None = None, per_sample: bool = False) -> CandidateTable:
    """Price every candidate micro-batch of the samples in DP order.

    ``ordered`` holds the lengths in DP order, ``(n,)`` or ``(n, 2)`` tokens; ``order[p]``
    is the original index of position p (for error messages); ``cap`` is the sequence
    length limit padding never exceeds (tokens), ``dec_cap`` an encoder-decoder target's
    (default ``cap``). ``per_sample``: every row's attention runs on its sample alone (the
    padding tail skipped), so each candidate is priced at its
    :class:`~dynapipe.cost.attention_density.AttentionDensity`. Raises
    :class:`DynaPipeError` naming a sample that does not fit in ``budget`` even alone.
    """
    ordered = np.asarray(ordered, dtype=np.int64)
    n = len(ordered)
    enc = padded_length(ordered if ordered.ndim == 1 else ordered[:, 0], cap)
    dec = None if ordered.ndim == 1 else padded_length(ordered[:, 1], cap if dec_cap is None else dec_cap)
    shared_rows = dec is None and not per_sample and bool(np.all(enc[1:] >= enc[:-1]))
    density = _range_density(ordered) if per_sample else None

    if shared_rows:
        # Row u: micro-batches whose last (longest) sample has padded length row_seq[u].
        starts = np.flatnonzero(np.concatenate(([True], enc[1:] != enc[:-1])))
        row_seq = enc[starts]
        last_end = np.append(starts[1:], n)          # a row's candidates end at most here
        row_of_end = np.concatenate(([0], np.repeat(np.arange(len(starts)), np.diff(np.append(starts, n)))))
        first_pos = starts

        def shape(rows, counts):
            return row_seq[rows], None
    else:
        rmax_enc = RangeMax(enc)
        rmax_dec = RangeMax(dec) if dec is not None else None
        last_end = np.arange(1, n + 1, dtype=np.int64)
        row_of_end = np.arange(-1, n, dtype=np.int64)
        row_of_end[0] = 0
        first_pos = np.arange(n)

        def shape(rows, counts):
            end = rows + 1
            return rmax_enc(end, counts), (rmax_dec(end, counts) if rmax_dec is not None else None)

    def price(rows, counts):
        s, d = shape(rows, counts)
        # Without shared rows, row r holds the candidates ending at position r + 1.
        attention = None if density is None else density(np.asarray(rows) + 1, np.asarray(counts), s, d)
        return cost_model.stage_cost(counts, s, d, recompute=recompute, attention=attention)

    def memory(counts, rows):
        c = price(rows, counts)
        return c.stored_mib + c.peak_mib

    row_len = max_fitting_count(memory, last_end, budget.activation_mib)
    if np.any(row_len == 0):
        bad = np.flatnonzero(row_len == 0)
        need = memory(np.ones(len(bad), dtype=np.int64), bad)
        r = int(bad[np.argmin(need)])
        c = price(np.array([r]), np.array([1]))
        pos = int(first_pos[r]) if shared_rows else r
        failing = int(sum(last_end[b] - first_pos[b] for b in bad)) if shared_rows else len(bad)
        raise oversized_sample_error(int(order[pos]), _describe(ordered, pos, enc, dec), float(c.stored_mib[0]),
                                     float(c.peak_mib[0]), budget, recompute, others=failing - 1)

    if budget.micro_batch_share < 1.0:
        # Several samples within the share; a sample alone keeps the whole budget.
        row_len = np.maximum(np.minimum(row_len, max_fitting_count(memory, last_end, budget.multi_sample_mib)), 1)
    offsets, rows, counts = _flat_counts(row_len)
    seq, dseq = shape(rows, counts)
    cost = price(rows, counts)
    time_ms = np.array(cost.time_ms, dtype=np.float64)
    stored, peak = np.array(cost.stored_mib, dtype=np.float64), np.array(cost.peak_mib, dtype=np.float64)
    if np.any(np.isnan(time_ms)) or np.any(time_ms < 0):
        raise DynaPipeError("the cost model returned a negative or NaN time; "
                            "check the profile or config it was built from.")
    # Guard against a cost model whose memory is not monotone in the count (the search above
    # assumes it): no candidate over its limit, the share's for two samples or more.
    limit = np.where(counts > 1, budget.multi_sample_mib, budget.activation_mib)
    time_ms[stored + peak > limit] = np.inf
    steps = np.diff(time_ms)
    inside = np.ones(len(steps), dtype=bool)
    inside[offsets[1:] - 1] = False
    monotone = bool(np.all(steps[inside] >= 0))
    return CandidateTable(
        n=n, row_of_end=np.ascontiguousarray(row_of_end, dtype=np.int64), offsets=offsets,
        row_len=row_len.astype(np.int64), time_ms=time_ms, stored_mib=stored, peak_mib=peak,
        seqlen=np.asarray(seq, dtype=np.int64),
        dec_seqlen=np.zeros_like(counts) if dseq is None else np.asarray(dseq, dtype=np.int64),
        monotone=monotone)
