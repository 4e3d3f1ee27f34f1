"""How much of a padded micro-batch's attention a per-sample attention computes.

A packed row of ``s`` tokens holds several samples. Megatron's packing isolates them with
a mask, and its attention still computes every (query, key) pair of the row: ``s^2`` a
row. Attention run on each sample alone (a varlen kernel such as Transformer Engine's THD
format on a GPU; ``--dynapipe-packed-attention per-sample`` here) computes, and stores
scores for, only ``sum(l_i^2)``. The cost models price such a micro-batch at its padded
shape with the attention core's FLOPs and score bytes scaled by an
:class:`AttentionDensity`: the share of the dense pairs it computes, one for each kind of
attention (self-attention over the inputs, or a decoder-only model's sequence; a T5
decoder's self-attention over the targets; its cross-attention, targets x inputs). The
linear layers (projections, MLP) still run on every token of the row, padding included.

It also counts the calls: attention run once a sample (``segment_attention.py``, where no
varlen kernel is built) pays each call's fixed cost, whatever its pairs, and a cost model
with a measured per-call cost (``attention_call_ms``) adds it.

Pure numpy, no torch.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence, Union

import numpy as np

from dynapipe.errors import DynaPipeError

Density = Union[float, np.ndarray]


@dataclass(frozen=True)
class AttentionDensity:
    """Shares in (0, 1] of a micro-batch's dense attention pairs that are computed.

    ``input``: self-attention over the input side (``sum(l_i^2) / (rows x seqlen^2)``;
    a decoder-only model's only attention). ``target``: a T5 decoder's self-attention
    (``sum(t_i^2) / (rows x dec_seqlen^2)``). ``cross``: its cross-attention
    (``sum(t_i x l_i) / (rows x dec_seqlen x seqlen)``). Floats, or arrays that broadcast
    with the micro-batch shapes priced beside them. 1 everywhere: dense attention.
    ``calls``: the calls each attention core of a layer makes on the micro-batch, one a
    sample with keys (0: not counted, as for dense rows, whose one call the measured layer holds).
    """

    input: Density = 1.0
    target: Density = 1.0
    cross: Density = 1.0
    calls: Density = 0.0

    def __post_init__(self):
        for name in ("input", "target", "cross"):
            arr = np.asarray(getattr(self, name), dtype=np.float64)
            if arr.size and (not np.all(np.isfinite(arr)) or np.any(arr <= 0) or np.any(arr > 1 + 1e-12)):
                raise DynaPipeError(f"attention density {name}={getattr(self, name)!r}: a share of a micro-batch's "
                                    f"attention pairs lies in (0, 1] (1: dense attention).")
        calls = np.asarray(self.calls, dtype=np.float64)
        if calls.size and (not np.all(np.isfinite(calls)) or np.any(calls < 0)):
            raise DynaPipeError(f"attention calls={self.calls!r}: a count of per-sample attention calls is at "
                                f"least 0.")

    def padded_to(self, seqlen: float, dec_seqlen: float, new_seqlen: float,
                  new_dec_seqlen: float) -> "AttentionDensity":
        """The same pairs in rows padded further, from ``seqlen``/``dec_seqlen`` to
        ``new_seqlen``/``new_dec_seqlen`` tokens (0 decoder tokens: decoder-only): each share
        falls by the dense pairs' growth."""
        s = seqlen / new_seqlen
        if not new_dec_seqlen:  # decoder-only: one kind of attention
            return AttentionDensity(input=np.asarray(self.input) * s * s, target=self.target, cross=self.cross,
                                    calls=self.calls)
        t = dec_seqlen / new_dec_seqlen
        return AttentionDensity(input=np.asarray(self.input) * s * s, target=np.asarray(self.target) * t * t,
                                cross=np.asarray(self.cross) * s * t, calls=self.calls)

    def to_json(self) -> dict:
        """The three shares, rounded to 6 digits, and the calls (floats only)."""
        return {**{k: round(float(getattr(self, k)), 6) for k in ("input", "target", "cross")},
                "calls": int(round(float(self.calls)))}


DENSE = AttentionDensity()


def packed_density(lengths: np.ndarray, rows: Sequence[Sequence[int]], seqlen: int,
                   dec_seqlen: int = 0) -> AttentionDensity:
    """The :class:`AttentionDensity` of packed ``rows`` (sample indices into ``lengths``,
    tokens: ``(n,)``, or ``(n, 2)`` input and target lengths) padded to ``seqlen`` (and
    ``dec_seqlen`` decoder) tokens, run with per-sample attention."""
    arr = np.asarray(lengths, dtype=np.float64)
    if not rows or seqlen < 1:
        raise DynaPipeError(f"packed density: {len(rows)} rows of {seqlen} tokens; give at least one row of at "
                            f"least one token.")
    idx = np.concatenate([np.asarray(r, dtype=np.int64) for r in rows])
    b = float(len(rows))
    if arr.ndim == 1:
        return AttentionDensity(input=_share(np.sum(arr[idx] ** 2), b * seqlen * seqlen), calls=float(len(idx)))
    if dec_seqlen < 1:
        raise DynaPipeError("packed density: encoder-decoder rows need their decoder length (dec_seqlen >= 1).")
    inp, tgt = arr[idx, 0], arr[idx, 1]
    return AttentionDensity(input=_share(np.sum(inp ** 2), b * seqlen * seqlen),
                            target=_share(np.sum(tgt ** 2), b * dec_seqlen * dec_seqlen),
                            cross=_share(np.sum(inp * tgt), b * dec_seqlen * seqlen), calls=float(len(idx)))


def _share(pairs: float, dense: float) -> float:
    # A sample longer than the row (not truncated by the caller) would claim more than dense.
    if pairs > dense:
        raise DynaPipeError(f"packed density: the samples hold {int(pairs)} attention pairs, more than the "
                            f"{int(dense)} of their padded rows; truncate samples to the row length first.")
    return max(float(pairs / dense), 1e-12)


def stack(densities: Sequence[Optional[AttentionDensity]]) -> Optional[AttentionDensity]:
    """One :class:`AttentionDensity` of arrays for a list of micro-batches' (None: dense),
    or None when every one is dense (then nothing needs scaling)."""
    if all(d is None for d in densities):
        return None
    filled = [DENSE if d is None else d for d in densities]
    return AttentionDensity(*(np.array([float(getattr(d, k)) for d in filled])
                              for k in ("input", "target", "cross", "calls")))


def decoder_core_density(target: Density, cross: Density, s_dec, s_enc) -> np.ndarray:
    """A T5 decoder layer's density over its two attention cores together: self-attention
    (``s_dec`` keys a query) and cross-attention (``s_enc``), weighted by their dense FLOPs
    and score bytes, which both grow with the keys a query."""
    s_dec, s_enc = np.asarray(s_dec, dtype=np.float64), np.asarray(s_enc, dtype=np.float64)
    return (np.asarray(target) * s_dec + np.asarray(cross) * s_enc) / np.maximum(s_dec + s_enc, 1e-30)


def thin(total, share, density):
    """``total`` with its ``share`` (in [0, 1]) scaled by ``density``, and that part's new
    share of the result: how a profile's measured layer figures (time or stored MiB, whose
    attention part is ``share``) shrink when attention computes ``density`` of its pairs."""
    total, share, density = (np.asarray(x, dtype=np.float64) for x in (total, share, density))
    kept = 1.0 - share * (1.0 - density)
    return total * kept, share * density / np.maximum(kept, 1e-30)
