"""The synthetic multi-task mixture as a dataset: lengths and token ids, both seeded.

Lengths are drawn once for the whole dataset by :func:`dynapipe.data.synthetic.sample_mixture`
(already within ``seq_length``). Token ids are a counter-based hash (SplitMix64's
finaliser) of ``(seed, sample index, position)``: any sample reads the same ids in any
process, in any order, after any restart, and a sample costs a few vectorised numpy
operations instead of seeding a generator.
"""
from __future__ import annotations

from typing import Optional

import numpy as np

from dynapipe.data.samples import LengthLimits, SampleDataset, clip_lengths
from dynapipe.data.synthetic import Mixture, load_mixture, sample_mixture
from dynapipe.errors import DynaPipeError, given

# Ids below this are special (pad 0, eod 1); synthetic tokens never use them.
FIRST_TOKEN_ID = 2
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_MIX1 = np.uint64(0xBF58476D1CE4E5B9)
_MIX2 = np.uint64(0x94D049BB133111EB)


def hashed_token_ids(seed: int, index: int, n: int, vocab_size: int) -> np.ndarray:
    """``n`` pseudo-random ids in ``[FIRST_TOKEN_ID, vocab_size)`` for sample ``index`` (int64)."""
    base = np.uint64((seed * 0x100000001B3 + index * 0xC2B2AE3D27D4EB4F + 1) & 0xFFFFFFFFFFFFFFFF)
    x = (np.arange(1, n + 1, dtype=np.uint64) * _GOLDEN) ^ base  # wraps modulo 2**64 by design
    x ^= x >> np.uint64(30)
    x *= _MIX1
    x ^= x >> np.uint64(27)
    x *= _MIX2
    x ^= x >> np.uint64(31)
    return (x % np.uint64(vocab_size - FIRST_TOKEN_ID)).astype(np.int64) + FIRST_TOKEN_ID


class MixtureDataset(SampleDataset):
    """``num_samples`` samples of the mixture (``configs/data/flan-mixture.yaml`` by default)."""

    def __init__(self, num_samples: int, seed: int, limits: LengthLimits, vocab_size: int,
                 encoder_decoder: bool = False, mixture: Optional[Mixture] = None):
        if vocab_size <= FIRST_TOKEN_ID:
            raise DynaPipeError(f"vocab_size {vocab_size} is too small for synthetic tokens; use at least 3.")
        self.encoder_decoder = encoder_decoder
        self.seed = int(seed)
        self.vocab_size = int(vocab_size)
        self.pad_id, self.eod_id = 0, 1
        mix = sample_mixture(mixture or load_mixture(), num_samples, seed, limits.seq_length, encoder_decoder,
                             limits.dec_seq_length)
        self.tasks = mix.task_ids
        self.input_lengths, self.target_lengths, self.truncated = clip_lengths(
            mix.input_lengths, mix.target_lengths, limits, encoder_decoder, "synthetic mixture")

    def _check_token_ids(self, vocab_size: int) -> None:
        # Ids are drawn in [FIRST_TOKEN_ID, self.vocab_size) by construction.
        if self.vocab_size > vocab_size:
            raise DynaPipeError(f"the synthetic mixture draws token ids below {self.vocab_size}, more than "
                                f"{given('vocab_size', vocab_size)}; build it with the model's vocabulary size.")

    def _read(self, idx: int, input_len: int, target_len: int):
        ids = hashed_token_ids(self.seed, idx, input_len + target_len, self.vocab_size)
        return ids[:input_len], ids[input_len:], int(self.tasks[idx])
