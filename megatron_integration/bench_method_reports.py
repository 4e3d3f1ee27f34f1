"""Each method's reported run in :func:`megatron_integration.bench.run_bench`, and its part
of the report.

:class:`BenchRounds` holds what the timed rounds ran; :class:`Picked` each method's
reported run (its fastest entry, medians over rounds) with what the simulation says of
it; :func:`time_split`, :func:`print_time_and_memory`, :func:`method_report` and
:func:`add_ratios` turn those into the printed tables and the report's ``methods`` and
``ratios``. Times are in ms.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional, Sequence, TextIO

from megatron_integration.bench_presets import BASELINES, DYNAPIPE_METHODS
from megatron_integration.bench_report import breakdown_summary, breakdown_table, round_ratios
from megatron_integration.bench_request import Entry
from megatron_integration.bench_results import MethodResult, format_memory_faults


@dataclass
class BenchRounds:
    """What the timed rounds ran: the entries (baselines at each swept size), the simulated
    sweeps, and per entry label its result and time breakdown (ms) of every round, and each
    round's order of entry labels."""

    entries: list[Entry]
    sweeps: dict[str, list[dict]]
    runs: dict[str, list[MethodResult]] = field(default_factory=dict)
    splits: dict[str, list[list[dict]]] = field(default_factory=dict)
    order_log: list[list[str]] = field(default_factory=list)


@dataclass
class Picked:
    """Each method's reported run and what the simulation says of it: the median result of
    every entry, the entry chosen per method and its result, micro-batch size (None for
    DynaPipe methods), attention share, simulated iteration (ms) and the gpt-7b reference share."""

    per_entry: dict[str, MethodResult]
    chosen: dict[str, Entry]
    results: dict[str, MethodResult]
    sizes: dict[str, Optional[int]]
    shares: dict[str, float]
    simulated: dict[str, dict]
    reference: dict


def time_split(methods: Sequence[str], rounds: BenchRounds, picked: Picked) -> dict[str, dict]:
    """Per method, where its reported run's iterations went (ms, over rounds), with the
    planner's CPU ms where there is a breakdown."""
    split = {m: breakdown_summary(rounds.splits[picked.chosen[m].label]) for m in methods}
    for m in methods:
        if split[m]:
            split[m]["planner_cpu_ms"] = picked.results[m].planner_cpu_ms
    return split


def print_time_and_memory(methods: Sequence[str], cfg: Any, picked: Picked, split: dict, stream: TextIO) -> None:
    """Print where each method's iteration went (ms), the cost model's simulated iteration
    against the measured one (ms), and the memory the runs first touched in timed iterations
    (``cfg``'s pre-touched heap, MiB, beside it)."""
    results, simulated = picked.results, picked.simulated
    print("\nwhere an iteration's time went (ms per iteration, mean over rounds and timed iterations):",
          file=stream)
    print(breakdown_table(split), file=stream)
    print("\nthe cost model's own prediction (simulated pipeline iteration, ms) against the measured iteration:",
          file=stream)
    for m in methods:
        print(f"  {m}: simulated {simulated[m]['iteration_ms']:.0f}, measured {results[m].iteration_ms:.0f} "
              f"({results[m].iteration_ms / max(simulated[m]['iteration_ms'], 1e-9):.2f}x)", file=stream)
    print(format_memory_faults({m: (results[m].minor_faults, results[m].system_ms, results[m].pretouch_s)
                                for m in methods},
                               cfg.parallel.cpu_pretouch_mb), file=stream)


def method_report(m: str, rounds: BenchRounds, picked: Picked, split: dict, errors: dict, sim) -> dict:
    """Method ``m``'s entry in the report's ``methods``: its reported run's figures, each
    round's real tokens/s, its time breakdown and split (ms), the cost model's errors (where
    calibrated), the simulated run and, for a swept baseline, the sweep with what ran."""
    label = picked.chosen[m].label
    return {**picked.results[m].to_json(), "micro_batch_size": picked.sizes[m], "run": label,
            "rounds_real_tokens_per_s": [round(r.real_tokens_per_s, 2) for r in rounds.runs[label]],
            "attention_share": round(picked.shares[m], 4),
            "gpt7b_attention_share": picked.reference.get(m),
            "time_breakdown_ms": rounds.splits[label], "time_split_ms": split[m],
            **({"cost_model_error": errors[m]} if m in errors else {}),
            # The cost model's own prediction of this method's run, next to what was measured.
            "simulated": picked.simulated[m],
            **({"sweep": sim.sweep_with_measured(rounds.sweeps[m], picked.per_entry, m)}
               if m in rounds.sweeps else {})}


def add_ratios(report: dict, results: dict[str, MethodResult], best_base: Optional[str]) -> None:
    """Add to ``report["ratios"]`` each DynaPipe method's real tokens/s against the best
    baseline's, and set ``report["ratios_per_round"]``, the ratios of every round."""
    if best_base is not None:
        for m in DYNAPIPE_METHODS:
            if m in results:
                report["ratios"][f"{m}_vs_best_baseline"] = round(
                    results[m].real_tokens_per_s / results[best_base].real_tokens_per_s, 3)
    # Each reported method carries its run's label and its figure of every round.
    report["ratios_per_round"] = round_ratios(
        report["methods"], {r["run"]: r for r in report["methods"].values()},
        [b for b in BASELINES if b in results], best_base, best_for=DYNAPIPE_METHODS)
