"""Benchmark the pipeline schedules on mixture batches: makespan, bubbles, planning time.

For every batch of the synthetic multi-task mixture the micro-batches are planned once
(DynaPipe's DP), then scheduled four ways on the same micro-batches and the same cost
model: ``1f1b`` (Megatron's order, planned micro-batch order, the lightest recompute
level that fits), ``adaptive`` and ``zb-h1`` (the backward split into input and weight
parts; likewise) and ``auto`` (the search over 1f1b, adaptive and zb-h1 x orders x
recompute levels). Planning time is the whole of ``plan_iteration``:
micro-batching + schedule search + compilation of every rank's plan, wall clock and
CPU time of this process, median over the batches.

    python scripts/bench_schedules.py                 # 100 batches of 1024 samples, S = 4 and 8
    python scripts/bench_schedules.py --batches 10    # quicker
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from typing import Optional

import numpy as np

from dynapipe.config import load_cluster_config, load_device_config, load_model_config
from dynapipe.cost import build_cost_model
from dynapipe.data.synthetic import sample_lengths
from dynapipe.errors import DynaPipeError, NoScheduleFits
from dynapipe.output_paths import check_output_file, write_output
from dynapipe.pipeline_planner import plan_iteration
from dynapipe.cli.spelling import CLI_SPELLING
from dynapipe.errors import spelled_by
from dynapipe.schedule import _kernels
from dynapipe.schedule.search import search_schedules
from dynapipe.argparsing import StrictArgumentParser, print_error

# The planner names the `plan` command's memory flag; here the device config sets the limit.
SPELLING = {**CLI_SPELLING, "memory_limit_mib": "the memory of --device"}
# Schedules priced alone, on the planner's micro-batches (auto's choice is the planner's own).
FIXED = ("1f1b", "adaptive", "zb-h1")


def _fixed(reps, cm, name: str, capacity: float, cluster):
    """The best candidate of schedule ``name`` alone on the planner's micro-batches, or None
    where none fits ``capacity`` (MiB): zb-h1's pending weight parts can overflow at every
    recompute level on micro-batches cut for another schedule's memory."""
    try:
        return search_schedules(reps, cm, schedule=name, recompute=None, capacity_mib=capacity, cluster=cluster).best
    except NoScheduleFits:
        return None


def _mean(values) -> Optional[float]:
    """Mean over the batches where the schedule fitted (None where it fitted in none)."""
    kept = [v for v in values if v is not None]
    return float(np.mean(kept)) if kept else None


def _fmt(value: Optional[float], spec: str) -> str:
    return "-" if value is None else spec.format(value)


def bench_stage_count(args, model, device, cluster, S: int) -> dict:
    cm = build_cost_model(model, device, S)
    capacity = device.memory_mib - device.reserved_mib
    rows = []
    # Warm up once (first calls load compiled kernels and fill caches).
    plan_iteration(sample_lengths(args.samples, 10_000, args.seq_length), cm, cluster=cluster)
    for b in range(args.batches):
        lengths = sample_lengths(args.samples, args.seed + b, args.seq_length)
        wall0, cpu0 = time.perf_counter(), time.process_time()
        it = plan_iteration(lengths, cm, cluster=cluster)
        wall, cpu = (time.perf_counter() - wall0) * 1e3, (time.process_time() - cpu0) * 1e3
        bp = it.batch_plan
        reps = [bp.replica(r) for r in range(bp.dp)]
        fixed = {name: _fixed(reps, cm, name, capacity, cluster) for name in FIXED}
        rows.append({
            "batch": b, "micro_batches": len(bp.micro_batches),
            "makespan_ms": dict({k: c and c.makespan_ms for k, c in fixed.items()}, auto=it.simulated_ms),
            "bubble": dict({k: c and c.bubble_fraction for k, c in fixed.items()}, auto=it.bubble_fraction),
            "recompute": dict({k: c and c.recompute for k, c in fixed.items()}, auto=it.recompute),
            "auto_choice": f"{it.schedule}/{it.order}/{it.recompute}",
            "planning_wall_ms": wall, "planning_cpu_ms": cpu, "timings_ms": dict(it.timings_ms),
        })
    def ratios(name: str) -> list[float]:
        return [r["makespan_ms"][name] / r["makespan_ms"]["1f1b"] for r in rows
                if r["makespan_ms"][name] is not None and r["makespan_ms"]["1f1b"] is not None]

    ratio, ratio_ad, ratio_zb = ratios("auto"), ratios("adaptive"), ratios("zb-h1")
    choices: dict = {}
    for r in rows:
        choices[r["auto_choice"]] = choices.get(r["auto_choice"], 0) + 1
    med = lambda key: statistics.median(r["timings_ms"][key] for r in rows)
    return {
        "stages": S, "batches": len(rows), "samples": args.samples,
        "mean_micro_batches": float(np.mean([r["micro_batches"] for r in rows])),
        "mean_makespan_ms": {k: _mean(r["makespan_ms"][k] for r in rows) for k in FIXED + ("auto",)},
        "mean_bubble": {k: _mean(r["bubble"][k] for r in rows) for k in FIXED + ("auto",)},
        "fits": {k: sum(r["makespan_ms"][k] is not None for r in rows) for k in FIXED + ("auto",)},
        "auto_vs_1f1b": {"mean_ratio": _mean(ratio), "max_ratio": max(ratio, default=None),
                         "mean_reduction_pct": None if not ratio else float(100 * (1 - np.mean(ratio)))},
        "adaptive_vs_1f1b_mean_ratio": _mean(ratio_ad),
        "zb_h1_vs_1f1b": {"mean_ratio": _mean(ratio_zb), "max_ratio": max(ratio_zb, default=None)},
        "auto_choices": dict(sorted(choices.items(), key=lambda kv: -kv[1])),
        "planning_ms_median": {"wall": statistics.median(r["planning_wall_ms"] for r in rows),
                               "cpu": statistics.median(r["planning_cpu_ms"] for r in rows),
                               "batching": med("batching"), "schedule": med("schedule"), "compile": med("compile")},
        "planning_ms_p90_wall": float(np.percentile([r["planning_wall_ms"] for r in rows], 90)),
        "rows": rows,
    }


