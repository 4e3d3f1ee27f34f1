"""The attention core's share of a transformer's layer FLOPs over a batching's micro-batches.

The quadratic term (scores and weighted values) against everything linear in the tokens
(projections, MLP), as megatron-core's local attention computes it: dense over every padded
row, or over the pairs inside samples for packed rows run per sample (their
:class:`~dynapipe.cost.attention_density.AttentionDensity`). Embedding and output layer
excluded. Pure Python + numpy.
"""
from __future__ import annotations

from typing import Optional, Sequence

from dynapipe.config import ModelConfig
from dynapipe.cost.attention_density import DENSE, AttentionDensity


def attention_share(model: ModelConfig, shapes: Sequence[Sequence[int]],
                    densities: Optional[Sequence[Optional[AttentionDensity]]] = None) -> float:
    """Fraction of the transformer layers' forward FLOPs spent in the attention core
    (scores and weighted values, the term quadratic in the sequence) over micro-batches
    of the given padded shapes.

    ``shapes``: ``(rows, seqlen)`` per micro-batch (tokens), or ``(rows, seqlen,
    dec_seqlen)`` for encoder-decoder models. Counts what dense (unfused, non-causal-
    skipping) attention computes, as megatron-core's local attention does; embedding and
    output layer excluded. ``densities``: per micro-batch, the attention density of packed
    rows run per sample (None: dense).
    """
    core, linear = attention_and_linear_flops(model, shapes, densities)
    total = core + linear
    return core / total if total > 0 else 0.0


def attention_and_linear_flops(model: ModelConfig, shapes: Sequence[Sequence[int]],
                               densities: Optional[Sequence[Optional[AttentionDensity]]] = None
                               ) -> tuple[float, float]:
    """The transformer layers' forward FLOPs of micro-batches of ``shapes`` (see
    :func:`attention_share`): (attention core, everything else)."""
    h, ad, f = model.hidden_size, model.attention_dim, model.ffn_hidden_size
    core = linear = 0.0
    for i, shape in enumerate(shapes):
        b, s = float(shape[0]), float(shape[1])
        d = (densities[i] if densities is not None else None) or DENSE
        if model.is_encoder_decoder:
            t = float(shape[2]) if len(shape) > 2 else s
            # Encoder self-attention; decoder self-attention plus cross-attention on the encoder output.
            core += model.encoder_layers * 4 * b * s * s * ad * float(d.input)
            linear += model.encoder_layers * b * s * (8 * h * ad + 4 * h * f)
            core += model.decoder_layers * (4 * b * t * t * ad * float(d.target) + 4 * b * t * s * ad * float(d.cross))
            linear += model.decoder_layers * (b * t * (8 * h * ad + 4 * h * f) + 4 * b * t * h * ad
                                              + 4 * b * s * h * ad)
        else:
            core += model.num_layers * 4 * b * s * s * ad * float(d.input)
            linear += model.num_layers * b * s * (8 * h * ad + 4 * h * f)
    return core, linear
