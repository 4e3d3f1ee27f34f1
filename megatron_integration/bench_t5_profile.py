"""``bench --model t5``: the T5 cost profile it plans with, and how well that profile predicted.

Before the timed runs the bench measures an encoder-decoder profile of this machine
(:mod:`megatron_integration.t5_profiler`, one spawned rank with a training rank's threads)
over a grid that covers the run's lengths; DynaPipe's cuts, the ``auto`` stage placement
and the simulation are priced with it. After the runs, :func:`stage_check` compares, per
pipeline stage, the compute the profile predicted for the ops a run executed (its traced
forwards and backwards at their shapes) with the executed compute, so a reader sees
whether the model has the encoder/decoder balance right, and :func:`compute_floor_check` sets
each method's predicted compute against the least any batching of the timed batches needs.
Times in ms.
"""
from __future__ import annotations

import time
from typing import Optional, Sequence

import numpy as np

from megatron_integration.bench_report import passes

PROFILE_MBS = (1, 2, 4)
MIN_SEQLEN, MIN_DEC_SEQLEN = 64, 32


def _doubling(start: int, stop: int) -> list[int]:
    """``start, 2 start, ...`` below ``stop``, then ``stop`` (tokens)."""
    out, s = [], start
    while s < stop:
        out.append(s)
        s *= 2
    return out + [stop]


def profile_grids(encoder_seq_length: int, decoder_seq_length: int) -> tuple[list[int], list[int], list[int]]:
    """(mbs, seqlen, dec_seqlen) grid of the bench's profile: doublings up to the run's
    longest encoder input and decoder target (tokens), micro-batches of 1, 2 and 4
    samples (larger ones scale linearly from 4)."""
    return (list(PROFILE_MBS), _doubling(min(MIN_SEQLEN, encoder_seq_length), encoder_seq_length),
            _doubling(min(MIN_DEC_SEQLEN, decoder_seq_length), decoder_seq_length))


def measure_bench_profile(cfg, output: str, threads: int, timeout_s: float, repeats: int = 3) -> float:
    """Measure the T5 profile of ``cfg`` (a T5TrainingConfig) into ``output``; seconds taken."""
    from megatron_integration.t5_profiler import measure_t5_profile

    started = time.perf_counter()
    mbs, seqlens, dec = profile_grids(cfg.encoder_seq_length, cfg.decoder_seq_length)
    measure_t5_profile(cfg.base.model, output, mbs, seqlens, dec, threads=threads, timeout_s=timeout_s,
                       repeats=repeats, seed=cfg.base.seed)
    return time.perf_counter() - started


def _op_ms(cost_model):
    """``event -> predicted ms`` of a traced forward or backward: priced on its rank's stage, or
    on an interleaved placement on its chunk's virtual stage (``args.chunk``, 0 when absent)."""
    from dynapipe.cost.attention_density import AttentionDensity
    from dynapipe.schedule.interleaved import chunk_count, virtual_cost_model

    chunks, P = chunk_count(cost_model), cost_model.num_stages
    priced = virtual_cost_model(cost_model) if chunks > 1 else cost_model

    def price(e: dict) -> float:
        a = e["args"]
        stage = int(a.get("chunk", 0)) * P + int(e.get("tid", 0)) if chunks > 1 else int(e.get("tid", 0))
        # At the level the op ran (its trace note), as the GPT calibration prices it, and at the
        # attention density its segment tables computed (per-sample packing's note).
        density = AttentionDensity(**a["attention"]) if a.get("attention") else None
        c = priced.stage_cost(a["mbs"], a["seqlen"], a.get("dec_seqlen", 0), stage=stage,
                              recompute=a.get("recompute", "none"), attention=density)
        return float(c.fw_ms if e["cat"] == "forward" else c.bw_ms)
    return price


def stage_check(trace_dir: str, iterations: Sequence[int], cost_model) -> Optional[dict]:
    """Per stage, the predicted (``cost_model`` at the traced shapes, recompute none) and the
    executed forward + backward ms per iteration of a run's ``iterations``, their ratio, and
    the stage-0 / last-stage balance both ways. None without traces."""
    from megatron_integration.bench_report import _trace_events

    traces = _trace_events(trace_dir, set(iterations))
    pred: dict[int, float] = {}
    meas: dict[int, float] = {}
    counted: dict[int, set] = {}
    price = _op_ms(cost_model)
    for _, (_, per) in traces.items():
        for it, events in per.items():
            for e in passes(events):
                stage = int(e.get("tid", 0))
                pred[stage] = pred.get(stage, 0.0) + price(e)
                meas[stage] = meas.get(stage, 0.0) + e["dur"] / 1e3
                counted.setdefault(stage, set()).add((id(per), it))
    if not pred:
        return None
    stages = []
    for s in sorted(pred):
        n = max(len(counted[s]), 1)  # iterations x replicas that ran this stage
        layout = cost_model.layouts[s]
        stages.append({"stage": s, "layers": f"{layout.encoder_layers}+{layout.decoder_layers}",
                       "predicted_ms": round(pred[s] / n, 1), "executed_ms": round(meas[s] / n, 1),
                       "executed_over_predicted": round(meas[s] / max(pred[s], 1e-9), 3)})
    first, last = stages[0], stages[-1]
    return {"stages": stages,
            "first_over_last_predicted": round(first["predicted_ms"] / max(last["predicted_ms"], 1e-9), 3),
            "first_over_last_executed": round(first["executed_ms"] / max(last["executed_ms"], 1e-9), 3)}


