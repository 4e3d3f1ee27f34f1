"""The packing baseline as Megatron users run it on GPUs: whole samples packed end to end into
rows of ``--seq-length`` tokens and handed to megatron-core in THD layout
(``PackedSeqParams(qkv_format="thd")`` with ``cu_seqlens``), so attention never crosses a
sample. Transformer Engine's attention only: megatron-core's local attention refuses packed
sequences (``scripts/gpu_check.py`` falls back to masked rows there).
"""
from __future__ import annotations

import time
from typing import Sequence

import numpy as np

from dynapipe.errors import DynaPipeError


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


def thd_packing_job(argv: Sequence[str]) -> dict:
    """Rank body: train ``argv``'s model for ``--train-iters`` iterations with packed THD
    micro-batches (one process, one GPU); per iteration its loss, ms, real tokens and activation
    peak (MiB), as :func:`megatron_integration.jobs.run_training` reports a run."""
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
