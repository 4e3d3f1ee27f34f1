"""A profile's measured tables and the rules that price a shape between and beyond their
grid points (ms, MiB; lengths in tokens, sizes in samples).

:class:`ProfileTable` is one quantity, or several on one (mbs, seqlen) grid evaluated in one
pass: linear inside the grid; beyond the longest length the largest of the power law of the
last two lengths (:func:`growth_power`), the line through them and the upward parabola
through the last three (:func:`rising_tail`), a time capped at quadratic growth
(:func:`extrapolate`) and, on a grid of several sizes, extrapolated through its per-sample part
(the last size step's ms per sample); more samples never cheaper there, and past the largest
size a time grows by the last step's slope, memory in proportion. :class:`DecoderTable` adds a T5 decoder
layer's encoder-length axis (:func:`interp_axis`); :class:`OpTables` names an op's fields.
The cost models (:mod:`dynapipe.cost.profile`, :mod:`dynapipe.cost.profile_t5`) price stages
from them.
"""
from __future__ import annotations

from typing import Optional

import numpy as np


# (samples, length) pairs as one exact float key: both whole and below 2**26, the product's
# bits stay within float64's 53.
_KEY = float(2 ** 26)


def _whole(x: np.ndarray) -> bool:
    """Whether every value is a whole number in [0, 2**26) (so it fits the pair key)."""
    return bool(np.all((x >= 0) & (x < _KEY) & (x == np.floor(x))))


def growth_power(v0, v1, s0: float, s1: float):
    """The exponent of the power law through (s0, v0) and (s1, v1) that extrapolates a table
    beyond its longest measured length, kept within [0, 2]: no op gets cheaper with more
    tokens, and none grows faster than attention's quadratic term. Why: noise, or a zero, in
    the last two points would otherwise price long micro-batches below short ones, or at
    10^34 MiB."""
    v0, v1 = np.maximum(v0, 1e-12), np.maximum(v1, 1e-12)
    return np.clip(np.log(v1 / v0) / np.log(s1 / s0), 0.0, 2.0)


def rising_tail(grid: np.ndarray, rows: np.ndarray, s: np.ndarray) -> np.ndarray:
    """Rows of values at the lengths ``grid`` (``rows[..., len(grid)]``; ms or MiB, lengths in
    tokens) at the lengths ``s`` (above the grid, broadcast against ``rows[..., 0]``): the
    largest of the row's power law (:func:`growth_power`), the line through its last two points
    and, where its last three points rise and curve upward, the parabola through them. Why: a layer's
    time and activation memory are quadratics in the length (linear work and tensors plus
    attention's scores), which a power law read from two points under-prices: a stage of
    gpt-tiny measured up to 256 tokens and run at 1,024 measured 54.1 MiB against 42.7
    planned, and its layers' times beyond the grid came out 33-39% short on average. The
    parabola is exact on a quadratic; the line keeps a fixed part (a weight's gradient, a
    launch) from flattening the growth; the power law keeps the result at or above the last
    measured value. Never falls with the length."""
    x1, y1 = grid[-1], rows[..., -1]
    out = y1 * (s / x1) ** growth_power(rows[..., -2], y1, grid[-2], x1)
    d1 = (y1 - rows[..., -2]) / (x1 - grid[-2])
    out = np.maximum(out, y1 + d1 * (s - x1))
    if len(grid) > 2:
        # Newton's form through the last three points; a concave curve is left to the line, and
        # so is one whose points fall before they rise (noise, or a zero: a parabola through
        # 2, 0, 1e-9 would grow a billionfold).
        d0 = (rows[..., -2] - rows[..., -3]) / (grid[-2] - grid[-3])
        curve = np.where(d0 >= 0, np.maximum((d1 - d0) / (x1 - grid[-3]), 0.0), 0.0)
        out = np.maximum(out, y1 + d1 * (s - x1) + curve * (s - x1) * (s - grid[-2]))
    return out


def extrapolate(grid: np.ndarray, rows: np.ndarray, s: np.ndarray, timed) -> np.ndarray:
    """:func:`rising_tail`, a time (``timed``: a flag broadcast against the result) capped at
    its last measured value times ``(s / grid[-1]) ** 2``: a sum of fixed, linear and quadratic
    costs grows no faster, and noise in the last three points could make a parabola do so.
    Memory is not capped: a peak that is the largest of several terms grows faster where its
    quadratic term takes over (gpt-tiny's layer: 4.5x from 512 to 1,024 tokens)."""
    out = rising_tail(grid, rows, s)
    if not np.any(timed):
        return out
    return np.where(timed, np.minimum(out, rows[..., -1] * (s / grid[-1]) ** 2), out)


