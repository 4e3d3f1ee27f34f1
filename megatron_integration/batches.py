"""Fixed-shape micro-batches of the megatron baselines, filled like DynaPipe's.

Tensors come from :func:`dynapipe.data.collate.collate`, the very function that fills
DynaPipe's planned micro-batches: same tokens, labels (the next token) and loss mask
(target tokens only), so the losses of every method are comparable. Shapes are
``[rows, --seq-length]``.

* ``padding``: one sample per row; micro-batch ``j`` of replica ``r`` holds samples
  ``j*mbs*dp + r*mbs ...`` of the global batch (Megatron's sampler order).
* ``packing``: whole samples packed into rows of ``--seq-length`` by the planner's
  packing baseline (best-fit decreasing); rows are dealt to replicas in Megatron's
  order, and every replica runs the same number of micro-batches of ``mbs`` rows (rows
  missing at the end are all padding). Position ids restart at every sample with
  ``--reset-position-ids`` and run along the row without it; with
  ``--reset-attention-mask`` a block-diagonal causal mask keeps samples apart.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np
import torch

from dynapipe.data.collate import TensorRequest, collate
from dynapipe.data.samples import Sample
from dynapipe.errors import DynaPipeError

_NAMES = (("tokens", "int64"), ("position_ids", "int64"), ("labels", "int64"), ("loss_mask", "float32"),
          ("segment_ids", "int64"))


@dataclass
class MicroBatchTensors:
    """Inputs of one fixed-shape micro-batch. ``attention_mask`` is ``[rows, 1, s, s]``
    bool, True = masked (None: the default causal mask)."""

    tokens: torch.Tensor
    position_ids: torch.Tensor
    labels: torch.Tensor
    loss_mask: torch.Tensor
    attention_mask: Optional[torch.Tensor] = None

    def to(self, device: torch.device) -> "MicroBatchTensors":
        from dynapipe.runtime.buffers import to_device
        from megatron_integration.segment_attention import is_segment_table

        move = lambda t: None if t is None else to_device(t, device)
        # A segment table (per-sample attention) is read on the host, layer by layer.
        mask = self.attention_mask if is_segment_table(self.attention_mask) else move(self.attention_mask)
        return MicroBatchTensors(move(self.tokens), move(self.position_ids), move(self.labels),
                                 move(self.loss_mask), mask)


def rows_micro_batch(rows: Sequence[Sequence[Sample]], seqlen: int, reset_position_ids: bool = True,
                     reset_attention_mask: bool = False, pad_id: int = 0,
                     per_sample_attention: bool = False) -> MicroBatchTensors:
    """Tensors of rows of samples (one sample a row for padding; empty rows are all pad).
    ``per_sample_attention`` (with ``reset_attention_mask``): the samples are kept apart by
    running attention on each alone (the mask is then a segment table,
    :mod:`megatron_integration.segment_attention`)."""
    requests = [TensorRequest(n, (len(rows), seqlen), d) for n, d in _NAMES]
    t = collate(rows, requests, seqlen, pad_id=pad_id)
    positions = t["position_ids"]
    if not reset_position_ids:
        positions = np.broadcast_to(np.arange(seqlen, dtype=np.int64), positions.shape).copy()
    mask = None
    if reset_attention_mask and per_sample_attention:
        from megatron_integration.segment_attention import segment_table

        mask = torch.from_numpy(segment_table(t["segment_ids"]))
    elif reset_attention_mask:
        seg = t["segment_ids"]
        causal = np.tril(np.ones((seqlen, seqlen), dtype=bool))
        same = (seg[:, :, None] == seg[:, None, :]) & (seg[:, :, None] > 0)
        # Padding positions attend to themselves only (their loss is masked out anyway),
        # so no softmax row is empty.
        eye = np.eye(seqlen, dtype=bool)[None]
        mask = torch.from_numpy(~((same & causal[None]) | eye))[:, None]
    return MicroBatchTensors(torch.from_numpy(t["tokens"]), torch.from_numpy(positions),
                             torch.from_numpy(t["labels"]), torch.from_numpy(t["loss_mask"]), mask)


def padding_assignment(num_samples: int, mbs: int, dp: int, dp_rank: int) -> list[list[int]]:
    """Sample positions of each micro-batch of replica ``dp_rank`` (Megatron's sampler order)."""
    if num_samples % (mbs * dp):
        raise DynaPipeError(f"a global batch of {num_samples} samples is not divisible by "
                            f"--micro-batch-size {mbs} x data-parallel size {dp}.")
    step = mbs * dp
    return [list(range(j + dp_rank * mbs, j + (dp_rank + 1) * mbs)) for j in range(0, num_samples, step)]


def pack_rows(lengths: np.ndarray, seqlen: int) -> list[list[int]]:
    """Packed rows (sample positions) as the planner's ``packing`` baseline makes them."""
    from dynapipe.batching.baselines import packing

    if int(np.max(lengths)) > seqlen:
        raise DynaPipeError(f"a sample of {int(np.max(lengths))} tokens does not fit a row of --seq-length {seqlen}.")
    micro_batches, _ = packing(np.asarray(lengths, dtype=np.int64), 1, seqlen)
    return [list(mb.rows[0]) for mb in micro_batches]


def packing_assignment(lengths: np.ndarray, seqlen: int, mbs: int, dp: int, dp_rank: int,
                       mb_multiple: int = 1) -> list[list[list[int]]]:
    """Rows (lists of sample positions) of each micro-batch of replica ``dp_rank``;
    every replica gets the same number of micro-batches, padded with empty rows, and a
    multiple of ``mb_multiple`` of them (megatron-core's interleaved schedule runs whole groups
    of ``--pipeline-model-parallel-size`` micro-batches)."""
    rows = pack_rows(lengths, seqlen)
    step = mbs * dp
    num_mb = -(-len(rows) // step)
    num_mb = -(-num_mb // mb_multiple) * mb_multiple
    rows = rows + [[] for _ in range(num_mb * step - len(rows))]
    return [rows[j * step + dp_rank * mbs: j * step + (dp_rank + 1) * mbs] for j in range(num_mb)]
