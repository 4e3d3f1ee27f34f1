"""The profile cost model's interpolation tables, evaluated stacked.

The planner prices every candidate micro-batch of an iteration on every stage; a T5 stage's
decoder layer alone is four fields times one (mbs, dec_seqlen) table per encoder length. The
tables of one grid are evaluated in one pass (``ProfileTable`` with ``[K, mbs, seqlen]`` values); a
stacked evaluation must follow the tables' rules (written out here row by row, independently
of ``ProfileTable``: linear inside the grid; beyond the longest length the largest of a power
law, a line and an upward parabola, a time's capped at quadratic growth and grown through its
per-sample part; more samples never cheaper, a time's
growth by the last step's slope, memory's in proportion), give what
each table gives alone (to the bit inside the measured lengths, to the last bits beyond them),
and inside them exactly what ``np.interp`` row by row gives.
"""
from __future__ import annotations

import numpy as np
import pytest

from dynapipe.cost.profile_tables import DecoderTable, OpTables, ProfileTable


def _grid(rng, size, low, high, step):
    return np.sort(rng.choice(np.arange(low, high, step), size, replace=False)).astype(np.float64)


def _case(rng):
    mbs, seq = _grid(rng, int(rng.integers(1, 5)), 1, 17, 1), _grid(rng, int(rng.integers(1, 6)), 8, 4096, 8)
    k = int(rng.integers(1, 5))
    values = np.abs(rng.normal(size=(k, len(mbs), len(seq))) * 10 + np.linspace(0, 30, len(seq)))
    if len(seq) > 1:
        values[0, :, -1] = values[0, :, -2]  # a flat last step: power 0
    timed = rng.random(k) < 0.5
    return mbs, seq, values, timed


def _queries(rng, mbs, seq, n=48):
    s = np.concatenate([seq, rng.integers(1, int(seq[-1]) * 2, n - len(seq)).astype(np.float64)])
    b = rng.integers(1, 3 * int(mbs[-1]) + 2, len(s)).astype(np.float64)
    return b, s


def _ref_power(grid, row, s):
    """The power law of a row's last two points (exponent within [0, 2]) at ``s``."""
    power = np.clip(np.log(max(row[-1], 1e-12) / max(row[-2], 1e-12)) / np.log(grid[-1] / grid[-2]), 0.0, 2.0)
    return row[-1] * (np.maximum(s, grid[-1]) / grid[-1]) ** power


def _ref_tail(grid, row, s, timed):
    """Beyond the grid: the largest of the power law, the line through the last two points and
    the parabola through the last three (Lagrange's form) where it opens upward and its first
    two points do not fall; a time at
    most its last value times (s / last length) ** 2."""
    s = np.maximum(s, grid[-1])
    line = row[-1] + (row[-1] - row[-2]) / (grid[-1] - grid[-2]) * (s - grid[-1])
    out = np.maximum(_ref_power(grid, row, s), line)
    if len(grid) > 2:
        x, y = grid[-3:], row[-3:]
        terms = [y[i] * np.prod([(s - x[j]) / (x[i] - x[j]) for j in range(3) if j != i], axis=0) for i in range(3)]
        lead = sum(y[i] / np.prod([x[i] - x[j] for j in range(3) if j != i]) for i in range(3))
        if lead > 0 and y[1] >= y[0]:  # opening upward, through points that rise
            out = np.maximum(out, sum(terms))
    return np.minimum(out, row[-1] * (s / grid[-1]) ** 2) if timed else out


def _ref_along(grid, row, s, timed):
    """One row along the length: np.interp inside, :func:`_ref_tail` above."""
    inside = np.interp(s, grid, row)
    if len(grid) < 2:
        return inside
    return np.where(s > grid[-1], _ref_tail(grid, row, s, timed), inside)


