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

from dynapipe.config import CONFIG_DIR, resolve_config_path
from dynapipe.errors import DynaPipeError, given

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
    """Tasks drawn in proportion to their weights (normalised by :attr:`weights`)."""

    tasks: tuple[TaskSpec, ...]

    @property
    def weights(self) -> np.ndarray:
        w = np.array([t.weight for t in self.tasks], dtype=np.float64)
        return w / w.sum()


# Lengths of more samples than this do not fit a reasonable amount of memory at once.
MAX_SAMPLES = 100_000_000
# Length distributions of real tasks have log-normal shapes well below 3; a sigma past this
# one multiplies the median by e^10 (22,000x) at one standard deviation, so it is a typo
# (a variance, a length) rather than a distribution.
MAX_SIGMA = 10.0
_TASK_KEYS = tuple(TaskSpec.__dataclass_fields__)


def _task_spec(path: str, i: int, t: dict) -> TaskSpec:
    """One task of a mixture file, every key present, known and in range."""
    label = f"task {t['name']!r}" if isinstance(t.get("name"), str) else f"task {i}"
    missing = [k for k in _TASK_KEYS if k not in t]
    if missing:
        raise DynaPipeError(f"{path}: {label} lacks key(s) {missing}; every task needs {list(_TASK_KEYS)}.")
    unknown = sorted(str(k) for k in t if k not in _TASK_KEYS)
    if unknown:
        raise DynaPipeError(f"{path}: {label} has unknown key(s) {unknown}; known keys are {list(_TASK_KEYS)}.")
    if not isinstance(t["name"], str) or not t["name"]:
        raise DynaPipeError(f"{path}: {label}: name={t['name']!r} must be a non-empty string.")
    for key in _TASK_KEYS[1:]:
        value = t[key]
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise DynaPipeError(f"{path}: {label}: {key}={value!r} must be a finite number.")
    for key in ("weight", "median_input", "median_target"):
        if t[key] <= 0:
            raise DynaPipeError(f"{path}: {label}: {key}={t[key]!r} must be > 0.")
    for key in ("sigma_input", "sigma_target"):
        if not 0 <= t[key] <= MAX_SIGMA:
            raise DynaPipeError(f"{path}: {label}: {key}={t[key]!r} must be between 0 and {MAX_SIGMA:g} "
                                f"(the log-normal shape: 0 draws the median every time, 0.3-1 is typical).")
    return TaskSpec(**t)


def resolve_mixture(path_or_name: Optional[str] = None, flag: Optional[str] = None) -> str:
    """The file of a mixture given as a YAML path or a name shipped in ``configs/data``
    (``flan-mixture``); ``None``: the default mixture. An unknown one is refused naming
    ``flag`` (when given) and the shipped names."""
    if not path_or_name:
        return DEFAULT_MIXTURE
    return resolve_config_path(path_or_name, "data", flag)


def load_mixture(path: Optional[str] = None, flag: Optional[str] = None) -> Mixture:
    """Read a mixture: a YAML path or a shipped name (see :func:`resolve_mixture`; default
    ``configs/data/flan-mixture.yaml``). ``flag``: the option named in errors."""
    from dynapipe.config import read_yaml

    path = resolve_mixture(path, flag)
    data = read_yaml(path)
    tasks = data.get("tasks")
    if not isinstance(tasks, list) or not tasks:
        raise DynaPipeError(f"{path}: a mixture needs a non-empty 'tasks' list.")
    specs = []
    for i, t in enumerate(tasks):
        if not isinstance(t, dict):
            raise DynaPipeError(f"{path}: task {i} must be a mapping of {list(_TASK_KEYS)}.")
        specs.append(_task_spec(path, i, t))
        if specs[-1].name in (spec.name for spec in specs[:-1]):
            # Two weights for one task: a copied entry left unrenamed, which reports would merge.
            raise DynaPipeError(f"{path}: task {i} is named {specs[-1].name!r} like an earlier task; give each "
                                f"task its own name (or merge the two into one weight).")
    return Mixture(tuple(specs))


@dataclass(frozen=True)
class MixtureSample:
    """Lengths (tokens) and task ids of a batch of synthetic samples."""

    input_lengths: np.ndarray
    target_lengths: np.ndarray
    task_ids: np.ndarray


def sample_mixture(mixture: Mixture, n: int, seed: int, seq_length: int,
                   encoder_decoder: bool = False, dec_seq_length: int = 0) -> MixtureSample:
    """Draw ``n`` samples. Decoder-only: input + target together fit in ``seq_length`` tokens.
    Encoder-decoder: inputs fit in ``seq_length``, targets in ``dec_seq_length`` (0: the same)."""
    if n <= 0:
        raise DynaPipeError(f"{given('n', n)}: the number of samples must be positive.")
    if n > MAX_SAMPLES:
        raise DynaPipeError(f"{given('n', n)}: at most {MAX_SAMPLES:,} samples can be drawn at once.")
    if seed < 0:
        raise DynaPipeError(f"{given('seed', seed)}: the seed must be a non-negative integer.")
    if seq_length < 2:
        raise DynaPipeError(f"{given('seq_length', seq_length)}: must be at least 2 tokens.")
    rng = np.random.default_rng(seed)
    tasks = rng.choice(len(mixture.tasks), size=n, p=mixture.weights)
    med_in = np.array([t.median_input for t in mixture.tasks])[tasks]
    sig_in = np.array([t.sigma_input for t in mixture.tasks])[tasks]
    med_tg = np.array([t.median_target for t in mixture.tasks])[tasks]
    sig_tg = np.array([t.sigma_target for t in mixture.tasks])[tasks]
    inp = _lengths(med_in, sig_in, rng.standard_normal(n), seq_length)
    tgt = _lengths(med_tg, sig_tg, rng.standard_normal(n), seq_length)
    if encoder_decoder:
        # Drawn within each side's own limit: a mock sample is never one the data would truncate.
        inp, tgt = np.minimum(inp, seq_length), np.minimum(tgt, dec_seq_length or seq_length)
    else:
        tgt = np.minimum(tgt, seq_length - 1)
        inp = np.minimum(inp, seq_length - tgt)
    return MixtureSample(inp, tgt, tasks.astype(np.int64))


def _lengths(median: np.ndarray, sigma: np.ndarray, z: np.ndarray, seq_length: int) -> np.ndarray:
    """Log-normal draws rounded to whole tokens in [1, seq_length]. Clipped while still
    floats: a wide sigma overflows exp to inf, which casts to a garbage (negative) int64."""
    with np.errstate(over="ignore"):
        x = median * np.exp(sigma * z)
    return np.rint(np.clip(x, 1, seq_length)).astype(np.int64)


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