def check_args(args):
    """The model, device and cluster configs, once every flag is known to be usable
    (else a DynaPipeError naming the flag): planning the batches can take minutes."""
    for flag, value in (("--batches", args.batches), ("--samples", args.samples), ("--seq-length", args.seq_length)):
        if value < 1:
            raise DynaPipeError(f"{flag} {value}: must be at least 1.")
    bad = [s for s in args.stages if s < 1]
    if bad:
        raise DynaPipeError(f"--stages {' '.join(map(str, args.stages))}: {bad[0]} is not a pipeline; give stage "
                            f"counts of at least 1.")
    if args.seed < 0:
        raise DynaPipeError(f"--seed {args.seed}: the seed must be a non-negative integer.")
    if args.output is not None:
        check_output_file(args.output, "--output")
    return (load_model_config(args.model, "--model"), load_device_config(args.device, "--device"),
            load_cluster_config(args.cluster, "--cluster"))


@spelled_by(SPELLING)  # the planning layers' errors name this script's flags
def main(argv=None) -> int:
    p = StrictArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batches", type=int, default=100)
    p.add_argument("--samples", type=int, default=1024)
    p.add_argument("--stages", type=int, nargs="+", default=[4, 8])
    p.add_argument("--seq-length", type=int, default=2048)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--model", default="gpt-7b")
    p.add_argument("--device", default="a100-40gb")
    p.add_argument("--cluster", default="a100-8x")
    p.add_argument("--output", default=None, help="write the full results (every batch) as JSON")
    args = p.parse_args(argv)
    try:
        model, device, cluster = check_args(args)
        results = [bench_stage_count(args, model, device, cluster, S) for S in args.stages]
    except DynaPipeError as e:
        print_error(str(e))
        return 2
    print(f"{args.model} on {args.device} ({args.cluster}), {args.batches} batches of {args.samples} mixture "
          f"samples (seq-length {args.seq_length}); simulation kernels "
          f"{'compiled' if _kernels.compiled() else 'in pure Python'}")
    print("| S | micro-batches | 1f1b ms | adaptive ms | auto ms | zb-h1 ms | auto vs 1f1b (mean / worst) | "
          "zb-h1 vs 1f1b (mean / worst) | bubble 1f1b / adaptive / auto / zb-h1 | "
          "planning median ms (wall / cpu) | batching / search / compile |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in results:
        m, bb, pl, a = r["mean_makespan_ms"], r["mean_bubble"], r["planning_ms_median"], r["auto_vs_1f1b"]
        z, n, fits = r["zb_h1_vs_1f1b"], r["batches"], r["fits"]

        def ms(k: str) -> str:  # the mean, and in how many batches it fitted where not all
            return _fmt(m[k], "{:.0f}") + ("" if fits[k] == n else f" ({fits[k]} of {n} fit)")

        cut = None if a["mean_reduction_pct"] is None else -a["mean_reduction_pct"]
        print(f"| {r['stages']} | {r['mean_micro_batches']:.0f} | {ms('1f1b')} | {ms('adaptive')} | "
              f"{ms('auto')} | {ms('zb-h1')} | {_fmt(cut, '{:.1f}%')} / x{_fmt(a['max_ratio'], '{:.3f}')} | "
              f"x{_fmt(z['mean_ratio'], '{:.3f}')} / x{_fmt(z['max_ratio'], '{:.3f}')} | "
              + " / ".join(_fmt(bb[k] and 100 * bb[k], "{:.1f}%") for k in ("1f1b", "adaptive", "auto", "zb-h1"))
              + f" | {pl['wall']:.1f} / {pl['cpu']:.1f} | {pl['batching']:.1f} / {pl['schedule']:.1f} / "
              f"{pl['compile']:.1f} |")
    for r in results:
        print(f"S={r['stages']}: auto chose " + ", ".join(f"{k} x{v}" for k, v in r["auto_choices"].items()))
    both = [row["makespan_ms"]["auto"] / row["makespan_ms"]["1f1b"]
            for r in results for row in r["rows"] if row["makespan_ms"]["1f1b"] is not None]
    overall = float(np.mean(both)) if both else float("nan")
    worst = max((r["auto_vs_1f1b"]["max_ratio"] for r in results if r["auto_vs_1f1b"]["max_ratio"] is not None),
                default=float("nan"))
    worst_plan = max(r["planning_ms_median"]["wall"] for r in results)
    print(f"overall: auto {100 * (1 - overall):.1f}% lower makespan than 1f1b on average (target >= 5%), "
          f"never slower: {worst <= 1 + 1e-9} (worst ratio {worst:.4f}); whole planning median "
          f"{worst_plan:.1f} ms wall (target <= 150 ms)")
    if args.output:
        try:
            write_output(args.output, json.dumps({"args": vars(args), "results": results,
                                                  "overall_mean_ratio": overall}, indent=1), "--output")
        except DynaPipeError as e:
            print_error(str(e))
            return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
