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
from dataclasses import dataclass
from typing import Any, Optional, Sequence, TextIO

from dynapipe.progress import Progress
from dynapipe.output_paths import write_output
from megatron_integration import cpu_allocator
from megatron_integration.bench_checks import calibrated_profile_path, check_bench_outputs, measured_profile_path
from megatron_integration.bench_method_reports import (BenchRounds, Picked, add_ratios, method_report,
                                                       print_time_and_memory, time_split)
from megatron_integration.bench_request import Entry, check_request  # noqa: F401 (Entry re-exported)
from megatron_integration.bench_presets import (BASELINES, EXECUTOR_METHODS, METHOD_FLAGS, PRESETS, PROFILE_MBS,
                                                PROFILE_SEQLENS, REFERENCE_SEQ_LENGTH, fill_defaults, flag_value,
                                                host_defaults, with_defaults)
from megatron_integration.bench_report import breakdown, format_compute_floor, ratio_table, rounds_line, write_png
from megatron_integration.bench_results import MethodResult, median_result, summarise  # noqa: F401
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


@dataclass
class _Request:
    """A bench request resolved against its preset: ``None`` arguments replaced by the
    preset's values, ``argv`` completed with the preset's and this host's defaults, and the
    training config of the DynaPipe run parsed from it (``timeout_s``: per run, seconds)."""

    preset: str
    p: Any  # its Preset
    methods: list[str]
    argv: list[str]
    nproc: int
    output: str
    timeout_s: float
    rounds: int
    per_method: dict  # method -> how many of its sizes run (the preset's, where --sweep-top was not given)
    sweep_top: int
    warmup_iters: int
    calibrate_iters: int
    cfg: Any
    threads: int
    given_profile: Optional[str]  # --dynapipe-cost-model in argv, if any

    @property
    def trace_root(self) -> str:
        """The folder of every executor run's traces, next to ``output``."""
        return os.path.splitext(self.output)[0] + ".traces"


def _resolve_request(argv, methods, nproc, output, png, preset, rounds, sweep_top, warmup_iters, calibrate_iters,
                     threads_per_rank, timeout_s) -> _Request:
    """Refuse a request the bench cannot honour (before anything starts) and fill it in from the preset."""
    from megatron_integration.arguments import parse_training_args

    p = PRESETS[preset]
    methods = list(methods or p.methods)
    check_request(argv, methods, preset, rounds=rounds, sweep_top=sweep_top, warmup_iters=warmup_iters, nproc=nproc,
                  calibrate_iters=calibrate_iters)
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
    return _Request(preset, p, methods, argv, nproc, output, timeout_s, rounds, per_method, sweep_top, warmup_iters,
                    calibrate_iters, cfg, threads, flag_value(argv, "--dynapipe-cost-model"))


def _cost_profile(req: _Request, profile: Optional[str], stream: TextIO) -> Optional[str]:
    """The cost profile to plan with: the one ``argv`` names, else ``profile``, else one
    measured now (:func:`measure_profile`) next to the output."""
    if req.given_profile is not None:
        return req.given_profile
    if profile is None:
        p = req.p
        profile = measured_profile_path(req.output)
        print(f"measuring a cost profile of this machine ({req.threads} thread(s) per rank) -> {profile}",
              file=stream, flush=True)
        measure_profile(req.cfg.model, profile, req.threads, req.timeout_s, p.profile_repeats, p.profile_mbs,
                        p.profile_levels)
    return profile


def _calibrated_profile(req: _Request, profile: Optional[str], stream: TextIO) -> tuple[Optional[str], Optional[dict]]:
    """``(profile, calibration)``: where the request calibrates (iterations asked for, a profile
    not given in ``argv`` nor analytic, a method that runs the executor), the profile refitted
    from an untimed DynaPipe run and what the fit recorded (:func:`calibrate`); else
    ``profile`` unchanged and None."""
    if req.calibrate_iters > 0 and req.given_profile is None and profile != "analytic" and any(
            m.startswith("dynapipe") or m in EXECUTOR_METHODS for m in req.methods):
        return calibrate(req.argv, profile, req.cfg, req.nproc, req.calibrate_iters, req.threads, req.timeout_s,
                         stream)
    return profile, None


def _entries(req: _Request, sim) -> tuple[dict[str, list[dict]], list[Entry]]:
    """``(sweeps, entries)``: what runs for real, each swept baseline at its best simulated
    sizes among those that fit (:func:`pick_sizes`), every other method once."""
    sweeps: dict[str, list[dict]] = {}
    entries: list[Entry] = []
    for m in req.methods:
        if m in BASELINES and req.sweep_top > 0:
            sweeps[m] = sim.sweep(m)
            ranked = sorted((r for r in sweeps[m] if r["fits"]), key=lambda r: -r["real_tokens_per_s"])
            if not ranked:
                raise no_baseline_size(m, sweeps[m])
            entries += [Entry(m, r["micro_batch_size"]) for r in pick_sizes(
                ranked, req.per_method.get(m, req.sweep_top), req.p.sweep_within)]
        else:
            entries.append(Entry(m))
    return sweeps, entries


