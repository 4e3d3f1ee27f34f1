"""Micro-batch tensors (numpy) for the tensors an execution plan's ``LoadInput`` names.

The plan decides which tensors a stage loads and their exact shapes and dtypes; this
module fills them from the samples. Tensors are batch-first ``[mbs, seqlen]`` as in
Megatron (a ``[seqlen, mbs]`` spec gets the transpose). Known names:

Decoder-only (a row is a sample, or several samples for packing):
  ``tokens``        input ids, ``pad_id`` after the sample
  ``position_ids``  0, 1, ... restarting at every sample of a packed row; 0 on padding
  ``labels``        the next token (``labels[j] = tokens[j + 1]`` within a sample); pad elsewhere
  ``loss_mask``     1 where the label is a target token, 0 on inputs, the last token of a
                    sample, and padding
  ``segment_ids``   1-based index of the sample within its row, 0 on padding
Encoder-decoder (``seqlen`` encoder tokens, ``dec_seqlen`` decoder tokens; a row is an
(input, target) pair, or several for packing: inputs packed into the encoder row, targets
into the decoder row, in the same order):
  ``tokens`` / ``enc_tokens``, ``position_ids`` / ``enc_position_ids`` (restarting at every
  sample), ``enc_mask`` (the 1-based sample number within the row on real tokens, 0 on padding)
  ``dec_tokens`` (each target shifted right behind ``eod_id`` as start token),
  ``dec_position_ids``, ``dec_mask`` (as ``enc_mask``), ``labels`` (the target), ``loss_mask``
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Sequence

import numpy as np

from dynapipe.data.samples import Sample
from dynapipe.errors import DynaPipeError

NUMPY_DTYPES = {"int64": np.int64, "int32": np.int32, "float32": np.float32, "float16": np.float16,
                "bool": np.bool_, "uint8": np.uint8}
DECODER_TENSORS = ("tokens", "position_ids", "labels", "loss_mask", "segment_ids")
ENC_DEC_TENSORS = ("tokens", "position_ids", "enc_tokens", "enc_position_ids", "enc_mask", "dec_tokens", "dec_position_ids",
                   "dec_mask", "labels", "loss_mask")


@dataclass(frozen=True)
class TensorRequest:
    """A tensor to fill: name, shape and dtype name (what a plan's ``TensorSpec`` says)."""

    name: str
    shape: tuple[int, ...]
    dtype: str


def loss_token_counts(input_lengths: np.ndarray, target_lengths: np.ndarray, encoder_decoder: bool) -> np.ndarray:
    """Per sample, the tokens the loss counts (the sum of its ``loss_mask``), from its
    input and target lengths (tokens); the data need not be read."""
    tgt = np.asarray(target_lengths, dtype=np.int64)
    if encoder_decoder:
        return tgt
    # Decoder-only: positions whose label (the next token) is a target token.
    return np.where(np.asarray(input_lengths) > 0, tgt, tgt - 1)


def loss_tokens(sample: Sample, encoder_decoder: bool) -> int:
    """Tokens of ``sample`` the loss counts (the sum of its ``loss_mask``)."""
    return int(loss_token_counts(np.array([sample.input_ids.shape[0]]), np.array([sample.target_ids.shape[0]]),
                                 encoder_decoder)[0])


def _decoder_rows(rows: Sequence[Sequence[Sample]], seqlen: int, pad_id: int,
                  names: set) -> dict[str, np.ndarray]:
    """The decoder-only tensors in ``names`` (only those: the first and the last stage
    want different ones)."""
    mbs = len(rows)
    out = {}
    if "tokens" in names:
        out["tokens"] = np.full((mbs, seqlen), pad_id, dtype=np.int64)
    if "position_ids" in names:
        out["position_ids"] = np.zeros((mbs, seqlen), dtype=np.int64)
    if "labels" in names:
        out["labels"] = np.full((mbs, seqlen), pad_id, dtype=np.int64)
    if "loss_mask" in names:
        out["loss_mask"] = np.zeros((mbs, seqlen), dtype=np.float32)
    if "segment_ids" in names:
        out["segment_ids"] = np.zeros((mbs, seqlen), dtype=np.int32)
    tokens, positions, labels = out.get("tokens"), out.get("position_ids"), out.get("labels")
    loss_mask, segments = out.get("loss_mask"), out.get("segment_ids")
    ramp = np.arange(seqlen, dtype=np.int64)
    for r, row in enumerate(rows):
        pos = 0
        for k, s in enumerate(row):
            n_in, n_tg = s.input_ids.shape[0], s.target_ids.shape[0]
            n = n_in + n_tg
            if pos + n > seqlen:
                raise DynaPipeError(f"micro-batch row {r} needs {pos + n} tokens but the plan pads it to "
                                    f"{seqlen}; the plan and the data disagree on sample lengths.")
            if tokens is not None:
                tokens[r, pos:pos + n_in] = s.input_ids
                tokens[r, pos + n_in:pos + n] = s.target_ids
            if labels is not None:  # labels[j] = token j + 1, within the sample
                if n_in:
                    labels[r, pos:pos + n_in - 1] = s.input_ids[1:]
                    labels[r, pos + n_in - 1] = s.target_ids[0]
                labels[r, pos + n_in:pos + n - 1] = s.target_ids[1:]
            if positions is not None:
                positions[r, pos:pos + n] = ramp[:n]
            if loss_mask is not None:
                loss_mask[r, pos + max(n_in - 1, 0):pos + n - 1] = 1.0
            if segments is not None:
                segments[r, pos:pos + n] = k + 1
            pos += n
    return out


def _enc_dec_rows(rows: Sequence[Sequence[Sample]], seqlen: int, dec_seqlen: int, pad_id: int,
                  start_id: int) -> dict[str, np.ndarray]:
    mbs = len(rows)
    out = {
        "enc_tokens": np.full((mbs, seqlen), pad_id, dtype=np.int64),
        "enc_position_ids": np.zeros((mbs, seqlen), dtype=np.int64),
        "enc_mask": np.zeros((mbs, seqlen), dtype=np.int64),
        "dec_tokens": np.full((mbs, dec_seqlen), pad_id, dtype=np.int64),
        "dec_position_ids": np.zeros((mbs, dec_seqlen), dtype=np.int64),
        "dec_mask": np.zeros((mbs, dec_seqlen), dtype=np.int64),
        "labels": np.full((mbs, dec_seqlen), pad_id, dtype=np.int64),
        "loss_mask": np.zeros((mbs, dec_seqlen), dtype=np.float32),
    }
    for r, row in enumerate(rows):
        ni, nt = (sum(s.input_ids.shape[0] for s in row), sum(s.target_ids.shape[0] for s in row))
        if ni > seqlen or nt > dec_seqlen:
            raise DynaPipeError(f"micro-batch row {r} has {ni}/{nt} encoder/decoder tokens but the plan "
                                f"pads to {seqlen}/{dec_seqlen}; the plan and the data disagree on lengths.")
        e = d = 0
        for k, s in enumerate(row):
            ni, nt = s.input_ids.shape[0], s.target_ids.shape[0]
            out["enc_tokens"][r, e:e + ni] = s.input_ids
            out["enc_position_ids"][r, e:e + ni] = np.arange(ni)
            out["enc_mask"][r, e:e + ni] = k + 1
            out["dec_tokens"][r, d] = start_id
            out["dec_tokens"][r, d + 1:d + nt] = s.target_ids[:-1]
            out["dec_position_ids"][r, d:d + nt] = np.arange(nt)
            out["dec_mask"][r, d:d + nt] = k + 1
            out["labels"][r, d:d + nt] = s.target_ids
            out["loss_mask"][r, d:d + nt] = 1.0
            e, d = e + ni, d + nt
    out["tokens"], out["position_ids"] = out["enc_tokens"], out["enc_position_ids"]
    return out


def collate(rows: Sequence[Sequence[Sample]], requests: Iterable[TensorRequest], seqlen: int,
            dec_seqlen: int = 0, encoder_decoder: bool = False, pad_id: int = 0,
            eod_id: int = 1) -> dict[str, np.ndarray]:
    """Fill the requested tensors of one micro-batch.

    ``rows[r]`` lists the samples of row ``r`` (one sample per row unless packed; an empty
    row is padding).
    Every request must name a known tensor and have shape ``[mbs, seqlen]`` (or the
    transpose; ``dec_seqlen`` for decoder-side tensors); dtypes are cast as requested.
    """
    requests = list(requests)
    if not requests:
        return {}
    if encoder_decoder:
        full = _enc_dec_rows(rows, seqlen, dec_seqlen, pad_id, eod_id)
        known = ENC_DEC_TENSORS
    else:
        full = _decoder_rows(rows, seqlen, pad_id, {r.name for r in requests})
        known = DECODER_TENSORS
    out = {}
    for req in requests:
        if req.name not in known:
            raise DynaPipeError(f"the plan asks to load tensor {req.name!r}, which the data loader does not "
                                f"know for {'encoder-decoder' if encoder_decoder else 'decoder-only'} models; "
                                f"known tensors: {list(known)}.")
        if req.dtype not in NUMPY_DTYPES:
            raise DynaPipeError(f"tensor {req.name!r}: dtype {req.dtype!r} cannot hold data; use one of "
                                f"{sorted(NUMPY_DTYPES)}.")
        arr = full[req.name]
        shape = tuple(req.shape)
        if shape == arr.shape[::-1] and arr.shape[0] != arr.shape[1]:
            arr = arr.T
        elif shape != arr.shape:
            raise DynaPipeError(f"tensor {req.name!r}: the plan asks for shape {list(shape)} but the micro-batch "
                                f"is {list(arr.shape)} ([mbs, seqlen]); the plan and the data disagree.")
        out[req.name] = np.ascontiguousarray(arr, dtype=NUMPY_DTYPES[req.dtype])
    return out
