"""Bytes one transformer layer keeps for its backward, per token and per attention score.

Korthikanti et al. (2022) count ``sbh(34 + 5ns/h)`` bytes a layer for 2-byte activations,
assuming dropout everywhere and an unfused attention core. What a layer keeps depends on
more than its shape, and these functions follow what megatron-core's layers keep (measured
with saved-tensor hooks on its local layers; the tests check them against a layer):

- **Attention scores**, per element (one head, one query, one key): the softmax output
  (the activation dtype, or fp32 under ``--attention-softmax-in-fp32`` plus the cast copy the
  weighted sum reads), and with attention dropout its mask and its output; at dropout 0
  ``torch.nn.functional.dropout`` returns its input and keeps nothing. A fused attention
  kernel (flash or cuDNN fused attention, Transformer Engine's default in half precision)
  keeps no score matrix, only its fp32 log-sum-exp per head and query.
- **Hidden dropout**: two masks per token and hidden unit (after the attention and after the
  MLP), none at dropout 0.
- **Rotary positions**: the rotated query and key are new tensors, kept next to the
  projection's output, which the value (a view of it) keeps alive.

``mask_bytes``: bytes a dropout mask keeps per element: 1 on CUDA (a bool mask), the
activation's dtype on a CPU (:attr:`dynapipe.config.DeviceConfig.dropout_mask_bytes`).
Pure Python; no torch.
"""
from __future__ import annotations

from dynapipe.config import ModelConfig

FP32_BYTES = 4
CUDA_MASK_BYTES = 1.0
ROTARY = ("rope",)


def score_bytes(model: ModelConfig, mask_bytes: float = CUDA_MASK_BYTES) -> float:
    """Bytes a layer keeps per attention-score element (one head, one query, one key)."""
    m = model
    if m.fused_attention:
        return 0.0
    d = m.dtype_bytes
    softmax = FP32_BYTES if m.attention_softmax_in_fp32 else d
    if m.attention_dropout > 0:
        return softmax + mask_bytes + d  # the dropout's output feeds the weighted sum
    return softmax + (d if softmax != d else 0.0)  # the cast back to d feeds it


def layer_token_bytes(model: ModelConfig, tp: int = 1, seq_shard: int = 1,
                      mask_bytes: float = CUDA_MASK_BYTES) -> float:
    """Bytes a self-attention + MLP layer keeps per token apart from its score matrix, on one
    of ``tp`` tensor-parallel ranks; ``seq_shard``: the ranks the replicated part (norm inputs,
    residual-side tensors, dropout masks) is sharded over (``tp`` with sequence parallelism, else 1).

    Replicated: the two norms' inputs, outputs and statistics (``8h`` for 2-byte activations,
    + 16 bytes for LayerNorm's; torch's RMSNorm more, :func:`torch_rms_norm_bytes`) and the
    hidden-dropout masks. Split ``tp`` ways: the query/key/value projection's output, the
    attention output, the MLP's FC1 output and activation (a gated MLP keeps both FC1 halves,
    and megatron-core's unfused gate, the one this build runs on every device, also the SiLU of
    one and the other's offset copy its product reads), the rotated query and key, the
    query/key norms and a fused kernel's softmax statistics.
    """
    m = model
    d = m.dtype_bytes
    replicated = (4 * m.hidden_size * d + 2 * norm_stat_bytes(m) + 2 * m.hidden_size * torch_rms_norm_bytes(m)
                  + (2 * mask_bytes * m.hidden_size if m.hidden_dropout > 0 else 0.0))
    split = (2 * m.attention_dim + 2 * m.kv_dim + m.fc1_width + m.ffn_hidden_size) * d
    if m.gated_linear_unit:
        split += 2 * m.ffn_hidden_size * d  # silu(x_glu) and x_linear + offset, each ffn wide
    if m.position_embedding_type in ROTARY:
        split += (m.attention_dim + m.kv_dim) * d
    if m.fused_attention:
        split += m.num_attention_heads * FP32_BYTES
    return replicated / seq_shard + (split + qk_norm_token_bytes(m)) / tp


def cross_token_bytes(model: ModelConfig, tp: int = 1, seq_shard: int = 1,
                      mask_bytes: float = CUDA_MASK_BYTES) -> tuple[float, float]:
    """Bytes a decoder layer's cross-attention block keeps apart from its scores, per decoder
    token and per encoder token (its keys and values), on one of ``tp`` tensor-parallel ranks.

    Per decoder token: the norm's input, output and statistics (replicated), the hidden-dropout mask, the
    query and the attention output; per encoder token: the key/value projection's output. A
    fused kernel adds its softmax statistics per decoder token. The encoder output the key/value
    projection reads is the stage's input, held once for all its decoder layers, not here."""
    m = model
    d = m.dtype_bytes
    replicated = (2 * m.hidden_size * d + norm_stat_bytes(m)
                  + (mask_bytes * m.hidden_size if m.hidden_dropout > 0 else 0.0))
    dec = replicated / seq_shard + (2 * m.attention_dim * d
                                    + (m.num_attention_heads * FP32_BYTES if m.fused_attention else 0.0)) / tp
    enc = 2 * m.attention_dim * d / tp
    return dec, enc


def torch_rms_norm_bytes(model: ModelConfig, output_kept: bool = True) -> float:
    """Bytes a norm keeps per normalised element beyond its input, output and statistics when it
    is torch's composite RMSNorm (``model.torch_norms``): the normalised product in fp32, or
    below fp32 an fp32 copy of the input and the product cast back. ``output_kept=False``
    (query/key norms before the attention core or rotary positions, which keep no copy of
    their input) counts the output the weight's product keeps too, below fp32. Measured on
    CPU (hidden 64): 4 bytes in fp32, 6 (8 with the output) in bf16. 0 for LayerNorm or
    Transformer Engine's norms, which keep input and statistics."""
    m = model
    if not (m.torch_norms and m.normalization == "RMSNorm"):
        return 0.0
    d = m.dtype_bytes
    if d == FP32_BYTES:
        return FP32_BYTES
    return FP32_BYTES + d + (0 if output_kept else d)


def norm_stat_bytes(model: ModelConfig) -> float:
    """Bytes one norm keeps per token besides its input: LayerNorm's mean and 1/std, RMSNorm's
    1/rms, counted in fp32 (CUDA keeps them so; a CPU in the activation's dtype)."""
    return (1 if model.normalization == "RMSNorm" else 2) * FP32_BYTES


def qk_norm_token_bytes(model: ModelConfig) -> float:
    """``--qk-layernorm``'s bytes a token (every head, before TP): the per-head statistics in
    fp32 (LayerNorm's mean and 1/std, RMSNorm's 1/rms); torch's RMSNorm's copies
    (:func:`torch_rms_norm_bytes`); and without rotary positions the normalised queries and
    keys the attention core keeps (rotary positions keep the rotated ones, counted apart, and
    nothing keeps the norm's output). Measured on CPU in fp32 at 4 heads of 16, learned
    positions: 576 bytes a token for LayerNorm, 1,056 for torch's RMSNorm."""
    m = model
    if not m.qk_layernorm:
        return 0.0
    width = m.attention_dim + m.kv_dim
    heads = m.num_attention_heads + (m.num_query_groups or m.num_attention_heads)
    kept = 0.0 if m.position_embedding_type in ROTARY else width * m.dtype_bytes
    stats = heads * (1 if m.normalization == "RMSNorm" else 2) * FP32_BYTES
    return stats + width * torch_rms_norm_bytes(m, output_kept=False) + kept
