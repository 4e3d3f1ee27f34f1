"""The fixed cost of one per-sample attention call, measured for a profile.

Per-sample attention (:mod:`megatron_integration.segment_attention`) runs megatron-core's local
attention once a sample. Each call costs its pairs, which the profile's attention share prices
through :class:`~dynapipe.cost.attention_density.AttentionDensity`, and a fixed cost the pairs
do not show: the call's own ops (two batched matmuls, the softmax, dropout, reshapes) and the
concatenation of the results. On a 2-core CPU with hidden 64 it was about 0.14 ms forward and
as much backward, against a few ms for a whole layer: a micro-batch of 16 samples pays it
16 times a core. A varlen kernel would pay it once; this build's per-sample attention does not.

Measured on one row of one-token segments, whose pairs cost nothing: the time over the calls.
"""
from __future__ import annotations

from typing import Callable, Optional

import torch

# One row of this many one-token segments: enough calls that the per-call figure is steady,
# few enough to cost under a second on a CPU.
CALLS = 64


def measure_attention_call_ms(config, device: torch.device, causal: bool, repeats: int = 3, warmup: int = 1,
                              flush: Optional[Callable[[], None]] = None, group=None) -> dict:
    """``{"fw": ms, "bw": ms}``: the forward and backward time of one call of per-sample
    attention built from megatron-core's ``TransformerConfig`` ``config`` (``causal``: the
    mask type of a decoder's self-attention; else an encoder's), on ``device``, to 6 decimals.
    ``group``: the tensor-parallel group whose ranks all measure it; the slowest rank's times."""
    from megatron.core.transformer.enums import AttnMaskType

    from megatron_integration.masked_softmax import use_additive_masks
    from megatron_integration.profiler import measure_op, slowest_rank
    from megatron_integration.segment_attention import segmented_attention_class

    mask_type = AttnMaskType.causal if causal else AttnMaskType.padding
    core = segmented_attention_class()(config=config, layer_number=1, attn_mask_type=mask_type,
                                       attention_type="self").to(device)
    use_additive_masks(core, device)  # as the training stages are built
    dim = core.hidden_size_per_attention_head
    # Keys and values have a head a query group (grouped-query attention), queries a head each.
    heads = (core.num_attention_heads_per_partition, core.num_query_groups_per_partition,
             core.num_query_groups_per_partition)
    qkv = [torch.randn(CALLS, 1, h, dim, device=device, dtype=config.params_dtype, requires_grad=True)
           for h in heads]
    starts = torch.arange(CALLS, dtype=torch.int32)
    table = torch.stack([torch.zeros_like(starts), starts, starts + 1, starts, starts + 1], dim=1)

    def forward():
        return core(*qkv, table, attn_mask_type=mask_type)

    m = measure_op(forward, qkv, device, repeats=repeats, warmup=warmup, group=group, flush=flush)
    if group is not None:
        m = slowest_rank(m, group, device)
    return {"fw": round(m.fw_ms / CALLS, 6), "bw": round(m.bw_ms / CALLS, 6)}
