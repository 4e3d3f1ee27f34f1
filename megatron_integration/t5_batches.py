"""Fixed-shape micro-batches of the T5 baselines, and the tensors of T5 rows.

* ``padding``: one (input, target) pair a row, encoder rows padded to
  ``--encoder-seq-length`` and decoder rows to ``--decoder-seq-length``; micro-batch ``j``
  of replica ``r`` holds samples ``j*mbs*dp + r*mbs ...`` (Megatron's sampler order).
* ``packing``: pairs packed whole into rows holding at most ``--encoder-seq-length``
  input tokens and ``--decoder-seq-length`` target tokens (first-fit decreasing by input
  length); ``--micro-batch-size`` rows a micro-batch, rows dealt to replicas in Megatron's
  order, every replica running the same number of micro-batches (missing rows are padding).
  Packed samples are isolated: ``enc_mask`` / ``dec_mask`` hold each token's sample number,
  from which every stage builds block-diagonal masks and per-sample positions.

Row tensors are those :func:`dynapipe.data.collate.collate` makes for encoder-decoder
micro-batches (decoder input = the target shifted right behind ``eod_id``), so every method
trains on the same tokens; unpacked rows come from ``collate`` itself.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

from dynapipe.batching.baselines import pack_rows_2d
from dynapipe.batching.types import MicroBatch
from dynapipe.cost.model_flops import TokenWork, rows_work
from dynapipe.data.collate import TensorRequest, collate
from dynapipe.data.samples import Sample
from dynapipe.errors import DynaPipeError
from megatron_integration.batches import padding_assignment

ROW_TENSORS = (("tokens", "int64", "enc"), ("dec_tokens", "int64", "dec"), ("labels", "int64", "dec"),
               ("loss_mask", "float32", "dec"), ("enc_mask", "int32", "enc"), ("dec_mask", "int32", "dec"))


def pack_pairs(lengths: np.ndarray, enc_capacity: int, dec_capacity: int) -> list[list[int]]:
    """Rows of sample positions: first-fit decreasing by input length, a row holding at most
    ``enc_capacity`` input and ``dec_capacity`` target tokens; rows in order of their first sample."""
    inputs, targets = lengths[:, 0], lengths[:, 1]
    if int(inputs.max()) > enc_capacity or int(targets.max()) > dec_capacity:
        raise DynaPipeError(f"a pair of {int(inputs.max())} input / {int(targets.max())} target tokens does not fit "
                            f"rows of --encoder-seq-length {enc_capacity} / --decoder-seq-length {dec_capacity}.")
    rows = pack_rows_2d(inputs, targets, enc_capacity, dec_capacity)
    rows.sort(key=lambda r: r[0])
    return rows


def baseline_micro_batches(method: str, lengths: np.ndarray, enc_seq: int, dec_seq: int, mbs: int, dp: int,
                           dp_rank: int) -> tuple[list[MicroBatch], TokenWork]:
    """Replica ``dp_rank``'s fixed-shape micro-batches (``real_tokens``: input + target tokens;
    ``loss_tokens``: target tokens, what the loss counts) and what the global batch executes
    (every replica's rows at ``enc_seq`` / ``dec_seq``; ``total_tokens``: the padded tokens)."""
    lengths = np.asarray(lengths, dtype=np.int64).reshape(-1, 2)
    if method == "padding":
        groups = padding_assignment(len(lengths), mbs, dp, dp_rank)
        out = [MicroBatch(samples=g, seqlen=enc_seq, dec_seqlen=dec_seq, real_tokens=int(lengths[g].sum()),
                          loss_tokens=int(lengths[g, 1].sum()))
               for g in groups]
        return out, rows_work(len(lengths), enc_seq, dec_seq, encoder_decoder=True)
    if method == "packing":
        rows = pack_pairs(lengths, enc_seq, dec_seq)
        step = mbs * dp
        num_mb = -(-len(rows) // step)
        rows = rows + [[] for _ in range(num_mb * step - len(rows))]
        out = []
        for j in range(num_mb):
            group = rows[j * step + dp_rank * mbs: j * step + (dp_rank + 1) * mbs]
            samples = [i for r in group for i in r]
            out.append(MicroBatch(samples=samples, seqlen=enc_seq, dec_seqlen=dec_seq, rows=group,
                                  real_tokens=int(lengths[samples].sum()) if samples else 0,
                                  loss_tokens=int(lengths[samples, 1].sum()) if samples else 0))
        return out, rows_work(num_mb * step, enc_seq, dec_seq, encoder_decoder=True)
    raise DynaPipeError(f"not a T5 baseline: {method!r}; use padding or packing.")


def t5_row_tensors(rows: Sequence[Sequence[Sample]], seqlen: int, dec_seqlen: int, pad_id: int = 0,
                   eod_id: int = 1) -> dict[str, np.ndarray]:
    """Every T5 tensor (see :data:`ROW_TENSORS`) of rows of samples ``[rows, seqlen]`` /
    ``[rows, dec_seqlen]``; a row of several samples is packed, an empty row is padding."""
    shapes = {"enc": (len(rows), seqlen), "dec": (len(rows), dec_seqlen)}
    return collate(rows, [TensorRequest(n, shapes[side], d) for n, d, side in ROW_TENSORS], seqlen, dec_seqlen,
                   encoder_decoder=True, pad_id=pad_id, eod_id=eod_id)
