"""An exact, cheaper attention mask for megatron-core's unfused softmax.

The local layer spec's ``DotProductAttention`` masks scores in ``FusedScaleMaskSoftmax``;
without its CUDA kernels (on a CPU, or in fp32) that is the torch fallback, whose
``mask_func`` (megatron-core's ``attention_mask_func``) fills the masked scores with -10000
by an in-place ``masked_fill_`` on a view of the score tensor. On a CPU that one call
doubled the cost of attention: measured on 4 heads x 1,024 x 1,024 scores, forward and
backward took 49-52 ms with it against 18-23 ms unmasked, and it is paid by every packed
row, every padded micro-batch and every causal layer.

:func:`additive_attention_mask` adds a bias that is -10000 where the mask is set instead
(23-24 ms on the same scores). The probabilities are bitwise the same as megatron-core's in
every row that keeps at least one key: the masked scores are about -10000 either way, so
the row's maximum comes from a kept score and ``exp`` of every masked one underflows to
exactly 0 in fp32 (and in the fp32 softmax of half-precision runs); the gradients follow
(a masked score's gradient is ``p * (...)``, zero). A row that keeps nothing (a padding
decoder query in T5 cross-attention: no keys of its own sample) gets the softmax of its
unmasked scores instead of a uniform row; it is a padding position, whose loss is masked
and whose keys no other query sees, so no loss and no gradient changes.
"""
from __future__ import annotations

import torch

# megatron-core's attention_mask_func fills masked scores with this value.
MASK_FILL = -10000.0


class _BiasCache:
    """The biases of the last few masks seen. Every layer of a stage is given the same mask
    objects for a micro-batch (a T5 decoder layer alternates its self-attention and its
    cross-attention mask), so each bias is built once per micro-batch, not once per layer.
    The entries hold their masks, so an identity match cannot be a recycled object."""

    def __init__(self, size: int = 4) -> None:
        self.size = size
        self.entries: list[tuple[torch.Tensor, int, torch.dtype, torch.Tensor]] = []

    def bias_of(self, mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        for i, (m, version, dt, bias) in enumerate(self.entries):
            if m is mask and version == mask._version and dt == dtype:
                self.entries.insert(0, self.entries.pop(i))
                return bias
        bias = torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(mask, MASK_FILL)
        self.entries = [(mask, mask._version, dtype, bias)] + self.entries[:self.size - 1]
        return bias


_CACHE = _BiasCache()


def additive_attention_mask(scores: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``scores`` (``[b, heads, sq, sk]``) with -10000 added where ``mask`` (bool, True =
    masked, broadcastable) is set: a drop-in ``mask_func`` for megatron-core's
    ``FusedScaleMaskSoftmax`` (see the module doc for when it equals ``attention_mask_func``).
    A mask that is not bool goes to megatron-core's own function."""
    if mask.dtype != torch.bool:
        from megatron.core.transformer.utils import attention_mask_func

        return attention_mask_func(scores, mask)
    return scores + _CACHE.bias_of(mask, scores.dtype)


def use_additive_masks(module: torch.nn.Module, device: torch.device = torch.device("cpu")) -> int:
    """Give every ``FusedScaleMaskSoftmax`` in ``module`` :func:`additive_attention_mask`
    when ``device`` (where the module runs) is a CPU, the only place it was measured; returns
    how many it changed (0 on a GPU, and for Transformer Engine layers, which mask in their
    own kernels). Call it on a freshly built model, before training or profiling."""
    from megatron.core.fusions.fused_softmax import FusedScaleMaskSoftmax

    if torch.device(device).type != "cpu":
        return 0
    changed = 0
    for m in module.modules():
        if isinstance(m, FusedScaleMaskSoftmax) and hasattr(m, "mask_func"):
            m.mask_func = additive_attention_mask
            changed += 1
    return changed
