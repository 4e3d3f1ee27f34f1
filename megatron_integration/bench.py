"""DynaPipe against megatron-core's padding, per-micro-batch padding and packing, side by side.

:func:`run_bench` trains every method on the same model, seed and global batches (each
run a fresh spawned job of ``nproc`` gloo/NCCL ranks), after measuring a cost profile of
this machine for DynaPipe's planner (unless one is given). The methods and the presets
are in :mod:`megatron_integration.bench_presets`; every method's figures (tokens per
second, padding efficiency, iteration and plan-wait time, activation peaks: see
:class:`~megatron_integration.bench_results.MethodResult`) come from
:mod:`megatron_integration.bench_results`. Next to them the report gives
``time_breakdown_ms`` / ``time_split_ms``: where each stage's iteration went (compute,
bubble, communication, schedule overhead, optimizer, plan wait), from the executor's
traces and megatron-core's timed steps (:mod:`megatron_integration.bench_breakdown`).

Before the timed rounds, a preset with ``calibrate_iters`` runs DynaPipe untimed and refits
the profile's times per shape from the ops it executed
(:mod:`megatron_integration.bench_calibrate`, :mod:`megatron_integration.bench_refit`);
every method is planned and simulated with that calibrated profile. Fairness: the
baselines' ``--micro-batch-size`` is tuned (the sizes that fit memory are simulated with
the calibrated profile, the best ``sweep_top`` run for real, the fastest
kept); methods run in rotated order over ``rounds`` rounds and report medians; DynaPipe's
planner workers plan ahead during the timed iterations and their CPU time is recorded.
"""
from __future__ import annotations

import json
import os
import resource
import sys
import time
from typing import Optional, Sequence, TextIO

from dynapipe.progress import Progress
from dynapipe.output_paths import write_output
# Preset and stage_activation_peaks are not used here: callers import them from this module.
from megatron_integration import cpu_allocator
from megatron_integration.bench_checks import calibrated_profile_path, check_bench_outputs, measured_profile_path
from megatron_integration.bench_request import Entry, check_request  # noqa: F401 (Entry re-exported)
from megatron_integration.bench_presets import (BASELINES, DYNAPIPE_METHODS, EXECUTOR_METHODS, METHOD_FLAGS,
                                                PRESETS, PROFILE_MBS, PROFILE_SEQLENS, REFERENCE_SEQ_LENGTH,
                                                fill_defaults, flag_value, host_defaults, with_defaults)
from megatron_integration.bench_report import (breakdown, breakdown_summary, breakdown_table, format_compute_floor,
                                               ratio_table, round_ratios, rounds_line, write_png)
from megatron_integration.bench_results import (MethodResult, median_result,  # noqa: F401 (re-exported)
                                                stage_activation_peaks, summarise)
from megatron_integration.bench_results import format_memory_faults
from megatron_integration.jobs import run_training


def _children_cpu_s() -> float:
    """User + system CPU seconds of this process's finished child processes (and theirs), the
    ranks of its jobs included (they fork from a server, so they report their own)."""
    from megatron_integration.launch import ranks_cpu_s

    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime + ranks_cpu_s()


def pick_sizes(ranked: Sequence[dict], top: int, within: float) -> list[dict]:
    """The sweep rows (best simulated first) that run for real: at most ``top``, and with
    ``within`` > 0 only those simulated at least ``1 - within`` times the best one's real
    tokens/s (a clearly slower size is not worth a run)."""
    if not ranked:
        return []
    floor = ranked[0]["real_tokens_per_s"] * (1.0 - within) if within > 0 else float("-inf")
    return [r for r in ranked[:top] if r["real_tokens_per_s"] >= floor]


def no_baseline_size(method: str, sweep: Sequence[dict]) -> Exception:
    """The error for a baseline none of whose micro-batch sizes fits (before any training run:
    the comparison would have nothing to set against DynaPipe)."""
    from dynapipe.errors import DynaPipeError

    why = "; ".join(f"{r['micro_batch_size']}: {r.get('reason', 'does not fit')}" for r in sweep) or "no candidate"
    return DynaPipeError(f"no micro-batch size of the {method} baseline fits the memory limit without recompute "
                         f"({why}); raise --dynapipe-memory-limit-mb, shorten --seq-length, or leave {method} "
                         f"out of --methods.")


