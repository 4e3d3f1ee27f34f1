"""The L2 norm of a model's parameters over all its pipeline and tensor-parallel ranks
(Megatron-LM's ``--log-params-norm``).

Each parameter counts once: copies are left out where megatron-core marks them (a tied output
layer's or a later stage's embedding copy: ``shared``; weights every tensor-parallel rank holds
whole, such as layer norms: counted on tensor-parallel rank 0 only). The squares are summed in
fp32 on every rank and all-reduced over the model-parallel group (tensor x pipeline), so every
rank gets the whole model's norm; data-parallel replicas hold the same values.
"""
from __future__ import annotations

from typing import Iterable

import torch
import torch.distributed as dist


def params_l2_norm(modules: Iterable[torch.nn.Module], device: torch.device) -> float:
    """L2 norm of the parameters of ``modules`` (this rank's model chunks) and of the other
    model-parallel ranks' (collective over megatron-core's model-parallel group)."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import param_is_not_tensor_parallel_duplicate
    from megatron.core.transformer.module import param_is_not_shared

    total = torch.zeros(1, dtype=torch.float64, device=device)
    for module in modules:
        for p in module.parameters():
            if param_is_not_shared(p) and param_is_not_tensor_parallel_duplicate(p):
                total += p.detach().float().pow(2).sum().double()
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(total, group=parallel_state.get_model_parallel_group())
    return float(total.sqrt().item())
