"""A seeded FLAN-like multi-task mixture: lengths for the planner, token ids for training.

Each task draws input and target lengths from log-normal distributions (median in
tokens, sigma the shape) and has a sampling weight; ``configs/data/flan-mixture.yaml``
is the default. Lengths are clipped at ``seq_length`` (decoder-only: input + target;
encoder-decoder: each side) and are at least one token.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Optional

import numpy as np
import yaml

from dynapipe.config import CONFIG_DIR
from dynapipe.errors import DynaPipeError

DEFAULT_MIXTURE = os.path.join(CONFIG_DIR, "data", "flan-mixture.yaml")


@dataclass(frozen=True)
class TaskSpec:
    """One task of the mixture: weight and log-normal length parameters (tokens)."""

    name: str
    weight: float
    median_input: float
    sigma_input: float
    median_target: float
    sigma_target: float


@dataclass(frozen=True)
class Mixture:
    tasks: tuple[TaskSpec, ...]

    @property
    def weights(self) -> np.ndarray:
        w = np.array([t.weight for t in self.tasks], dtype=np.float64)
        return w / w.sum()


# Lengths of more samples than this do not fit a reasonable amount of memory at once.
MAX_SAMPLES = 100_000_000


def load_mixture(path: Optional[str] = None) -> Mixture:
    """Read a mixture YAML file (default: ``configs/data/flan-mixture.yaml``)."""
    from dynapipe.config import read_yaml

    path = path or DEFAULT_MIXTURE
    if not os.path.exists(path):
        raise DynaPipeError(f"mixture file {path!r} does not exist.")
    data = read_yaml(path)
    tasks = data.get("tasks")
    if not isinstance(tasks, list) or not tasks:
        raise DynaPipeError(f"{path}: a mixture needs a non-empty 'tasks' list.")
    specs = []
    for i, t in enumerate(tasks):
        if not isinstance(t, dict):
            raise DynaPipeError(f"{path}: task {i} must be a mapping of {list(TaskSpec.__dataclass_fields__)}.")
        try:
            spec = TaskSpec(**t)
        except TypeError as e:
            raise DynaPipeError(f"{path}: task {i}: {e}") from None
        for key in ("weight", "median_input", "sigma_input", "median_target", "sigma_target"):
            value = getattr(spec, key)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise DynaPipeError(f"{path}: task {i}: {key}={value!r} must be a finite number.")
        if spec.weight <= 0 or spec.median_input <= 0 or spec.median_target <= 0:
            raise DynaPipeError(f"{path}: task {spec.name!r}: weight and medians must be > 0.")
        if spec.sigma_input < 0 or spec.sigma_target < 0:
            raise DynaPipeError(f"{path}: task {spec.name!r}: sigmas must be >= 0.")
        specs.append(spec)
    return Mixture(tuple(specs))


@dataclass(frozen=True)
class MixtureSample:
    """Lengths (tokens) and task ids of a batch of synthetic samples."""

    input_lengths: np.ndarray
    target_lengths: np.ndarray
    task_ids: np.ndarray


def sample_mixture(mixture: Mixture, n: int, seed: int, seq_length: int,
                   encoder_decoder: bool = False) -> MixtureSample:
    """Draw ``n`` samples. Decoder-only: input + target together fit in ``seq_length``."""
    if n <= 0:
        raise DynaPipeError(f"--samples {n}: the number of samples must be positive.")
    if n > MAX_SAMPLES:
        raise DynaPipeError(f"--samples {n}: at most {MAX_SAMPLES:,} samples can be drawn at once.")
    if seed < 0:
        raise DynaPipeError(f"--seed {seed}: the seed must be a non-negative integer.")
    if seq_length < 2:
        raise DynaPipeError(f"--seq-length {seq_length}: must be at least 2 tokens.")
    rng = np.random.default_rng(seed)
    tasks = rng.choice(len(mixture.tasks), size=n, p=mixture.weights)
    med_in = np.array([t.median_input for t in mixture.tasks])[tasks]
    sig_in = np.array([t.sigma_input for t in mixture.tasks])[tasks]
    med_tg = np.array([t.median_target for t in mixture.tasks])[tasks]
    sig_tg = np.array([t.sigma_target for t in mixture.tasks])[tasks]
    inp = np.maximum(1, np.rint(med_in * np.exp(sig_in * rng.standard_normal(n)))).astype(np.int64)
    tgt = np.maximum(1, np.rint(med_tg * np.exp(sig_tg * rng.standard_normal(n)))).astype(np.int64)
    if encoder_decoder:
        inp, tgt = np.minimum(inp, seq_length), np.minimum(tgt, seq_length)
    else:
        tgt = np.minimum(tgt, seq_length - 1)
        inp = np.minimum(inp, seq_length - tgt)
    return MixtureSample(inp, tgt, tasks.astype(np.int64))


def sample_lengths(n: int, seed: int, seq_length: int, encoder_decoder: bool = False,
                   mixture: Optional[Mixture] = None) -> np.ndarray:
    """Sequence lengths in tokens: shape ``(n,)`` for decoder-only (input + target),
    ``(n, 2)`` (input, target) for encoder-decoder."""
    s = sample_mixture(mixture or load_mixture(), n, seed, seq_length, encoder_decoder)
    if encoder_decoder:
        return np.stack([s.input_lengths, s.target_lengths], axis=1)
    return s.input_lengths + s.target_lengths


def sample_token_ids(lengths: np.ndarray, seed: int, vocab_size: int) -> list[np.ndarray]:
    """Deterministic random token ids (int64) for each length, avoiding id 0 (padding)."""
    rng = np.random.default_rng(seed)
    return [rng.integers(1, vocab_size, size=int(l), dtype=np.int64) for l in lengths]
