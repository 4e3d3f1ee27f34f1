"""How a stage's backward divides into its input-gradient and weight-gradient parts.

Zero-bubble schedules (:mod:`dynapipe.schedule.zero_bubble`) run a backward as two ops:
the input part (every input gradient, the attention core's backward, any recomputation,
and the output layer's whole backward) and the weight part, the deferred
weight-gradient GEMMs of the transformer layers' linear layers. A weight-gradient GEMM
multiplies the same two matrices as its forward GEMM, so it costs as many FLOPs; the
backward's FLOPs are twice the forward's plus the recomputation. :func:`backward_split`
turns that into the weight part's share of the backward's time and the activation
memory the weight part keeps after the input part ends. It uses the model and the
stage's layers only, so every cost model (analytic, measured profiles, T5) gets the same
split of its own backward time. Units: MiB, shares of ms.

The forward FLOPs of one transformer layer (:func:`layer_flops`, :func:`cross_attention_flops`)
live here too; :mod:`dynapipe.cost.analytic` prices its forward with them.
"""
from __future__ import annotations

from typing import Optional

import numpy as np

from dynapipe.config import ModelConfig, TensorParallelConfig
from dynapipe.cost.attention_density import DENSE
from dynapipe.cost.base import MIB, StageLayout, check_recompute


def layer_flops(model: ModelConfig, b, s) -> tuple:
    """Forward FLOPs of one self-attention + MLP layer on ``b`` samples of ``s`` tokens:
    ``(linear, core)``, the QKV, output-projection and MLP GEMMs, and the attention
    scores with their weighted sum (whole model width, before any TP split)."""
    m = model
    h, ad, f = m.hidden_size, m.attention_dim, m.ffn_hidden_size
    linear = 2 * b * s * h * (ad + 2 * m.kv_dim) + 2 * b * s * ad * h + 2 * b * s * h * (m.fc1_width + f)
    core = 4 * b * s * s * ad
    return linear, core


def cross_attention_flops(model: ModelConfig, b, s_dec, s_enc) -> tuple:
    """Forward FLOPs of one T5 decoder layer's cross-attention: ``(linear, core)``; the query
    and output projections span the decoder tokens, the key and value projections the
    encoder tokens."""
    m = model
    h, ad = m.hidden_size, m.attention_dim
    linear = 2 * b * s_dec * h * ad + 4 * b * s_enc * h * ad + 2 * b * s_dec * ad * h
    core = 4 * b * s_dec * s_enc * ad
    return linear, core


def backward_split(model: ModelConfig, layout: StageLayout, mbs, seqlen, dec_seqlen=None, *,
                   recompute: str = "none", tp: Optional[TensorParallelConfig] = None,
                   attention=None) -> tuple[np.ndarray, np.ndarray]:
    """``(weight_share, stash_mib)`` of one micro-batch's backward on a stage with ``layout``.

    ``weight_share`` (a fraction of the backward's ms): the FLOPs of the transformer layers'
    weight-gradient GEMMs (= their forward linear FLOPs) over the backward's FLOPs at
    ``recompute`` (twice the forward's, + the attention core for ``selective``, + the
    layers' forward for ``full``). The output layer's weight gradient stays in the input
    part: deferring it would keep its fp32 logit gradients, vocabulary-wide.

    ``stash_mib``: what the weight part keeps from the input part's end to its own, per
    TP rank: every deferred GEMM's input and output gradient. Per token of a layer:
    inputs ``h`` (QKV) + ``a_d`` (output projection) + ``h`` (FC1) + ``f`` (FC2), output
    gradients ``a_d + 2 k_d`` (QKV, narrower with grouped-query attention) + ``h`` + the
    FC1 width (``2f`` gated) + ``h``; a T5 decoder layer's cross-attention adds ``h + a_d``
    inputs and ``a_d + h`` gradients a decoder token and ``2 a_d`` key/value gradients an
    encoder token, and its stage keeps the encoder output once. Widths split over TP
    (``a_d``, ``k_d``, ``f``) are divided by the TP size. Under sequence parallelism the
    column-parallel layers (QKV, FC1, the cross-attention's query) keep their input
    sequence-sharded (they gather it again in the weight part) and the encoder output is
    sharded too, while the row-parallel layers' output gradients (projection, FC2) arrive
    gathered over the whole sequence, ``h`` wide on every rank. In the model dtype.

    Both are estimates from FLOPs and tensor sizes, not measurements. The stash is what
    the weight part holds whatever the recompute level: under ``full`` the input part
    rematerialises the layer and the deferred GEMMs keep the recomputed inputs, so it can
    exceed what the stage stores between forward and backward. Arrays broadcast over ``mbs``/``seqlen``/``dec_seqlen``
    (samples, tokens; ``dec_seqlen`` for encoder-decoder models). ``attention``: an
    :class:`~dynapipe.cost.attention_density.AttentionDensity` of packed rows run per sample,
    whose attention cores compute that share of their dense FLOPs (None: dense).
    """
    check_recompute(recompute)
    m, t = model, (tp or TensorParallelConfig())
    b = np.asarray(mbs, dtype=np.float64)
    s_enc = np.asarray(seqlen, dtype=np.float64)
    s_dec = np.asarray(dec_seqlen, dtype=np.float64) if m.is_encoder_decoder and dec_seqlen is not None else s_enc
    shape = np.broadcast(b, s_enc, s_dec).shape
    h, ad, kv, f, f1 = m.hidden_size, m.attention_dim, m.kv_dim, m.ffn_hidden_size, m.fc1_width
    sp = t.size if t.sequence_parallel else 1
    # Stashed elements a token of one layer, per TP rank (see the docstring).
    per_token = 2 * h / sp + 2 * h + (ad + f + ad + 2 * kv + f1) / t.size
    cross_dec = h / sp + h + 2 * ad / t.size
    cross_enc = 2 * ad / t.size
    lin = core = stash = 0.0
    dens = attention if attention is not None else DENSE
    if layout.encoder_layers:
        n = layout.encoder_layers
        l_lin, l_core = layer_flops(m, b, s_enc)
        lin, core = lin + n * l_lin, core + n * l_core * dens.input
        stash = stash + n * b * s_enc * per_token
    if layout.decoder_layers:
        n = layout.decoder_layers
        l_lin, l_core = layer_flops(m, b, s_dec)
        l_core = l_core * (dens.target if m.is_encoder_decoder else dens.input)
        stash_layer = b * s_dec * per_token
        if m.is_encoder_decoder:
            c_lin, c_core = cross_attention_flops(m, b, s_dec, s_enc)
            l_lin, l_core = l_lin + c_lin, l_core + c_core * dens.cross
            stash_layer = stash_layer + b * (s_dec * cross_dec + s_enc * cross_enc)
            stash = stash + b * s_enc * h / sp  # the encoder output every cross-attention reads
        lin, core = lin + n * l_lin, core + n * l_core
        stash = stash + n * stash_layer
    out = 2 * b * s_dec * h * m.vocab_size if layout.has_output else 0.0
    bw = 2 * (lin + core + out)
    if recompute == "selective":
        bw = bw + core
    elif recompute == "full":
        bw = bw + lin + core
    lin = np.broadcast_to(np.asarray(lin, dtype=np.float64), shape)
    bw = np.broadcast_to(np.asarray(bw, dtype=np.float64), shape)
    share = np.divide(lin, bw, out=np.zeros(shape), where=bw > 0)
    return (share, np.broadcast_to(np.asarray(stash * m.dtype_bytes / MIB, dtype=np.float64), shape))
