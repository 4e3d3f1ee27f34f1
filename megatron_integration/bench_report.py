"""Reports of ``python -m dynapipe bench``: where the time went, tables and the picture.

:func:`breakdown` says where the time of the timed iterations went on each rank, from
what the run recorded (megatron-core's steps timed as they ran, or the DynaPipe
executor's traces); :func:`ratio_table`, :func:`breakdown_table` and :func:`write_png`
present a run's :class:`~megatron_integration.bench.MethodResult` figures.
"""
from __future__ import annotations

import glob
import json
import os
import statistics
from typing import TYPE_CHECKING, Optional

if TYPE_CHECKING:
    from megatron_integration.bench import MethodResult


def timed_indices(ranks: list[dict], warmup_iters: int) -> list[int]:
    """Iterations after the warm-up (at least the last one)."""
    n = len(ranks[0]["iteration_ms"])
    return list(range(min(warmup_iters, n - 1), n))


def _trace_breakdown(trace_dir: str, iterations: set[int]) -> dict[int, dict[int, dict]]:
    """``rank -> iteration -> {compute_ms, comm_ms, data_ms, executor_ms}`` from the executor's
    Chrome traces (``rankNNN.json``); comm includes waiting for the peer."""
    out: dict[int, dict[int, dict]] = {}
    for path in sorted(glob.glob(os.path.join(trace_dir, "rank*.json"))):
        rank = int(os.path.basename(path)[4:-5])
        with open(path) as f:
            events = json.load(f)["traceEvents"]
        per: dict[int, dict] = {}
        for e in events:
            if e.get("ph") != "X":
                continue
            it = e.get("args", {}).get("iteration")
            if it not in iterations:
                continue
            d = per.setdefault(it, {"compute_ms": 0.0, "comm_ms": 0.0, "data_ms": 0.0, "start": e["ts"], "end": 0.0})
            key = {"forward": "compute_ms", "backward": "compute_ms", "comm": "comm_ms", "data": "data_ms"}.get(
                e.get("cat"))
            if key:
                d[key] += e["dur"] / 1e3
            d["start"] = min(d["start"], e["ts"])
            d["end"] = max(d["end"], e["ts"] + e["dur"])
        for d in per.values():
            d["executor_ms"] = (d.pop("end") - d.pop("start")) / 1e3
        out[rank] = per
    return out


def breakdown(ranks: list[dict], warmup_iters: int, trace_dir: Optional[str] = None) -> list[dict]:
    """Mean ms per timed iteration on every rank: ``iteration``, ``compute`` (forward +
    backward), ``p2p_and_wait`` (transfers and waiting for the other stage: bubble plus
    communication), ``optimizer_and_grads`` (gradient finaliser and optimizer step),
    ``plan_wait`` and ``other``; from megatron-core's timed steps, or for DynaPipe from
    the executor traces in ``trace_dir``. Empty when the run recorded neither."""
    keep = timed_indices(ranks, warmup_iters)
    traces = _trace_breakdown(trace_dir, set(keep)) if trace_dir and os.path.isdir(trace_dir) else {}
    out = []
    for rank, r in enumerate(ranks):
        rows = []
        for i in keep:
            it_ms = r["iteration_ms"][i]
            b = (r.get("breakdown_ms") or [{}] * (i + 1))[i] or {}
            t = traces.get(rank, {}).get(i)
            if b:
                compute, p2p = b["forward_ms"] + b["backward_ms"], b["p2p_and_wait_ms"]
                opt = b["finalize_ms"] + b["optimizer_ms"]
                wait = 0.0
            elif t:
                compute, p2p = t["compute_ms"], t["comm_ms"]
                wait = r["plan_wait_ms"][i]
                # Outside the executor: loader wait, gradient finaliser, optimizer, loss reduction.
                opt = max(it_ms - t["executor_ms"] - wait, 0.0)
            else:
                continue
            rows.append({"iteration": it_ms, "compute": compute, "p2p_and_wait": p2p,
                         "optimizer_and_grads": opt, "plan_wait": wait,
                         "other": max(it_ms - compute - p2p - opt - wait, 0.0)})
        if rows:
            out.append({k: round(statistics.fmean(x[k] for x in rows), 2) for k in rows[0]} | {"rank": rank})
    return out


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
    return "\n".join(lines)


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
    fig.savefig(path, dpi=120)
    plt.close(fig)



def breakdown_summary(splits: list[list[dict]]) -> dict:
    """Mean over rounds and ranks of :func:`breakdown`'s figures (ms per iteration), and
    ``busy_fraction``: compute / iteration time on the busiest rank (1 - idle share)."""
    rows = [b for rnd in splits for b in rnd]
    if not rows:
        return {}
    keys = ("iteration", "compute", "p2p_and_wait", "optimizer_and_grads", "plan_wait", "other")
    out = {k: round(statistics.fmean(r[k] for r in rows), 1) for k in keys}
    out["busy_fraction"] = round(max(statistics.fmean(r["compute"] / r["iteration"] for r in rows
                                                      if r["rank"] == rank)
                                     for rank in {r["rank"] for r in rows}), 3)
    return out


def breakdown_table(summaries: dict[str, dict]) -> str:
    """Where the time of an iteration went, per method (ms, means over rounds and ranks)."""
    header = (f"{'method':<14} {'iter ms':>9} {'compute':>9} {'p2p+wait':>9} {'optim+grads':>12} {'plan wait':>10} "
              f"{'other':>7} {'busiest rank busy':>18}")
    lines = [header, "-" * len(header)]
    for name, s in summaries.items():
        if not s:
            continue
        lines.append(f"{name:<14} {s['iteration']:>9.1f} {s['compute']:>9.1f} {s['p2p_and_wait']:>9.1f} "
                     f"{s['optimizer_and_grads']:>12.1f} {s['plan_wait']:>10.1f} {s['other']:>7.1f} "
                     f"{s['busy_fraction']:>18.1%}")
    return "\n".join(lines)
