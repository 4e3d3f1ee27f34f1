"""Pretraining documents longer than ``--seq-length``, split into pieces that keep every token.

Megatron-LM's ``GPTDataset`` concatenates documents and cuts the stream into windows of
``seq_length + 1`` tokens that overlap by one token, so every next-token prediction of the
corpus is trained and none is lost at a window edge. DynaPipe does not concatenate (short
documents stay whole and are batched by length), but a document longer than
``seq_length`` tokens must still fit a sample. It is cut into pieces of at most
``seq_length`` tokens that overlap by one token: piece ``k`` starts at token
``k x (seq_length - 1)``. A piece of ``n`` tokens trains its ``n - 1`` next-token
predictions, so the pieces of a document train exactly the predictions of the whole
document, each once; the document's tokens are all in some piece, and the pieces of a
document hold ``pieces - 1`` more tokens than the document (the shared edge tokens).

Pure numpy: lengths in, piece arrays out; no token is read.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from dynapipe.errors import DynaPipeError, given


@dataclass(frozen=True)
class Pieces:
    """Samples cut from documents: sample ``i`` is tokens ``[offset[i], offset[i] + length[i])``
    of document ``document[i]`` (int64 arrays, one entry per sample, in document order)."""

    document: np.ndarray
    offset: np.ndarray
    length: np.ndarray

    def __len__(self) -> int:
        return int(self.document.shape[0])


def pieces_per_document(lengths: np.ndarray, seq_length: int) -> np.ndarray:
    """Pieces each document of ``lengths`` tokens is cut into at ``seq_length`` tokens
    (1 for a document that fits; ``ceil((L - 1) / (seq_length - 1))`` for a longer one)."""
    if seq_length < 2:
        raise DynaPipeError(f"{given('seq_length', seq_length)}: splitting documents needs at least 2 tokens a sample.")
    lengths = np.asarray(lengths, dtype=np.int64)
    if np.any(lengths < 1):
        raise DynaPipeError("a document has no tokens; every document needs at least one.")
    long_ = lengths > seq_length
    out = np.ones(lengths.shape[0], dtype=np.int64)
    out[long_] = -(-(lengths[long_] - 1) // (seq_length - 1))
    return out


def split_documents(lengths: np.ndarray, seq_length: int) -> Pieces:
    """Cut documents of ``lengths`` tokens into pieces of at most ``seq_length`` tokens
    overlapping by one token (see the module docstring); documents that fit stay whole."""
    lengths = np.asarray(lengths, dtype=np.int64)
    counts = pieces_per_document(lengths, seq_length)
    document = np.repeat(np.arange(lengths.shape[0], dtype=np.int64), counts)
    # Rank of each piece within its document: 0, 1, ... restarting at every document.
    first = np.cumsum(counts) - counts
    rank = np.arange(document.shape[0], dtype=np.int64) - np.repeat(first, counts)
    offset = rank * (seq_length - 1)
    length = np.minimum(seq_length, lengths[document] - offset)
    return Pieces(document, offset, length)


__all__ = ["Pieces", "pieces_per_document", "split_documents"]
