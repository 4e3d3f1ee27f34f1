"""Samples, length limits and the interface every dataset implements.

A sample is an input and a target token sequence (a Megatron ``{"text": ...}`` document
has an empty input: the whole sequence is target). Decoder-only models read input and
target concatenated; encoder-decoder models read the input in the encoder and the target
in the decoder.

Lengths are known without reading tokens (the planner and the token-budget sampler need
them for millions of samples), so every dataset keeps two length arrays and reads token
ids only for the samples of a planned global batch. Over-long samples are truncated here,
once, so lengths and tokens always agree; or rejected before training starts.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Callable, Sequence, Union

import numpy as np

from dynapipe.errors import DynaPipeError, arg, given

OVERLONG_POLICIES = ("truncate", "reject")


@dataclass(frozen=True)
class Sample:
    """Token ids (int64) of one sample and its task id."""

    input_ids: np.ndarray
    target_ids: np.ndarray
    task: int = 0


@dataclass(frozen=True)
class LengthLimits:
    """Longest sample accepted, in tokens, and what happens to longer ones.

    ``seq_length`` bounds input + target for decoder-only models and the input (encoder
    side) for encoder-decoder models; ``dec_seq_length`` bounds the target of an
    encoder-decoder sample (0 means ``seq_length``). ``overlong`` is ``truncate`` (cut,
    counted per global batch) or ``reject`` (a clear error before training starts).
    """

    seq_length: int
    dec_seq_length: int = 0
    overlong: str = "truncate"

    def validate(self) -> "LengthLimits":
        if self.seq_length < 2:
            raise DynaPipeError(f"{given('seq_length', self.seq_length)}: must be at least 2 tokens.")
        if self.dec_seq_length < 0:
            raise DynaPipeError(f"decoder sequence length {self.dec_seq_length} must be >= 0.")
        if self.overlong not in OVERLONG_POLICIES:
            raise DynaPipeError(
                f"over-long sample policy {self.overlong!r} is not known; use one of {list(OVERLONG_POLICIES)}.")
        return self


def clip_lengths(raw_input: np.ndarray, raw_target: np.ndarray, limits: LengthLimits,
                 encoder_decoder: bool,
                 source: Union[str, Callable[[int], str]],
                 documents: bool = False) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Clip raw (input, target) lengths to ``limits``; returns (input, target, truncated mask).

    Decoder-only: the target is kept whole when it fits and the input's tail is cut
    first (an instruction sample without its answer teaches nothing); a target longer
    than ``seq_length`` keeps its head. Encoder-decoder: each side is cut at its own
    limit. With ``overlong="reject"`` the first over-long sample raises, naming it: ``source(i)``
    says where sample ``i`` is stored (``file:line``), or ``source`` names the data and the
    sample its index. ``documents``: samples without an input are pretraining documents, which
    ``overlong="truncate"`` would cut into pieces (the caller's data does that), named so.
    """
    limits.validate()
    raw_input = np.asarray(raw_input, dtype=np.int64)
    raw_target = np.asarray(raw_target, dtype=np.int64)
    if encoder_decoder:
        dec_limit = limits.dec_seq_length or limits.seq_length
        inp = np.minimum(raw_input, limits.seq_length)
        tgt = np.minimum(raw_target, dec_limit)
    else:
        tgt = np.minimum(raw_target, limits.seq_length)
        inp = np.minimum(raw_input, limits.seq_length - tgt)
    truncated = (inp != raw_input) | (tgt != raw_target)
    if limits.overlong == "reject" and truncated.any():
        i = int(np.flatnonzero(truncated)[0])
        if encoder_decoder:
            what = (f"input {raw_input[i]} / target {raw_target[i]} tokens, limits "
                    f"{limits.seq_length} / {limits.dec_seq_length or limits.seq_length}")
        else:
            what = (f"{raw_input[i] + raw_target[i]} tokens (input {raw_input[i]} + target "
                    f"{raw_target[i]}), more than {given('seq_length', limits.seq_length)}")
        raise_flags = f"{arg('seq_length')} / {arg('dec_seq_length')}" if encoder_decoder else arg("seq_length")
        where = source(i) if callable(source) else f"{source}: sample {i}"
        if documents and not encoder_decoder and raw_input[i] == 0:
            # A pretraining document has no input or target, and the default does not truncate it:
            # it cuts it into pieces that keep every next-token prediction.
            raise DynaPipeError(
                f"{where} is a document of {raw_target[i]} tokens, more than {given('seq_length', limits.seq_length)} "
                f"({int(truncated.sum())} over-long sample(s) in all). Raise {arg('seq_length')}, filter the data, "
                f"or let long documents be cut into {arg('seq_length')} pieces as Megatron's GPTDataset does "
                f"({given('overlong', 'truncate')}, the default).")
        raise DynaPipeError(
            f"{where} has {what} ({int(truncated.sum())} over-long sample(s) in all). "
            f"Raise {raise_flags}, filter the data, or truncate over-long samples "
            f"({given('overlong', 'truncate')}, the default).")
    return inp, tgt, truncated


