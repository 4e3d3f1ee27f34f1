"""One-GPU check of what the CPU suite cannot run: ``python scripts/gpu_check.py --output DIR``.

On one CUDA device, in about 5 minutes (the first run, on an H200: 263 s), it

1. measures a cost profile with ``python -m dynapipe profile`` (Transformer Engine's layer
   spec where megatron-core can build it, bf16);
2. trains the same single-stage bf16 GPT on the same global batches, dropout 0, with
   * ``dynapipe``: planned variable-shape micro-batches through the DynaPipe executor, once
     per recompute level (``--dynapipe-recompute none|selective|full``), once more with
     ``--use-distributed-optimizer``, and last once more with a Chrome trace timed by CUDA events;
   * ``padding``: megatron-core's fixed-shape schedule, at each of ``--baseline-mbs``;
   * ``packing``: whole samples packed end to end without cross-sample attention. With
     Transformer Engine: megatron-core's packed-sequence path (``PackedSeqParams(qkv_format=
     "thd")`` with ``cu_seqlens``), how Megatron users pack on GPUs. Without it (megatron-core's
     local attention refuses packed sequences): Megatron's ``--reset-position-ids
     --reset-attention-mask`` rows through megatron-core's schedule, at each of
     ``--baseline-mbs``, whose attention spans the whole row under a per-sample mask;
3. writes ``DIR/gpu_check.json`` (after every phase, so a phase that fails or a run cut short
   keeps what finished) and ``DIR/gpu_check.md``: real tokens/s and the ratios against the best
   of each baseline, per-iteration losses (equal across methods up to bf16 rounding), and per
   recompute level the measured activation peak (allocator peak above the model states)
   against the peak the plan promised, and every run's caching-allocator maxima (max allocated
   and max reserved, MiB: the cache, fragmentation included, is the difference).

A phase that fails is recorded with its error and the others still run; the exit status is 1
then. Without CUDA it stops at once with one line (exit status 2).
"""
from __future__ import annotations

import json
import os
import sys
import time
import traceback
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from dynapipe.errors import DynaPipeError  # noqa: E402
from dynapipe.argparsing import StrictArgumentParser  # noqa: E402
from dynapipe.output_paths import check_output_dir  # noqa: E402
from megatron_integration.gpu_check_report import checks, failed, loss_spread, markdown, summarise  # noqa: E402
from megatron_integration.thd_packing import thd_packing_job  # noqa: E402

LEVELS = ("none", "selective", "full")


@dataclass(frozen=True)
class CheckShape:
    """What the check trains: the model's and the training's Megatron flags, the profile grid
    (``python -m dynapipe profile`` flags) and the baselines' micro-batch sizes (samples)."""

    model_args: tuple[str, ...]
    train_args: tuple[str, ...]
    profile_grid: tuple[str, ...]
    baseline_mbs: tuple[int, ...] = (1, 2)
    #: The profile's micro-batch sizes without Transformer Engine (None: ``profile_grid``'s):
    #: megatron-core's local attention keeps [mbs, heads, s, s] scores, 16 GiB a tensor in bf16 at
    #: 32 x 4,096 tokens and 16 heads, which no 80 GB GPU holds three of.
    unfused_profile_mbs: Optional[str] = "1,2,4,8"


# A ~1B-parameter slice of GPT (8 layers of a 2048-wide model) at 4096 tokens: large enough for
# real kernels, small enough that the profile and the trainings fit in minutes on one GPU.
GPU_SHAPE = CheckShape(
    model_args=tuple(("--num-layers 8 --hidden-size 2048 --num-attention-heads 16 --ffn-hidden-size 8192 "
                      "--seq-length 4096 --max-position-embeddings 4096 --vocab-size 32768 "
                      "--position-embedding-type rope --hidden-dropout 0 --attention-dropout 0 --bf16").split()),
    train_args=tuple(("--micro-batch-size 1 --global-batch-size 64 --train-iters 5 --lr 1e-4 --mock-data "
                      "--log-interval 1 --seed 1234").split()),
    # Up to the micro-batch sizes the planner cuts from short samples, so they are priced from
    # measurements: the first GPU run profiled 1-4 only, and the cost model then scaled the 4-sample
    # row proportionally, counting a micro-batch's fixed cost (about 2.5 ms a layer there, whatever
    # the shape) once per 4 samples; the planner cut 15 small micro-batches.
    profile_grid=("--mbs", "1,2,4,8,16,32", "--seqlens", "256,512,1024,2048,4096", "--repeats", "3"))

