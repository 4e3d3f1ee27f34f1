"""Calibrating the cost profile from a short executed DynaPipe run.

The profiler times each op (layer, embedding, output) alone, in a tight loop, one
process on the machine. A micro-batch on a training rank pays more: the stage handler
around the ops, the executor's dispatch, input loading and transfer posting, and on a
shared machine the other ranks' use of caches and memory bandwidth.

:func:`executed_ops` reads every forward and backward a run executed from its executor
traces, with the profile's prediction for its shape and stage, and
:func:`executor_ms_per_op` the executor's own time per op outside compute and waiting
(from :mod:`megatron_integration.bench_breakdown`). :func:`refit_from_run` refits the
profile's times per shape from them (:mod:`megatron_integration.bench_refit`): what the
bench plans with. :func:`fit_stage_overhead` is the single line
``measured = slope * predicted + intercept`` through the same ops, kept as the
comparison the JSON records (and for :func:`write_calibrated_profile`, which writes
only a fixed cost per op): on the representative preset its intercept is negative
because long rows run further above the profile than mid-sized ones, so a line cannot
price small micro-batches right.

Every executed op is priced at the recompute level it ran (:func:`op_level`): the level its
trace records, else the level the run planned every op at (its ``--dynapipe-recompute``, which
the caller passes; ``none`` unless told). A recomputing backward priced without its
recomputation would read the extra forward as a slow backward and scale every backward table
of the profile by it. A run of ``--dynapipe-recompute auto`` (the search chooses per stage)
whose traces do not record the levels is refused in one line.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, replace
from typing import Any, Mapping, Optional, Sequence

import numpy as np


def calibration_argv(seed: int) -> list[str]:
    """The flags that give the calibration run other global batches than the timed runs train
    (the sampler and the mock data are seeded by ``--seed``, here ``seed`` + 1): the fit is
    then judged on ops it never saw. The model's initial weights change too, which the
    timing of an op does not depend on."""
    return ["--seed", str(int(seed) + 1)]


@dataclass(frozen=True)
class OverheadFit:
    """The fit of measured against predicted op times (ms): ``slope`` and ``intercept``
    of the least-squares line over ``ops`` ops, ``executor_ms`` the executor's own time
    per op, and ``stage_overhead_ms`` the fixed cost per op in the profile's units."""

    slope: float
    intercept_ms: float
    executor_ms: float
    stage_overhead_ms: float
    ops: int

    def to_json(self) -> dict:
        return {k: round(v, 4) if isinstance(v, float) else v for k, v in asdict(self).items()}


#: The least slope a fit may have to be read as a fixed cost per op. Below it the executed times
#: barely grow with the profiled ones, which a per-op cost cannot explain: the fit is noise
#: (measured on a 2-core host: one fitted T5 iteration gave 0.28 x profiled + 11.9 ms; priced
#: with that, DynaPipe cut coarse micro-batches, padding efficiency 0.72 against 0.92, and
#: measured 1.13x packing against 1.57x the same day uncalibrated).
MIN_FIT_SLOPE = 0.5


def fit_stage_overhead(predicted: np.ndarray, measured: np.ndarray, executor_ms: float) -> OverheadFit:
    """Fit ``measured = slope * predicted + intercept`` (ms) and turn it into the fixed
    cost per stage op in the profile's units (see the module doc); a negative intercept
    counts as none, and a fit of slope below :data:`MIN_FIT_SLOPE` as noise (only the
    executor's own time per op is kept)."""
    slope, intercept = 1.0, 0.0
    if len(predicted) >= 2 and float(np.ptp(predicted)) > 0.0:
        s, i = (float(v) for v in np.polyfit(predicted, measured, 1))
        # Times that do not grow with the predicted cost are noise (a loaded machine, shapes too
        # alike): no fixed cost can be read from them, only the executor's own time is kept.
        if s >= MIN_FIT_SLOPE:
            slope, intercept = s, i
    overhead = (max(intercept, 0.0) + max(executor_ms, 0.0)) / slope
    return OverheadFit(slope, intercept, executor_ms, overhead, int(len(predicted)))


#: The argument of a traced op naming the recompute level it ran at, where the stage handlers'
#: ``trace_note`` records it (:mod:`dynapipe.runtime.contract`).
LEVEL_ARG = "recompute"


def op_level(args: Mapping[str, Any], recompute: Optional[str], trace_dir: str) -> str:
    """The recompute level a traced op (its trace ``args``) ran at: the one its trace records,
    else ``recompute``, the level the run planned every op at. Neither (a run of
    ``--dynapipe-recompute auto``, whose search chose per stage, traced without levels): a
    one-line :class:`DynaPipeError`, since pricing its backwards at no recompute would read
    a recomputing op's extra forward as a slow backward and inflate every backward table."""
    from dynapipe.cost.base import check_recompute
    from dynapipe.errors import DynaPipeError

    level = args.get(LEVEL_ARG, recompute)
    if level is None:
        raise DynaPipeError(f"calibration: the executor traces in {trace_dir} do not record the recompute level of "
                            f"each op, and the run let the planner choose one per stage (--dynapipe-recompute "
                            f"auto): its backwards cannot be priced at the level they ran. Give the run "
                            f"--dynapipe-recompute none (or the level it needs), or skip calibration with "
                            f"--calibrate-iters 0.")
    return check_recompute(level)


