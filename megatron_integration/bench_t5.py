"""``bench --model t5``: DynaPipe against tuned padding and packing on a T5, side by side.

Every method trains the same T5 (megatron-core stages, 2 pipeline stages by default) on the
same seed and global batches of the multi-task mixture, all through the DynaPipe executor
(megatron-core's schedules no longer pipeline encoder-decoder models):

* ``dynapipe``: planned variable-shape micro-batches (the schedule search's choice), priced
  with a T5 cost profile of this machine measured at the start
  (:mod:`megatron_integration.bench_t5_profile`; ``--dynapipe-cost-model`` given: that
  profile, or ``analytic``);
* ``padding``: pairs padded to ``--encoder-seq-length`` / ``--decoder-seq-length``;
* ``packing``: pairs packed into encoder and decoder rows, samples isolated by masks.

Stage placement: the bench chooses it once with that profile, as ``--dynapipe-placement
auto`` would (a ``--dynapipe-placement`` given is used instead), and reports DynaPipe's
simulated bubble under the even split and under it (``placement.simulated``). As each
baseline keeps its fastest micro-batch size, every method keeps its fastest placement of
that one, the best contiguous split and Megatron's even split
(:mod:`megatron_integration.bench_t5_entries`); ``dynapipe-even`` reports DynaPipe's
even-split run, the measured before. Every run records executor traces, split per stage into
compute, bubble, communication and overhead as for GPT (``time_split_ms``), and each
method's per-stage compute is set against what the cost model predicted for the ops it ran
(``cost_model.stage_check``).

Tuning: each baseline runs at every micro-batch size of ``--t5-sweep`` (default: the
preset's) and its fastest is kept. All runs of one bench share one spawned job (runs in
turn, the slowest rank's iteration time counted). ``real_tokens_per_s`` counts input +
target tokens (padding excluded) per second of wall time over the iterations after the
warm-up; ``real_tokens_per_cpu_s`` the same per CPU second of the ranks and their planner
workers (on a machine shared with other jobs, wall time also holds the time runnable ranks
wait for a core, which weighs most on the method with the most synchronisation points).
"""
from __future__ import annotations

import json
import os
import statistics
import sys
import time
from typing import Optional, Sequence, TextIO

from dynapipe.errors import DynaPipeError
from dynapipe.output_paths import write_output
from megatron_integration import cpu_allocator
from megatron_integration.bench_checks import (check_bench_outputs, check_warmup_iters, make_output_dir,
                                               measured_profile_path, parse_t5_sweep)
from megatron_integration.bench_presets import fill_defaults, host_defaults
from megatron_integration.bench_results import schedule_counts
from megatron_integration.bench_t5_entries import (T5_BASELINES, T5_METHOD_FLAGS, UNCALIBRATED, T5Entry, best_runs,
                                                   t5_entries)
from megatron_integration.bench_t5_presets import T5_PRESETS, t5_with_defaults


def t5_figures(ranks: list[dict], warmup_iters: int, prefetch: int) -> dict:
    """Figures of one run from every rank's summary, iterations after the warm-up; ``prefetch``
    (``--dynapipe-prefetch``) counts the plans made during them, as the GPT bench does
    (:func:`~megatron_integration.bench_results.plans_queued_in`)."""
    from megatron_integration.bench_results import memory_faults, plans_queued_in, pretouch_seconds

    n = len(ranks[0]["iteration_ms"])
    keep = list(range(min(warmup_iters, n - 1), n))
    iter_ms = [max(r["iteration_ms"][i] for r in ranks) for i in keep]
    real = sum(ranks[0]["real_tokens"][i] for i in keep)
    padded = sum(ranks[0]["padded_tokens"][i] for i in keep)
    # CPU time of the ranks and of what they started (planner workers): the work done, which a
    # shared machine's run queue does not stretch the way it stretches wall time.
    cpu_ms = sum(r["cpu_ms"][i] + (r["children_cpu_ms"][i] or 0.0) for r in ranks for i in keep) \
        if all(r.get("cpu_ms") for r in ranks) else None
    # The planner workers' CPU (children of the planning rank; 0 for the baselines), per plan
    # made in the timed window: the run's last iterations have nothing left to plan.
    children = [r.get("children_cpu_ms") for r in ranks]
    plans = plans_queued_in(keep, prefetch, n)
    planner = round(sum(c[i] or 0.0 for c in children for i in keep) / plans, 1) \
        if plans and all(c for c in children) else None
    faults, system = memory_faults(ranks, keep)
    return {"real_tokens_per_s": round(real / (sum(iter_ms) / 1e3), 2),
            "planner_cpu_ms": planner,
            "minor_faults": None if faults is None else round(faults, 1),
            "system_ms": None if system is None else round(system, 1),
            "pretouch_s": pretouch_seconds(ranks),
            "real_tokens_per_cpu_s": None if not cpu_ms else round(real / (cpu_ms / 1e3), 2),
            "cpu_ms_per_iteration": None if cpu_ms is None else round(cpu_ms / len(keep), 1),
            "padding_efficiency": round(real / max(padded, 1), 4),
            "iteration_ms": round(statistics.fmean(iter_ms), 2),
            "plan_wait_ms": round(statistics.fmean(max(r["plan_wait_ms"][i] for r in ranks) for i in keep), 3),
            "timed_iterations": len(keep), "lm_loss": ranks[0]["losses"],
            "schedules": schedule_counts(ranks[0].get("schedules"), keep)}


