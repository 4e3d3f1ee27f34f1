"""Global batches: by sample count or by token budget, deterministic, resumable.

The sample stream is the dataset's epochs one after another, each epoch a permutation
seeded by ``(seed, epoch)`` (or the identity without shuffling). A stream position is
a count of consumed samples, exactly Megatron's ``consumed_samples``: global batches are
consecutive slices of the stream, so a job restarted with the ``consumed_samples`` of
its checkpoint continues the very same stream. Batches may span an epoch boundary.

- By sample count: every global batch holds ``global_batch_size`` samples.
- By token budget: a global batch takes samples while their tokens (input + target)
  stay within ``tokens_per_global_batch``; a sample larger than the budget goes alone;
  at least ``min_samples`` samples (the data-parallel size, so no replica is empty).
"""
from __future__ import annotations

from array import array

from dataclasses import dataclass
from typing import Iterator

import numpy as np

from dynapipe.errors import DynaPipeError, arg, check_fields, given


@dataclass(frozen=True)
class SamplerConfig:
    """How global batches are cut: exactly one of the two sizes is set (> 0)."""

    global_batch_size: int = 0
    tokens_per_global_batch: int = 0
    seed: int = 1234
    shuffle: bool = True
    min_samples: int = 1

    def validate(self) -> "SamplerConfig":
        check_fields(self, "SamplerConfig")
        if (self.global_batch_size > 0) == (self.tokens_per_global_batch > 0):
            raise DynaPipeError(
                f"set exactly one of {arg('global_batch_size')} ({self.global_batch_size}) and "
                f"{arg('tokens_per_global_batch')} ({self.tokens_per_global_batch}) to a positive number.")
        if self.min_samples < 1:
            raise DynaPipeError(f"min_samples {self.min_samples} must be at least 1.")
        if 0 < self.global_batch_size < self.min_samples:
            raise DynaPipeError(f"{given('global_batch_size', self.global_batch_size)} is smaller than the "
                                f"{self.min_samples} data-parallel replicas; every replica needs a sample.")
        return self


@dataclass(frozen=True)
class GlobalBatch:
    """One global batch: dataset indices in stream order, and the stream positions
    (consumed samples) before and after it."""

    indices: np.ndarray
    start: int
    end: int

    @property
    def consumed_samples(self) -> int:
        """Megatron's ``consumed_samples`` once this batch is trained."""
        return self.end


class GlobalBatchSampler:
    """Global batches of a dataset from ``consumed_samples`` on; batch ``k`` is the k-th
    of this run. Random access (:meth:`batch`) so planner workers can each take their own
    iterations: fixed-size batches by arithmetic, a token budget's found once and their
    boundaries kept in order."""

    def __init__(self, sample_tokens: np.ndarray, config: SamplerConfig, consumed_samples: int = 0):
        self.config = config.validate()
        self.tokens = np.asarray(sample_tokens, dtype=np.int64)
        self.num_samples = int(self.tokens.shape[0])
        if self.num_samples == 0:
            raise DynaPipeError("the dataset is empty; there is nothing to sample.")
        if consumed_samples < 0:
            raise DynaPipeError(f"consumed_samples {consumed_samples} must be >= 0.")
        budget, total = self.config.tokens_per_global_batch, int(self.tokens.sum())
        if budget > total:
            # Each batch would draw the data over and over (and be planned as one huge batch,
            # which takes the planner longer than any plan timeout).
            raise DynaPipeError(f"{given('tokens_per_global_batch', budget)}: more than the {total:,} tokens of the "
                                f"whole training data ({self.num_samples:,} samples), so one global batch would hold "
                                f"every sample several times; give at most {total} (Megatron's global batches are a "
                                f"small part of the data).")
        self._min_tokens = max(1, int(self.tokens.min()))
        self._start = int(consumed_samples)
        # Stream position of every batch boundary found so far, only where a token budget makes
        # batches of varying sizes (8 bytes an iteration); fixed batches are arithmetic.
        self._bounds = array("q", [self._start])
        self._perms: dict[int, np.ndarray] = {}

    def _perm(self, epoch: int) -> np.ndarray:
        p = self._perms.get(epoch)
        if p is None:
            if len(self._perms) >= 3:
                self._perms.pop(min(self._perms))
            if self.config.shuffle:
                p = np.random.default_rng([self.config.seed, epoch]).permutation(self.num_samples)
            else:
                p = np.arange(self.num_samples)
            self._perms[epoch] = p
        return p

    def indices(self, start: int, end: int) -> np.ndarray:
        """Dataset indices at stream positions ``[start, end)``."""
        n = self.num_samples
        parts = []
        pos = start
        while pos < end:
            epoch, off = divmod(pos, n)
            take = min(end - pos, n - off)
            parts.append(self._perm(epoch)[off:off + take])
            pos += take
        return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)

    def _next_end(self, start: int) -> int:
        cfg = self.config
        if cfg.global_batch_size:
            return start + cfg.global_batch_size
        budget = cfg.tokens_per_global_batch
        # Look ahead in chunks until the budget is exhausted (at most a few chunks).
        span = max(cfg.min_samples, budget // self._min_tokens + 1)
        span = min(span, 4 * self.num_samples)
        while True:
            cum = np.cumsum(self.tokens[self.indices(start, start + span)])
            fit = int(np.searchsorted(cum, budget, side="right"))
            if fit < span:
                return start + max(fit, cfg.min_samples, 1)
            span *= 2

    def batch(self, k: int) -> GlobalBatch:
        """The ``k``-th global batch of this run (``k >= 0``)."""
        if k < 0:
            raise IndexError(f"batch {k}: batches are numbered from 0")
        size = self.config.global_batch_size
        if size:
            start, end = self._start + k * size, self._start + (k + 1) * size
        else:
            while len(self._bounds) <= k + 1:
                self._bounds.append(self._next_end(self._bounds[-1]))
            start, end = self._bounds[k], self._bounds[k + 1]
        return GlobalBatch(self.indices(start, end), start, end)

    def __iter__(self) -> Iterator[GlobalBatch]:
        k = 0
        while True:
            yield self.batch(k)
            k += 1
