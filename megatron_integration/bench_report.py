"""Reports of ``python -m dynapipe bench``: where the time went, tables and the picture.

:func:`breakdown` says where the time of the timed iterations went on each rank, from
what the run recorded (megatron-core's steps timed as they ran, or the DynaPipe
executor's traces); :func:`ratio_table`, :func:`round_ratios`, :func:`breakdown_table`
and :func:`write_png` present a run's :class:`~megatron_integration.bench_results.MethodResult` figures, and
:func:`format_compute_floor` the compute floor of its timed batches.
"""
from __future__ import annotations

import glob
import json
import os
import statistics
from typing import TYPE_CHECKING, Iterator, Optional, Sequence

if TYPE_CHECKING:
    from megatron_integration.bench_results import MethodResult


def timed_indices(ranks: list[dict], warmup_iters: int) -> list[int]:
    """Iterations after the warm-up (at least the last one)."""
    n = len(ranks[0]["iteration_ms"])
    return list(range(min(warmup_iters, n - 1), n))


def passes(events: Sequence[dict]) -> Iterator[dict]:
    """The forwards and backwards among one rank's traced ``events`` of one iteration, a split
    backward's input and weight parts (zero-bubble plans) summed into one ``backward`` event
    (the input part's arguments, both parts' ``dur``): the profile prices a backward whole."""
    pending: dict = {}
    for e in events:
        cat = e.get("cat")
        if cat in ("backward-input", "backward-weight"):
            a = e.get("args", {})
            key = (e.get("tid", 0), a.get("mb"), a.get("chunk", 0))
            if key not in pending:
                pending[key] = e
                continue
            first = pending.pop(key)
            yield {**first, "cat": "backward", "dur": first["dur"] + e["dur"]}
        elif cat in ("forward", "backward"):
            yield e


def _trace_events(trace_dir: str, iterations: set[int]) -> dict[int, tuple[float, dict[int, list[dict]]]]:
    """``rank -> (wall-clock origin us, iteration -> complete events)`` of the executor's
    Chrome traces (``rankNNN.json``) in ``trace_dir``."""
    out: dict[int, tuple[float, dict[int, list[dict]]]] = {}
    for path in sorted(glob.glob(os.path.join(trace_dir, "rank*.json"))):
        rank = int(os.path.basename(path)[4:-5])
        with open(path) as f:
            doc = json.load(f)
        per: dict[int, list[dict]] = {}
        for e in doc["traceEvents"]:
            it = e.get("args", {}).get("iteration") if e.get("ph") == "X" else None
            if it in iterations:
                per.setdefault(it, []).append(e)
        out[rank] = (doc.get("otherData", {}).get("origin_us", 0.0), per)
    return out


def breakdown(ranks: list[dict], warmup_iters: int, trace_dir: Optional[str] = None) -> list[dict]:
    """Mean ms per timed iteration on every rank, split as
    :mod:`megatron_integration.bench_breakdown` says (compute, bubble, comm, overhead,
    optimizer_and_grads, plan_wait, unattributed; plus ``iteration``, ``overhead_per_mb``,
    ``stage`` and ``rank``); from megatron-core's timed steps, or for DynaPipe from the
    executor traces in ``trace_dir``. Empty when the run recorded neither."""
    from megatron_integration import bench_breakdown as bb

    keep = timed_indices(ranks, warmup_iters)
    traces = _trace_events(trace_dir, set(keep)) if trace_dir and os.path.isdir(trace_dir) else {}
    replica_of, seen = [], {}
    for r in ranks:  # megatron-core's rank order: the k-th rank of a stage is in replica k
        s = r.get("pp_rank", 0)
        replica_of.append(seen.get(s, 0))
        seen[s] = replica_of[-1] + 1
    per_iteration = []
    for i in keep:
        timelines = []
        for rank, r in enumerate(ranks):
            t = bb.megatron_timeline(r, i, replica_of[rank])
            if t is None and rank in traces and i in traces[rank][1]:
                t = bb.executor_timeline(traces[rank][1][i], traces[rank][0], r, i)
            if t is None:
                return []
            timelines.append(t)
        per_iteration.append(bb.rows(timelines))
    return [{**row, "rank": rank} for rank, row in enumerate(bb.mean_rows(per_iteration))]