class ProfileTable:
    """One measured quantity over the (mbs, seqlen) grid, with the extrapolation rules.
    ``timed``: a time (ms), which grows beyond the largest measured mbs by the last measured
    step's slope (a micro-batch's fixed cost stays fixed); memory (MiB) grows proportionally,
    as does anything from a grid of one mbs (no step to read a slope from).

    ``values`` is ``[mbs, seqlen]``, or ``[K, mbs, seqlen]``: K tables on the same grid (an op's
    fields; a T5 decoder layer's, one per encoder length), evaluated together and returned
    stacked (``[K, *shape]``), ``timed`` then a flag or one per table. Why: the planner prices
    every candidate micro-batch of an iteration on every stage, and one pass over all tables
    costs about what one table's pass did."""

    def __init__(self, mbs: np.ndarray, seqlen: np.ndarray, values: np.ndarray, timed=False):
        values = np.asarray(values, dtype=np.float64)
        self.mbs, self.seqlen = mbs, seqlen
        self.stacked = values.ndim == 3
        self._v = values if self.stacked else values[None]
        # ``timed`` may name each stacked table's kind (times and memory stacked together).
        self._timed = np.broadcast_to(np.asarray(timed, dtype=bool), (len(self._v),))
        self._slope = None
        if self._timed.any() and len(mbs) > 1:
            # ms per extra sample at each measured length: the last step's, never negative, and
            # never below a shorter length's. Launch-bound small shapes measure flat steps
            # (noise, or a profile lowered to larger shapes' times), which alone would price a
            # longer sample below a shorter one, or 32 samples at the price of 4.
            step = np.maximum(self._v[:, -1] - self._v[:, -2], 0.0) / (mbs[-1] - mbs[-2])
            self._slope = np.maximum.accumulate(step, axis=-1)[:, None, :]

    def _along_seqlen(self, rows: np.ndarray, s: np.ndarray, timed: np.ndarray) -> np.ndarray:
        """Every row of ``rows`` (``[K, R, len(seqlen)]``) at the lengths ``s``:
        ``[K, R, *s.shape]``; inside the grid ``np.interp``'s rule (a grid point's own value,
        else ``slope * (s - x0) + y0``), above it :func:`extrapolate` (``timed``: ``[K]``
        flags, the tables that hold times)."""
        grid = self.seqlen
        tail = (slice(None), slice(None)) + (None,) * s.ndim
        first, last = rows[..., 0][tail], rows[..., -1][tail]
        if len(grid) < 2:
            return np.broadcast_to(first, rows.shape[:2] + s.shape).copy()
        j = np.searchsorted(grid, s, side="right") - 1
        k = np.clip(j, 0, len(grid) - 2)
        x0, x1 = grid[k], grid[k + 1]
        y0, y1 = rows[..., k], rows[..., k + 1]
        inside = np.where(s == x0, y0, (y1 - y0) / (x1 - x0) * (s - x0) + y0)
        inside = np.where(j < 0, first, np.where(j >= len(grid) - 1, last, inside))
        if not np.any(s > grid[-1]):
            return inside
        pointwise = rows.reshape(rows.shape[:2] + (1,) * s.ndim + rows.shape[-1:])
        above = extrapolate(grid, pointwise, np.maximum(s, grid[-1]), timed[(slice(None),) + (None,) * (s.ndim + 1)])
        return np.where(s > grid[-1], above, inside)

    def __call__(self, b: np.ndarray, s: np.ndarray) -> np.ndarray:
        b, s = np.broadcast_arrays(np.asarray(b, dtype=np.float64), np.asarray(s, dtype=np.float64))
        shape, b, s = b.shape, b.ravel(), s.ravel()
        if b.size == 0:
            out = np.zeros((len(self._v),) + shape)
            return out if self.stacked else out[0]
        keys = at = None
        if b.size > 64 and _whole(b) and _whole(s):
            # Many points, few distinct shapes (a T5 decoder's (samples, target length) pairs over
            # the candidates of every encoder length): each shape priced once.
            keys, at = np.unique(b * _KEY + s, return_inverse=True)
        if keys is not None and 2 * len(keys) < b.size:
            out = self._points(np.floor(keys / _KEY), keys % _KEY)[:, at.ravel()]
        else:
            out = self._points(b, s)
        out = out.reshape((len(out),) + shape)
        return out if self.stacked else out[0]

    def _points(self, b: np.ndarray, s: np.ndarray) -> np.ndarray:
        """``[K, n]``: every table at the points ``(b[i], s[i])`` (flat arrays)."""
        grid_b, top = self.mbs, self.seqlen[-1]
        # Per row of the grid, interpolate along seqlen, once per distinct length: the planner's
        # thousands of candidate micro-batches share a few dozen padded lengths. Then along mbs
        # (linear inside, proportional scaling from the nearest row outside), each point reading
        # its length's rows by index.
        lengths, at = np.unique(s, return_inverse=True)
        rows = self._along_seqlen(self._v, lengths, self._timed)  # [K, R, distinct lengths]
        slope = None
        if self._slope is not None and (np.any(lengths > top) or np.any(b > grid_b[-1])):
            # ms per sample (the last size step's) at each length: a time, whatever table it steps.
            slope = self._along_seqlen(self._slope, lengths, np.ones(len(self._v), dtype=bool))[:, 0, :]
            if np.any(lengths > top):
                # A time beyond the longest length: each size's last measured time, plus its samples
                # times the growth of the per-sample time. A micro-batch's fixed cost (a launch-bound
                # small size's) stays fixed, as past the largest size; each row extrapolated on its
                # own read noise in three small, launch-bound points as growth: two 2,048-token
                # samples priced 6% above one on a CPU profile of 64-256 tokens (measured: 1.79x).
                grown = self._v[:, :, -1:] + self.mbs[None, :, None] * (slope - self._slope[:, 0, -1:])[:, None, :]
                rows = np.where(self._timed[:, None, None] & (lengths > top), grown, rows)
        # Beyond the longest measured length each row follows its own curve, which can carry
        # a smaller size's row above a larger one's: there, more samples never cost less. (Inside
        # the grid the measurements stand as measured.)
        if np.any(lengths > top):
            rows = np.where(lengths > top, np.maximum.accumulate(rows, axis=1), rows)
        first, last = rows[:, 0, at], rows[:, -1, at]  # [K, points]
        if len(grid_b) == 1:
            out = first * b / grid_b[0]
        else:
            idx = np.clip(np.searchsorted(grid_b, b) - 1, 0, len(grid_b) - 2)
            r0, r1 = rows[:, idx, at], rows[:, idx + 1, at]
            b0, b1 = grid_b[idx], grid_b[idx + 1]
            inside = r0 + (r1 - r0) * ((b - b0) / (b1 - b0))
            below = first * b / grid_b[0]
            above = last * b / grid_b[-1]
            if self._slope is not None and np.any(b > grid_b[-1]):
                # Each profile's largest size predicted from the two below it (an H200 profile, two
                # CPU ones): this misses by 7% (backward) and 29% (forward) on average on the GPU,
                # where proportional scaling, paying the fixed cost again per grid-top of samples,
                # misses by 40% and 56%; on the CPUs by 11-29% against 13-36%.
                grown = last + (b - grid_b[-1]) * slope[:, at]
                above = grown if self._timed.all() else np.where(self._timed[:, None], grown, above)
            out = np.where(b < grid_b[0], below, np.where(b > grid_b[-1], above, inside))
        return out


