#!/usr/bin/env python
"""Planner benchmark: every batching method on the synthetic multi-task mixture.

For each batch size (256, 1024, 4096 samples by default) it plans one global batch
with every method under the same cost model (gpt-7b as 8 pipeline stages on
a100-40gb by default) and prints, side by side: micro-batches, the objective
``T = sum(t)/dp + (S-1) max(t)``, its ratio to DynaPipe's, padding efficiency, whether
every micro-batch fits in memory, and the median planning time over several runs.

Baselines are tuned: each runs at the micro-batch size (or token budget) with the lowest
objective among those that fit in memory. DynaPipe runs at the device's memory limit
and, for the timing target, with no limit (a limit of 1e12 MiB).

The process pins itself to one CPU core (``--no-pin`` to skip), since the timing
targets are for one core. ``--quick``: 1024 samples, 3 repeats, a few seconds.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from dynapipe.batching import plan_micro_batches  # noqa: E402
from dynapipe.batching.dp_partition import compiled_kernel_available  # noqa: E402
from dynapipe.config import load_device_config, load_model_config  # noqa: E402
from dynapipe.cost import build_cost_model  # noqa: E402
from dynapipe.data.synthetic import sample_lengths  # noqa: E402
from dynapipe.errors import DynaPipeError  # noqa: E402
from dynapipe.output_paths import check_output_file, write_output  # noqa: E402
from dynapipe.cli.spelling import CLI_SPELLING  # noqa: E402
from dynapipe.errors import spelled_by  # noqa: E402
from dynapipe.argparsing import StrictArgumentParser, print_error  # noqa: E402

NO_LIMIT_MIB = 1e12
# The planner names the `plan` command's memory flag; here the device config sets the limit.
SPELLING = {**CLI_SPELLING, "memory_limit_mib": "the memory of --device"}
# Targets of the planner (median planning ms on one core): (samples, limit name, ms).
TARGETS = [(1024, "device", 25.0), (4096, "device", 400.0), (1024, "none", 100.0)]


def plan_timed(lengths, cost_model, repeats: int, **kw):
    """The plan and the median of ``repeats`` in-process planning times (ms)."""
    times, plan = [], None
    for _ in range(repeats):
        # The table reports the exact optimum (gap 0), as its targets were set for.
        plan = plan_micro_batches(lengths, cost_model, **{"gap": 0.0, **kw})
        times.append(plan.planning_ms)
    return plan, statistics.median(times)


def tuned(lengths, cost_model, method, settings, key, base):
    """Plan with each setting; keep the lowest objective whose micro-batches all fit."""
    best = None
    for value in settings:
        try:
            plan = plan_micro_batches(lengths, cost_model, method=method, **base, **{key: value})
        except DynaPipeError:
            continue
        fits = plan.extra["over_memory_micro_batches"] == 0
        rank = (not fits, plan.objective_ms)
        if best is None or rank < best[0]:
            best = (rank, value)
    return best[1]


def bench_size(n, args, cost_model, device):
    lengths = sample_lengths(n, args.seed, args.seq_length)
    base = dict(dp=args.dp, memory_limit_mib=device.memory_mib, reserved_mib=device.reserved_mib,
                seq_length=args.seq_length)
    rows = []
    plan, ms = plan_timed(lengths, cost_model, args.repeats, method="dynapipe", **base)
    rows.append(("dynapipe", f"limit {device.memory_mib:.0f} MiB", plan, ms))
    unl = dict(base, memory_limit_mib=NO_LIMIT_MIB)
    plan_u, ms_u = plan_timed(lengths, cost_model, args.repeats, method="dynapipe", **unl)
    rows.append(("dynapipe", "no memory limit", plan_u, ms_u))
    sizes = [1, 2, 4, 8, 16, 32]
    for method, key, settings, label in (
            ("padding", "micro_batch_size", sizes, "mbs {}"),
            ("padding-mb", "micro_batch_size", sizes, "mbs {}"),
            ("packing", "micro_batch_size", sizes, "mbs {} rows"),
            ("token-budget", "max_tokens", [args.seq_length * s for s in sizes], "{} tokens")):
        value = tuned(lengths, cost_model, method, settings, key, base)
        plan_b, ms_b = plan_timed(lengths, cost_model, args.repeats, method=method, **base, **{key: value})
        rows.append((method, label.format(value), plan_b, ms_b))
    return rows


def print_table(n, rows, repeats):
    ref = rows[0][2].objective_ms
    print(f"\n{n} samples")
    head = (f"  {'method':<13} {'setting':<20} {'micro-batches':>13} {'objective ms':>13} {'vs dynapipe':>11} "
            f"{'padding eff':>11} {'fits':>5} {'plan ms':>9}")
    print(head)
    print("  " + "-" * (len(head) - 2))
    for method, setting, plan, ms in rows:
        fits = "yes" if not plan.extra.get("over_memory_micro_batches") else "NO"
        print(f"  {method:<13} {setting:<20} {len(plan.micro_batches):>13} {plan.objective_ms:>13.1f} "
              f"{plan.objective_ms / ref:>10.2f}x {100 * plan.padding_efficiency:>10.1f}% {fits:>5} {ms:>9.2f}")
    fitting = [r for r in rows if r[0] != "dynapipe" and not r[2].extra.get("over_memory_micro_batches")]
    if fitting:
        method, setting, plan, _ = min(fitting, key=lambda r: r[2].objective_ms)
        print(f"  best baseline that fits: {method} ({setting}), objective {plan.objective_ms / ref:.3f}x DynaPipe's")
    print(f"  (plan ms: median of {repeats} runs, in-process wall time of planning alone)")


def check_args(args):
    """The model, device and cost model, once every flag is known to be usable (else a
    DynaPipeError naming the flag)."""
    bad = [n for n in args.samples if n < 1]
    if bad:
        raise DynaPipeError(f"--samples {' '.join(map(str, args.samples))}: {bad[0]} is not a batch size; give "
                            f"batch sizes of at least 1 sample.")
    for flag, value in (("--repeats", args.repeats), ("--stages", args.stages), ("--dp", args.dp),
                        ("--seq-length", args.seq_length)):
        if value < 1:
            raise DynaPipeError(f"{flag} {value}: must be at least 1.")
    if args.seed < 0:
        raise DynaPipeError(f"--seed {args.seed}: the seed must be a non-negative integer.")
    if args.json is not None:
        check_output_file(args.json, "--json")
    model, device = load_model_config(args.model, "--model"), load_device_config(args.device, "--device")
    return model, device, build_cost_model(model, device, args.stages)


@spelled_by(SPELLING)  # the planning layers' errors name this script's flags
def main(argv=None) -> int:
    p = StrictArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--samples", type=int, nargs="+", default=None, help="batch sizes (default 256 1024 4096)")
    p.add_argument("--repeats", type=int, default=None, help="timed repeats (default 9)")
    p.add_argument("--quick", action="store_true", help="1024 samples, 3 repeats (unless given)")
    p.add_argument("--model", default="gpt-7b")
    p.add_argument("--device", default="a100-40gb")
    p.add_argument("--stages", type=int, default=8)
    p.add_argument("--dp", type=int, default=1)
    p.add_argument("--seq-length", type=int, default=2048)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-pin", action="store_true", help="do not pin the process to one CPU core")
    p.add_argument("--json", default=None, help="also write the results here as JSON")
    args = p.parse_args(argv)
    if args.samples is None:
        args.samples = [1024] if args.quick else [256, 1024, 4096]
    if args.repeats is None:
        args.repeats = 3 if args.quick else 9
    try:
        model, device, cost_model = check_args(args)
    except DynaPipeError as e:
        print_error(str(e))
        return 2
    # The timing targets are for one core; pinned only after the checks, so that a refused
    # command line leaves its caller's cores alone.
    if not args.no_pin and hasattr(os, "sched_setaffinity"):
        core = min(os.sched_getaffinity(0))
        os.sched_setaffinity(0, {core})
        pinned = f"pinned to CPU {core}"
    else:
        pinned = "not pinned"
    kernel = "C extension" if compiled_kernel_available() else "numpy fallback (C extension not built)"
    print(f"planner benchmark: {model.name} as {args.stages} stages x dp {args.dp} on {device.name}, "
          f"synthetic mixture (seed {args.seed}, seq-length {args.seq_length}); DP kernel: {kernel}; {pinned}")
    started = time.perf_counter()
    results = {}
    for n in args.samples:
        try:
            rows = bench_size(n, args, cost_model, device)
        except DynaPipeError as e:
            print_error(str(e))
            return 2
        print_table(n, rows, args.repeats)
        results[n] = rows
    print("\ntargets (median planning ms, one core):")
    for n, limit, target in TARGETS:
        if n not in results:
            continue
        ms = results[n][0 if limit == "device" else 1][3]
        status = "ok" if ms <= target else "MISSED"
        print(f"  {n:>5} samples, {'device memory limit' if limit == 'device' else 'no memory limit':<20} "
              f"{ms:8.2f} ms  (target <= {target:.0f} ms)  {status}")
    print(f"\n(total benchmark time {time.perf_counter() - started:.1f} s)")
    if args.json:
        out = {str(n): [{"method": m, "setting": s, "micro_batches": len(pl.micro_batches),
                         "objective_ms": pl.objective_ms, "padding_efficiency": pl.padding_efficiency,
                         "planning_ms_median": ms, "fits": not pl.extra.get("over_memory_micro_batches")}
                        for m, s, pl, ms in rows] for n, rows in results.items()}
        try:
            write_output(args.json, json.dumps(out, indent=1), "--json")
        except DynaPipeError as e:
            print_error(str(e))
            return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
