"""What ``scripts/gpu_check.py`` concludes from its runs: each run summarised (real tokens/s,
losses, activation peaks in MiB), the checks every finished run must pass (losses agree with the
best padding run's, measured activation peaks within the plans'), and the Markdown table it
writes.
"""
from __future__ import annotations

import statistics
from typing import Optional

import numpy as np

#: Largest relative difference a run's per-iteration loss may have from the best padding run's
#: (bf16; the first H200 run: 3.7e-5): the methods train the same samples from the same weights.
LOSS_TOLERANCE = 1e-3
#: Most a DynaPipe run's measured activation peak may exceed the plan's (measured / planned; the
#: first H200 run: 0.87-1.02): beyond it the planner's memory limit does not protect the GPU.
PEAK_TOLERANCE = 1.10



def summarise(run: dict, warmup: int = 1) -> dict:
    """Real tokens/s over the iterations after ``warmup``, losses, and the activation peaks (MiB)."""
    keep = list(range(min(warmup, len(run["iteration_ms"]) - 1), len(run["iteration_ms"])))
    ms = sum(run["iteration_ms"][i] for i in keep)
    planned = [p for p in run["activation_planned_mib"] if p is not None]
    memory = run.get("cuda_memory_mib") or {}
    return {"real_tokens_per_s": sum(run["real_tokens"][i] for i in keep) / (ms / 1e3),
            "iteration_ms": statistics.fmean(run["iteration_ms"][i] for i in keep),
            "losses": run["losses"], "layer_spec": run.get("layer_spec", ""),
            "activation_measured_mib": max(run["activation_measured_mib"]),
            "activation_planned_mib": max(planned) if planned else None,
            # The caching allocator's most reserved (MiB): what the GPU held, its cache included.
            "max_reserved_mib": memory.get("max_reserved"), "max_allocated_mib": memory.get("max_allocated")}


def best_of(results: dict, prefix: str) -> Optional[str]:
    """The name of the fastest finished run whose name starts with ``prefix`` (the tuned
    baseline), or None when none finished."""
    done = [n for n, r in results.items() if n.startswith(prefix) and "error" not in r]
    return max(done, key=lambda n: results[n]["real_tokens_per_s"]) if done else None


def markdown(results: dict, loss_spread: Optional[float]) -> str:
    """The short table the check writes: throughput and the ratios against the best padding and
    the best packing run, then activation memory per level; failed phases last, with their error."""
    best = {b: best_of(results, b) for b in ("padding", "packing")}
    lines = ["| method | real tokens/s | vs best padding | vs best packing | iteration (ms) "
             "| activation peak measured / planned (MiB) | allocator max allocated / max reserved (MiB) |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    failed = []
    for name, r in results.items():
        if "error" in r:
            failed.append(f"- {name} failed: {r['error'].strip().splitlines()[-1]}")
            continue
        vs = [f"{r['real_tokens_per_s'] / results[b]['real_tokens_per_s']:.2f}x" if b else "-" for b in best.values()]
        planned = "-" if r["activation_planned_mib"] is None else f"{r['activation_planned_mib']:.0f}"
        ratio = ("" if r["activation_planned_mib"] is None
                 else f" ({r['activation_measured_mib'] / r['activation_planned_mib']:.2f})")
        held = ("-" if r.get("max_reserved_mib") is None
                else f"{r['max_allocated_mib']:,.0f} / {r['max_reserved_mib']:,.0f}")
        lines.append(f"| {name} | {r['real_tokens_per_s']:,.0f} | {vs[0]} | {vs[1]} | {r['iteration_ms']:.0f} | "
                     f"{r['activation_measured_mib']:.0f} / {planned}{ratio} | {held} |")
    lines.append("")
    if loss_spread is not None:
        lines.append(f"Largest relative difference of any method's per-iteration loss from "
                     f"{best['padding']}'s: {loss_spread:.2e}.")
    c = checks(results)
    if not c["losses"]["ok"]:
        failed.append(f"- check failed: losses differ by {loss_spread:.2e} (relative), over {LOSS_TOLERANCE:g}")
    over = {k: v for k, v in c["activation_peak"]["measured_over_planned"].items() if v > PEAK_TOLERANCE}
    failed += [f"- check failed: {k} measured {v:.2f}x its planned activation peak, over {PEAK_TOLERANCE:g}x"
               for k, v in over.items()]
    return "\n".join(lines + failed) + "\n"


def loss_spread(results: dict) -> Optional[float]:
    """Largest relative difference of a finished run's per-iteration loss from the best padding
    run's (None without a finished padding run; infinite where a loss is NaN or infinite)."""
    ref = best_of(results, "padding")
    if ref is None:
        return None
    base = np.asarray(results[ref]["losses"], dtype=np.float64)
    spreads = [np.abs(np.asarray(r["losses"], dtype=np.float64) - base) / np.abs(base)
               for r in results.values() if "error" not in r]
    # A NaN or infinite loss anywhere is no agreement (max() would keep a finite value over a NaN).
    return max((float(np.max(d)) if np.all(np.isfinite(d)) else float("inf")) for d in spreads)


def failed(report: dict) -> bool:
    """Whether any phase of ``report`` failed, the profile included, or a finished run broke one
    of its :func:`checks`."""
    return ("error" in report.get("profile", {}) or "error" in report.get("analytic_memory", {})
            or any("error" in r for r in report["methods"].values())
            or any(not c["ok"] for c in checks(report["methods"]).values()))


def checks(results: dict) -> dict:
    """What the finished runs of ``results`` must show: every run's losses within
    :data:`LOSS_TOLERANCE` of the best padding run's (relative), and every DynaPipe run's
    measured activation peak within :data:`PEAK_TOLERANCE` of its plan's (MiB over MiB)."""
    spread = loss_spread(results)
    peaks = {name: round(r["activation_measured_mib"] / r["activation_planned_mib"], 3)
             for name, r in results.items() if "error" not in r and r.get("activation_planned_mib")}
    return {"losses": {"max_relative_difference": spread, "limit": LOSS_TOLERANCE,
                       "ok": spread is None or spread <= LOSS_TOLERANCE},
            "activation_peak": {"measured_over_planned": peaks, "limit": PEAK_TOLERANCE,
                                "ok": all(v <= PEAK_TOLERANCE for v in peaks.values())}}
