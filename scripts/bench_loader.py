"""Benchmark the DynaPipe data loader: how long does the training loop wait for its plan?

Spawns ``pp x dp`` gloo ranks. Each rank runs ``--iterations`` steps of a training-step
stand-in of fixed duration (``--step-ms``; a sleep, as a GPU-bound step leaves the host
CPU idle, or ``--busy`` to burn a CPU core for that long), taking its plan and tensors
from the loader before every step and meeting the other ranks at a barrier after it.
Planner workers plan ahead at the loader's default settings unless told otherwise.

Reported, over the iterations after the prefetch warm-up (the first ``--warmup``): the
ms each rank waited in ``next(loader)`` per iteration (median, p95, max over ranks) and
as a share of the iteration time (target: at most 1%); the cold-start wait of
iteration 0; and per planner worker, the planner's ms and the worker's whole ms per
iteration (planning, tensors, serialisation, store writes) as plans per second.

    python scripts/bench_loader.py                       # defaults: gpt-7b, a100-40gb, PP4, 256 samples
    python scripts/bench_loader.py --step-ms 300 --output bench_loader.json
"""
from __future__ import annotations

import datetime
import json
import logging
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as tmp  # noqa: E402

from dynapipe.batching.memory import memory_budget  # noqa: E402
from dynapipe.batching.planner import METHODS  # noqa: E402
from dynapipe.config import load_device_config, load_model_config  # noqa: E402
from dynapipe.data.config import DatasetConfig  # noqa: E402
from dynapipe.data.sampler import SamplerConfig  # noqa: E402
from dynapipe.errors import DynaPipeError  # noqa: E402
from dynapipe.output_paths import check_output_file, write_output  # noqa: E402
from dynapipe.runtime.distributed import free_port  # noqa: E402
from dynapipe.runtime.loader import DynaPipeDataLoader, LoaderConfig, RankLayout  # noqa: E402
from dynapipe.runtime.plan_source import IterationPlanner, PlannerSettings  # noqa: E402
from dynapipe.cli.spelling import CLI_SPELLING  # noqa: E402
from dynapipe.errors import spelled_as, spelled_by  # noqa: E402
from dynapipe.schedule.search import SCHEDULE_CHOICES  # noqa: E402
from dynapipe.schedule.types import CHUNKED_SCHEDULE_NAMES  # noqa: E402
from dynapipe.argparsing import StrictArgumentParser, print_error  # noqa: E402

DEFAULTS = LoaderConfig()
# The planner and the loader name the `plan` command's and the training job's flags in their
# errors; a person running this bench can only change these.
SPELLING = {**CLI_SPELLING, "num_stages": "--pp", "memory_limit_mib": "the memory of --device", "method": "--method",
            "num_workers": "--workers", "prefetch": "--prefetch", "kv_backend": "--kv-backend",
            "redis_host": "--redis-host", "redis_port": "--redis-port", "global_batch_size": "--global-batch-size",
            "n": "--num-samples"}
ERROR_FILE = "error-rank{}.txt"
# Each rank holds one model chunk here, so the interleaved schedules cannot plan.
SCHEDULES = tuple(s for s in SCHEDULE_CHOICES if s not in CHUNKED_SCHEDULE_NAMES)


def parse_args(argv=None):
    p = StrictArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="gpt-7b")
    p.add_argument("--device", default="a100-40gb")
    p.add_argument("--pp", type=int, default=4, help="pipeline stages (ranks per replica)")
    p.add_argument("--dp", type=int, default=1, help="data-parallel replicas")
    p.add_argument("--global-batch-size", type=int, default=256, help="samples per global batch")
    p.add_argument("--seq-length", type=int, default=2048)
    p.add_argument("--num-samples", type=int, default=100_000, help="size of the synthetic mixture dataset")
    p.add_argument("--method", default="dynapipe", choices=METHODS)
    p.add_argument("--schedule", default="auto", choices=SCHEDULES)
    p.add_argument("--iterations", type=int, default=40)
    p.add_argument("--warmup", type=int, default=None, help="iterations excluded as warm-up (default: prefetch)")
    p.add_argument("--step-ms", type=float, default=1000.0, help="duration of the training-step stand-in")
    p.add_argument("--busy", action="store_true", help="burn a CPU core during the step instead of sleeping")
    p.add_argument("--workers", type=int, default=DEFAULTS.num_workers, help="planner workers per planner node")
    p.add_argument("--prefetch", type=int, default=DEFAULTS.prefetch, help="iterations planned ahead")
    p.add_argument("--kv-backend", default=DEFAULTS.kv_backend, choices=["store", "redis"])
    p.add_argument("--redis-host", default="127.0.0.1")
    p.add_argument("--redis-port", type=int, default=6379)
    p.add_argument("--output", help="write the results as JSON here")
    p.add_argument("--timeout-s", type=float, default=600.0)
    return p.parse_args(argv)


