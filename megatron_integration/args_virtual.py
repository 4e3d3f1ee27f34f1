"""Megatron-LM's interleaved (virtual) pipeline arguments, validated as Megatron-LM does.

``--num-virtual-stages-per-pipeline-rank V`` or ``--num-layers-per-virtual-pipeline-stage N``
(at most one; ``V = layers per pipeline stage / N``) give every pipeline rank ``V`` model
chunks: chunk ``c`` of rank ``p`` is virtual stage ``c * P + p``. ``V = 1`` is no
interleaving, as in Megatron-LM. The fixed-shape baselines run megatron-core's interleaved
1F1B, which overlaps its transfers with compute unless ``--no-overlap-p2p-communication`` is
given, and which Megatron-LM allows at ``--pipeline-model-parallel-size 2`` only overlapped (its
batched sends and receives would pair twice between the same two ranks). DynaPipe's executor
places its transfers where its plans put them (posted ahead of compute) and takes 2 stages.

No torch or megatron import.
"""
from __future__ import annotations

import argparse
from typing import Optional

from dynapipe.errors import DynaPipeError


def virtual_stages_from_args(args: argparse.Namespace, pp: int, dp: int, backend: str) -> Optional[int]:
    """Model chunks per pipeline rank (None: not interleaved), validated against the layer
    count, the pipeline size, the backend (``gloo``/``nccl``) and what this build trains
    interleaved. ``args.overlap_p2p_comm`` (Megatron-LM's default True) only means something
    with chunks: :func:`overlap_p2p_comm` gives the value the schedule gets."""
    per_stage, per_rank = args.num_layers_per_virtual_pipeline_stage, args.num_virtual_stages_per_pipeline_rank
    if per_stage is not None and per_rank is not None:
        raise DynaPipeError(f"--num-layers-per-virtual-pipeline-stage {per_stage} and "
                            f"--num-virtual-stages-per-pipeline-rank {per_rank} were both given; give one "
                            f"(as in Megatron-LM).")
    if per_stage is None and per_rank is None:
        return None
    layers = args.num_layers
    if per_stage is not None:
        if per_stage < 1:
            raise DynaPipeError(f"--num-layers-per-virtual-pipeline-stage {per_stage}: give at least 1 layer.")
        per_rank_layers = layers // pp
        if per_rank_layers % per_stage:
            raise DynaPipeError(f"--num-layers-per-virtual-pipeline-stage {per_stage} does not divide the "
                                f"{per_rank_layers} layers of a pipeline stage (--num-layers {layers} over "
                                f"--pipeline-model-parallel-size {pp}); use a divisor of {per_rank_layers}.")
        chunks = per_rank_layers // per_stage
    else:
        if per_rank < 1:
            raise DynaPipeError(f"--num-virtual-stages-per-pipeline-rank {per_rank}: give at least 1.")
        if layers % (pp * per_rank):
            raise DynaPipeError(f"--num-virtual-stages-per-pipeline-rank {per_rank}: --num-layers {layers} cannot be "
                                f"split evenly over {pp} x {per_rank} virtual stages; use a number of chunks that "
                                f"divides {layers // pp}.")
        chunks = per_rank
    if chunks == 1:
        return None  # one chunk a rank is the plain pipeline (Megatron-LM sets no virtual size)
    method = "dynapipe" if args.use_dynapipe else (args.dynapipe_batching or "padding")
    if method == "dynapipe" and not args.overlap_p2p_comm:
        raise DynaPipeError("--no-overlap-p2p-communication sets megatron-core's interleaved schedule; DynaPipe's "
                            "executor posts its transfers where its plans put them, ahead of compute. Drop it with "
                            "--use-dynapipe.")
    if pp < 2:
        raise DynaPipeError(f"{_flag(args)} needs --pipeline-model-parallel-size 2 or more (interleaving splits a "
                            f"pipeline's stages into chunks); drop it or add stages.")
    if method != "dynapipe" and backend == "gloo":
        # Measured: over gloo, megatron-core's interleaved schedule gives other losses than its 1F1B
        # at 2 stages (both neighbours are one rank) and, overlapped, at 4 stages too (an
        # asynchronous send of a tensor the schedule frees right after).
        if args.overlap_p2p_comm:
            raise DynaPipeError(f"{_flag(args)} over gloo: megatron-core's interleaved schedule overlaps its "
                                f"transfers by default, and its overlapped sends are not safe on gloo; add "
                                f"--no-overlap-p2p-communication (or --use-dynapipe).")
        if pp < 3:
            raise DynaPipeError(f"{_flag(args)} at --pipeline-model-parallel-size {pp} over gloo: megatron-core's "
                                f"interleaved schedule needs 3 or more stages there (--use-dynapipe runs 2).")
    elif pp == 2 and method != "dynapipe" and not args.overlap_p2p_comm:
        raise DynaPipeError(f"{_flag(args)} at --pipeline-model-parallel-size 2: megatron-core's interleaved schedule "
                            f"needs its transfers overlapped there (as Megatron-LM requires); drop "
                            f"--no-overlap-p2p-communication, or add stages.")
    mbs = args.micro_batch_size or 1
    if method in ("padding", "padding-mb") and args.global_batch_size:
        count = args.global_batch_size // (mbs * dp)
        if count % pp:
            raise DynaPipeError(f"{_flag(args)}: megatron-core's interleaved schedule runs micro-batches in groups of "
                                f"--pipeline-model-parallel-size {pp}, but --global-batch-size "
                                f"{args.global_batch_size} gives {count} micro-batches of {mbs} per "
                                f"replica; use a global batch of a multiple of "
                                f"{pp * mbs * dp} samples.")
    return chunks


def overlap_p2p_comm(args: argparse.Namespace, chunks: Optional[int]) -> bool:
    """Whether megatron-core's schedule overlaps its transfers: Megatron-LM's
    ``--no-overlap-p2p-communication`` (default: overlap), off without interleaving as
    Megatron-LM sets it."""
    return chunks is not None and bool(args.overlap_p2p_comm)


def _flag(args: argparse.Namespace) -> str:
    if args.num_layers_per_virtual_pipeline_stage is not None:
        return f"--num-layers-per-virtual-pipeline-stage {args.num_layers_per_virtual_pipeline_stage}"
    return f"--num-virtual-stages-per-pipeline-rank {args.num_virtual_stages_per_pipeline_rank}"
