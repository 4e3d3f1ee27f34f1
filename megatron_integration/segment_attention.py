"""Per-sample attention for packed rows: the packing baseline without cross-sample work.

Megatron's ``--reset-attention-mask`` keeps packed samples apart with a block-diagonal mask,
but megatron-core's local attention still computes every (query, key) pair of the row and
discards the ones across samples: a 1,024-token row of ten samples pays ten times the
attention it keeps. On GPUs packed rows avoid that through Transformer Engine's THD format
(per-sample ``cu_seqlens``); megatron-core's local ``DotProductAttention`` refuses packed
sequences. :class:`SegmentedDotProductAttention` is that local attention run once per sample
(``--dynapipe-packed-attention per-sample``): the same numbers for every real token as the
mask gives (a segment's softmax is the masked row's), and no work between samples, so the
packing baseline is as strong on a CPU as THD makes it on a GPU.

The segments travel where the mask would: a *segment table* (int32 ``[k, 5]``: row, query
start, query end, key start, key end; row-local token offsets) given as the layer's attention
mask. megatron-core hands the mask unchanged to the core attention, recomputation included
(its checkpoints save tensors, which the table is), and a T5 decoder's cross-attention gets
its own table through ``context_mask``. Every query token of a row is in exactly one entry;
a padding tail is a segment without keys (zeros, in self- and cross-attention alike: a
varlen kernel skips it, and its loss is masked), so the work is the pairs inside samples,
what :mod:`dynapipe.cost.attention_density` prices.
"""
from __future__ import annotations

from typing import Optional

import numpy as np
import torch

PACKED_ATTENTION = ("mask", "per-sample")
TABLE_COLUMNS = 5  # row, query start, query end, key start, key end


def _runs(ids: np.ndarray) -> list[tuple[int, int, int]]:
    """``(start, end, id)`` of the runs of equal ids of one row."""
    cut = np.flatnonzero(np.diff(ids)) + 1
    starts = np.concatenate(([0], cut))
    ends = np.concatenate((cut, [len(ids)]))
    return [(int(a), int(b), int(ids[a])) for a, b in zip(starts, ends)]


def segment_table(q_ids, kv_ids=None) -> np.ndarray:
    """The segment table (int32 ``[k, 5]``) of per-token sample ids ``q_ids`` (``[rows, sq]``,
    0 on padding). Self-attention (``kv_ids`` None): each run of equal ids attends to itself,
    padding to nothing. Cross-attention: each run of ``q_ids`` attends to the run of
    ``kv_ids`` (``[rows, sk]``) with the same sample id, and padding or a sample without keys
    to nothing."""
    q_ids = np.asarray(q_ids)
    out = []
    for r in range(q_ids.shape[0]):
        keys = None if kv_ids is None else {i: (a, b) for a, b, i in _runs(np.asarray(kv_ids)[r]) if i > 0}
        for a, b, i in _runs(q_ids[r]):
            if i <= 0:  # padding: no keys, zeros out
                ka, kb = 0, 0
            else:
                ka, kb = (a, b) if keys is None else keys.get(i, (0, 0))
            out.append((r, a, b, ka, kb))
    return np.asarray(out, dtype=np.int32).reshape(-1, TABLE_COLUMNS)


def _entries(table) -> np.ndarray:
    """A segment table (tensor or array) as an int64 ``[k, 5]`` array on the host."""
    return np.asarray(table.cpu() if isinstance(table, torch.Tensor) else table, dtype=np.int64).reshape(
        -1, TABLE_COLUMNS)


def table_density(table, rows: int, sq: int, sk: int) -> float:
    """The share of ``rows`` dense ``sq x sk`` attention a segment table computes (its
    segments' query x key pairs over them): what :class:`~dynapipe.cost.attention_density.
    AttentionDensity` prices, read off what ran; to 6 significant digits, as traces record it."""
    t = _entries(table)
    pairs = int(np.sum((t[:, 2] - t[:, 1]) * np.maximum(t[:, 4] - t[:, 3], 0)))
    return float(f"{max(pairs / float(max(rows * sq * sk, 1)), 1e-12):.6g}")


