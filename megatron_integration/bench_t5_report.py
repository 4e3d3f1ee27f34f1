"""What ``bench --model t5`` prints and adds to its JSON beyond the figures of each run.

* every ratio of the report, round by round
  (:func:`~megatron_integration.bench_report.round_ratios`), printed beside it;
* :func:`same_shape_spread`: how much the time of one op varied within a run when its
  work did not (the same forward or backward, stage, shape, and attention mask or none:
  a row of one whole sample needs none, :func:`~megatron_integration.t5_handlers.needed_mask`,
  and the T5 handlers' ``trace_note`` records which ops applied one). The work of such ops
  is the same, so their spread is the machine's. Grouped by shape alone, a packing run's
  encoder backwards had split into 48 ms (no mask) and 100 ms (megatron-core's in-place
  ``masked_fill_``), which read as noise.
* :func:`print_t5_report`: the tables and lines the bench prints.
"""
from __future__ import annotations

import statistics
from typing import Optional, Sequence, TextIO

import numpy as np


def same_shape_spread(events: Sequence[dict], min_ops: int = 3) -> Optional[dict]:
    """How much identical ops among executor trace ``events`` varied: ops are grouped by
    replica and stage (``pid``/``tid``), chunk, forward or backward, shape (``mbs``,
    ``seqlen``, ``dec_seqlen``), whether they applied an attention mask (``masked``,
    where the trace records it) and the attention density per-sample packing's ops computed
    (``attention``: packed rows of one shape hold different samples, so different work); every op of a group of at least ``min_ops`` is divided by
    its group's median time, and the 10th and 90th percentiles of those quotients are
    returned with their ratio (``{"ops", "groups", "p10", "p90", "p90_over_p10"}``), or
    None where no group is large enough. Percentiles of quotients, not a group's slowest
    over its fastest, so that runs with more repeats of a shape do not read noisier."""
    groups: dict[tuple, list[float]] = {}
    for e in events:
        if e.get("ph") != "X" or e.get("cat") not in ("forward", "backward", "backward-input", "backward-weight"):
            continue
        a = e.get("args", {})
        key = (e.get("pid"), e.get("tid"), a.get("chunk", 0), e["cat"], a.get("mbs"), a.get("seqlen"),
               a.get("dec_seqlen"), a.get("masked"), tuple(sorted((a.get("attention") or {}).items())))
        groups.setdefault(key, []).append(float(e["dur"]))
    kept = [d for d in groups.values() if len(d) >= min_ops and statistics.median(d) > 0]
    if not kept:
        return None
    quotients = np.concatenate([np.asarray(d) / statistics.median(d) for d in kept])
    p10, p90 = (float(v) for v in np.percentile(quotients, [10, 90]))
    return {"ops": int(quotients.size), "groups": len(kept), "p10": round(p10, 3), "p90": round(p90, 3),
            "p90_over_p10": round(p90 / p10, 2)}


def trace_spread(trace_dir: str, iterations: Sequence[int]) -> Optional[dict]:
    """:func:`same_shape_spread` of the ``iterations`` of the executor traces in ``trace_dir``."""
    from megatron_integration.bench_report import _trace_events

    events = [e for _rank, (_origin, per) in sorted(_trace_events(trace_dir, set(iterations)).items())
              for i in iterations for e in per.get(i, [])]
    return same_shape_spread(events)


def print_t5_report(report: dict, stream: TextIO) -> None:
    """Print the bench's tables and lines from its JSON ``report``."""
    from megatron_integration.bench_report import breakdown_table, format_compute_floor
    from megatron_integration.bench_t5_profile import format_stage_check

    results, ratios = report["methods"], report["ratios"]
    per_round = report.get("ratios_per_round") or {}
    wm, wr = max([10] + [len(m) for m in results]), max([14] + [len(r["run"]) for r in results.values()])
    print(f"{'method':<{wm}} {'run':<{wr}} {'real tok/s':>11} {'tok/CPU-s':>10} {'pad eff':>8} {'iter ms':>9}",
          file=stream)
    for m, r in results.items():
        per_cpu = r["real_tokens_per_cpu_s"]
        print(f"{m:<{wm}} {r['run']:<{wr}} {r['real_tokens_per_s']:>11.1f} {per_cpu or 0:>10.1f} "
              f"{r['padding_efficiency']:>8.3f} {r['iteration_ms']:>9.1f}", file=stream)
    ran = [f"{m} {', '.join(f'{s} x{n}' for s, n in r['schedules'].items())}" for m, r in results.items()
           if r.get("schedules")]
    if ran:
        print("pipeline schedules run (timed iterations): " + "; ".join(ran), file=stream)
    for k, v in ratios.items():
        rounds = per_round.get(k)
        more = f" (round by round: {', '.join(f'{x:.2f}x' for x in rounds)})" if rounds else ""
        print(f"{k}: {v:.2f}x{more}", file=stream)
    spread = {m: r["same_shape_spread"] for m, r in results.items() if r.get("same_shape_spread")}
    if spread:
        print("identical ops (same stage, pass, shape and mask), time over their median, 10th-90th percentile: "
              + "; ".join(f"{m} {s['p10']:.2f}-{s['p90']:.2f} ({s['ops']} ops)" for m, s in spread.items())
              + " (the machine's noise: the work was the same)", file=stream)
    from megatron_integration.bench_results import format_memory_faults

    print(format_memory_faults({m: (r.get("minor_faults"), r.get("system_ms"), r.get("pretouch_s"))
                                for m, r in results.items()},
                               report["setup"].get("cpu_pretouch_mb", 0)), file=stream)
    load = report["setup"]["load_average"]
    print(f"load average (1, 5, 15 min) at the start {load['start']}, at the end {load['end']}", file=stream)
    print("where an iteration's time went (ms per iteration, mean over timed iterations):", file=stream)
    print(breakdown_table({m: r["time_split_ms"] for m, r in results.items() if r["time_split_ms"]}), file=stream)
    placement = report["placement"]
    sim = placement["simulated"]
    print(f"stage placement {placement['placement']} ({placement['source']}); DynaPipe plans simulated: even split "
          f"{sim['even']['placement']} bubble {100 * sim['even']['bubble_fraction']:.1f}% "
          f"{sim['even']['simulated_ms']:.0f} ms, placed bubble {100 * sim['placed']['bubble_fraction']:.1f}% "
          f"{sim['placed']['simulated_ms']:.0f} ms", file=stream)
    cost = report["cost_model"]
    measured = "" if cost["profile_s"] is None else f" (measured in {cost['profile_s']:.1f} s)"
    print(f"cost model {cost['profile']}{measured}; compute per iteration and stage, predicted -> executed:",
          file=stream)
    for m, check in cost["stage_check"].items():
        print("  " + format_stage_check(f"{m} ({results[m]['run']})", check), file=stream)
    if cost["compute_floor"]["predicted_ms"]:
        print(format_compute_floor(cost["compute_floor"], report["best_baseline"]), file=stream)