def ratio_table(results: dict[str, MethodResult], baselines: tuple[str, ...] = ("padding", "packing"),
                shares: Optional[dict[str, float]] = None, sizes: Optional[dict[str, Optional[int]]] = None) -> str:
    """The side-by-side table printed by ``python -m dynapipe bench``."""
    cols = [b for b in baselines if b in results]
    header = (f"{'method':<14} {'mbs':>4} {'real tok/s':>11} {'pad eff':>8} {'iter ms':>10} {'plan wait ms':>13} "
              f"{'attn share':>10}" + "".join(f" {'vs ' + b:>14}" for b in cols))
    lines = [header, "-" * len(header)]
    for name, r in results.items():
        vs = [f"{r.real_tokens_per_s / results[b].real_tokens_per_s:.2f}x" for b in cols]
        mbs = (sizes or {}).get(name)
        share = (shares or {}).get(name)
        lines.append(f"{name:<14} {('-' if mbs is None else str(mbs)):>4} {r.real_tokens_per_s:>11.1f} "
                     f"{r.padding_efficiency:>8.3f} {r.iteration_ms:>10.1f} {r.plan_wait_ms:>13.2f} "
                     f"{('-' if share is None else f'{share:.1%}'):>10}" + "".join(f" {v:>14}" for v in vs))
    ran = [f"{name} {', '.join(f'{s} x{n}' for s, n in r.schedules.items())}" for name, r in results.items()
           if r.schedules]
    if ran:
        lines.append("pipeline schedules run (timed iterations, every round): " + "; ".join(ran))
    return "\n".join(lines)


def rounds_line(per_round: dict, timed_iterations: int) -> str:
    """The report's line on the ratios' spread: ``per_round`` (:func:`round_ratios`) round by
    round, or, with one round, how far its ``timed_iterations`` a method can be trusted."""
    if per_round:
        return "ratios round by round (each round's runs side by side): " + "; ".join(
            f"{k} {', '.join(f'{x:.2f}x' for x in v)}" for k, v in per_round.items())
    # The README's tiny-preset ranges over runs of one round each span 10-30%.
    return (f"one round of {timed_iterations} timed iteration(s) a method: the ratios above move by 10-30% between "
            f"such runs on a loaded machine; --rounds 3 rotates the methods and reports each round's ratios")


def round_ratios(results: dict, runs: dict, baselines: Sequence[str], best_baseline: Optional[str] = None,
                 pairs: Optional[dict[str, tuple[str, str]]] = None,
                 best_for: Sequence[str] = ("dynapipe",)) -> dict[str, list[float]]:
    """``{"<method>_vs_<baseline>": [ratio of round 0, round 1, ...]}``: real tokens/s of each
    method's reported run (``results[m]["run"]``) over the baseline's, round by round
    (``runs[label]["rounds_real_tokens_per_s"]`` in round order), with
    ``<m>_vs_best_baseline`` for the methods of ``best_for`` and ``pairs`` (``name -> (run
    label, run label)``) the same way; empty with one round.

    Why: each method reports its median round, and two methods' medians may come from rounds
    minutes apart; the runs of one round ran side by side, so these ratios and their spread
    say how far one round can be trusted on a shared machine."""
    named = {f"{m}_vs_{b}": (results[m]["run"], results[b]["run"]) for m in results for b in baselines if b != m}
    if best_baseline is not None:
        named.update({f"{m}_vs_best_baseline": named[f"{m}_vs_{best_baseline}"] for m in best_for if m in results})
    named.update(pairs or {})
    out: dict[str, list[float]] = {}
    for name, (a, b) in named.items():
        mine, theirs = runs[a]["rounds_real_tokens_per_s"], runs[b]["rounds_real_tokens_per_s"]
        if min(len(mine), len(theirs)) < 2:
            return {}
        out[name] = [round(x / y, 3) for x, y in zip(mine, theirs)]
    return out