def require_cuda() -> None:
    """Stop with one line when no CUDA device is usable."""
    import torch

    if not torch.cuda.is_available():
        raise DynaPipeError("gpu_check needs a CUDA GPU and torch.cuda.is_available() is False here; "
                            "run it on a GPU machine (the CPU paths are covered by the test suite).")


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = StrictArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--output", required=True,
                   help="directory for gpu_check.json, gpu_check.md, the profile and a trace")
    p.add_argument("--timeout-s", type=float, default=420.0,
                   help="limit for each training job and for the profile (s)")
    p.add_argument("--baseline-mbs", default=",".join(map(str, GPU_SHAPE.baseline_mbs)),
                   help="micro-batch sizes (samples) each fixed-shape baseline runs at; the best counts")
    p.add_argument("--profile-mbs", default=None,
                   help=f"micro-batch sizes (samples) the profile measures at every length (default "
                        f"{GPU_SHAPE.profile_grid[1]} with Transformer Engine, {GPU_SHAPE.unfused_profile_mbs} "
                        f"without; lower the largest on GPUs under 80 GB: 32 x 4,096 tokens peaks at about 43 GB "
                        f"with Transformer Engine)")
    args = p.parse_args(argv)
    try:
        mbs, grid = check_request(args)
        require_cuda()
        # A size given is measured as given, with or without Transformer Engine.
        unfused = GPU_SHAPE.unfused_profile_mbs if args.profile_mbs is None else None
        shape = CheckShape(GPU_SHAPE.model_args, GPU_SHAPE.train_args, grid, mbs, unfused)
        os.makedirs(args.output, exist_ok=True)
        report = run(args.output, args.timeout_s, shape)
    except (DynaPipeError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 1 if failed(report) else 0


def _positive_ints(text: str, flag: str) -> tuple[int, ...]:
    values = []
    for item in text.split(","):
        if not item.strip().isascii() or not item.strip().isdigit() or int(item) < 1:
            raise DynaPipeError(f"{flag} {text!r}: expected positive whole numbers separated by commas, such as 1,2.")
        values.append(int(item))
    return tuple(values)


def check_request(args) -> tuple[tuple[int, ...], tuple[str, ...]]:
    """The baselines' micro-batch sizes and the profile grid, refused before anything runs
    (one line naming the flag): GPU time is too scarce to learn of a bad value from the
    first job that fails."""
    if not args.timeout_s > 0:
        raise DynaPipeError(f"--timeout-s {args.timeout_s}: must be a positive number of seconds.")
    check_output_dir(args.output, "--output")  # an empty path, a file, a path under a file
    mbs = _positive_ints(args.baseline_mbs, "--baseline-mbs")
    if len(set(mbs)) != len(mbs):
        raise DynaPipeError(f"--baseline-mbs {args.baseline_mbs}: a size is given twice; give each once.")
    global_batch = int(GPU_SHAPE.train_args[GPU_SHAPE.train_args.index("--global-batch-size") + 1])
    bad = [m for m in mbs if global_batch % m]
    if bad:
        raise DynaPipeError(f"--baseline-mbs {args.baseline_mbs}: {bad[0]} does not divide the global batch of "
                            f"{global_batch} samples; use divisors of it.")
    if args.profile_mbs is None:
        return mbs, GPU_SHAPE.profile_grid
    _positive_ints(args.profile_mbs, "--profile-mbs")
    return mbs, ("--mbs", args.profile_mbs) + GPU_SHAPE.profile_grid[2:]


def _phase(results: dict, name: str, body: Callable[[], dict], save: Callable[[], None]) -> None:
    """Run one phase; its summary, or its error (the others still run), goes into ``results``."""
    started = time.perf_counter()
    print(f"[gpu_check] {name} ...", flush=True)
    try:
        results[name] = body()
    except Exception as e:  # noqa: BLE001 - recorded and reported, the next phase runs
        results[name] = {"error": f"{type(e).__name__}: {e}\n{traceback.format_exc()}"}
    took = time.perf_counter() - started
    print(f"[gpu_check] {name}: {'failed' if 'error' in results[name] else 'done'} in {took:.0f} s", flush=True)
    save()


def run(out_dir: str, timeout_s: float, shape: CheckShape = GPU_SHAPE) -> dict:
    """Profile, then train every method (one job each); write and return the report."""
    import torch

    from megatron_integration.jobs import run_training
    from megatron_integration.launch import spawn
    from megatron_integration.model import te_available

    started = time.perf_counter()
    cuda = torch.cuda.is_available()
    device = torch.cuda.get_device_name(0) if cuda else "cpu"
    te = te_available()
    # The device config the DynaPipe runs plan with: the shipped one of this GPU, or none named
    # (a GPU no shipped config describes: the runs then plan with h100-80gb's figures and, unlike
    # a named config, compare no GPU model with the profile's), or the CPU's.
    total_mib = torch.cuda.get_device_properties(0).total_memory // 2 ** 20 if cuda else 0
    planner_device = device_config(device, total_mib) if cuda else "cpu"
    # The plans' memory limit is this GPU's own (MiB): a shipped config's would let an A100-80GB
    # plan for 40 GB, or a 24 GB card for 80.
    memory_limit = ["--dynapipe-memory-limit-mb", str(total_mib)] if cuda else []
    named = [] if planner_device is None else ["--dynapipe-device", planner_device]
    profile = os.path.join(out_dir, "profile.json")
    grid = shape.profile_grid if te or shape.unfused_profile_mbs is None else \
        ("--mbs", shape.unfused_profile_mbs) + shape.profile_grid[2:]
    results: dict = {}
    report = {"device": device, "torch": torch.__version__, "megatron_core": _megatron_version(),
              "transformer_engine": te, "model_args": shape.model_args, "train_args": shape.train_args,
              "packing_path": "thd" if te else "masked rows", "methods": results}

    def save() -> None:
        report["max_relative_loss_difference"] = loss_spread(results)
        report["checks"] = checks(results)
        report["wall_s"] = round(time.perf_counter() - started, 1)
        with open(os.path.join(out_dir, "gpu_check.json"), "w") as f:
            json.dump(report, f, indent=1)

    # Transformer Engine's layers where megatron-core can build them, else the local ones
    # (--transformer-impl's default, transformer_engine, is refused without them), in the
    # profile and in every run.
    impl = [] if te else ["--transformer-impl", "local"]

    def profile_body() -> dict:
        if run_profile(["--output", profile, *grid, *shape.model_args, *impl], timeout_s) != 0:
            raise DynaPipeError("profiling failed; see the lines above.")
        return {"path": profile, "s": round(time.perf_counter() - started, 1)}

    _phase(report, "profile", profile_body, save)
    base = list(shape.model_args + shape.train_args) + impl
    if "error" not in report["profile"]:
        _phase(report, "analytic_memory", lambda: analytic_memory(profile, base, planner_device or "h100-80gb"),
               save)
    # Without a profile the DynaPipe runs still train, planned by the analytic cost model.
    report["cost_model"] = cost = "analytic" if "error" in report["profile"] else profile

    def with_mbs(argv: list, mbs: int) -> list:
        i = argv.index("--micro-batch-size")
        return argv[:i + 1] + [str(mbs)] + argv[i + 2:]

    def train(argv: list) -> Callable[[], dict]:
        return lambda: summarise(run_training(argv, 1, timeout_s=timeout_s)[0])

    def dynapipe(level: str, *extra: str) -> list:
        return base + ["--use-dynapipe", "--dynapipe-cost-model", cost, "--dynapipe-recompute", level,
                       *named, *memory_limit, *extra]

    packing_flags = ["--dynapipe-batching", "packing", "--reset-position-ids", "--reset-attention-mask"]
    trace = os.path.join(out_dir, "trace")
    phases = [("dynapipe (none)", train(dynapipe("none")))]
    phases += [(f"padding (mbs {m})", train(with_mbs(base, m) + ["--dynapipe-batching", "padding"]))
               for m in shape.baseline_mbs[:1]]
    if te:
        phases.append(("packing (thd)", lambda: summarise(spawn(thd_packing_job, 1, (base,), timeout_s=timeout_s)[0])))
    else:
        phases += [(f"packing (masked rows, mbs {m})", train(with_mbs(base, m) + packing_flags))
                   for m in shape.baseline_mbs]
    phases += [(f"dynapipe ({level})", train(dynapipe(level))) for level in LEVELS[1:]]
    phases += [(f"padding (mbs {m})", train(with_mbs(base, m) + ["--dynapipe-batching", "padding"]))
               for m in shape.baseline_mbs[1:]]
    phases.append(("dynapipe (none, distributed optimizer)", train(dynapipe("none", "--use-distributed-optimizer"))))
    # Traced in a run of its own: a traced run records CUDA events around every op, which the
    # timed runs above should not pay (the first GPU run traced its first DynaPipe run).
    phases.append(("dynapipe (none, traced)", train(dynapipe("none", "--dynapipe-trace-dir", trace))))
    for name, body in phases:
        _phase(results, name, body, save)
    table = markdown(results, report["max_relative_loss_difference"])
    with open(os.path.join(out_dir, "gpu_check.md"), "w") as f:
        planned = ("DynaPipe planned with this run's profile" if cost == profile else
                   "the profile failed, so DynaPipe planned with the analytic cost model")
        f.write(f"GPU check on {device} (torch {report['torch']}, megatron-core {report['megatron_core']}, "
                f"Transformer Engine {'yes' if te else 'no'}), {report['wall_s']} s; {planned}\n\n{table}")
    print(table)
    return report


def analytic_memory(profile_path: str, argv: Sequence[str], device: str) -> dict:
    """The analytic cost model's stored MiB of one layer (levels none and selective) against
    the profile's measurement at every grid point: checks what it counts (dropout, positions,
    fused attention with Transformer Engine) on this device's layers (``device``: its device
    config's name)."""
    import torch

    from dynapipe.config import load_device_config
    from dynapipe.cost import AnalyticCostModel, StageLayout
    from megatron_integration.arguments import parse_training_args

    with open(profile_path) as f:
        data = json.load(f)
    cuda = torch.cuda.is_available()
    model = parse_training_args(list(argv), 1, cuda=cuda).model.to_model_config()
    cm = AnalyticCostModel(model, load_device_config(device), 1)
    layer = StageLayout(stage=0, encoder_layers=0, decoder_layers=1, has_embedding=False, has_output=False)
    points = []
    for i, b in enumerate(data["mbs"]):
        for j, s in enumerate(data["seqlen"]):
            point = {"mbs": b, "seqlen": s}
            for level, op in (("none", "layer"), ("selective", "layer_selective")):
                if op in data["ops"]:
                    measured = data["ops"][op]["stored_mib"][i][j]
                    priced = float(cm.layout_cost(layer, b, s, s, level).stored_mib)
                    point[level] = {"measured_mib": measured, "analytic_mib": round(priced, 3),
                                    "analytic_over_measured": round(priced / measured, 3) if measured else None}
            points.append(point)
    return {"fused_attention": model.fused_attention, "points": points}


def run_profile(argv: Sequence[str], timeout_s: float) -> int:
    """``python -m dynapipe profile ARGV`` in a process of its own (its exit status): its process
    group, environment and device memory end with it, before the trainings start. Killed after
    ``timeout_s`` (a DynaPipeError then), so a hung profile cannot take the whole check."""
    import subprocess

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH", "")) if p)
    try:
        return subprocess.run([sys.executable, "-m", "dynapipe", "profile", *argv], env=env,
                              timeout=timeout_s).returncode
    except subprocess.TimeoutExpired:
        raise DynaPipeError(f"profiling did not finish within {timeout_s:.0f} s (--timeout-s); it was killed.") from None


def _megatron_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("megatron-core")
    except PackageNotFoundError:
        return "unknown"


def device_config(name: str, total_mib: float) -> Optional[str]:
    """The shipped device config (its throughput figures) of a CUDA device (its name, its memory
    in MiB), None for a GPU none describes; the runs take their memory limit from the GPU itself
    (``--dynapipe-memory-limit-mb``)."""
    from dynapipe.cost.profile_device import shipped_config_for_gpu

    return shipped_config_for_gpu(name, total_mib)


if __name__ == "__main__":
    sys.exit(main())
