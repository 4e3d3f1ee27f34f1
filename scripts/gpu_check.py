"""One-GPU check of what the CPU suite cannot run: ``python scripts/gpu_check.py --output DIR``.

On one CUDA device, in a few minutes (budget: 8), it

1. measures a cost profile with ``python -m dynapipe profile`` (Transformer Engine's layer
   spec when ``transformer_engine`` imports, bf16);
2. trains the same single-stage bf16 GPT on the same global batches, dropout 0, with
   * ``dynapipe``: planned variable-shape micro-batches through the DynaPipe executor, once
     per recompute level (``--dynapipe-recompute none|selective|full``);
   * ``padding``: megatron-core's fixed-shape schedule;
   * ``packing``: whole samples packed end to end, run through megatron-core's packed-sequence
     path (``PackedSeqParams(qkv_format="thd")`` with ``cu_seqlens``), which is how Megatron
     users pack without cross-sample attention;
3. writes ``DIR/gpu_check.json`` and ``DIR/gpu_check.md``: real tokens/s and the ratios,
   per-iteration losses (equal across methods up to bf16 rounding), and per recompute level
   the measured activation peak (allocator peak above the model states) against the peak
   the plan promised.

Without CUDA it stops at once with one line (exit status 2).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Optional, Sequence

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402

from dynapipe.errors import DynaPipeError  # noqa: E402

LEVELS = ("none", "selective", "full")
# A ~1B-parameter slice of GPT (8 layers of a 2048-wide model) at 4096 tokens: large enough for
# real kernels, small enough that profile + 5 trainings fit in 8 minutes on one GPU.
MODEL_ARGS = ("--num-layers 8 --hidden-size 2048 --num-attention-heads 16 --ffn-hidden-size 8192 "
              "--seq-length 4096 --max-position-embeddings 4096 --vocab-size 32768 --position-embedding-type rope "
              "--hidden-dropout 0 --attention-dropout 0 --bf16").split()
TRAIN_ARGS = ("--micro-batch-size 1 --global-batch-size 64 --train-iters 5 --lr 1e-4 --mock-data "
              "--log-interval 1 --seed 1234").split()
PROFILE_GRID = ("--mbs", "1,2,4", "--seqlens", "256,512,1024,2048,4096")


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
    from dynapipe.runtime.activation_meter import measure_activations
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
        for it in range(cfg.train_iters):
            batch = batches.batch(it)
            samples = batches.samples(batch)
            lengths = batches.lengths(batch)
            rows = pack_rows(lengths, cfg.model.seq_length)
            total_loss_tokens = sum(sample_loss_tokens(s, False) for s in samples)
            torch.cuda.synchronize()
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
            torch.cuda.synchronize()
            times.append((time.perf_counter() - start) * 1e3)
            losses.append(float(loss_sum) / total_loss_tokens)
            real.append(int(lengths.sum()))
            peaks.append(act["peak_mib"])
        return {"method": "packing", "losses": losses, "iteration_ms": times, "real_tokens": real,
                "activation_measured_mib": peaks, "activation_planned_mib": [None] * len(peaks),
                "layer_spec": stage.spec_name, "pp_rank": 0}
    finally:
        destroy()


def summarise(run: dict, warmup: int = 1) -> dict:
    """Real tokens/s over the iterations after ``warmup``, losses, and the activation peaks (MiB)."""
    keep = list(range(min(warmup, len(run["iteration_ms"]) - 1), len(run["iteration_ms"])))
    ms = sum(run["iteration_ms"][i] for i in keep)
    planned = [p for p in run["activation_planned_mib"] if p is not None]
    return {"real_tokens_per_s": sum(run["real_tokens"][i] for i in keep) / (ms / 1e3),
            "iteration_ms": statistics.fmean(run["iteration_ms"][i] for i in keep),
            "losses": run["losses"], "layer_spec": run.get("layer_spec", ""),
            "activation_measured_mib": max(run["activation_measured_mib"]),
            "activation_planned_mib": max(planned) if planned else None}


def markdown(results: dict, loss_spread: float) -> str:
    """The short table the check writes: throughput and ratios, then activation memory per level."""
    lines = ["| method | real tokens/s | vs padding | vs packing | iteration (ms) "
             "| activation peak measured / planned (MiB) |",
             "|---|---:|---:|---:|---:|---:|"]
    for name, r in results.items():
        vs = [f"{r['real_tokens_per_s'] / results[b]['real_tokens_per_s']:.2f}x" if b in results else "-"
              for b in ("padding", "packing")]
        planned = "-" if r["activation_planned_mib"] is None else f"{r['activation_planned_mib']:.0f}"
        ratio = ("" if r["activation_planned_mib"] is None
                 else f" ({r['activation_measured_mib'] / r['activation_planned_mib']:.2f})")
        lines.append(f"| {name} | {r['real_tokens_per_s']:,.0f} | {vs[0]} | {vs[1]} | {r['iteration_ms']:.0f} | "
                     f"{r['activation_measured_mib']:.0f} / {planned}{ratio} |")
    lines.append("")
    lines.append(f"Largest relative difference of any method's per-iteration loss from padding's: {loss_spread:.2e}.")
    return "\n".join(lines) + "\n"


def loss_spread(results: dict) -> float:
    """Largest relative difference of a per-iteration loss from the padding baseline's."""
    base = np.asarray(results["padding"]["losses"])
    return max(float(np.max(np.abs(np.asarray(r["losses"]) - base) / np.abs(base))) for r in results.values())


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--output", required=True, help="directory for gpu_check.json, gpu_check.md and the profile")
    p.add_argument("--timeout-s", type=float, default=420.0, help="limit for each training job (s)")
    args = p.parse_args(argv)
    try:
        require_cuda()
        os.makedirs(args.output, exist_ok=True)
        run(args.output, args.timeout_s)
    except DynaPipeError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


