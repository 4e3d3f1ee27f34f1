"""DynaPipe against megatron-core's padding and packing, side by side in one run.

:func:`run_bench` trains every method one after another on the same model, seed and
global batches (each method a fresh spawned job of ``nproc`` gloo/NCCL ranks), after
measuring a cost profile of this machine for DynaPipe's planner (unless one is given),
and summarises each method over the iterations after ``warmup_iters``:

* ``real_tokens_per_s``: sample tokens (padding excluded) trained per second;
* ``padding_efficiency``: real tokens / tokens computed (padding included);
* ``iteration_ms``: mean wall time of an iteration (the slowest rank's);
* ``plan_wait_ms``: mean time the training loop waited for its plan (0 for the baselines);
* ``activation_peak_mib``: per pipeline stage, the highest measured activation peak and
  the highest the plans promised (``planned`` is None for the baselines), over replicas
  and timed iterations.
"""
from __future__ import annotations

import json
import os
import statistics
import sys
from dataclasses import dataclass, field
from typing import Optional, Sequence, TextIO

from megatron_integration.jobs import run_training
from megatron_integration.launch import spawn

METHOD_FLAGS = {
    "dynapipe": ["--use-dynapipe"],
    "padding": ["--dynapipe-batching", "padding"],
    # Megatron's packing with per-sample positions and attention isolation: the same loss as the others.
    "packing": ["--dynapipe-batching", "packing", "--reset-position-ids", "--reset-attention-mask"],
}

# The README's main job: the tiny GPT, 2 pipeline stages, the synthetic mixture at 1024 tokens.
DEFAULT_ARGS = {
    "--num-layers": "4", "--hidden-size": "64", "--num-attention-heads": "4", "--ffn-hidden-size": "256",
    "--seq-length": "1024", "--max-position-embeddings": "1024", "--vocab-size": "512",
    "--micro-batch-size": "4", "--global-batch-size": "64", "--pipeline-model-parallel-size": "2",
    "--train-iters": "4", "--lr": "1e-4", "--hidden-dropout": "0", "--attention-dropout": "0",
    "--log-interval": "1", "--seed": "1234",
}
PROFILE_MBS = (1, 2, 4, 8)
PROFILE_SEQLENS = (32, 64, 128, 256, 512, 1024)


def with_defaults(argv: Sequence[str]) -> list[str]:
    """``argv`` plus every default of :data:`DEFAULT_ARGS` it does not set (and ``--mock-data``
    unless data is given)."""
    argv = list(argv)
    given = {a.split("=")[0] for a in argv if a.startswith("--")}
    out = list(argv)
    for flag, value in DEFAULT_ARGS.items():
        if flag not in given:
            out += [flag, value]
    if "--mock-data" not in given and "--data-path" not in given:
        out.append("--mock-data")
    return out


def _arg(argv: Sequence[str], flag: str, default: Optional[str] = None) -> Optional[str]:
    for i, a in enumerate(argv):
        if a == flag and i + 1 < len(argv):
            return argv[i + 1]
        if a.startswith(flag + "="):
            return a.split("=", 1)[1]
    return default


@dataclass
class MethodResult:
    """One method's figures over the timed iterations (see the module docstring)."""

    real_tokens_per_s: float
    padding_efficiency: float
    iteration_ms: float
    plan_wait_ms: float
    losses: list[float] = field(default_factory=list)
    timed_iterations: int = 0
    layer_spec: str = ""
    activation_peak_mib: list = field(default_factory=list)  # per stage {"measured", "planned"}

    def to_json(self) -> dict:
        return {"real_tokens_per_s": round(self.real_tokens_per_s, 2),
                "padding_efficiency": round(self.padding_efficiency, 4),
                "iteration_ms": round(self.iteration_ms, 2), "plan_wait_ms": round(self.plan_wait_ms, 3),
                "plan_wait_fraction": round(self.plan_wait_ms / self.iteration_ms, 5) if self.iteration_ms else 0.0,
                "timed_iterations": self.timed_iterations, "lm_loss": self.losses, "layer_spec": self.layer_spec,
                "activation_peak_mib": self.activation_peak_mib}


def summarise(ranks: list[dict], warmup_iters: int) -> MethodResult:
    """Figures of one method from every rank's summary, iterations after the warm-up."""
    n = len(ranks[0]["iteration_ms"])
    keep = list(range(min(warmup_iters, n - 1), n))
    # An iteration lasts as long as its slowest rank.
    iter_ms = [max(r["iteration_ms"][i] for r in ranks) for i in keep]
    wait_ms = [max(r["plan_wait_ms"][i] for r in ranks) for i in keep]
    real = sum(ranks[0]["real_tokens"][i] for i in keep)
    padded = sum(ranks[0]["padded_tokens"][i] for i in keep)
    return MethodResult(real_tokens_per_s=real / (sum(iter_ms) / 1e3), padding_efficiency=real / max(padded, 1),
                        iteration_ms=statistics.fmean(iter_ms), plan_wait_ms=statistics.fmean(wait_ms),
                        losses=ranks[0]["losses"], timed_iterations=len(keep), layer_spec=ranks[0]["layer_spec"],
                        activation_peak_mib=stage_activation_peaks(ranks, keep))