def _run_rounds(req: _Request, sweeps: dict, entries: list[Entry], profile: Optional[str], stream: TextIO,
                progress: bool) -> BenchRounds:
    """Train every entry once a round, in rotated order (:func:`rotated`); record each run's
    result and time breakdown (ms). Executor runs plan with ``profile`` (unless ``argv`` names
    one) and write their traces under the request's trace root."""
    done = BenchRounds(entries, sweeps, {e.label: [] for e in entries}, {e.label: [] for e in entries})
    bar = Progress(req.rounds * len(entries), "bench", enabled=progress, stream=stream)
    for k in range(req.rounds):
        order = rotated(entries, k)
        done.order_log.append([e.label for e in order])
        for e in order:
            margv = e.argv(req.argv)
            trace_dir = None
            if e.method in EXECUTOR_METHODS:
                if profile not in (None, "analytic") and req.given_profile is None:
                    margv += ["--dynapipe-cost-model", profile]
                trace_dir = os.path.join(req.trace_root, f"{e.label}-round{k}")
                margv += ["--dynapipe-trace-dir", trace_dir]
            bar.begin(f"round {k + 1}/{req.rounds}: training {e.label} on {req.nproc} rank(s) ...")
            t0 = time.perf_counter()
            ranks = run_training(margv, req.nproc, timeout_s=req.timeout_s, threads_per_rank=req.threads)
            bar.step(f"{time.perf_counter() - t0:.0f} s")
            done.runs[e.label].append(summarise(ranks, req.warmup_iters, req.cfg.dynapipe.prefetch))
            done.splits[e.label].append(breakdown(ranks, req.warmup_iters, trace_dir))
    bar.close()
    return done


def _pick_runs(methods: Sequence[str], cfg: Any, done: BenchRounds, sim) -> Picked:
    """Each method's reported run: of its entries, the one of highest median real tokens/s
    (the first on a tie), with what ``sim`` says of that method at that size (a baseline not
    swept at ``cfg``'s ``--micro-batch-size``)."""
    from megatron_integration import bench_sim

    per_entry: dict[str, MethodResult] = {label: median_result(rs) for label, rs in done.runs.items()}
    chosen: dict[str, Entry] = {}
    for e in done.entries:
        best = chosen.get(e.method)
        if best is None or per_entry[e.label].real_tokens_per_s > per_entry[best.label].real_tokens_per_s:
            chosen[e.method] = e
    results = {m: per_entry[chosen[m].label] for m in methods}
    sizes = {m: (chosen[m].micro_batch_size or cfg.micro_batch_size) if m in BASELINES else None for m in methods}
    shares = {m: sim.attention_share(m, sizes[m]) for m in methods}
    simulated = {m: sim.simulated(m, sizes[m]) for m in methods}
    reference = bench_sim.gpt7b_attention_shares(methods, REFERENCE_SEQ_LENGTH)
    return Picked(per_entry, chosen, results, sizes, shares, simulated, reference)


def _cost_model_errors(req: _Request, picked: Picked, profile: str, measured_profile: str,
                       stream: TextIO) -> dict[str, dict]:
    """Per executor method, how well the calibrated and the measured profile predict the
    forwards and backwards (ms) its reported run executed in the timed iterations (every
    round's traces, :func:`cost_model_error`); printed."""
    keep = list(range(req.warmup_iters, req.cfg.train_iters))
    errors = {m: cost_model_error(req.cfg, {"calibrated": profile, "measured": measured_profile},
                                  [os.path.join(req.trace_root, f"{picked.chosen[m].label}-round{k}")
                                   for k in range(req.rounds)],
                                  keep)
              for m in req.methods if m in EXECUTOR_METHODS}
    print("\nthe cost model against the forwards and backwards the timed runs executed (executed / predicted ms, "
          "mean error per op):", file=stream)
    for m, e in errors.items():
        print(f"  {m}: " + "; ".join(f"{name} profile {v['total'].get('ratio', 0):.2f}x, "
                                    f"{v['total'].get('mean_abs_error', 0):.0%}" for name, v in e.items()),
              file=stream)
    return errors