def _reference(mbs, seq, values, timed, b, s):
    """The extrapolation rules of one (mbs, seqlen) table written out row by row, as the
    profile cost model's docstrings state them, independently of ``ProfileTable``."""
    b, s = np.broadcast_arrays(np.asarray(b, dtype=np.float64), np.asarray(s, dtype=np.float64))
    rows = np.stack([_ref_along(seq, r, s, timed) for r in values])
    if timed and len(mbs) > 1:
        # Beyond the longest length a size's time is its last one plus its samples times the
        # growth of the last size step's ms per sample.
        slope = np.maximum.accumulate(np.maximum(values[-1] - values[-2], 0.0) / (mbs[-1] - mbs[-2]))
        per_row = (slice(None),) + (None,) * s.ndim
        grown = values[:, -1][per_row] + mbs[per_row] * (_ref_along(seq, slope, s, True) - slope[-1])
        rows = np.where(s > seq[-1], grown, rows)
    rows = np.where(s > seq[-1], np.maximum.accumulate(rows, axis=0), rows)  # more samples never cost less
    if len(mbs) == 1:
        return rows[0] * b / mbs[0]
    idx = np.clip(np.searchsorted(mbs, b) - 1, 0, len(mbs) - 2)
    r0, r1 = np.take_along_axis(rows, idx[None], 0)[0], np.take_along_axis(rows, (idx + 1)[None], 0)[0]
    inside = r0 + (r1 - r0) * ((b - mbs[idx]) / (mbs[idx + 1] - mbs[idx]))
    below, above = rows[0] * b / mbs[0], rows[-1] * b / mbs[-1]
    if timed:  # a time grows past the largest size by the last step's slope, never below a shorter length's
        slope = np.maximum.accumulate(np.maximum(values[-1] - values[-2], 0.0) / (mbs[-1] - mbs[-2]))
        above = rows[-1] + (b - mbs[-1]) * _ref_along(seq, slope, s, True)
    return np.where(b < mbs[0], below, np.where(b > mbs[-1], above, inside))


@pytest.mark.parametrize("seed", range(6))
def test_stacked_tables_follow_the_rules_written_out(seed):
    rng = np.random.default_rng(200 + seed)
    for _ in range(40):
        mbs, seq, values, timed = _case(rng)
        b, s = _queries(rng, mbs, seq)
        out = ProfileTable(mbs, seq, values, timed=timed)(b, s)
        for i in range(len(values)):
            want = _reference(mbs, seq, values[i], bool(timed[i]), b, s)
            np.testing.assert_allclose(out[i], want, rtol=1e-11, atol=0)


@pytest.mark.parametrize("seed", range(6))
def test_stacked_tables_give_what_each_table_gives_alone(seed):
    rng = np.random.default_rng(seed)
    for _ in range(40):
        mbs, seq, values, timed = _case(rng)
        stacked = ProfileTable(mbs, seq, values, timed=timed)
        b, s = _queries(rng, mbs, seq)
        for args in ((b, s), (2.0, float(seq[-1]) * 1.5), (b[:12].reshape(3, 4), s[:12].reshape(3, 4))):
            together = stacked(*args)
            inside = np.broadcast_to(np.asarray(args[1]) <= seq[-1], np.shape(together[0]))
            for i in range(len(values)):
                alone = ProfileTable(mbs, seq, values[i], timed=bool(timed[i]))(*args)
                assert np.shape(together[i]) == np.shape(alone)
                # Bit for bit inside the measured lengths; beyond them numpy's power may take
                # another loop for another array shape (a last-bit difference).
                np.testing.assert_array_equal(np.where(inside, together[i], 0), np.where(inside, alone, 0))
                np.testing.assert_allclose(together[i], alone, rtol=1e-15, atol=0)