def executed_ops(trace_dir: str, cost, iterations: Sequence[int], recompute: Optional[str] = "none"):
    """Every forward and backward (a split one's two parts summed) of the ``iterations`` in
    the executor traces of ``trace_dir``, with what ``cost`` predicts for it at the recompute
    level it ran (:func:`op_level`; ``recompute``: the run's ``--dynapipe-recompute`` level,
    None for ``auto``) and its stage: its stage pass without the fixed ``stage_overhead_ms``,
    which the executor pays outside the pass, ms; as
    :class:`~megatron_integration.bench_refit.ExecutedOps`."""
    from dynapipe.cost.attention_density import AttentionDensity
    from megatron_integration.bench_refit import ExecutedOps
    from megatron_integration.bench_report import _trace_events, passes

    fixed = float(getattr(cost, "stage_overhead_ms", 0.0))
    rows = []
    for _rank, (_origin, per) in _trace_events(trace_dir, set(iterations)).items():
        for i in iterations:
            for e in passes(per.get(i, [])):  # a split backward's parts summed into one backward
                a, stage, backward = e.get("args", {}), e.get("tid", 0), e["cat"] == "backward"
                # A recomputing backward also runs (part of) the forward again: priced without
                # it, the refit would scale every backward table by that extra work.
                # Per-sample packed rows at the share of their pairs the op computed (its trace note).
                density = AttentionDensity(**a["attention"]) if a.get("attention") else None
                c = cost.stage_cost(a["mbs"], a["seqlen"], stage=stage, recompute=op_level(a, recompute, trace_dir),
                                    attention=density)
                pred = float(c.bw_ms if backward else c.fw_ms) - fixed
                rows.append((a["mbs"], a["seqlen"], stage, backward, e["dur"] / 1e3, pred))
    return ExecutedOps.from_rows(rows)


def executor_ms_per_op(ranks: list[dict], trace_dir: str, iterations: Sequence[int]) -> float:
    """The executor's own time per stage pass (ms: its overhead and transfer posting over the
    forwards and backwards it ran), mean over ranks and ``iterations``."""
    from megatron_integration.bench_breakdown import executor_timeline
    from megatron_integration.bench_report import _trace_events

    per_op = []
    for rank, (origin, per) in _trace_events(trace_dir, set(iterations)).items():
        for i in iterations:
            if per.get(i):
                t = executor_timeline(per[i], origin, ranks[rank], i)
                if t.micro_batches:
                    per_op.append((t.overhead_ms + t.posting_ms) / (2 * t.micro_batches))
    return float(np.mean(per_op)) if per_op else 0.0


def refit_from_run(ranks: list[dict], trace_dir: str, profile_path: str, cost, iterations: Sequence[int],
                   output: str, recompute: Optional[str] = "none") -> dict:
    """Refit the profile at ``profile_path`` (which ``cost`` was built from) per shape from the
    ops of a DynaPipe run (:func:`megatron_integration.bench_refit.refit_factors`), each
    priced at the recompute level it ran (``recompute``: the run's ``--dynapipe-recompute``,
    as for :func:`executed_ops`), with the executor's own time per op as
    ``stage_overhead_ms``; write it to ``output``. Returns what the JSON records: the
    factors, the line fit for comparison, and the errors per size class of the profile
    before and after (on the same ops, so in-sample)."""
    from megatron_integration import bench_refit as br

    ops = executed_ops(trace_dir, cost, iterations, recompute)  # first: it refuses what it cannot price
    with open(profile_path) as f:
        profile = json.load(f)
    executor_ms = executor_ms_per_op(ranks, trace_dir, iterations)
    line = fit_stage_overhead(ops.predicted_ms, ops.measured_ms, executor_ms) if len(ops) else None
    refit = br.refit_factors(ops, profile["mbs"], profile["seqlen"])
    out = br.refit_profile(profile, refit, executor_ms)
    after = replace_predicted(ops, ops.predicted_ms * refit.factor(ops.mbs, ops.seqlen, ops.backward))
    info = {"method": "per-shape refit", "executor_ms": round(executor_ms, 4), "refit": refit.to_json(),
            "line_fit": None if line is None else line.to_json(),
            "error_before": {"total": br.total_error(ops), "per_size": br.shape_errors(ops)},
            "error_after": {"total": br.total_error(after), "per_size": br.shape_errors(after)}}
    out["calibration"] = info
    with open(output, "w") as f:
        json.dump(out, f, indent=1)
    return info


def replace_predicted(ops, predicted: np.ndarray):
    """``ops`` with other predicted times (ms)."""
    return replace(ops, predicted_ms=np.asarray(predicted, dtype=np.float64))


def write_calibrated_profile(profile_path: str, output: str, fit: OverheadFit) -> str:
    """The profile at ``profile_path`` with ``stage_overhead_ms`` from ``fit`` (and the fit
    itself under ``calibration``), written to ``output``; returns ``output``."""
    with open(profile_path) as f:
        profile = json.load(f)
    profile["stage_overhead_ms"] = round(fit.stage_overhead_ms, 4)
    profile["calibration"] = fit.to_json()
    with open(output, "w") as f:
        json.dump(profile, f, indent=1)
    return output
