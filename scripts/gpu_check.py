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
import statistics
import sys
import time
import traceback
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402

from dynapipe.errors import DynaPipeError  # noqa: E402
from dynapipe.argparsing import StrictArgumentParser  # noqa: E402
from dynapipe.output_paths import check_output_dir  # noqa: E402

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

#: Largest relative difference a run's per-iteration loss may have from the best padding run's
#: (bf16; the first H200 run: 3.7e-5): the methods train the same samples from the same weights.
LOSS_TOLERANCE = 1e-3
#: Most a DynaPipe run's measured activation peak may exceed the plan's (measured / planned; the
#: first H200 run: 0.87-1.02): beyond it the planner's memory limit does not protect the GPU.
PEAK_TOLERANCE = 1.10


def require_cuda() -> None:
    """Stop with one line when no CUDA device is usable."""
    import torch

    if not torch.cuda.is_available():
        raise DynaPipeError("gpu_check needs a CUDA GPU and torch.cuda.is_available() is False here; "
                            "run it on a GPU machine (the CPU paths are covered by the test suite).")


def thd_micro_batch(samples: Sequence, pad_id: int = 0) -> dict:
    """One packed sequence in THD layout: ``tokens``/``position_ids``/``labels``/``loss_mask``
    ``[1, total]`` (positions restart at every sample) and ``cu_seqlens`` int32 ``[n + 1]``
    (sample boundaries in tokens), ``max_seqlen`` (tokens), as ``PackedSeqParams`` takes them."""
    from dynapipe.data.collate import TensorRequest, collate

    lengths = [s.input_ids.shape[0] + s.target_ids.shape[0] for s in samples]
    total = int(sum(lengths))
    if not samples or total == 0:
        raise DynaPipeError("a packed micro-batch needs at least one non-empty sample.")
    names = (("tokens", "int64"), ("position_ids", "int64"), ("labels", "int64"), ("loss_mask", "float32"))
    out = collate([list(samples)], [TensorRequest(n, (1, total), d) for n, d in names], total, pad_id=pad_id)
    out["cu_seqlens"] = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    out["max_seqlen"] = int(max(lengths))
    return out


def _thd_packing_job(argv: Sequence[str]) -> dict:
    """Rank body: train ``argv``'s model with packed THD micro-batches (one process, one GPU)."""
    import torch
    from megatron.core.packed_seq_params import PackedSeqParams

    from dynapipe.data.collate import loss_tokens as sample_loss_tokens
    from dynapipe.runtime.activation_meter import cuda_memory_mib, measure_activations, reset_cuda_peaks
    from megatron_integration.arguments import parse_training_args
    from megatron_integration.batches import pack_rows
    from megatron_integration.data import GlobalBatches
    from megatron_integration.initialize import destroy, initialize_megatron
    from megatron_integration.model import attach_training_hooks, build_stage, finalize_grads_func
    from megatron_integration.optimizer import build_optimizer

    cfg = parse_training_args(list(argv), 1)
    info = initialize_megatron(cfg.parallel, cfg.seed)
    try:
        stage = build_stage(cfg, info)
        optimizer, scheduler = build_optimizer(cfg, stage)
        attach_training_hooks(stage, optimizer)
        batches = GlobalBatches.create(cfg, 0, 0)
        dev = info.device
        losses, times, real, peaks = [], [], [], []
        reset_cuda_peaks(dev)
        for it in range(cfg.train_iters):
            batch = batches.batch(it)
            samples = batches.samples(batch)
            lengths = batches.lengths(batch)
            rows = pack_rows(lengths, cfg.model.seq_length)
            total_loss_tokens = sum(sample_loss_tokens(s, False) for s in samples)
            _sync(dev)
            start = time.perf_counter()
            stage.module.zero_grad_buffer()
            optimizer.zero_grad()
            loss_sum = torch.zeros((), dtype=torch.float64, device=dev)
            with measure_activations(stage.module, dev) as act:
                for row in rows:
                    mb = thd_micro_batch([samples[i] for i in row])
                    cu = torch.from_numpy(mb["cu_seqlens"]).to(dev)
                    psp = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                                          max_seqlen_q=mb["max_seqlen"], max_seqlen_kv=mb["max_seqlen"])
                    t = {k: torch.from_numpy(mb[k]).to(dev) for k in ("tokens", "position_ids", "labels", "loss_mask")}
                    out = stage.module(t["tokens"], t["position_ids"], None, labels=t["labels"], packed_seq_params=psp)
                    loss = torch.sum(out.float() * t["loss_mask"])
                    loss.backward()
                    loss_sum += loss.detach()
            # calculate_per_token_loss: finalize divides the gradients by the global loss tokens.
            finalize_grads_func()([stage.module], torch.tensor(total_loss_tokens, device=dev))
            ok, _, _ = optimizer.step()
            if ok:
                scheduler.step(increment=1)
            _sync(dev)
            times.append((time.perf_counter() - start) * 1e3)
            losses.append(float(loss_sum) / total_loss_tokens)
            real.append(int(lengths.sum()))
            peaks.append(act["peak_mib"])
        return {"method": "packing", "losses": losses, "iteration_ms": times, "real_tokens": real,
                "activation_measured_mib": peaks, "activation_planned_mib": [None] * len(peaks),
                "cuda_memory_mib": cuda_memory_mib(dev), "layer_spec": stage.spec_name, "pp_rank": 0}
    finally:
        destroy()


def _sync(device) -> None:
    """Wait for the device's queued work, so a host timer brackets it (no-op on CPU)."""
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


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
        phases.append(("packing (thd)", lambda: summarise(spawn(_thd_packing_job, 1, (base,), timeout_s=timeout_s)[0])))
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