def rotated(entries: Sequence, round_index: int) -> list:
    """Round ``round_index``'s order: the list rotated left by the round number, so each
    entry runs at a different position (and after different neighbours) in every round."""
    k = round_index % max(len(entries), 1)
    return list(entries[k:]) + list(entries[:k])


def measure_profile(model, output: str, threads: int, timeout_s: float, repeats: int = 3,
                    mbs_grid: Sequence[int] = PROFILE_MBS, levels: bool = True) -> str:
    """Profile this machine for ``model`` (GPTModelArgs; one spawned rank, ``threads`` threads)
    over ``mbs_grid`` x the :data:`~megatron_integration.bench_presets.PROFILE_SEQLENS` up to
    its sequence length."""
    from megatron_integration.profile_job import measure_profile as measure

    seqlens = [s for s in PROFILE_SEQLENS if s <= model.seq_length]
    if model.seq_length not in seqlens:
        seqlens.append(model.seq_length)
    return measure(model, output, list(mbs_grid), seqlens, repeats=repeats, threads=threads, timeout_s=timeout_s,
                   levels=levels)


def calibrate(argv: Sequence[str], profile: str, cfg, nproc: int, iters: int, threads: int, timeout_s: float,
              stream: TextIO) -> tuple[str, dict]:
    """Run DynaPipe untimed for ``iters`` iterations with ``profile``, on other global batches than
    the timed runs (:func:`~megatron_integration.bench_calibrate.calibration_argv`), and write
    next to it the profile refitted per shape from the ops it executed
    (:func:`megatron_integration.bench_calibrate.refit_from_run`); returns that file and what
    the JSON records of the fit (with the run's wall time). Every method's planning and
    simulation then uses it alike."""
    from dynapipe.config import load_device_config
    from dynapipe.cost import build_cost_model
    from megatron_integration import bench_calibrate

    t0 = time.perf_counter()
    trace_dir = os.path.splitext(profile)[0] + ".calibration-traces"
    margv = Entry("dynapipe").argv(argv) + ["--dynapipe-cost-model", profile, "--dynapipe-trace-dir", trace_dir,
                                            "--train-iters", str(iters)]
    other_batches = bench_calibrate.calibration_argv(cfg.seed)
    margv += other_batches
    print(f"calibrating the profile per shape from executed ops ({iters} DynaPipe iterations, untimed) ...",
          end=" ", file=stream, flush=True)
    ranks = run_training(margv, nproc, timeout_s=timeout_s, threads_per_rank=threads)
    cost = build_cost_model(cfg.model.to_model_config("bench"), load_device_config(cfg.dynapipe.device),
                            cfg.parallel.pipeline_model_parallel_size, profile)
    out = calibrated_profile_path(profile)
    # The first iteration pays one-off costs (allocations, first calls); fit the others.
    info = bench_calibrate.refit_from_run(ranks, trace_dir, profile, cost, list(range(min(1, iters - 1), iters)), out,
                                          recompute=cfg.dynapipe.recompute)
    before, after = info["error_before"]["total"], info["error_after"]["total"]
    print(f"{before.get('ops', 0)} ops, executed/profiled {before.get('ratio', 1.0):.2f}x, mean error per op "
          f"{before.get('mean_abs_error', 0.0):.0%} -> {after.get('mean_abs_error', 0.0):.0%} "
          f"({time.perf_counter() - t0:.0f} s)", file=stream, flush=True)
    return out, {**info, "profile": out, "seconds": round(time.perf_counter() - t0, 1),
                 "seed": int(other_batches[-1]),
                 "lm_loss": ranks[0]["losses"]}