def write_png(results: dict[str, MethodResult], path: str, title: str) -> None:
    """Bar charts of real tokens/s and padding efficiency per method."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(results)
    colors = ["#1f77b4" if n.startswith("dynapipe") else "#999999" for n in names]
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
    tps = [results[n].real_tokens_per_s for n in names]
    axes[0].bar(names, tps, color=colors)
    axes[0].set_ylabel("real tokens / s")
    for i, v in enumerate(tps):
        axes[0].text(i, v, f"{v:.0f}", ha="center", va="bottom", fontsize=9)
    eff = [results[n].padding_efficiency for n in names]
    axes[1].bar(names, eff, color=colors)
    axes[1].set_ylim(0, 1.05)
    axes[1].set_ylabel("padding efficiency")
    for i, v in enumerate(eff):
        axes[1].text(i, v, f"{v:.2f}", ha="center", va="bottom", fontsize=9)
    for ax in axes:
        ax.tick_params(axis="x", labelrotation=20)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120, format="png")  # not guessed from the name: --png writes a PNG
    plt.close(fig)



def breakdown_summary(splits: list[list[dict]]) -> dict:
    """:func:`breakdown`'s figures over rounds: per pipeline stage the mean over rounds and
    ranks of that stage (``stages``), the mean over all ranks, and ``busy_fraction``:
    compute / iteration time on the busiest stage (1 - its idle share)."""
    rows = [b for rnd in splits for b in rnd]
    if not rows:
        return {}
    from megatron_integration.bench_breakdown import PARTS

    keys = ("iteration",) + PARTS + ("unattributed", "overhead_per_mb", "micro_batches")

    def mean(rs):
        return {k: round(statistics.fmean(r[k] for r in rs), 2) for k in keys}

    stages = [{"stage": s, **mean([r for r in rows if r["stage"] == s])} for s in sorted({r["stage"] for r in rows})]
    out = mean(rows)
    out["busy_fraction"] = round(max(s["compute"] / s["iteration"] for s in stages if s["iteration"]), 3)
    out["stages"] = stages
    return out


def breakdown_table(summaries: dict[str, dict]) -> str:
    """Where the time of an iteration went, per method and pipeline stage (ms, means over
    rounds and timed iterations). ``planner CPU``: CPU ms per iteration of the planner
    workers, all ranks together, spent on the same cores meanwhile (not a part of the sum)."""
    w = max([14] + [len(name) for name in summaries])
    header = (f"{'method':<{w}} {'stage':>5} {'iter ms':>9} {'compute':>9} {'bubble':>8} {'comm':>7} "
              f"{'overhead':>9} {'(per mb)':>9} {'optim+grads':>12} {'plan wait':>10} {'unattrib.':>10} "
              f"{'planner CPU':>12}")
    lines = [header, "-" * len(header)]
    for name, s in summaries.items():
        cpu = "-" if s.get("planner_cpu_ms") is None else f"{s['planner_cpu_ms']:.1f}"
        for st in s.get("stages", []):
            lines.append(f"{name:<{w}} {st['stage']:>5} {st['iteration']:>9.1f} {st['compute']:>9.1f} "
                         f"{st['bubble']:>8.1f} {st['comm']:>7.1f} {st['overhead']:>9.1f} "
                         f"{st['overhead_per_mb']:>9.2f} {st['optimizer_and_grads']:>12.1f} "
                         f"{st['plan_wait']:>10.1f} {st['unattributed']:>10.1f} {cpu:>12}")
    return "\n".join(lines)


def format_compute_floor(floor: dict, baseline: Optional[str]) -> str:
    """One line: the floor, each method's predicted compute over it, and what that caps
    DynaPipe's gain on ``baseline`` at (by compute alone)."""
    parts = ", ".join(f"{m} {v:.0f} ({floor['over_floor'][m]:.2f}x)" for m, v in floor["predicted_ms"].items())
    line = (f"compute floor (no padding, each sample at its cheapest micro-batch size, by the cost model): "
            f"{floor['floor_ms']:.0f} ms an iteration over all stages; predicted compute {parts}")
    if baseline in floor["over_floor"]:
        line += (f"; {baseline}'s compute is {floor['over_floor'][baseline]:.2f}x the floor, the most any "
                 f"batching gains on it by compute alone")
    return line