def run_t5_bench(argv: Sequence[str], methods: Sequence[str], nproc: int, output: str, preset: str = "tiny",
                 sweep: Optional[Sequence[int]] = None, warmup_iters: Optional[int] = None,
                 threads_per_rank: Optional[int] = None, timeout_s: float = 1800.0,
                 stream: TextIO = sys.stdout, rounds: int = 1, calibrate_iters: int = 0) -> dict:
    """Train every method (each baseline at every size of ``sweep``) and write the JSON report.
    ``calibrate_iters``: iterations of an untimed DynaPipe run that fits the measured profile's
    fixed cost per stage op before the timed runs (0: none; ignored with a given profile).
    ``rounds``: every run repeated in a rotated order (in the same job); each run's figures
    are those of its round with the median real tokens/s (the lower one of two)."""
    from megatron_integration.bench_report import breakdown, breakdown_summary, round_ratios, timed_indices
    from megatron_integration.bench_t5_report import print_t5_report, trace_spread
    from megatron_integration.t5_arguments import parse_t5_args
    from megatron_integration.t5_jobs import run_t5_training

    p = T5_PRESETS[preset]
    sweep = tuple(p.sweep if sweep is None else sweep)
    warmup = p.warmup_iters if warmup_iters is None else warmup_iters
    check_warmup_iters(warmup)
    check_bench_outputs(output, argv=argv)
    argv = fill_defaults(t5_with_defaults(argv, preset), host_defaults(nproc, p.cpu_pretouch_mb))
    # Every command line checked before any process starts (the contiguous splits tried beside
    # an interleaved placement are the planner's own).
    for margv in [e.argv(argv) for e in t5_entries(methods, sweep, {"placement": ""})]:
        cfg = parse_t5_args(margv, nproc)
    from megatron_integration.bench_request import check_some_iteration_timed

    check_some_iteration_timed(cfg.base, warmup)
    make_output_dir(output)
    started, load_start = time.perf_counter(), _load_average()
    # DynaPipe's cuts, the auto placement and the simulation are priced with a profile of this
    # machine unless --dynapipe-cost-model says otherwise (the analytic model misjudges the
    # encoder/decoder balance on CPUs).
    profile, profile_s, calibration = _flag_value(argv, "--dynapipe-cost-model"), None, None
    measured = None  # the measured profile, when the bench calibrated it
    if profile is None:
        from megatron_integration.bench_t5_profile import measure_bench_profile

        profile = measured_profile_path(output)
        threads = threads_per_rank or max(1, (os.cpu_count() or 1) // nproc)
        print(f"measuring a T5 cost profile of this machine ({threads} thread(s)) -> {profile}", file=stream,
              flush=True)
        profile_s = measure_bench_profile(cfg, profile, threads, timeout_s)
        print(f"profiled in {profile_s:.1f} s", file=stream, flush=True)
        if calibrate_iters:
            from megatron_integration.bench_t5_profile import calibrate_t5_profile

            print(f"calibrating the profile's fixed cost per stage op ({calibrate_iters} DynaPipe iterations on the "
                  f"even split, untimed) ...", file=stream, flush=True)
            measured = profile
            profile, calibration = calibrate_t5_profile(argv + ["--dynapipe-cost-model", profile], profile, cfg,
                                                        nproc, calibrate_iters, threads, timeout_s,
                                                        _flag_value(argv, "--dynapipe-placement"))
            print(f"calibrated: executed = {calibration['slope']:.2f} x profiled + {calibration['intercept_ms']:.1f} "
                  f"ms per op, executor {calibration['executor_ms']:.1f} ms per op -> stage_overhead_ms "
                  f"{calibration['stage_overhead_ms']:.1f} ({calibration['seconds']:.0f} s)", file=stream, flush=True)
        argv += ["--dynapipe-cost-model", profile]
    placement = _placement(argv, nproc, warmup, [(m, size) for m in methods if m in T5_BASELINES for size in sweep])
    if placement["source"] == "auto":  # chosen once here: every run builds the same split
        argv += ["--dynapipe-placement", placement["placement"]]
    entries = t5_entries(methods, sweep, placement, measured)
    methods = list(methods) + ([UNCALIBRATED] if any(e.method == UNCALIBRATED for e in entries) else [])
    # Every run records executor traces: where each stage's time went (compute, bubble, ...).
    trace_root = os.path.splitext(output)[0] + ".traces"
    rounds = max(int(rounds), 1)
    # Rotated orders, so that no method always runs first or last on a machine whose load drifts.
    order = [(k, entries[(i + k) % len(entries)]) for k in range(rounds) for i in range(len(entries))]
    trace = {(k, e.label): os.path.join(trace_root, e.label if rounds == 1 else f"{e.label}-round{k}")
             for k, e in order}
    runs = [e.argv(argv) + ["--dynapipe-trace-dir", trace[k, e.label]] for k, e in order]
    print(f"training {', '.join(e.label for e in entries)} on {nproc} rank(s) ...", file=stream, flush=True)
    ranks = run_t5_training(runs, nproc, timeout_s=timeout_s, threads_per_rank=threads_per_rank)
    # The planner's look-ahead, as DynaPipe's runs read it (the baselines' lines drop the flag).
    prefetch = parse_t5_args(T5Entry("dynapipe").argv(argv), nproc).base.dynapipe.prefetch
    by_round: dict = {}
    for j, (k, e) in enumerate(order):
        by_round.setdefault(e.label, []).append((t5_figures([r[j] for r in ranks], warmup, prefetch), j, k))
    per_entry, picked = {}, {}
    for label, figs in by_round.items():
        mid = statistics.median_low([f["real_tokens_per_s"] for f, _, _ in figs])
        fig, j, k = next(x for x in figs if x[0]["real_tokens_per_s"] == mid)
        per_entry[label] = {**fig, "rounds_real_tokens_per_s": [f["real_tokens_per_s"] for f, _, _ in figs]}
        picked[label] = (j, k)
    best = best_runs(entries, per_entry, methods)
    results = {m: {**fig, "run": e.label, "micro_batch_size": e.micro_batch_size,
                   "placement": e.split or placement["placement"]} for m, (e, fig) in best.items()}
    for m, (e, _) in best.items():
        j, k = picked[e.label]
        rows = breakdown([r[j] for r in ranks], warmup, trace[k, e.label])
        results[m]["time_breakdown_ms"], results[m]["time_split_ms"] = rows, breakdown_summary([rows])
        results[m]["time_split_ms"]["planner_cpu_ms"] = results[m]["planner_cpu_ms"]
        timed = timed_indices([r[j] for r in ranks], warmup)
        results[m]["same_shape_spread"] = (trace_spread(trace[k, e.label], timed)
                                           if os.path.isdir(trace[k, e.label]) else None)
    checks, floor = _stage_checks(cfg, nproc, profile, results, ranks, picked, trace, warmup)
    base = [b for b in T5_BASELINES if b in results]
    best_base = max(base, key=lambda b: results[b]["real_tokens_per_s"], default=None)
    ratios = {f"{m}_vs_{b}": round(results[m]["real_tokens_per_s"] / results[b]["real_tokens_per_s"], 3)
              for m in results for b in base if m != b}
    if all(results[m]["real_tokens_per_cpu_s"] for m in results):
        ratios.update({f"{m}_vs_{b}_per_cpu_s": round(results[m]["real_tokens_per_cpu_s"]
                                                      / results[b]["real_tokens_per_cpu_s"], 3)
                       for m in results for b in base if m != b})
    if best_base is not None and "dynapipe" in results:
        ratios["dynapipe_vs_best_baseline"] = ratios[f"dynapipe_vs_{best_base}"]
    pairs = {}
    if UNCALIBRATED in per_entry and "dynapipe" in per_entry:
        # Both on the bench's placement, planned with the calibrated and the measured profile.
        pairs["calibrated_vs_uncalibrated"] = ("dynapipe", UNCALIBRATED)
        ratios["calibrated_vs_uncalibrated"] = round(per_entry["dynapipe"]["real_tokens_per_s"]
                                                     / per_entry[UNCALIBRATED]["real_tokens_per_s"], 3)
    report = {"model": "t5", "preset": preset, "about": p.about, "methods": results, "runs": per_entry,
              "ratios": ratios, "ratios_per_round": round_ratios(results, per_entry, base, best_base, pairs),
              "best_baseline": best_base, "placement": placement,
              "cost_model": {"profile": profile, "profile_s": None if profile_s is None else round(profile_s, 1),
                             "calibration": calibration, "stage_check": checks, "compute_floor": floor},
              "setup": {"argv": list(argv), "nproc": nproc, "warmup_iters": warmup, "sweep": list(sweep),
                        "rounds": rounds,
                        "round_orders": [[e.label for k2, e in order if k2 == k] for k in range(rounds)],
                        "load_average": {"start": load_start, "end": _load_average()},
                        "elapsed_s": round(time.perf_counter() - started, 1),
                        "cpu_allocator": cpu_allocator.describe(), "cpu_pretouch_mb": cfg.base.parallel.cpu_pretouch_mb,
                        "executor": "every method through the DynaPipe executor (fixed-shape 1F1B plans for "
                                    "the baselines)"}}
    print_t5_report(report, stream)
    write_output(output, json.dumps(report, indent=1), "--output")
    return report


def _flag_value(argv: Sequence[str], flag: str) -> Optional[str]:
    """The value of the last ``flag`` in ``argv`` (``--flag V`` or ``--flag=V``), or None."""
    value = None
    for i, a in enumerate(argv):
        if a == flag and i + 1 < len(argv):
            value = argv[i + 1]
        elif a.startswith(flag + "="):
            value = a.split("=", 1)[1]
    return value


def _stage_checks(cfg, nproc: int, profile: str, results: dict, ranks, picked: dict, trace: dict,
                  warmup: int) -> tuple[dict, dict]:
    """Per method, :func:`~megatron_integration.bench_t5_profile.stage_check` and
    :func:`~megatron_integration.bench_t5_profile.op_fit` of its reported run against the cost
    model it was planned with (on the stages it ran: ``results[m]["placement"]``), and the
    :func:`~megatron_integration.bench_t5_profile.compute_floor_check` of the timed batches."""
    from dynapipe.config import load_device_config
    from dynapipe.cost import build_cost_model
    from megatron_integration.bench_report import timed_indices
    from megatron_integration.bench_t5_profile import compute_floor_check, op_fit, stage_check
    from megatron_integration.t5_placement import parse_t5_placement

    model, pp = cfg.planner_model(), cfg.base.parallel.pipeline_model_parallel_size
    cost = build_cost_model(model, load_device_config(cfg.base.dynapipe.device), pp,
                            None if profile == "analytic" else profile)
    out = {}
    for m, r in results.items():
        j, k = picked[r["run"]]
        cm = cost.with_placement(parse_t5_placement(r["placement"], model, pp))
        keep = timed_indices([rank[j] for rank in ranks], warmup)
        path = trace[k, r["run"]]
        if os.path.isdir(path):
            out[m] = {"placement": str(cm.placement), **(stage_check(path, keep, cm) or {}),
                      "op_fit": op_fit(path, keep, cm)}
    return out, compute_floor_check(cfg, cost, out, warmup, cfg.base.parallel.data_parallel_size)


def _load_average() -> Optional[list[float]]:
    """The machine's 1, 5 and 15 minute load averages when the report is written (None where
    the OS has none): how shared the cores were."""
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except (AttributeError, OSError):
        return None


def _placement(argv: list[str], nproc: int, warmup: int, baselines: Sequence[tuple[str, int]] = ()) -> dict:
    """The stage placement of every run (``--dynapipe-placement`` if given, else what ``auto``
    chooses), DynaPipe's simulated bubble under the even split and under it, and (none given)
    each of ``baselines``' (method, micro-batch size) own best contiguous split."""
    from megatron_integration.bench_t5_placement import t5_bench_placement
    from megatron_integration.t5_arguments import parse_t5_args

    flags = [a for a in argv if a.split("=")[0] == "--dynapipe-placement"]
    given = None
    if flags:
        i = len(argv) - 1 - argv[::-1].index(flags[-1])
        given = argv[i].split("=", 1)[1] if "=" in argv[i] else argv[i + 1]
    cfg = parse_t5_args(list(argv) + ["--use-dynapipe"], nproc)
    return t5_bench_placement(cfg, nproc, warmup, given, baselines)


def t5_calibrate_iters(given: Optional[int], preset: str, argv: Sequence[str]) -> int:
    """The calibration run's iterations: ``given`` (``--calibrate-iters``), else the preset's,
    which a given ``--dynapipe-cost-model`` turns off (there is no measured profile to
    calibrate); refuses 1 and negative counts, and an explicit calibration with a given model."""
    model_given = _flag_value(argv, "--dynapipe-cost-model") is not None
    if given is None:
        return 0 if model_given else T5_PRESETS[preset].calibrate_iters
    if given < 0 or given == 1:
        raise DynaPipeError(f"--calibrate-iters {given}: give 0 (none) or at least 2 (the first "
                            f"iteration is a warm-up the fit leaves out).")
    if given and model_given:
        raise DynaPipeError("--calibrate-iters calibrates the profile the bench measures; with --dynapipe-cost-model "
                            "given there is none to calibrate: drop one of them.")
    return given


def run_t5_cli(args, argv: list[str]) -> int:
    """``python -m dynapipe bench --model t5 ...`` (argv: the training flags given)."""
    from megatron_integration.launch import RankFailed, RankUserError

    preset = args.preset
    from megatron_integration.bench_request import method_list

    methods = list(T5_PRESETS[preset].methods) if args.methods is None else method_list(args.methods)
    choices = [m for m in T5_METHOD_FLAGS if m != UNCALIBRATED]
    unknown = [m for m in methods if m not in choices]
    if unknown or not methods or len(set(methods)) != len(methods):
        extra = (f" ({UNCALIBRATED} runs by itself whenever the bench calibrates)"
                 if UNCALIBRATED in unknown else "")
        raise DynaPipeError(f"--methods {args.methods!r}: for --model t5 choose each at most once from "
                            f"{', '.join(choices)}{extra}.")
    for flag in ("--use-dynapipe", "--dynapipe-batching", "--micro-batch-size"):
        if flag in argv:
            raise DynaPipeError(f"{flag}: the T5 bench sets the method and tunes the baselines' micro-batch size "
                                f"itself (--t5-sweep).")
    if args.rounds is not None and args.rounds < 1:
        raise DynaPipeError(f"--rounds {args.rounds}: give at least 1 round.")
    calibrate_iters = t5_calibrate_iters(args.calibrate_iters, preset, argv)
    if args.calibrate_iters and not any(m.startswith("dynapipe") or m == "packing-search" for m in methods):
        raise DynaPipeError(f"--calibrate-iters {args.calibrate_iters} calibrates the plans of the DynaPipe "
                            f"executor's planner; --methods {','.join(methods)} plans none: drop it.")
    # Given at all (--sweep-top 0, --png ""), they would be ignored: refused.
    for flag, value, why in (("--sweep-top", args.sweep_top, "the baselines' sizes come from --t5-sweep"),
                             ("--png", args.png, "the T5 report draws no picture")):
        if value is not None:
            raise DynaPipeError(f"{flag} {value!r} is not supported with --model t5 ({why}).")
    sweep = None if args.t5_sweep is None else parse_t5_sweep(args.t5_sweep)
    if sweep is not None and not any(m in T5_BASELINES for m in methods):
        raise DynaPipeError(f"--t5-sweep {args.t5_sweep} sets the baselines' micro-batch sizes; --methods "
                            f"{','.join(methods)} runs none: drop it.")
    from megatron_integration.bench_request import refuse_unread_bench_flags

    refuse_unread_bench_flags(argv, methods)
    full = t5_with_defaults(argv, preset)
    from megatron_integration.bench_presets import flag_value, one_replica_ranks

    dp = max((args.nproc or one_replica_ranks(full)) // one_replica_ranks(full), 1)
    gbs = int(flag_value(full, "--global-batch-size", "0") or 0)
    odd = [m for m in (sweep or ()) if gbs and gbs % (m * dp)]
    if odd:  # named here: the run's own check would name --micro-batch-size, which no one typed
        raise DynaPipeError(f"--t5-sweep {args.t5_sweep}: {odd[0]} x {dp} data-parallel replica(s) does not divide "
                            f"--global-batch-size {gbs}; give sizes that do.")

    try:
        run_t5_bench(argv, methods, args.nproc or one_replica_ranks(full), args.output, preset=preset, sweep=sweep,
                     warmup_iters=args.warmup_iters, threads_per_rank=args.threads_per_rank,
                     timeout_s=args.timeout_s, rounds=args.rounds or 1, calibrate_iters=calibrate_iters)
    except RankUserError as e:
        raise DynaPipeError(str(e)) from None
    except RankFailed as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(f"wrote {args.output}")
    return 0