def cost_model_error(cfg, profiles: dict, trace_dirs: Sequence[str], iterations: Sequence[int]) -> dict:
    """How well each cost profile (name -> path) predicts the forwards and backwards timed
    DynaPipe runs executed (their traces, all rounds): totals and errors per size class. The
    calibrated profile is out of sample here (fitted on the calibration run, not on these ops)."""
    from dynapipe.config import load_device_config
    from dynapipe.cost import build_cost_model
    from megatron_integration import bench_calibrate, bench_refit

    out = {}
    for name, path in profiles.items():
        cost = build_cost_model(cfg.model.to_model_config("bench"), load_device_config(cfg.dynapipe.device),
                                cfg.parallel.pipeline_model_parallel_size, path)
        level = cfg.dynapipe.recompute
        ops = bench_refit.ExecutedOps.concat([bench_calibrate.executed_ops(d, cost, iterations, recompute=level)
                                              for d in trace_dirs])
        out[name] = {"total": bench_refit.total_error(ops), "per_size": bench_refit.shape_errors(ops)}
    return out


def run_bench(argv: Sequence[str], methods: Optional[Sequence[str]], nproc: int, output: str,
              png: Optional[str] = None, warmup_iters: Optional[int] = None, profile: Optional[str] = None,
              threads_per_rank: Optional[int] = None, timeout_s: float = 1800.0, stream: TextIO = sys.stdout,
              preset: str = "tiny", rounds: Optional[int] = None, sweep_top: Optional[int] = None,
              calibrate_iters: Optional[int] = None, progress: bool = True) -> dict:
    """Train every method with ``argv`` on ``nproc`` ranks, ``rounds`` rounds in rotated order;
    write the JSON (and PNG). ``None`` arguments take the preset's value. ``progress``: a bar over
    the training runs on a terminal (see :mod:`dynapipe.progress`)."""
    from megatron_integration.arguments import parse_training_args
    from megatron_integration import bench_sim

    p = PRESETS[preset]
    methods = list(methods or p.methods)
    check_request(argv, methods, preset, rounds=rounds, sweep_top=sweep_top, warmup_iters=warmup_iters, nproc=nproc)
    check_bench_outputs(output, png, argv)
    rounds = p.rounds if rounds is None else rounds
    # The preset's per-method sizes apply only where --sweep-top was not given (even at its value).
    per_method = p.sweep_top_of if sweep_top is None else {}
    sweep_top = p.sweep_top if sweep_top is None else sweep_top
    warmup_iters = p.warmup_iters if warmup_iters is None else warmup_iters
    calibrate_iters = p.calibrate_iters if calibrate_iters is None else calibrate_iters
    argv = fill_defaults(with_defaults(argv, preset), host_defaults(nproc, p.cpu_pretouch_mb))
    cfg = parse_training_args(argv + METHOD_FLAGS["dynapipe"], nproc)
    threads = threads_per_rank or max(1, (os.cpu_count() or 1) // nproc)
    given_profile = flag_value(argv, "--dynapipe-cost-model")
    started = time.perf_counter()
    cpu0 = _children_cpu_s()
    profile_s = 0.0
    if given_profile is not None:
        profile = given_profile
    elif profile is None:
        profile = measured_profile_path(output)
        print(f"measuring a cost profile of this machine ({threads} thread(s) per rank) -> {profile}", file=stream,
              flush=True)
        measure_profile(cfg.model, profile, threads, timeout_s, p.profile_repeats, p.profile_mbs,
                        p.profile_levels)
    profile_s = time.perf_counter() - started
    calibration = None
    measured_profile = profile
    if calibrate_iters > 0 and given_profile is None and profile != "analytic" and any(
            m.startswith("dynapipe") or m in EXECUTOR_METHODS for m in methods):
        profile, calibration = calibrate(argv, profile, cfg, nproc, calibrate_iters, threads, timeout_s, stream)
    sim = bench_sim.BenchSimulation(cfg, nproc, None if profile == "analytic" else profile, warmup_iters)

    # Which sizes of each baseline run for real: the best simulated ones among those that fit.
    sweeps: dict[str, list[dict]] = {}
    entries: list[Entry] = []
    for m in methods:
        if m in BASELINES and sweep_top > 0:
            sweeps[m] = sim.sweep(m)
            ranked = sorted((r for r in sweeps[m] if r["fits"]), key=lambda r: -r["real_tokens_per_s"])
            if not ranked:
                raise no_baseline_size(m, sweeps[m])
            entries += [Entry(m, r["micro_batch_size"]) for r in pick_sizes(
                ranked, per_method.get(m, sweep_top), p.sweep_within)]
        else:
            entries.append(Entry(m))

    trace_root = os.path.splitext(output)[0] + ".traces"
    runs: dict[str, list[MethodResult]] = {e.label: [] for e in entries}
    splits: dict[str, list[list[dict]]] = {e.label: [] for e in entries}
    order_log = []
    bar = Progress(rounds * len(entries), "bench", enabled=progress, stream=stream)
    for k in range(rounds):
        order = rotated(entries, k)
        order_log.append([e.label for e in order])
        for e in order:
            margv = e.argv(argv)
            trace_dir = None
            if e.method in EXECUTOR_METHODS:
                if profile not in (None, "analytic") and given_profile is None:
                    margv += ["--dynapipe-cost-model", profile]
                trace_dir = os.path.join(trace_root, f"{e.label}-round{k}")
                margv += ["--dynapipe-trace-dir", trace_dir]
            bar.begin(f"round {k + 1}/{rounds}: training {e.label} on {nproc} rank(s) ...")
            t0 = time.perf_counter()
            ranks = run_training(margv, nproc, timeout_s=timeout_s, threads_per_rank=threads)
            bar.step(f"{time.perf_counter() - t0:.0f} s")
            runs[e.label].append(summarise(ranks, warmup_iters, cfg.dynapipe.prefetch))
            splits[e.label].append(breakdown(ranks, warmup_iters, trace_dir))

    bar.close()
    per_entry = {label: median_result(rs) for label, rs in runs.items()}
    chosen: dict[str, Entry] = {}
    for e in entries:
        best = chosen.get(e.method)
        if best is None or per_entry[e.label].real_tokens_per_s > per_entry[best.label].real_tokens_per_s:
            chosen[e.method] = e
    results = {m: per_entry[chosen[m].label] for m in methods}
    sizes = {m: (chosen[m].micro_batch_size or cfg.micro_batch_size) if m in BASELINES else None for m in methods}
    shares = {m: sim.attention_share(m, sizes[m]) for m in methods}
    simulated = {m: sim.simulated(m, sizes[m]) for m in methods}
    reference = bench_sim.gpt7b_attention_shares(methods, REFERENCE_SEQ_LENGTH)

    print(ratio_table(results, tuple(b for b in BASELINES if b in results), shares, sizes), file=stream)
    time_split = {m: breakdown_summary(splits[chosen[m].label]) for m in methods}
    for m in methods:
        if time_split[m]:
            time_split[m]["planner_cpu_ms"] = results[m].planner_cpu_ms
    print("\nwhere an iteration's time went (ms per iteration, mean over rounds and timed iterations):",
          file=stream)
    print(breakdown_table(time_split), file=stream)
    print("\nthe cost model's own prediction (simulated pipeline iteration, ms) against the measured iteration:",
          file=stream)
    for m in methods:
        print(f"  {m}: simulated {simulated[m]['iteration_ms']:.0f}, measured {results[m].iteration_ms:.0f} "
              f"({results[m].iteration_ms / max(simulated[m]['iteration_ms'], 1e-9):.2f}x)", file=stream)
    print(format_memory_faults({m: (results[m].minor_faults, results[m].system_ms, results[m].pretouch_s)
                                for m in methods},
                               cfg.parallel.cpu_pretouch_mb), file=stream)
    errors = {}
    if calibration is not None:
        keep = list(range(warmup_iters, cfg.train_iters))
        errors = {m: cost_model_error(cfg, {"calibrated": profile, "measured": measured_profile},
                                      [os.path.join(trace_root, f"{chosen[m].label}-round{k}") for k in range(rounds)],
                                      keep)
                  for m in methods if m in EXECUTOR_METHODS}
        print("\nthe cost model against the forwards and backwards the timed runs executed (executed / predicted ms, "
              "mean error per op):", file=stream)
        for m, e in errors.items():
            print(f"  {m}: " + "; ".join(f"{name} profile {v['total'].get('ratio', 0):.2f}x, "
                                        f"{v['total'].get('mean_abs_error', 0):.0%}" for name, v in e.items()),
                  file=stream)
    best_base = max((b for b in BASELINES if b in results), key=lambda b: results[b].real_tokens_per_s, default=None)
    floor = sim.compute_floor(sizes)
    print("\n" + format_compute_floor(floor, best_base), file=stream)
    report = {
        "preset": preset, "about": p.about,
        "methods": {m: {**results[m].to_json(), "micro_batch_size": sizes[m], "run": chosen[m].label,
                        "rounds_real_tokens_per_s": [round(r.real_tokens_per_s, 2) for r in runs[chosen[m].label]],
                        "attention_share": round(shares[m], 4),
                        "gpt7b_attention_share": reference.get(m),
                        "time_breakdown_ms": splits[chosen[m].label], "time_split_ms": time_split[m],
                        **({"cost_model_error": errors[m]} if m in errors else {}),
                        # The cost model's own prediction of this method's run, next to what was measured.
                        "simulated": simulated[m],
                        **({"sweep": sim.sweep_with_measured(sweeps[m], per_entry, m)} if m in sweeps else {})}
                    for m in methods},
        "ratios": {f"{m}_vs_{b}": round(results[m].real_tokens_per_s / results[b].real_tokens_per_s, 3)
                   for m in results for b in BASELINES if b in results and m != b},
        "best_baseline": best_base, "compute_floor": floor,
        "setup": {"argv": list(argv), "nproc": nproc, "threads_per_rank": threads, "warmup_iters": warmup_iters,
                  "rounds": rounds, "round_orders": order_log, "sweep_top": sweep_top,
                  "sweep_within": p.sweep_within, "sweep_top_of": dict(p.sweep_top_of), "profile_mbs": list(p.profile_mbs),
                  "profile_recompute_levels": "measured" if p.profile_levels else "derived",
                  "elapsed_s": round(time.perf_counter() - started, 1), "profile_s": round(profile_s, 1),
                  "calibration": calibration, "cpu_pretouch_mb": cfg.parallel.cpu_pretouch_mb,
                  # CPU seconds of every process the bench started (ranks, planner workers, profiler):
                  # what bounds its wall time on an idle machine (>= cpu_s / cores).
                  "cpu_s": round(_children_cpu_s() - cpu0, 1),
                  "cost_model": profile or "analytic", "timed_regions": bench_sim.TIMED_REGIONS,
                  "cpu_allocator": cpu_allocator.describe(),
                  "attention_share_reference": f"gpt-7b at --seq-length {REFERENCE_SEQ_LENGTH}, same method, "
                                               f"simulated on the same mixture (65,536 tokens, PP4 x DP2 a100-40gb, "
                                               f"distributed optimizer)"},
    }
    if best_base is not None:
        for m in DYNAPIPE_METHODS:
            if m in results:
                report["ratios"][f"{m}_vs_best_baseline"] = round(
                    results[m].real_tokens_per_s / results[best_base].real_tokens_per_s, 3)
    # Each reported method carries its run's label and its figure of every round.
    report["ratios_per_round"] = round_ratios(
        report["methods"], {r["run"]: r for r in report["methods"].values()},
        [b for b in BASELINES if b in results], best_base, best_for=DYNAPIPE_METHODS)
    print("\n" + rounds_line(report["ratios_per_round"], cfg.train_iters - warmup_iters), file=stream)
    write_output(output, json.dumps(report, indent=1), "--output")
    if png:
        write_png(results, png, f"{preset}: {nproc} ranks, seq-length {flag_value(argv, '--seq-length')}, "
                                f"global batch {flag_value(argv, '--global-batch-size')}, median of {rounds} round(s)")
    return report