def _setup_report(req: _Request, done: BenchRounds, profile: Optional[str], calibration: Optional[dict],
                  started: float, profile_s: float, cpu0: float) -> dict:
    """The report's ``setup``: the request as run, the round orders, and the bench's wall and
    CPU seconds (``started``: its perf_counter at the start; ``profile_s``: seconds getting the
    profile; ``cpu0``: its children's CPU seconds at the start)."""
    from megatron_integration import bench_sim

    p = req.p
    return {"argv": list(req.argv), "nproc": req.nproc, "threads_per_rank": req.threads,
            "warmup_iters": req.warmup_iters, "rounds": req.rounds, "round_orders": done.order_log,
            "sweep_top": req.sweep_top, "sweep_within": p.sweep_within, "sweep_top_of": dict(p.sweep_top_of),
            "profile_mbs": list(p.profile_mbs), "profile_recompute_levels": "measured" if p.profile_levels else "derived",
            "elapsed_s": round(time.perf_counter() - started, 1), "profile_s": round(profile_s, 1),
            "calibration": calibration, "cpu_pretouch_mb": req.cfg.parallel.cpu_pretouch_mb,
            # CPU seconds of every process the bench started (ranks, planner workers, profiler):
            # what bounds its wall time on an idle machine (>= cpu_s / cores).
            "cpu_s": round(_children_cpu_s() - cpu0, 1),
            "cost_model": profile or "analytic", "timed_regions": bench_sim.TIMED_REGIONS,
            "cpu_allocator": cpu_allocator.describe(),
            "attention_share_reference": f"gpt-7b at --seq-length {REFERENCE_SEQ_LENGTH}, same method, "
                                         f"simulated on the same mixture (65,536 tokens, PP4 x DP2 a100-40gb, "
                                         f"distributed optimizer)"}


def run_bench(argv: Sequence[str], methods: Optional[Sequence[str]], nproc: int, output: str,
              png: Optional[str] = None, warmup_iters: Optional[int] = None, profile: Optional[str] = None,
              threads_per_rank: Optional[int] = None, timeout_s: float = 1800.0, stream: TextIO = sys.stdout,
              preset: str = "tiny", rounds: Optional[int] = None, sweep_top: Optional[int] = None,
              calibrate_iters: Optional[int] = None, progress: bool = True) -> dict:
    """Train every method with ``argv`` on ``nproc`` ranks, ``rounds`` rounds in rotated order;
    write the JSON (and PNG). ``None`` arguments take the preset's value. ``progress``: a bar over
    the training runs on a terminal (see :mod:`dynapipe.progress`)."""
    from megatron_integration import bench_sim

    req = _resolve_request(argv, methods, nproc, output, png, preset, rounds, sweep_top, warmup_iters,
                           calibrate_iters, threads_per_rank, timeout_s)
    methods, cfg = req.methods, req.cfg
    started = time.perf_counter()
    cpu0 = _children_cpu_s()
    measured_profile = _cost_profile(req, profile, stream)
    profile_s = time.perf_counter() - started
    profile, calibration = _calibrated_profile(req, measured_profile, stream)
    sim = bench_sim.BenchSimulation(cfg, nproc, None if profile == "analytic" else profile, req.warmup_iters)
    sweeps, entries = _entries(req, sim)
    done = _run_rounds(req, sweeps, entries, profile, stream, progress)
    picked = _pick_runs(methods, cfg, done, sim)
    results = picked.results
    print(ratio_table(results, tuple(b for b in BASELINES if b in results), picked.shares, picked.sizes), file=stream)
    split = time_split(methods, done, picked)
    print_time_and_memory(methods, cfg, picked, split, stream)
    errors = {} if calibration is None else _cost_model_errors(req, picked, profile, measured_profile, stream)
    best_base = max((b for b in BASELINES if b in results), key=lambda b: results[b].real_tokens_per_s, default=None)
    floor = sim.compute_floor(picked.sizes)
    print("\n" + format_compute_floor(floor, best_base), file=stream)
    report = {
        "preset": preset, "about": req.p.about,
        "methods": {m: method_report(m, done, picked, split, errors, sim) for m in methods},
        "ratios": {f"{m}_vs_{b}": round(results[m].real_tokens_per_s / results[b].real_tokens_per_s, 3)
                   for m in results for b in BASELINES if b in results and m != b},
        "best_baseline": best_base, "compute_floor": floor,
        "setup": _setup_report(req, done, profile, calibration, started, profile_s, cpu0),
    }
    add_ratios(report, results, best_base)
    print("\n" + rounds_line(report["ratios_per_round"], cfg.train_iters - req.warmup_iters), file=stream)
    write_output(output, json.dumps(report, indent=1), "--output")
    if png:
        write_png(results, png, f"{preset}: {nproc} ranks, seq-length {flag_value(req.argv, '--seq-length')}, "
                                f"global batch {flag_value(req.argv, '--global-batch-size')}, median of "
                                f"{req.rounds} round(s)")
    return report