def stage_activation_peaks(ranks: list[dict], keep: Sequence[int]) -> list[dict]:
    """Per pipeline stage: the highest measured and planned activation peak (MiB) over its
    ranks and the iterations ``keep``; ``planned`` None where no plan promised one."""
    stages: dict[int, dict] = {}
    for r in ranks:
        if "activation_measured_mib" not in r:
            continue
        entry = stages.setdefault(r.get("pp_rank", 0), {"measured": 0.0, "planned": None})
        entry["measured"] = max(entry["measured"], max(r["activation_measured_mib"][i] for i in keep))
        planned = [r["activation_planned_mib"][i] for i in keep if r["activation_planned_mib"][i] is not None]
        if planned:
            entry["planned"] = max(entry["planned"] or 0.0, max(planned))
    return [{"stage": s, "measured": round(e["measured"], 3),
             "planned": None if e["planned"] is None else round(e["planned"], 3)} for s, e in sorted(stages.items())]


def _profile_job(argv: Sequence[str], output: str, threads: int) -> str:
    from dynapipe.cli import main

    args = ["profile", "--output", output, "--mbs", ",".join(map(str, PROFILE_MBS)),
            "--seqlens", ",".join(str(s) for s in PROFILE_SEQLENS if s <= int(_arg(argv, "--seq-length"))),
            "--repeats", "3", "--threads", str(threads)]
    for flag in ("--num-layers", "--hidden-size", "--num-attention-heads", "--ffn-hidden-size", "--kv-channels",
                 "--seq-length", "--max-position-embeddings", "--vocab-size", "--position-embedding-type",
                 "--normalization", "--hidden-dropout", "--attention-dropout"):
        value = _arg(argv, flag)
        if value is not None:
            args += [flag, value]
    for flag in ("--bf16", "--fp16", "--untie-embeddings-and-output-weights"):
        if flag in argv:
            args.append(flag)
    code = main(args)
    if code != 0:
        raise RuntimeError(f"profiling failed (exit code {code})")
    return output


def measure_profile(argv: Sequence[str], output: str, threads: int, timeout_s: float) -> str:
    """Profile this machine for the model in ``argv`` (one spawned rank, ``threads`` threads)."""
    return spawn(_profile_job, 1, (list(argv), output, threads), timeout_s=timeout_s, threads_per_rank=threads)[0]


def ratio_table(results: dict[str, MethodResult]) -> str:
    """The side-by-side table printed by ``python -m dynapipe bench``."""
    header = (f"{'method':<10} {'real tok/s':>11} {'pad eff':>8} {'iter ms':>10} {'plan wait ms':>13} "
              f"{'vs padding':>11} {'vs packing':>11}")
    lines = [header, "-" * len(header)]
    for name, r in results.items():
        vs = [f"{r.real_tokens_per_s / results[b].real_tokens_per_s:.2f}x" if b in results else "-"
              for b in ("padding", "packing")]
        lines.append(f"{name:<10} {r.real_tokens_per_s:>11.1f} {r.padding_efficiency:>8.3f} {r.iteration_ms:>10.1f} "
                     f"{r.plan_wait_ms:>13.2f} {vs[0]:>11} {vs[1]:>11}")
    return "\n".join(lines)


def write_png(results: dict[str, MethodResult], path: str, title: str) -> None:
    """Bar charts of real tokens/s and padding efficiency per method."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(results)
    colors = ["#1f77b4" if n == "dynapipe" else "#999999" for n in names]
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.6))
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
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def run_bench(argv: Sequence[str], methods: Sequence[str], nproc: int, output: str, png: Optional[str] = None,
              warmup_iters: int = 1, profile: Optional[str] = None, threads_per_rank: Optional[int] = None,
              timeout_s: float = 1800.0, stream: TextIO = sys.stdout) -> dict:
    """Train every method in ``methods`` with ``argv`` on ``nproc`` ranks; write the JSON (and PNG)."""
    argv = with_defaults(argv)
    threads = threads_per_rank or max(1, (os.cpu_count() or 1) // nproc)
    given_profile = _arg(argv, "--dynapipe-cost-model")
    if "dynapipe" in methods and given_profile in (None, "analytic") and profile != "analytic":
        profile = profile or os.path.splitext(output)[0] + ".profile.json"
        print(f"measuring a cost profile of this machine ({threads} thread(s) per rank) -> {profile}", file=stream)
        measure_profile(argv, profile, threads, timeout_s)
    results: dict[str, MethodResult] = {}
    for method in methods:
        margv = list(argv) + METHOD_FLAGS[method]
        if method == "dynapipe" and profile not in (None, "analytic") and given_profile is None:
            margv += ["--dynapipe-cost-model", profile]
        print(f"training {method} on {nproc} rank(s) ...", file=stream, flush=True)
        ranks = run_training(margv, nproc, timeout_s=timeout_s, threads_per_rank=threads)
        results[method] = summarise(ranks, warmup_iters)
    table = ratio_table(results)
    print(table, file=stream)
    report = {
        "methods": {m: r.to_json() for m, r in results.items()},
        "ratios": {f"{m}_vs_{b}": round(results[m].real_tokens_per_s / results[b].real_tokens_per_s, 3)
                   for m in results for b in ("padding", "packing") if b in results and m != b},
        "setup": {"argv": list(argv), "nproc": nproc, "threads_per_rank": threads, "warmup_iters": warmup_iters,
                  "cost_model": given_profile or profile or "analytic"},
    }
    with open(output, "w") as f:
        json.dump(report, f, indent=1)
    if png:
        write_png(results, png, f"{nproc} ranks, seq-length {_arg(argv, '--seq-length')}, "
                                f"global batch {_arg(argv, '--global-batch-size')}")
    return report