def run(out_dir: str, timeout_s: float) -> dict:
    from dynapipe.cli import main as cli
    from megatron_integration.jobs import run_training
    from megatron_integration.launch import spawn

    started = time.perf_counter()
    profile = os.path.join(out_dir, "profile.json")
    if cli(["profile", "--output", profile, *PROFILE_GRID, "--repeats", "3", *MODEL_ARGS]) != 0:
        raise DynaPipeError("profiling failed; see the lines above.")
    from megatron_integration.model import te_available

    # Transformer Engine's layers where it imports (as the profile times them), else the local ones:
    # --transformer-impl's default (transformer_engine) is refused without it.
    base = MODEL_ARGS + TRAIN_ARGS + ([] if te_available() else ["--transformer-impl", "local"])
    results = {}
    for level in LEVELS:
        argv = base + ["--use-dynapipe", "--dynapipe-cost-model", profile, "--dynapipe-recompute", level,
                       "--dynapipe-device", device_config(_device_name())]
        results[f"dynapipe ({level})"] = summarise(run_training(argv, 1, timeout_s=timeout_s)[0])
    results["padding"] = summarise(run_training(base + ["--dynapipe-batching", "padding"], 1, timeout_s=timeout_s)[0])
    results["packing"] = summarise(spawn(_thd_packing_job, 1, (base,), timeout_s=timeout_s)[0])
    spread = loss_spread(results)
    report = {"device": _device_name(), "model_args": MODEL_ARGS, "train_args": TRAIN_ARGS, "methods": results,
              "max_relative_loss_difference": spread, "wall_s": round(time.perf_counter() - started, 1)}
    with open(os.path.join(out_dir, "gpu_check.json"), "w") as f:
        json.dump(report, f, indent=1)
    table = markdown(results, spread)
    with open(os.path.join(out_dir, "gpu_check.md"), "w") as f:
        f.write(f"GPU check on {report['device']}, {report['wall_s']} s\n\n{table}")
    print(table)
    return report


def device_config(name: str) -> str:
    """The shipped device config (its memory limit) for a CUDA device name."""
    name = name.upper()
    if "H200" in name:
        return "h200"
    if "A100" in name:
        return "a100-40gb"
    return "h100-80gb"


def _device_name() -> str:
    import torch

    return torch.cuda.get_device_name(0)


if __name__ == "__main__":
    sys.exit(main())
