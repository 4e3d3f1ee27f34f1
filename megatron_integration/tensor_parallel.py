"""Tensor and sequence parallelism of the training run: argument checks, the sequence-parallel
norm for megatron-core's local layer spec, and the agreement of a TP group's plans.

* :func:`check_tensor_parallel_args`: what ``--tensor-model-parallel-size`` and
  ``--sequence-parallel`` need (called from :mod:`megatron_integration.arguments`).
* :func:`sequence_parallel_block_spec`: megatron-core's local spec builds its norms with
  ``WrappedTorchNorm``, which refuses sequence parallelism only because it does not mark
  its parameters; a norm over a sequence shard is the same computation, so the block gets
  torch norms whose parameters carry ``sequence_parallel`` (then ``finalize_model_grads``
  sums their gradients over the TP group, as it does for Apex's and Transformer Engine's).
* :func:`check_tp_plans_agree`: every rank of a TP group must run the same plan on the same
  micro-batch tensors; one small all-gather over the job compares their payload digests,
  so a disagreement stops every rank with the same line before anything is sent.
"""
from __future__ import annotations

import argparse
import os
import warnings
from typing import Optional

from dynapipe.errors import DynaPipeError, PlanError, iteration_name
from megatron_integration.model_flags import swiglu_ffn_hidden_size


def check_device_max_connections(tp: int, arch_major: Optional[int] = None) -> None:
    """Megatron-LM's rule for TP on GPUs before Blackwell: ``CUDA_DEVICE_MAX_CONNECTIONS=1``,
    so the kernels run in the order they are launched and a TP collective launched before a
    GEMM overlaps it as megatron-core arranges. ``arch_major``: the GPU's compute capability
    major (None: this process's GPU; no GPU visible here, nothing to check)."""
    if os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS") == "1":
        return
    if arch_major is None:
        import torch

        from megatron_integration.initialize import select_local_gpu

        if not torch.cuda.is_available():
            return
        select_local_gpu()  # asked of this rank's own GPU, so no context opens on GPU 0
        arch_major = torch.cuda.get_device_capability()[0]
    if arch_major < 10:
        raise DynaPipeError(f"--tensor-model-parallel-size {tp} on GPUs before Blackwell needs the environment "
                            f"variable CUDA_DEVICE_MAX_CONNECTIONS=1 (as Megatron-LM asserts; it is "
                            f"{os.environ.get('CUDA_DEVICE_MAX_CONNECTIONS')!r}): export it before torchrun.")


def check_tensor_parallel_args(args: argparse.Namespace, cuda: bool) -> None:
    """Refuse TP/SP settings the stages cannot honour, naming the flag and the fix.

    TP runs on CPUs too (megatron-core's tensor-parallel layers over gloo). As Megatron-LM
    does, ``--sequence-parallel`` at TP 1 is switched off with a warning (its launch scripts
    pass it whatever their TP size). A ``--dynapipe-cost-model``
    profile must have been measured at this TP size and sequence-parallel setting
    (``python -m dynapipe profile --tensor-model-parallel-size N [--sequence-parallel]``).
    """
    tp = args.tensor_model_parallel_size
    sp = bool(getattr(args, "sequence_parallel", False))
    if tp > 1:
        # The width the layers get: Megatron's default under --swiglu is not 4 x hidden.
        ffn = args.ffn_hidden_size or (swiglu_ffn_hidden_size(args.hidden_size) if getattr(args, "swiglu", False)
                                       else 4 * args.hidden_size)
        for flag, value in (("--num-attention-heads", args.num_attention_heads), ("--ffn-hidden-size", ffn)):
            if value % tp:
                raise DynaPipeError(f"--tensor-model-parallel-size {tp} does not divide {flag} {value}; "
                                    f"use a tensor-parallel size that divides it.")
    if tp > 1 and cuda:
        check_device_max_connections(tp)
    if sp and tp == 1:
        warnings.warn("Disabling sequence parallelism because tensor model parallelism is disabled "
                      "(--sequence-parallel at --tensor-model-parallel-size 1, as Megatron-LM reads it)", stacklevel=2)
        args.sequence_parallel = sp = False
    if sp and args.seq_length % tp:
        raise DynaPipeError(f"--sequence-parallel splits every sequence over the {tp} tensor-parallel ranks, but "
                            f"--seq-length {args.seq_length} is not a multiple of {tp}; use "
                            f"{-(-args.seq_length // tp) * tp}.")
    cost_model = getattr(args, "dynapipe_cost_model", "analytic")
    if args.use_dynapipe and cost_model != "analytic" and os.path.isfile(cost_model):
        # A profile is one TP rank's measurement at the TP size and SP setting it was taken at.
        from dynapipe.cost.profile_checks import check_profile, check_profile_tensor_parallel, read_profile

        data = read_profile(cost_model)
        source = f"--dynapipe-cost-model {cost_model}"
        check_profile(data, source)  # a file that is no profile is named as such, not as a TP mismatch
        check_profile_tensor_parallel(data, tp, sp, source)


