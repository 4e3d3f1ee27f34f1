"""Weighted blends of datasets, as Megatron-LM's ``--data-path W1 P1 W2 P2 ...`` mixes them.

Megatron-core's ``BlendedDataset`` blends fixed-length ``MegatronDataset`` samples; here a
sample is a whole document of its own length, so the blend is built over
:class:`~dynapipe.data.samples.SampleDataset` s instead, with the same contract:

* **Shares of tokens.** Every Megatron sample is ``--seq-length`` tokens, so there a weight is
  a dataset's share of the samples and of the tokens alike. Here samples differ in length, and
  the weight keeps its meaning in tokens: dataset ``i`` supplies ``weight_i / sum(weights)`` of
  the blend's tokens (in expectation over its samples), so a blend tuned for Megatron-LM trains
  on the same mixture. Its share of the samples is ``weight_i / mean_tokens_i``, normalised,
  rounded by largest remainder.
* **Sized by the run.** The blend holds as many samples as the run trains on (Megatron sizes
  its blend from the training samples the same way), at least as many as its parts together,
  so over a long run a dataset is drawn in passes through all of it, each pass a fresh seeded
  order, however small its weight: never the same subset epoch after epoch. A run longer
  than one whole pass of every dataset gets a blend of that pass, repeated: every epoch of it
  holds every document.
* **Interleaved evenly**, so any window of the blend holds the datasets in proportion.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

from dynapipe.data.samples import SampleDataset
from dynapipe.errors import DynaPipeError


def blend_counts(weights: Sequence[float], total: int) -> np.ndarray:
    """Samples of each dataset in a blend of ``total`` samples: ``total x weight / sum``
    rounded by largest remainder (the counts add up to ``total`` exactly)."""
    w = np.asarray(weights, dtype=np.float64)
    if w.ndim != 1 or len(w) == 0 or not np.all(np.isfinite(w)) or np.any(w <= 0):
        raise DynaPipeError(f"blend weights {list(weights)}: every weight must be a positive number.")
    exact = w / w.sum() * total
    counts = np.floor(exact).astype(np.int64)
    short = total - int(counts.sum())
    # Ties go to the earlier dataset (stable order), so the result is deterministic.
    counts[np.argsort(-(exact - counts), kind="stable")[:short]] += 1
    return counts


def token_share_weights(weights: Sequence[float], mean_tokens: Sequence[float]) -> np.ndarray:
    """Sample-share weights that give the datasets ``weights`` shares of the tokens: each weight
    over its dataset's mean sample length (``mean_tokens``, tokens a sample)."""
    w, mean = np.asarray(weights, dtype=np.float64), np.asarray(mean_tokens, dtype=np.float64)
    if mean.shape != w.shape or not np.all(mean > 0):
        raise DynaPipeError(f"blend: mean sample lengths {list(mean_tokens)} for weights {list(weights)}; give "
                            f"one positive mean (tokens) per weighted dataset.")
    return w / mean


def blend_indices(sizes: Sequence[int], weights: Sequence[float], total: int,
                  seed: int) -> tuple[np.ndarray, np.ndarray]:
    """``(dataset, sample)`` index arrays (int64, length ``total``) of a blend of datasets of
    ``sizes`` samples at ``weights``; see the module docstring."""
    counts = blend_counts(weights, total)
    rng = np.random.default_rng(seed)
    datasets, samples, positions = [], [], []
    for i, (size, count) in enumerate(zip(sizes, counts)):
        if size <= 0:
            raise DynaPipeError(f"blend dataset {i} holds no samples; drop it from the blend.")
        passes = -(-int(count) // int(size))
        order = np.concatenate([rng.permutation(size) for _ in range(passes)]) if passes else np.zeros(0, np.int64)
        samples.append(order[:count].astype(np.int64))
        datasets.append(np.full(count, i, dtype=np.int64))
        # The k-th sample of dataset i sits at (k + 0.5) / count of the blend: evenly spread.
        positions.append((np.arange(count) + 0.5) / max(int(count), 1))
    order = np.argsort(np.concatenate(positions), kind="stable")
    return np.concatenate(datasets)[order], np.concatenate(samples)[order]


class BlendedSampleDataset(SampleDataset):
    """Samples of ``parts`` blended at ``weights`` (see the module docstring). A sample's task
    id is the index of the part it comes from."""

    def __init__(self, parts: Sequence[SampleDataset], weights: Sequence[float], seed: int,
                 num_samples: int = 0, num_tokens: int = 0):
        """``weights``: shares of the tokens. The blend holds the samples the run draws from it:
        ``num_samples``, or enough for ``num_tokens`` (tokens, for token-budget batches), or
        its parts' total where that is larger."""
        if len(parts) != len(weights):
            raise DynaPipeError(f"{len(parts)} datasets but {len(weights)} blend weights; give one weight each.")
        if len({p.encoder_decoder for p in parts}) != 1:
            raise DynaPipeError("a blend mixes encoder-decoder and decoder-only datasets; blend one kind.")
        self.parts = list(parts)
        self.weights = tuple(float(w) for w in weights)
        first = self.parts[0]
        self.encoder_decoder = first.encoder_decoder
        self.pad_id, self.eod_id = first.pad_id, first.eod_id
        self.vocab_size = max(int(getattr(p, "vocab_size", 0) or 0) for p in self.parts)
        means = np.array([float(p.sample_tokens().mean()) for p in self.parts])
        by_samples = token_share_weights(self.weights, means)
        mean_sample = float((by_samples / by_samples.sum() * means).sum())  # tokens a blended sample
        sizes = np.array([len(p) for p in self.parts], dtype=np.float64)
        run = max(int(num_samples), int(np.ceil(num_tokens / mean_sample)))
        # No larger than the run needs, nor than a blend in which every path gets one whole pass
        # (later epochs of it then hold every document again): the index arrays stay small.
        whole_pass = int(np.ceil((sizes / (by_samples / by_samples.sum())).max()))
        total = max(int(sizes.sum()), min(run, whole_pass))
        self.part_ids, self.part_samples = blend_indices(sizes.astype(np.int64), by_samples, total, seed)
        self.tasks = self.part_ids
        self.input_lengths = np.empty(total, dtype=np.int64)
        self.target_lengths = np.empty(total, dtype=np.int64)
        self.truncated = np.empty(total, dtype=bool)
        for i, part in enumerate(self.parts):
            mine = self.part_ids == i
            local = self.part_samples[mine]
            self.input_lengths[mine] = part.input_lengths[local]
            self.target_lengths[mine] = part.target_lengths[local]
            self.truncated[mine] = part.truncated[local]

    def _check_token_ids(self, vocab_size: int) -> None:
        from dynapipe.data.indexed import TokenOutOfVocabulary

        for part in self.parts:
            try:
                part.validate_tokens(vocab_size)
            except TokenOutOfVocabulary as e:
                # The size to suggest holds every path's ids, not just the failing one's: each
                # retry would otherwise meet the next path's.
                largest = max([e.largest] + [p.largest_token_id() for p in self.parts
                                             if hasattr(p, "largest_token_id")])
                raise TokenOutOfVocabulary(e.where, vocab_size, largest) from None

    def _read(self, idx: int, input_len: int, target_len: int):
        part = int(self.part_ids[idx])
        inp, tgt, _ = self.parts[part]._read(int(self.part_samples[idx]), input_len, target_len)
        return inp, tgt, part