def table_calls(table) -> int:
    """The attention calls a segment table makes: its segments with keys (padding and samples
    without keys of their own get zeros, no call)."""
    t = _entries(table)
    return int(np.sum(t[:, 4] > t[:, 3]))


def t5_segment_tables(has_encoder: bool, has_decoder: bool, enc_ids, dec_ids) -> dict[str, torch.Tensor]:
    """The segment tables of a packed T5 micro-batch where its stage's masks go
    (``enc_attn_mask``, ``dec_attn_mask``, ``cross_attn_mask``: each target attends to its own
    sample's input), from per-token sample ids ``[mbs, s]`` (tensors or arrays; read on the host)."""
    enc = np.asarray(torch.as_tensor(enc_ids).cpu())
    out = {}
    if has_encoder:
        out["enc_attn_mask"] = torch.from_numpy(segment_table(enc))
    if has_decoder:
        dec = np.asarray(torch.as_tensor(dec_ids).cpu())
        out["dec_attn_mask"] = torch.from_numpy(segment_table(dec))
        out["cross_attn_mask"] = torch.from_numpy(segment_table(dec, enc))
    return out


def is_segment_table(mask) -> bool:
    """Whether an attention mask is a segment table (a bool mask or None is not)."""
    return isinstance(mask, torch.Tensor) and mask.dtype == torch.int32 and mask.dim() == 2 \
        and mask.shape[1] == TABLE_COLUMNS


def _segmented_class():
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    class SegmentedDotProductAttention(DotProductAttention):
        """megatron-core's ``DotProductAttention``, run on each segment of a segment-table
        mask alone (see the module docstring); any other mask goes to the parent as it is."""

        def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                    packed_seq_params=None):
            if not is_segment_table(attention_mask):
                return super().forward(query, key, value, attention_mask, attn_mask_type=attn_mask_type,
                                       attention_bias=attention_bias, packed_seq_params=packed_seq_params)
            rows: list[list] = [[] for _ in range(query.shape[1])]
            for r, a, b, ka, kb in attention_mask.tolist():
                if kb <= ka:  # queries without keys of their own sample (padding): zeros
                    rows[r].append(query.new_zeros((b - a, 1, self.hidden_size_per_partition)))
                    continue
                # One sample alone, under the layer's own mask type (causal: its earlier tokens).
                rows[r].append(super().forward(query[a:b, r:r + 1], key[ka:kb, r:r + 1], value[ka:kb, r:r + 1],
                                               None, attn_mask_type=attn_mask_type, attention_bias=attention_bias))
            out = [torch.cat(p, dim=0) if len(p) > 1 else p[0] for p in rows]
            return torch.cat(out, dim=1) if len(out) > 1 else out[0]

    return SegmentedDotProductAttention


_CLASS: Optional[type] = None


def segmented_attention_class() -> type:
    """The ``SegmentedDotProductAttention`` class (built on first use: it subclasses a
    megatron-core class, which this module does not import at load)."""
    global _CLASS
    if _CLASS is None:
        _CLASS = _segmented_class()
    return _CLASS


def with_segmented_attention(spec, cross: bool = False):
    """The local layer ``spec`` with its self-attention's (and with ``cross`` its
    cross-attention's) core attention replaced by ``SegmentedDotProductAttention``."""
    from dataclasses import replace

    def swapped(attn):
        return replace(attn, submodules=replace(attn.submodules, core_attention=segmented_attention_class()))

    subs = replace(spec.submodules, self_attention=swapped(spec.submodules.self_attention))
    if cross:
        subs = replace(subs, cross_attention=swapped(subs.cross_attention))
    return replace(spec, submodules=subs)