def interp_axis(grid: np.ndarray, values: list, x: np.ndarray, reference: Optional[list] = None,
                timed=True) -> np.ndarray:
    """Values at ``x`` along one grid axis from ``values[k]`` (arrays) at ``grid[k]``: linear
    inside the grid, the first point's value below it, and above it :func:`extrapolate`
    (attention grows faster than linearly in the length); with ``reference`` (a reference
    series' values at every grid point), that series' growth for every value, so that values
    ordered at the grid's end stay ordered beyond it. ``timed``: a flag, or one per entry of
    the values' first axis (fields): which hold times (ms) rather than memory (MiB)."""
    x = np.asarray(x, dtype=np.float64)
    if len(grid) == 1:
        return np.broadcast_to(values[0], np.broadcast(values[0], x).shape).copy()
    arrays = np.broadcast_arrays(*values, x)
    stack, x = np.stack(arrays[:-1]), arrays[-1]
    idx = np.clip(np.searchsorted(grid, x) - 1, 0, len(grid) - 2)
    x0, x1 = grid[idx], grid[idx + 1]
    v0 = np.take_along_axis(stack, idx[None, ...], 0)[0] if stack.ndim > 1 else stack[idx]
    v1 = np.take_along_axis(stack, (idx + 1)[None, ...], 0)[0] if stack.ndim > 1 else stack[idx + 1]
    w = np.clip((x - x0) / (x1 - x0), 0.0, 1.0)
    inside = v0 + (v1 - v0) * w
    if not np.any(x > grid[-1]):
        return inside
    ref = stack if reference is None else np.stack(np.broadcast_arrays(*reference, x)[:-1])
    beyond = np.maximum(x, grid[-1])
    timed = np.asarray(timed, dtype=bool)
    if timed.ndim:
        timed = timed[(slice(None),) + (None,) * (stack.ndim - 2)]
    ref_last = ref[-1]
    growth = extrapolate(grid, np.moveaxis(ref, 0, -1), beyond, timed) / np.where(ref_last > 0, ref_last, 1.0)
    above = stack[-1] * growth
    if np.any(ref_last <= 0):
        # A reference that ends at 0 has no growth to lend: each value grows on its own then.
        above = np.where(ref_last > 0, above, extrapolate(grid, np.moveaxis(stack, 0, -1), beyond, timed))
    return np.where(x > grid[-1], above, inside)