class SequenceParallelTorchNorm:
    """torch ``LayerNorm``/``RMSNorm`` for a sequence-sharded input; its parameters are
    marked ``sequence_parallel`` so their gradients are summed over the TP group.
    Constructed like megatron-core's ``WrappedTorchNorm`` (a module spec entry)."""

    def __new__(cls, config, hidden_size: int, eps: float = 1e-5, persist_layer_norm: bool = False,
                zero_centered_gamma: bool = False, normalization: str = "LayerNorm"):
        import torch

        norm_cls = torch.nn.RMSNorm if config.normalization == "RMSNorm" else torch.nn.LayerNorm
        norm = norm_cls(hidden_size, eps=eps)
        for p in norm.parameters():
            p.sequence_parallel = bool(config.sequence_parallel)
        return norm


def _replace_torch_norms(spec):
    """A copy of a layer spec whose ``WrappedTorchNorm`` entries are the sequence-parallel norm."""
    import dataclasses

    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    if spec is WrappedTorchNorm:
        return SequenceParallelTorchNorm
    if isinstance(spec, ModuleSpec):
        module = SequenceParallelTorchNorm if spec.module is WrappedTorchNorm else spec.module
        subs = spec.submodules
        if subs is not None and dataclasses.is_dataclass(subs):
            subs = dataclasses.replace(subs, **{f.name: _replace_torch_norms(getattr(subs, f.name))
                                                for f in dataclasses.fields(subs)})
        return dataclasses.replace(spec, module=module, submodules=subs)
    return spec


def sequence_parallel_block_spec(layer_spec, config, num_layers: int):
    """The spec to build a stage of ``num_layers`` layers with under ``config.sequence_parallel``.

    Transformer Engine's and Apex's norms handle sequence parallelism themselves: their
    spec is returned unchanged. megatron-core's local spec without Apex uses
    ``WrappedTorchNorm`` in every layer and for the final norm; those become
    :class:`SequenceParallelTorchNorm`.
    """
    if not config.sequence_parallel:
        return layer_spec
    from megatron.core.transformer.torch_norm import WrappedTorchNorm
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules
    import megatron.core.transformer.transformer_block as block

    layer = _replace_torch_norms(layer_spec)
    # The final norm megatron-core would build for this spec (the same across 0.16 to 0.19).
    default = getattr(block, "LayerNormImpl", WrappedTorchNorm)
    final = SequenceParallelTorchNorm if default is WrappedTorchNorm else default
    if layer == layer_spec and final is default:
        return layer_spec
    return TransformerBlockSubmodules(layer_specs=[layer] * num_layers, layer_norm=final)


def check_tp_plans_agree(iteration: int, digest: int, info, device=None) -> None:
    """Stop every rank, with the same one line, when the ranks of a TP group hold different
    payloads (plan and micro-batch tensors) for this iteration.

    ``digest``: this rank's payload digest (a 32-bit checksum). One all-gather of three
    integers a rank over the whole job, so every rank judges the same table: ranks of other
    TP groups stop too instead of waiting in a collective with a rank that refused.
    ``info``: this rank's :class:`~megatron_integration.initialize.RankInfo`.
    """
    if info.tp_size == 1:
        return
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    device = device or info.device
    leader = min(dist.get_process_group_ranks(ps.get_tensor_model_parallel_group()))
    mine = torch.tensor([int(digest), info.tp_rank, leader], dtype=torch.int64, device=device)
    rows = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(rows, mine)
    table = [r.tolist() for r in rows]
    groups: dict[int, list[int]] = {}
    for g, (_, _, first) in enumerate(table):
        groups.setdefault(first, []).append(g)
    for ranks in groups.values():
        if len({table[g][0] for g in ranks}) > 1:
            shown = ", ".join(f"global rank {g} (TP rank {table[g][1]}): {table[g][0]:08x}" for g in ranks)
            raise PlanError(f"{iteration_name(iteration)}: the tensor-parallel ranks {ranks} received different plans or "
                            f"micro-batch tensors ({shown}); every TP rank of a stage must run the same payload. "
                            f"Stopped on every rank before anything was sent.")


def check_plan_tensor_parallel(plan, tp_size: int, sequence_parallel: bool) -> None:
    """Refuse a plan compiled for another tensor-parallel layout than this run's (its
    ``meta``: ``tp``, ``sequence_parallel``); its message shapes would not be what the
    stages send. Every rank holds plans of the same settings, so every rank refuses alike."""
    meta = plan.meta or {}
    planned_tp, planned_sp = meta.get("tp", 1), bool(meta.get("sequence_parallel", False))
    if planned_tp != tp_size or planned_sp != sequence_parallel:
        raise PlanError(f"{iteration_name(plan.iteration)}: the plan was compiled for tensor-parallel size {planned_tp}"
                        f"{' with' if planned_sp else ' without'} sequence parallelism, but this run has "
                        f"--tensor-model-parallel-size {tp_size}{' with' if sequence_parallel else ' without'} "
                        f"--sequence-parallel; plan with the run's settings.")