"""Deterministic parameter initialisation of megatron-core model stages (GPT and T5).

Every parameter is drawn from a generator seeded by (seed, its name in the unsplit model)
with Megatron's distributions, so a model holds the same weights however it is split over
pipeline stages and tensor-parallel ranks: what lets the tests compare DynaPipe against
megatron-core's own schedules and the baselines loss for loss.
"""
from __future__ import annotations

import math
import zlib
from typing import Optional

import torch

from megatron_integration.train_config import GPTModelArgs

# Output projections of each layer get Megatron's scaled init: std / sqrt(2 x layers).
_SCALED = ("linear_proj.weight", "linear_fc2.weight")
_ONES = ("layer_norm_weight", "layernorm.weight", "final_layernorm.weight", "norm.weight")


def global_parameter_name(gpt: torch.nn.Module, local_name: str, tied: bool) -> str:
    """Name of a parameter in the unsplit model: layer indices made global; the last
    stage's tied output weight named after the word embedding it copies."""
    if tied and local_name == "output_layer.weight":
        return "embedding.word_embeddings.weight"
    prefix = "decoder.layers."
    if local_name.startswith(prefix):
        index, rest = local_name[len(prefix):].split(".", 1)
        layer = gpt.decoder.layers[int(index)]
        return f"{prefix}{layer.layer_number - 1}.{rest}"  # layer_number is global and 1-based
    return local_name


def _name_seed(seed: int, name: str) -> int:
    return (seed * 1_000_003 + zlib.crc32(name.encode())) % (2**63 - 1)


def _tp_partition(param: torch.nn.Parameter) -> Optional[int]:
    """The dimension along which megatron-core splits ``param`` over tensor-parallel ranks,
    or ``None`` for a parameter every TP rank holds whole (norms, row-parallel biases)."""
    if not getattr(param, "tensor_model_parallel", False):
        return None
    return int(getattr(param, "partition_dim", 0))


def tp_coordinates() -> tuple[int, int]:
    """(rank, size) of this process in its tensor-parallel group; (0, 1) without one."""
    try:
        from megatron.core import parallel_state as ps

        if ps.model_parallel_is_initialized():
            return ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size()
    except Exception:
        pass
    return 0, 1


@torch.no_grad()
def deterministic_init_(gpt: torch.nn.Module, model: GPTModelArgs, seed: int,
                        tp: Optional[tuple[int, int]] = None) -> None:
    """Re-initialise every parameter from a generator seeded by (seed, global name).

    Same distributions as Megatron (normal(0, std) weights, scaled normal for output
    projections, zero biases, unit norm weights); the draws depend only on the global
    parameter name and the unsplit shape, so a 1-stage and an N-stage model hold identical
    weights, and a tensor-parallel shard is the exact slice of the unsplit weight that
    megatron-core gives this rank: rows for column-parallel layers (QKV, FC1, the
    vocabulary-parallel embedding and output layer), columns for row-parallel ones (the
    attention projection, FC2). megatron-core lays out QKV as contiguous query groups (with
    grouped-query attention: each group's query heads, then its key and value head) and
    shards whole groups, so its slice is contiguous too. A SwiGLU FC1 is split with stride 2:
    the unsplit weight is [gate; up] and each rank holds [its gate rows; its up rows], the
    rank's slice of each half, as megatron-core's own CPU initialisation strides it.
    ``tp``: (rank, size) of the tensor-parallel group; megatron's parallel state when omitted.
    """
    tp_rank, tp_size = tp_coordinates() if tp is None else tp
    tied = model.tie_embeddings
    std = model.init_method_std
    scaled_std = std / math.sqrt(2.0 * model.num_layers)
    for local_name, param in gpt.named_parameters():
        name = global_parameter_name(gpt, local_name, tied)
        init_parameter_(param, name, std, scaled_std, seed, tp_rank, tp_size)


@torch.no_grad()
def init_parameter_(param: torch.nn.Parameter, name: str, std: float, scaled_std: float, seed: int,
                    tp_rank: int = 0, tp_size: int = 1) -> None:
    """Megatron's distribution for the parameter of global name ``name``: zero biases, unit
    norm weights, normal(0, ``scaled_std``) output projections, normal(0, ``std``) otherwise;
    drawn unsplit from a generator seeded by (seed, name), then cut to this rank's
    tensor-parallel shard (:func:`_tp_slice`)."""
    if name.endswith("bias"):
        param.zero_()
    elif any(name.endswith(s) for s in _ONES) or param.dim() == 1:
        param.fill_(1.0)
    else:
        dim = _tp_partition(param) if tp_size > 1 else None
        full_shape = list(param.shape)
        if dim is not None:
            full_shape[dim] *= tp_size
        # Draw the unsplit weight (the same on every split), keep this rank's slice.
        gen = torch.Generator(device=param.device).manual_seed(_name_seed(seed, name))
        value = torch.empty(full_shape, dtype=torch.float32, device=param.device)
        value.normal_(0.0, scaled_std if name.endswith(_SCALED) else std, generator=gen)
        if dim is not None:
            value = _tp_slice(value, dim, tp_rank, tp_size, int(getattr(param, "partition_stride", 1)))
        param.copy_(value)


def _tp_slice(full: torch.Tensor, dim: int, rank: int, size: int, stride: int) -> torch.Tensor:
    """This rank's shard of the unsplit ``full`` along ``dim``: the unsplit weight is cut into
    ``stride`` x ``size`` equal chunks and rank r keeps chunks r, r + size, ... (megatron-core's
    strided split; stride 1 is one contiguous slice)."""
    chunk = full.shape[dim] // (stride * size)
    if chunk * stride * size != full.shape[dim]:
        raise ValueError(f"a dimension of {full.shape[dim]} cannot be split into {stride} x {size} equal chunks.")
    return torch.cat([full.narrow(dim, (k * size + rank) * chunk, chunk) for k in range(stride)], dim=dim)