class DecoderTable:
    """The decoder layer's quantities over (mbs, dec_seqlen, seqlen): values ``[F, mbs,
    dec_seqlen, seqlen]`` (F fields; ``timed``: one flag per field), a 2-D (mbs, dec_seqlen)
    table per field and encoder length, all evaluated in one pass, then interpolated along
    the encoder length; returns ``[F, *shape]``."""

    def __init__(self, mbs: np.ndarray, dec: np.ndarray, enc: np.ndarray, values: np.ndarray, timed) -> None:
        values = np.asarray(values, dtype=np.float64)
        self.enc, self.top_mbs = enc, float(mbs[-1])
        self.fields, k = values.shape[0], len(enc)
        self.timed = np.broadcast_to(np.asarray(timed, dtype=bool), (self.fields,))
        stacked = np.moveaxis(values, 3, 1).reshape(self.fields * k, len(mbs), len(dec))
        self.slices = ProfileTable(mbs, dec, stacked, timed=np.repeat(np.asarray(timed, dtype=bool), k))

    def _per_encoder_length(self, b, s_dec) -> np.ndarray:
        out = self.slices(b, s_dec)
        return out.reshape((self.fields, len(self.enc)) + out.shape[1:])

    def __call__(self, b, s_dec, s_enc) -> np.ndarray:
        # Every argument at the call's shape: the fields' axis then lines up with s_enc's.
        b, s_dec, s_enc = np.broadcast_arrays(*(np.asarray(x, dtype=np.float64) for x in (b, s_dec, s_enc)))
        reference = None
        if len(self.enc) > 1 and bool(np.any(s_enc > self.enc[-1])):
            # Beyond the longest encoder length every micro-batch size grows as the largest
            # measured one does (the most compute-bound series): one growth for all sizes keeps
            # more samples never cheaper than fewer, which a curve per size can cross.
            top = self._per_encoder_length(self.top_mbs, s_dec)
            reference = [top[:, i] for i in range(len(self.enc))]
        tables = self._per_encoder_length(b, s_dec)
        return interp_axis(self.enc, [tables[:, i] for i in range(len(self.enc))], s_enc, reference, self.timed)


class OpTables:
    """One op's tables (``fw_ms``, ``bw_ms``, ``stored_mib``, ``peak_mib``, and ``bw_weight_ms``
    where measured), evaluated together: ``tables(*args)`` is ``{field: values}``;
    ``tables[field](*args)`` one field."""

    def __init__(self, names: tuple, table) -> None:
        self.names, self.table = names, table

    def __call__(self, *args) -> dict:
        return dict(zip(self.names, self.table(*args)))

    def __contains__(self, field: str) -> bool:
        return field in self.names

    def __getitem__(self, field: str):
        i = self.names.index(field)
        return lambda *args: self.table(*args)[i]