@pytest.mark.parametrize("seed", range(3))
def test_many_points_of_few_shapes_price_each_shape_as_alone(seed):
    # The planner's candidates: thousands of points, a few dozen (samples, length) pairs. Each
    # distinct shape is priced once and every point reads it; the result is the rules', bit for
    # bit what the shape gives alone, for whole and fractional shapes alike.
    rng = np.random.default_rng(300 + seed)
    for _ in range(20):
        mbs, seq, values, timed = _case(rng)
        b0, s0 = _queries(rng, mbs, seq, n=30)
        if rng.random() < 0.3:
            s0 = s0 + 0.5  # not whole: no shared key, every point priced on its own
        pick = rng.integers(0, len(b0), 900)
        b, s = b0[pick].reshape(30, 30), s0[pick].reshape(30, 30)
        table = ProfileTable(mbs, seq, values, timed=timed)
        many = table(b, s)
        assert many.shape == (len(values), 30, 30)
        assert table(np.zeros((0, 3)), np.zeros((0, 3))).shape == (len(values), 0, 3)  # no points: no prices
        for i in range(len(values)):
            alone = np.stack([table(b0[j:j + 1], s0[j:j + 1])[i, 0] for j in range(len(b0))])
            np.testing.assert_array_equal(many[i], alone[pick].reshape(30, 30))
            np.testing.assert_allclose(many[i], _reference(mbs, seq, values[i], bool(timed[i]), b, s),
                                       rtol=1e-11, atol=0)


def _interp_reference(mbs, seq, values, b, s):
    """The tables' rule inside the measured lengths and sizes: each mbs row interpolated along
    the length by ``np.interp``, then linearly between the rows."""
    rows = np.stack([np.interp(s, seq, r) for r in values])
    idx = np.clip(np.searchsorted(mbs, b) - 1, 0, max(len(mbs) - 2, 0))
    if len(mbs) == 1:
        return rows[0] * b / mbs[0]
    r0 = np.take_along_axis(rows, idx[None], 0)[0]
    r1 = np.take_along_axis(rows, (idx + 1)[None], 0)[0]
    return r0 + (r1 - r0) * ((b - mbs[idx]) / (mbs[idx + 1] - mbs[idx]))


@pytest.mark.parametrize("seed", range(4))
def test_inside_the_grid_a_table_is_np_interp_to_the_bit(seed):
    rng = np.random.default_rng(100 + seed)
    for _ in range(40):
        mbs, seq, values, timed = _case(rng)
        s = np.concatenate([seq, rng.uniform(seq[0], seq[-1], 40)])
        b = rng.uniform(mbs[0], mbs[-1], len(s)) if len(mbs) > 1 else np.full(len(s), mbs[0])
        out = ProfileTable(mbs, seq, values, timed=timed)(b, s)
        for i in range(len(values)):
            np.testing.assert_array_equal(out[i], _interp_reference(mbs, seq, values[i], b, s))


def test_a_decoder_layers_fields_are_each_their_own_table():
    rng = np.random.default_rng(7)
    mbs, dec, enc = np.array([1.0, 2, 4]), np.array([16.0, 64, 256]), np.array([64.0, 256, 1024])
    fields = np.abs(rng.normal(size=(4, 3, 3, 3))) * 5 + np.arange(3)  # [field, mbs, dec, enc]
    timed = np.array([True, True, False, False])
    together = DecoderTable(mbs, dec, enc, fields, timed)
    b = rng.integers(1, 10, 30).astype(np.float64)
    s_dec, s_enc = rng.integers(8, 400, 30).astype(np.float64), rng.integers(32, 2000, 30).astype(np.float64)
    for args in ((b, s_dec, s_enc), (2, 48, np.linspace(16, 2048, 7)), (3, 100.0, 700.0)):
        out = together(*args)
        for f in range(4):
            alone = DecoderTable(mbs, dec, enc, fields[f:f + 1], timed[f:f + 1])(*args)[0]
            assert out[f].shape == alone.shape == np.broadcast(*args).shape
            np.testing.assert_array_equal(out[f], alone)