def _step(ms: float, busy: bool) -> None:
    if not busy:
        time.sleep(ms / 1e3)
        return
    end = time.perf_counter() + ms / 1e3
    a = torch.randn(128, 128)
    while time.perf_counter() < end:
        a = torch.tanh(a @ a)


def planner_settings(args) -> PlannerSettings:
    return PlannerSettings(load_model_config(args.model, "--model"), load_device_config(args.device, "--device"),
                           args.pp, args.dp, method=args.method, schedule=args.schedule, seq_length=args.seq_length)


def warmup_of(args) -> int:
    return args.prefetch if args.warmup is None else args.warmup


def check_args(args) -> None:
    """Refuse what would fail only after every rank has started (a DynaPipeError naming the flag)."""
    if args.kv_backend != "redis" and (args.redis_host, args.redis_port) != ("127.0.0.1", 6379):
        raise DynaPipeError(f"--redis-host / --redis-port set the Redis plan store; --kv-backend {args.kv_backend} "
                            f"does not read them: add --kv-backend redis or drop them.")
    for flag, value in (("--pp", args.pp), ("--dp", args.dp), ("--global-batch-size", args.global_batch_size),
                        ("--seq-length", args.seq_length), ("--num-samples", args.num_samples),
                        ("--iterations", args.iterations), ("--workers", args.workers),
                        ("--prefetch", args.prefetch)):
        if value < 1:
            raise DynaPipeError(f"{flag} {value}: must be at least 1.")
    if args.step_ms < 0:
        raise DynaPipeError(f"--step-ms {args.step_ms:g}: must be 0 or more milliseconds.")
    if not args.timeout_s > 0:
        raise DynaPipeError(f"--timeout-s {args.timeout_s:g}: must be a positive number of seconds.")
    if not 1 <= args.redis_port <= 65535:
        raise DynaPipeError(f"--redis-port {args.redis_port}: must be a TCP port, 1 to 65535.")
    warm = warmup_of(args)
    if args.warmup is not None and not 0 <= warm < args.iterations:
        raise DynaPipeError(f"--warmup {args.warmup}: give 0 to {args.iterations - 1} (--iterations "
                            f"{args.iterations} leaves none timed otherwise).")
    if warm >= args.iterations:
        # The warm-up defaults to --prefetch, so a short run has no timed iteration left.
        raise DynaPipeError(f"--iterations {args.iterations}: the warm-up (--prefetch {args.prefetch}, as --warmup "
                            f"is not given) leaves none timed; give --iterations {warm + 1} or more, or a smaller "
                            f"--warmup.")
    if args.output is not None:
        check_output_file(args.output, "--output")
    # The sampler's own check, run before the spawn: in the ranks it came after every rank started.
    SamplerConfig(args.global_batch_size, min_samples=args.dp).validate()
    settings = planner_settings(args)
    # The stages' model states are known before any batch: a model that does not fit the
    # device at --pp stages would otherwise fail in the first rank's planner, after the spawn.
    planner = IterationPlanner(settings)
    try:
        memory_budget(planner.cost_model, settings.device.memory_mib, settings.device.reserved_mib, dp=args.dp)
    except DynaPipeError as e:
        raise DynaPipeError(f"--pp {args.pp}: {e}") from None


def _rank(rank: int, args, port: int, out_dir: str) -> None:
    try:
        with spelled_as(SPELLING):  # a spawned rank starts without its parent's
            _run_rank(rank, args, port, out_dir)
    except DynaPipeError as e:
        # The parent prints it as one line: a rank's traceback would bury it.
        with open(os.path.join(out_dir, ERROR_FILE.format(rank)), "w") as f:
            f.write(str(e))
        sys.exit(2)


def _rank_error(out_dir: str, world: int):
    """The first rank's refusal (a DynaPipeError it wrote down), or None."""
    for r in range(world):
        path = os.path.join(out_dir, ERROR_FILE.format(r))
        if os.path.exists(path):
            with open(path) as f:
                return f.read()
    return None