def format_stage_check(label: str, check: Optional[dict]) -> str:
    """One line per run: every stage's predicted -> executed compute and the balance."""
    if not check or not check.get("stages"):
        return f"{label}: no executor traces"
    parts = [f"stage {s['stage']} ({s['layers']}) {s['predicted_ms']:.0f} -> {s['executed_ms']:.0f} ms"
             for s in check["stages"]]
    return (f"{label}: {'; '.join(parts)}; first/last stage {check['first_over_last_predicted']:.2f} predicted, "
            f"{check['first_over_last_executed']:.2f} executed")


def op_fit(trace_dir: str, iterations: Sequence[int], cost_model) -> dict:
    """Least-squares ``executed = slope * predicted + intercept`` over every traced forward and
    backward (ms): the machine's load (slope) and a fixed cost per op the profile misses."""
    from megatron_integration.bench_report import _trace_events

    p, m = [], []
    price = _op_ms(cost_model)
    for _, (_, per) in _trace_events(trace_dir, set(iterations)).items():
        for events in per.values():
            for e in passes(events):
                p.append(price(e))
                m.append(e["dur"] / 1e3)
    if len(p) < 2 or float(np.ptp(p)) == 0.0:
        return {"ops": len(p)}
    slope, intercept = (float(v) for v in np.polyfit(p, m, 1))
    return {"ops": len(p), "slope": round(slope, 3), "intercept_ms": round(intercept, 3)}


def calibrate_t5_profile(argv: Sequence[str], profile: str, cfg, nproc: int, iters: int, threads: int,
                         timeout_s: float, placement: Optional[str] = None) -> tuple[str, dict]:
    """Run DynaPipe untimed for ``iters`` iterations with ``profile`` on ``placement`` (a
    ``--dynapipe-placement`` split; None or ``auto``: Megatron's even split)
    and write ``<profile>.calibrated.json`` with the fixed cost per stage op that the run
    shows beyond the profile (:func:`megatron_integration.bench_calibrate.fit_stage_overhead`
    over the traced forwards and backwards after the first iteration, at their encoder and
    decoder lengths, plus the executor's own time per op). Returns the path and the fit."""
    import os

    from dynapipe.config import load_device_config
    from dynapipe.cost import build_cost_model
    from megatron_integration.bench_breakdown import executor_timeline
    from megatron_integration.bench_calibrate import calibration_argv, fit_stage_overhead, write_calibrated_profile
    from megatron_integration.bench_checks import calibrated_profile_path
    from megatron_integration.bench_report import _trace_events
    from megatron_integration.t5_jobs import run_t5_training

    started = time.perf_counter()
    trace_dir = os.path.splitext(profile)[0] + ".calibration-traces"
    from megatron_integration.t5_placement import parse_t5_placement

    split = "even" if placement in (None, "auto") else placement
    margv = list(argv) + ["--use-dynapipe", "--dynapipe-placement", split, "--dynapipe-trace-dir", trace_dir,
                          "--train-iters", str(iters)] + calibration_argv(cfg.base.seed)
    ranks = [r[0] for r in run_t5_training([margv], nproc, timeout_s=timeout_s, threads_per_rank=threads)]
    model, pp = cfg.planner_model(), cfg.base.parallel.pipeline_model_parallel_size
    cost = build_cost_model(model, load_device_config(cfg.base.dynapipe.device), pp, profile,
                            placement=parse_t5_placement(split, model, pp))
    iterations = list(range(min(1, iters - 1), iters))
    pred, meas, per_op = [], [], []
    price = _op_ms(cost)
    for rank, (origin, per) in _trace_events(trace_dir, set(iterations)).items():
        for i in iterations:
            events = per.get(i, [])
            for e in passes(events):
                pred.append(price(e))
                meas.append(e["dur"] / 1e3)
            if events:
                t = executor_timeline(events, origin, ranks[rank], i)
                if t.micro_batches:
                    per_op.append((t.overhead_ms + t.posting_ms) / (2 * t.micro_batches))
    fit = fit_stage_overhead(np.asarray(pred), np.asarray(meas), float(np.mean(per_op)) if per_op else 0.0)
    out = write_calibrated_profile(profile, calibrated_profile_path(profile), fit)
    return out, {**fit.to_json(), "profile": out, "seconds": round(time.perf_counter() - started, 1)}


def compute_floor_check(cfg, cost_model, checks: dict, warmup: int, replicas: int) -> dict:
    """The compute floor of the run's timed global batches
    (:func:`dynapipe.cost.compute_floor.compute_floor_ms`: no padding, every sample at its
    cheapest micro-batch size, summed over the stages of ``cost_model``), per data-parallel
    replica and iteration, and each method's predicted compute (``checks``: the
    :func:`stage_check` of each method) over it. A baseline's figure is the most any batching
    can gain on it by compute alone, before bubble, transfers and the optimizer step. ms."""
    from dynapipe.cost.compute_floor import floor_over_batches
    from megatron_integration.t5_placement import first_global_batches

    batches = first_global_batches(cfg, cfg.base.train_iters)[warmup:]
    floor = floor_over_batches(cost_model, batches) / max(replicas, 1)
    # Every traced op priced at its shape (and per-sample packing's at its attention density).
    predicted = {m: round(sum(s["predicted_ms"] for s in c["stages"]), 1)
                 for m, c in checks.items() if c.get("stages")}
    return {"floor_ms": round(floor, 1), "iterations": len(batches), "predicted_ms": predicted,
            "over_floor": {m: round(v / floor, 3) for m, v in predicted.items()}}