def _decoder_reference(mbs, dec, enc, values, timed, b, s_dec, s_enc):
    """A decoder-layer field written out: its (mbs, dec_seqlen) table at each encoder length,
    then linear along the encoder length inside the grid, the first length's value below it,
    and above it the growth of the largest size's series (:func:`_ref_tail`)."""
    b, s_dec, s_enc = np.broadcast_arrays(*(np.asarray(x, dtype=np.float64) for x in (b, s_dec, s_enc)))
    at = [_reference(mbs, dec, values[:, :, k], timed, b, s_dec) for k in range(len(enc))]
    if len(enc) == 1:
        return at[0]
    k = np.clip(np.searchsorted(enc, s_enc) - 1, 0, len(enc) - 2)
    v0, v1 = np.choose(k, at), np.choose(k + 1, at)
    inside = v0 + (v1 - v0) * np.clip((s_enc - enc[k]) / (enc[k + 1] - enc[k]), 0.0, 1.0)
    top = np.stack([_reference(mbs, dec, values[:, :, j], timed, np.full_like(b, mbs[-1]), s_dec)
                    for j in range(len(enc))], axis=-1)
    above = np.empty_like(inside)
    for i in range(len(above)):  # point by point: the largest size's growth, applied to this size's value
        grown = _ref_tail(enc, top[i], s_enc[i], timed)
        above[i] = at[-1][i] * grown / top[i][-1]
    return np.where(s_enc > enc[-1], above, inside)


@pytest.mark.parametrize("seed", range(4))
def test_a_decoder_layers_tables_follow_the_rules_written_out(seed):
    rng = np.random.default_rng(300 + seed)
    for _ in range(20):
        mbs, dec = _grid(rng, int(rng.integers(1, 4)), 1, 9, 1), _grid(rng, int(rng.integers(2, 5)), 8, 512, 8)
        enc = _grid(rng, int(rng.integers(1, 5)), 16, 2048, 16)
        fields = np.abs(rng.normal(size=(3, len(mbs), len(dec), len(enc))) * 4) + np.linspace(1, 9, len(enc))
        timed = np.array([True, False, bool(rng.random() < 0.5)])
        n = 24
        b = rng.integers(1, 3 * int(mbs[-1]) + 2, n).astype(np.float64)
        s_dec = rng.integers(1, int(dec[-1]) * 2, n).astype(np.float64)
        s_enc = rng.integers(1, int(enc[-1]) * 2, n).astype(np.float64)
        out = DecoderTable(mbs, dec, enc, fields, timed)(b, s_dec, s_enc)
        for f in range(len(fields)):
            want = _decoder_reference(mbs, dec, enc, fields[f], bool(timed[f]), b, s_dec, s_enc)
            np.testing.assert_allclose(out[f], want, rtol=1e-13, atol=0)


def test_op_tables_name_their_fields():
    mbs, seq = np.array([1.0, 2.0]), np.array([64.0, 128.0])
    values = np.arange(8, dtype=np.float64).reshape(2, 2, 2) + 1
    op = OpTables(("fw_ms", "stored_mib"), ProfileTable(mbs, seq, values, timed=np.array([True, False])))
    both = op(np.array([1.0, 3.0]), np.array([96.0, 96.0]))
    assert set(both) == {"fw_ms", "stored_mib"} and "bw_weight_ms" not in op and "fw_ms" in op
    np.testing.assert_array_equal(op["stored_mib"](np.array([1.0, 3.0]), np.array([96.0, 96.0])), both["stored_mib"])
    # Past the largest size a time grows by the last step's slope (3.5 at mbs 2, + 2 a sample),
    # memory proportionally (7.5 at mbs 2, x 3/2).
    assert both["fw_ms"][1] == pytest.approx(5.5) and both["stored_mib"][1] == pytest.approx(11.25)
    assert both["fw_ms"][0] == pytest.approx(1.5) and both["stored_mib"][0] == pytest.approx(5.5)