class SampleDataset(ABC):
    """A dataset of samples whose lengths are known up front.

    Subclasses set ``encoder_decoder`` and the clipped length arrays ``input_lengths``,
    ``target_lengths`` (int64 tokens) and the boolean ``truncated`` mask, and implement
    :meth:`_read` (token ids of sample ``idx`` clipped to the given lengths). Instances
    must pickle cheaply: planner worker processes receive them at start-up.
    """

    encoder_decoder: bool = False
    input_lengths: np.ndarray
    target_lengths: np.ndarray
    truncated: np.ndarray
    pad_id: int = 0
    eod_id: int = 1
    vocab_size: int = 0

    def __len__(self) -> int:
        return int(self.input_lengths.shape[0])

    def validate_tokens(self, vocab_size: int) -> None:
        """Check that every token id of the dataset lies in ``[0, vocab_size)``.

        Vectorised over the whole dataset and done once per dataset and vocabulary size
        (the result is kept, and travels with the dataset into planner workers), so every
        batching path trains only on ids the embedding has. Raises :class:`DynaPipeError`
        naming the file and the document.
        """
        if vocab_size <= 0:
            raise DynaPipeError(f"{given('vocab_size', vocab_size)}: must be positive.")
        if getattr(self, "_tokens_valid_below", None) == vocab_size:
            return
        self._check_token_ids(int(vocab_size))
        self._tokens_valid_below = int(vocab_size)

    def _check_token_ids(self, vocab_size: int) -> None:
        """Raise :class:`DynaPipeError` for the first id outside ``[0, vocab_size)``.

        The default reads every sample; datasets holding their tokens in arrays override
        it with a vectorised check.
        """
        for idx in range(len(self)):
            s = self[idx]
            for part in (s.input_ids, s.target_ids):
                bad = np.flatnonzero((part < 0) | (part >= vocab_size))
                if len(bad):
                    raise DynaPipeError(f"sample {idx}: token id {int(part[bad[0]])} is outside the vocabulary "
                                        f"[0, {vocab_size}); raise {arg('vocab_size')} or fix the data.")

    @property
    def num_truncated(self) -> int:
        """Samples of the whole dataset that were truncated to the length limits."""
        return int(self.truncated.sum())

    def sample_tokens(self) -> np.ndarray:
        """Tokens of every sample (input + target), int64: what a token budget counts."""
        return self.input_lengths + self.target_lengths

    def loss_tokens(self, indices: Sequence[int]) -> int:
        """Tokens the loss counts (the sum of every ``loss_mask``) over the samples at
        ``indices``, from their lengths alone (nothing is read)."""
        from dynapipe.data.collate import loss_token_counts

        idx = np.asarray(indices, dtype=np.int64)
        return int(loss_token_counts(self.input_lengths[idx], self.target_lengths[idx], self.encoder_decoder).sum())

    def planner_lengths(self, indices: Sequence[int]) -> np.ndarray:
        """Lengths the planner takes for these samples: shape ``(n,)`` (input + target,
        decoder-only) or ``(n, 2)`` (input, target; encoder-decoder), in tokens."""
        idx = np.asarray(indices, dtype=np.int64)
        if self.encoder_decoder:
            return np.stack([self.input_lengths[idx], self.target_lengths[idx]], axis=1)
        return self.input_lengths[idx] + self.target_lengths[idx]

    def __getitem__(self, idx: int) -> Sample:
        idx = int(idx)
        if not 0 <= idx < len(self):
            raise IndexError(f"sample {idx} is outside the dataset of {len(self)} samples")
        inp, tgt, task = self._read(idx, int(self.input_lengths[idx]), int(self.target_lengths[idx]))
        if inp.shape[0] != self.input_lengths[idx] or tgt.shape[0] != self.target_lengths[idx]:
            raise DynaPipeError(
                f"sample {idx}: read {inp.shape[0]}+{tgt.shape[0]} tokens but the index says "
                f"{self.input_lengths[idx]}+{self.target_lengths[idx]}; the data files disagree with their index.")
        return Sample(inp.astype(np.int64, copy=False), tgt.astype(np.int64, copy=False), task)

    @abstractmethod
    def _read(self, idx: int, input_len: int, target_len: int) -> tuple[np.ndarray, np.ndarray, int]:
        """Token ids of sample ``idx`` cut to ``input_len`` / ``target_len`` and its task id."""