def _run_rank(rank: int, args, port: int, out_dir: str) -> None:
    torch.set_num_threads(1)
    world = args.pp * args.dp
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=args.timeout_s))
    layout = RankLayout(rank, world, rank % args.dp, args.dp, rank // args.dp, args.pp, rank, world)
    data = DatasetConfig("synthetic", args.seq_length, num_samples=args.num_samples, seed=1234, vocab_size=50304)
    planner = planner_settings(args)
    cfg = LoaderConfig(global_batch_size=args.global_batch_size, train_iters=args.iterations,
                       num_workers=args.workers, prefetch=args.prefetch, kv_backend=args.kv_backend,
                       redis_host=args.redis_host, redis_port=args.redis_port)
    loader = DynaPipeDataLoader(cfg, data if rank == 0 else None, planner, layout)
    records = []
    dist.barrier()
    for _ in range(args.iterations):
        t0 = time.perf_counter()
        d = next(loader)
        _step(args.step_ms, args.busy)
        dist.barrier()
        records.append({"iteration": d.iteration, "wait_ms": d.meta.wait_ms,
                        "iteration_ms": (time.perf_counter() - t0) * 1e3,
                        "padding_efficiency": d.meta.global_real_tokens / max(d.meta.global_padded_tokens, 1)})
    stats = loader.planner_stats()
    loader.close()
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump({"records": records, "planner": stats}, f)
    dist.barrier()
    dist.destroy_process_group()


def _pct(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


def summarize(args, ranks: list[dict]) -> dict:
    warm = warmup_of(args)
    per_rank = []
    for r in ranks:
        recs = r["records"][warm:]
        per_rank.append({"wait_ms": [x["wait_ms"] for x in recs], "iteration_ms": [x["iteration_ms"] for x in recs]})
    waits = [w for pr in per_rank for w in pr["wait_ms"]]
    fraction = max(sum(pr["wait_ms"]) / sum(pr["iteration_ms"]) for pr in per_rank)
    planner = ranks[0]["planner"]
    worker_ms = planner["worker_ms"]
    return {
        "settings": {k: v for k, v in vars(args).items() if k not in ("output",)},
        "warm_iterations": len(per_rank[0]["wait_ms"]),
        "cold_wait_ms": max(r["records"][0]["wait_ms"] for r in ranks),
        "wait_ms_median": statistics.median(waits),
        "wait_ms_p95": _pct(waits, 0.95),
        "wait_ms_max": max(waits),
        "iteration_ms_mean": statistics.fmean(it for pr in per_rank for it in pr["iteration_ms"]),
        "wait_fraction": fraction,
        "target_met": fraction <= 0.01,
        "planning_ms_median": statistics.median(planner["planning_ms"]),
        "worker_ms_median": statistics.median(worker_ms),
        "plans_per_s_per_worker": 1e3 / statistics.median(worker_ms),
        "padding_efficiency_mean": statistics.fmean(x["padding_efficiency"] for x in ranks[0]["records"]),
    }


@spelled_by(SPELLING)  # the planning layers' errors name this script's flags
def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        check_args(args)
    except DynaPipeError as e:
        print_error(str(e))
        return 2
    port = free_port()
    with tempfile.TemporaryDirectory() as out_dir:
        ctx = tmp.start_processes(_rank, args=(args, port, out_dir), nprocs=args.pp * args.dp, join=False,
                                  start_method="spawn")
        deadline = time.monotonic() + args.timeout_s
        # torch logs a line for every rank it stops after one fails; the failure's own line says why.
        logging.getLogger("torch.multiprocessing.spawn").setLevel(logging.ERROR)
        try:
            while not ctx.join(timeout=1):
                if time.monotonic() > deadline:
                    for p in ctx.processes:
                        p.kill()
                    print(f"error: the benchmark did not finish within {args.timeout_s:g} s", file=sys.stderr)
                    return 1
        except (tmp.ProcessExitedException, tmp.ProcessRaisedException):
            message = _rank_error(out_dir, args.pp * args.dp)
            if message is None:
                raise
            print_error(message)
            return 2
        ranks = []
        for r in range(args.pp * args.dp):
            with open(os.path.join(out_dir, f"rank{r}.json")) as f:
                ranks.append(json.load(f))
    res = summarize(args, ranks)
    print(f"{args.model} on {args.device}, PP{args.pp} x DP{args.dp}, {args.global_batch_size} samples/batch "
          f"(seq <= {args.seq_length}), {args.method}/{args.schedule}; step stand-in {args.step_ms:g} ms "
          f"({'busy' if args.busy else 'sleep'}); {args.workers} worker(s), prefetch {args.prefetch}, "
          f"{args.kv_backend} backend")
    print(f"  wait for plan, warm ({res['warm_iterations']} it): median {res['wait_ms_median']:.3f} ms, "
          f"p95 {res['wait_ms_p95']:.3f} ms, max {res['wait_ms_max']:.3f} ms")
    print(f"  share of iteration time ({res['iteration_ms_mean']:.1f} ms): {100 * res['wait_fraction']:.3f}% "
          f"(target <= 1%: {'met' if res['target_met'] else 'NOT met'})")
    print(f"  cold start (iteration 0): {res['cold_wait_ms']:.0f} ms")
    print(f"  planner worker: planning {res['planning_ms_median']:.1f} ms, whole {res['worker_ms_median']:.1f} ms "
          f"per iteration -> {res['plans_per_s_per_worker']:.1f} plans/s per worker; "
          f"padding efficiency {res['padding_efficiency_mean']:.3f}")
    if args.output:
        try:
            write_output(args.output, json.dumps(res, indent=2), "--output")
        except DynaPipeError as e:
            print_error(str(e))
            return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
