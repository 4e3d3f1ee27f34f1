"""Megatron-LM's interleaved (virtual) pipeline: what its schedules need, validated as Megatron-LM does.

``--num-virtual-stages-per-pipeline-rank V``, ``--num-layers-per-virtual-pipeline-stage N``
or a ``--pipeline-model-parallel-layout`` of ``V x P`` stages give every pipeline rank ``V``
model chunks (:mod:`megatron_integration.args_layout` derives them): chunk ``c`` of rank ``p``
is virtual stage ``c * P + p``. ``V = 1`` is no interleaving, as in Megatron-LM. The
fixed-shape baselines run megatron-core's interleaved 1F1B, which overlaps its transfers with compute unless ``--no-overlap-p2p-communication`` is
given, and which Megatron-LM allows at ``--pipeline-model-parallel-size 2`` only overlapped (its
batched sends and receives would pair twice between the same two ranks). DynaPipe's executor
places its transfers where its plans put them (posted ahead of compute) and takes 2 stages.

No torch or megatron import.
"""
from __future__ import annotations

import argparse
from typing import Optional

from dynapipe.errors import DynaPipeError


def check_interleaved(args: argparse.Namespace, chunks: Optional[int], pp: int, dp: int, backend: str) -> None:
    """Refuse what this build cannot run with ``chunks`` model chunks a rank (None: the plain
    pipeline; :func:`~megatron_integration.args_layout.pipeline_split_from_args` derives it),
    given the pipeline size, data-parallel size and backend (``gloo``/``nccl``).
    ``args.overlap_p2p_comm`` (Megatron-LM's default True) only means something with chunks:
    :func:`overlap_p2p_comm` gives the value the schedule gets."""
    if chunks is None:
        return
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
        # The stage count first: at 2 stages no flag mends it, and naming the overlap first sent
        # users through two refusals.
        if pp < 3:
            raise DynaPipeError(f"{_flag(args)} at --pipeline-model-parallel-size {pp} over gloo: megatron-core's "
                                f"interleaved schedule needs 3 or more stages there, with "
                                f"--no-overlap-p2p-communication (--use-dynapipe runs 2).")
        if args.overlap_p2p_comm:
            raise DynaPipeError(f"{_flag(args)} over gloo: megatron-core's interleaved schedule overlaps its "
                                f"transfers by default, and its overlapped sends are not safe on gloo; add "
                                f"--no-overlap-p2p-communication (or --use-dynapipe).")
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


def overlap_p2p_comm(args: argparse.Namespace, chunks: Optional[int]) -> bool:
    """Whether megatron-core's schedule overlaps its transfers: Megatron-LM's
    ``--no-overlap-p2p-communication`` (default: overlap), off without interleaving as
    Megatron-LM sets it."""
    return chunks is not None and bool(args.overlap_p2p_comm)


def _flag(args: argparse.Namespace) -> str:
    if args.pipeline_model_parallel_layout is not None:
        return f"--pipeline-model-parallel-layout {args.pipeline_model_parallel_layout!r}"
    if args.num_layers_per_virtual_pipeline_stage is not None:
        return f"--num-layers-per-virtual-pipeline-stage {args.num_layers_per_virtual_pipeline_stage}"
    return f"--num-virtual-stages-per-pipeline-rank {args.num_virtual_stages_per_pipeline_rank}"
