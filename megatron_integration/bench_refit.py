"""Refit a cost profile's per-shape times from the ops a training run executed.

The profiler times each shape alone, in a tight loop, one process on the machine. A
training rank runs the same shapes interleaved with other shapes, the optimizer and
transfers, while the other ranks compute on the same machine: caches and memory
bandwidth are shared and nothing stays warm. The slowdown is not one factor. On the
2-core machine of the representative bench, short micro-batches (a fixed cost per op
that the profile's tight loop amortises) and 512-token rows (attention score tensors
that no longer fit the shared cache next to the other rank's) run 1.4-2x slower than
profiled, mid-sized ones 1.1-1.25x. A line ``measured = slope * predicted + intercept``
through such points gets a steep slope and a negative intercept: it prices small
micro-batches as cheaper than profiled, the opposite of what runs.

:func:`refit_factors` fits, for forwards and backwards separately, one multiplicative
correction per cell of the profile's ``(mbs, seqlen)`` grid: the log of measured over
predicted time of every executed op is a bilinear blend of the log factors at the
grid cells around its shape (the interpolation the profile itself uses), solved by
least squares with a Huber weight (a few ops slowed by an unrelated process do not
move a cell) and a ridge pull towards the median log ratio (cells no op touched take the
typical slowdown rather than none). :func:`refit_profile` multiplies every time table of
the profile by its factors, so every method's planning and simulation price shapes as
executed. :func:`shape_errors` reports how well a model predicts executed ops, per size.
Pure numpy: no torch.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import numpy as np

# Upper edges (padded tokens of a micro-batch) of the size classes errors are reported for.
TOKEN_EDGES = (64, 128, 256, 384, 511, 512, 1024, 2048, 4096)


@dataclass(frozen=True)
class ExecutedOps:
    """Forward or backward passes a run executed: shape (``mbs`` rows of ``seqlen`` tokens),
    pipeline ``stage``, ``backward`` (else forward), ``measured_ms`` (wall time of the
    pass) and ``predicted_ms`` (the cost model's time of that stage pass, ms)."""

    mbs: np.ndarray
    seqlen: np.ndarray
    stage: np.ndarray
    backward: np.ndarray
    measured_ms: np.ndarray
    predicted_ms: np.ndarray

    @classmethod
    def from_rows(cls, rows: Sequence[tuple]) -> "ExecutedOps":
        """From ``(mbs, seqlen, stage, backward, measured_ms, predicted_ms)`` tuples."""
        cols = list(zip(*rows)) if rows else [()] * 6
        return cls(*(np.asarray(c, dtype=t) for c, t in zip(cols, (int, int, int, bool, float, float))))

    @classmethod
    def concat(cls, parts: Sequence["ExecutedOps"]) -> "ExecutedOps":
        """All ops of ``parts``, in order."""
        if not parts:
            return cls.from_rows([])
        return cls(*(np.concatenate([getattr(p, f) for p in parts]) for f in
                     ("mbs", "seqlen", "stage", "backward", "measured_ms", "predicted_ms")))

    def __len__(self) -> int:
        return int(self.mbs.size)

    def select(self, mask: np.ndarray) -> "ExecutedOps":
        return ExecutedOps(self.mbs[mask], self.seqlen[mask], self.stage[mask], self.backward[mask],
                           self.measured_ms[mask], self.predicted_ms[mask])


def grid_weights(mbs_grid: Sequence[float], seqlen_grid: Sequence[float], mbs, seqlen) -> np.ndarray:
    """Bilinear weights ``(ops, len(mbs_grid) * len(seqlen_grid))`` of every shape over the
    grid cells (row-major, mbs first); shapes outside the grid take the nearest edge."""
    def axis(grid, x):
        g = np.asarray(grid, dtype=np.float64)
        x = np.clip(np.asarray(x, dtype=np.float64), g[0], g[-1])
        w = np.zeros((x.size, g.size))
        if g.size == 1:
            w[:, 0] = 1.0
            return w
        i = np.clip(np.searchsorted(g, x, side="right") - 1, 0, g.size - 2)
        t = (x - g[i]) / (g[i + 1] - g[i])
        w[np.arange(x.size), i] = 1.0 - t
        w[np.arange(x.size), i + 1] += t
        return w

    wb, ws = axis(mbs_grid, mbs), axis(seqlen_grid, seqlen)
    return (wb[:, :, None] * ws[:, None, :]).reshape(wb.shape[0], wb.shape[1] * ws.shape[1])


def fit_log_factors(weights: np.ndarray, log_ratio: np.ndarray, ridge: float = 1.0, huber: float = 0.15,
                    iterations: int = 8) -> np.ndarray:
    """Log correction per grid cell minimising the Huber loss (threshold ``huber``, in log
    units: 0.15 is about 16%) of ``weights @ x - log_ratio`` plus ``ridge`` times the squared
    distance of every cell from the median log ratio (iteratively reweighted least squares)."""
    cells = weights.shape[1]
    if log_ratio.size == 0:
        return np.zeros(cells)
    prior = float(np.median(log_ratio))
    rw = np.ones(log_ratio.size)
    x = np.full(cells, prior)
    for _ in range(iterations):
        a = weights.T @ (weights * rw[:, None]) + ridge * np.eye(cells)
        b = weights.T @ (rw * log_ratio) + ridge * prior
        x = np.linalg.solve(a, b)
        r = np.abs(weights @ x - log_ratio)
        rw = np.where(r <= huber, 1.0, huber / np.maximum(r, 1e-12))
    return x


@dataclass(frozen=True)
class ShapeRefit:
    """Multiplicative corrections of a profile's forward and backward times per grid cell
    (``fw``/``bw``: ``len(mbs) x len(seqlen)``), fitted on ``ops`` executed ops."""

    mbs: tuple
    seqlen: tuple
    fw: np.ndarray
    bw: np.ndarray
    ops: int

    def factor(self, mbs, seqlen, backward) -> np.ndarray:
        """The correction at each shape (blended over the grid as in the fit)."""
        w = grid_weights(self.mbs, self.seqlen, mbs, seqlen)
        log_fw, log_bw = np.log(self.fw).ravel(), np.log(self.bw).ravel()
        return np.exp(np.where(np.asarray(backward, dtype=bool), w @ log_bw, w @ log_fw))

    def to_json(self) -> dict:
        return {"mbs": list(self.mbs), "seqlen": list(self.seqlen), "ops": self.ops,
                # Significant digits, not decimals: a factor of 0.016 (a profile timed under 60x the
                # load of its calibration) would lose 0.3% to four decimals.
                "fw_factor": _significant(self.fw), "bw_factor": _significant(self.bw)}


def _significant(values: np.ndarray, digits: int = 6) -> list:
    """``values`` (a 2-D array) as nested lists, each rounded to ``digits`` significant digits."""
    return [[float(f"{x:.{digits}g}") for x in row] for row in np.asarray(values, dtype=np.float64)]


def refit_factors(ops: ExecutedOps, mbs_grid: Sequence[float], seqlen_grid: Sequence[float],
                  ridge: float = 1.0, huber: float = 0.15) -> ShapeRefit:
    """Fit the per-cell corrections of forwards and backwards (see the module doc)."""
    keep = (ops.predicted_ms > 0) & (ops.measured_ms > 0)
    ops = ops.select(keep)
    out = {}
    for kind, backward in (("fw", False), ("bw", True)):
        part = ops.select(ops.backward == backward)
        w = grid_weights(mbs_grid, seqlen_grid, part.mbs, part.seqlen)
        x = fit_log_factors(w, np.log(part.measured_ms / part.predicted_ms), ridge, huber)
        out[kind] = np.exp(x).reshape(len(mbs_grid), len(seqlen_grid))
    return ShapeRefit(tuple(mbs_grid), tuple(seqlen_grid), out["fw"], out["bw"], len(ops))


def refit_profile(profile: Mapping[str, Any], refit: ShapeRefit, stage_overhead_ms: float) -> dict:
    """A copy of ``profile`` (the parsed JSON) whose forward and backward tables of every op
    (layer at every recompute level, embedding, output; the layer's weight part with its
    backward) are multiplied by ``refit``'s
    factors and made :func:`monotone`, with ``stage_overhead_ms`` (ms per stage pass, the
    executor's own time); a per-sample attention call's cost by the factors' median."""
    if list(profile["mbs"]) != list(refit.mbs) or list(profile["seqlen"]) != list(refit.seqlen):
        raise ValueError("the refit was fitted on another grid than the profile's")
    out = copy.deepcopy(dict(profile))
    for table in out["ops"].values():
        # A split backward's weight part scales with its backward (its share is kept).
        for key, factor in (("fw_ms", refit.fw), ("bw_ms", refit.bw), ("bw_weight_ms", refit.bw)):
            if key in table:
                table[key] = monotone(np.asarray(table[key], dtype=np.float64) * factor).round(6).tolist()
    calls = out.get("attention_call_ms")
    if calls:
        # Timed in the profiler's tight loop as the tables were: slowed by their median factor.
        factor = {"fw": float(np.median(refit.fw)), "bw": float(np.median(refit.bw))}
        out["attention_call_ms"] = {k: round(float(v) * factor[k], 6) for k, v in calls.items()}
    out["stage_overhead_ms"] = round(float(stage_overhead_ms), 4)
    return out


def monotone(table: np.ndarray) -> np.ndarray:
    """``table`` (mbs x seqlen) raised where a larger shape was timed faster than a smaller one
    (running maximum along both axes): a profile measured on a busy machine can hold such
    cells, and the planner would then merge samples into the shape that was timed while the
    machine happened to be quieter."""
    return np.maximum.accumulate(np.maximum.accumulate(table, axis=1), axis=0)


def size_class(tokens: int) -> str:
    """The label of the size class of a micro-batch of ``tokens`` padded tokens."""
    lo = 0
    for edge in TOKEN_EDGES:
        if tokens <= edge:
            return f"{lo + 1}-{edge}" if edge != lo + 1 else f"{edge}"
        lo = edge
    return f">{TOKEN_EDGES[-1]}"


def shape_errors(ops: ExecutedOps) -> list[dict]:
    """Per size class (padded tokens) and pass: ops, their total measured and predicted ms,
    the ratio of the totals, and the median and mean absolute relative error of single ops."""
    rows = []
    tokens = ops.mbs * ops.seqlen
    classes = np.array([size_class(int(t)) for t in tokens]) if len(ops) else np.array([], dtype=str)
    order = sorted(set(classes.tolist()), key=lambda c: tokens[classes == c].min())
    for c in order:
        for backward in (False, True):
            m = (classes == c) & (ops.backward == backward)
            if not m.any():
                continue
            meas, pred = ops.measured_ms[m], ops.predicted_ms[m]
            rel = meas / pred - 1.0
            rows.append({"tokens": c, "pass": "backward" if backward else "forward", "ops": int(m.sum()),
                         "measured_ms": round(float(meas.sum()), 1), "predicted_ms": round(float(pred.sum()), 1),
                         "ratio": round(float(meas.sum() / pred.sum()), 3),
                         "median_error": round(float(np.median(rel)), 3),
                         "mean_abs_error": round(float(np.mean(np.abs(rel))), 3)})
    return rows


def total_error(ops: ExecutedOps) -> dict:
    """Over all ops: the ratio of total measured to predicted ms and the mean absolute
    relative error of single ops."""
    if not len(ops):
        return {"ops": 0}
    rel = ops.measured_ms / ops.predicted_ms - 1.0
    return {"ops": len(ops), "ratio": round(float(ops.measured_ms.sum() / ops.predicted_ms.sum()), 3),
            "mean_abs_error": round(float(np.mean(np.abs(rel))), 3)}
