"""The activation memory a micro-batch may use, and the largest micro-batch that fits.

Budget on the most loaded stage = memory limit - reserved (framework) - model states.
A micro-batch fits when its stored plus peak activation memory is within the budget.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np

from dynapipe.cost import CostModel
from dynapipe.errors import DynaPipeError, arg, given

UNLIMITED_MIB = float("inf")


@dataclass(frozen=True)
class MemoryBudget:
    """Memory figures of the most loaded stage, in MiB.

    ``micro_batch_share``: the share of :attr:`activation_mib` a micro-batch of two or
    more samples may use (1: all of it); a sample alone may always use all of it. Below 1
    it keeps room for the other micro-batches a pipeline holds at once, which the
    schedule would otherwise have to make with heavier recompute."""

    limit_mib: float
    reserved_mib: float
    model_state_mib: float
    micro_batch_share: float = 1.0

    @property
    def activation_mib(self) -> float:
        """MiB left for a micro-batch's stored and peak activations."""
        return self.limit_mib - self.reserved_mib - self.model_state_mib

    @property
    def multi_sample_mib(self) -> float:
        """MiB a micro-batch of two or more samples may use."""
        return self.activation_mib * self.micro_batch_share

    def describe(self) -> str:
        return (f"{self.activation_mib:.1f} MiB are left for activations (memory limit {self.limit_mib:.0f} MiB "
                f"- reserved {self.reserved_mib:.0f} MiB - model states {self.model_state_mib:.1f} MiB)")


def memory_budget(cost_model: CostModel, memory_limit_mib: float | None, reserved_mib: float = 0.0, *,
                  dp: int = 1, zero: bool = False) -> MemoryBudget:
    """The budget under ``memory_limit_mib`` (``None``: unlimited); errors if nothing is left.

    ``zero=True`` prices model states with the optimizer sharded over ``dp`` replicas
    (Megatron's distributed optimizer)."""
    # A string or a bool is not a size, though float() would take "4000" or True.
    number = lambda v: not isinstance(v, (str, bytes, bool))  # noqa: E731
    try:
        limit = UNLIMITED_MIB if memory_limit_mib is None else float(memory_limit_mib)
    except (TypeError, ValueError):
        limit = float("nan")
    if not number(memory_limit_mib):
        limit = float("nan")
    if not limit > 0:
        raise DynaPipeError(f"{given('memory_limit_mib', memory_limit_mib)}: the memory limit (MiB) must be a positive "
                            f"number.")
    try:
        reserved = float(reserved_mib) if number(reserved_mib) else float("nan")
    except (TypeError, ValueError):
        reserved = float("nan")
    if not 0 <= reserved < float("inf"):
        raise DynaPipeError(f"reserved memory {reserved_mib!r} MiB must be a finite number, 0 or more.")
    budget = MemoryBudget(limit, reserved, float(cost_model.model_state_mib(dp=dp, zero=zero)))
    if budget.activation_mib <= 0:
        raise DynaPipeError(
            f"the model states of the most loaded stage need {budget.model_state_mib:.1f} MiB, so nothing is left "
            f"for activations under the memory limit of {limit:.0f} MiB (reserved {reserved_mib:.0f} MiB); "
            f"add pipeline stages{_flag_of('num_stages')} or raise {arg('memory_limit_mib', 'the memory limit')}.")
    return budget


def max_fitting_count(memory_mib: Callable[[np.ndarray, np.ndarray], np.ndarray], upper: np.ndarray,
                      budget_mib: float) -> np.ndarray:
    """For each row r, the largest count k in ``0..upper[r]`` with ``memory_mib(k, r) <= budget_mib``.

    ``memory_mib(counts, rows)`` prices many (count, row) pairs in one vectorised call.
    Memory must not decrease as the count grows (true of every cost model here: each
    term scales with the number of samples). Starts from the proportional guess
    ``budget / memory(1)``, exact for the analytic model, then bisects what is left.
    """
    upper = np.asarray(upper, dtype=np.int64)
    rows = np.arange(len(upper))
    lo = np.zeros(len(upper), dtype=np.int64)   # a count known to fit (0 always does)
    hi = upper + 1                              # a count known not to fit (or past the end)

    def probe(k: np.ndarray, r: np.ndarray) -> None:
        fits = memory_mib(k, r) <= budget_mib
        np.maximum.at(lo, r[fits], k[fits])
        np.minimum.at(hi, r[~fits], k[~fits])

    if np.isinf(budget_mib):
        return upper.copy()
    ones = np.ones(len(upper), dtype=np.int64)
    m1 = np.asarray(memory_mib(ones, rows), dtype=np.float64)
    fits = m1 <= budget_mib
    lo[fits], hi[~fits] = 1, 1
    active = rows[hi - lo > 1]
    if len(active):
        per_sample = m1[active]
        with np.errstate(divide="ignore", invalid="ignore"):
            guess = np.where(per_sample > 0, np.floor(budget_mib / np.where(per_sample > 0, per_sample, 1.0)),
                             upper[active])
        guess = np.clip(guess, 1, upper[active]).astype(np.int64)
        nxt = np.minimum(guess + 1, upper[active])
        probe(np.concatenate([guess, nxt]), np.concatenate([active, active]))
    while True:
        active = rows[hi - lo > 1]
        if not len(active):
            return lo
        probe((lo[active] + hi[active]) // 2, active)


def _flag_of(name: str) -> str:
    """`` (--flag)`` where the running program spells ``name`` as a flag, else nothing: the
    functions that reach these fixes name their stage count differently (``stages``,
    ``num_stages``)."""
    spelled = arg(name, "")
    return f" ({spelled})" if spelled else ""


def oversized_sample_error(index: int, length: str, stored_mib: float, peak_mib: float,
                           budget: MemoryBudget, recompute: str, others: int = 0) -> DynaPipeError:
    """The error for a sample whose one-sample micro-batch exceeds the activation budget.

    ``length`` describes the sample (tokens, padded shape); ``others`` counts further
    samples of the batch that do not fit either.
    """
    level = arg("recompute", "recompute level")
    stronger = {"none": f"{level} selective or full", "selective": f"{level} full"}.get(recompute)
    fixes = [f"raise {arg('memory_limit_mib', 'the memory limit')}"] + ([f"use {stronger}"] if stronger else []) + [
        f"truncate samples with a smaller {arg('seq_length')}", f"or add pipeline stages{_flag_of('num_stages')}"]
    more = f" ({others} more sample(s) of the batch do not fit either.)" if others else ""
    return DynaPipeError(
        f"sample {index} ({length}) does not fit in memory even alone: it needs {stored_mib + peak_mib:.1f} MiB "
        f"of activations (stored {stored_mib:.1f} + peak {peak_mib:.1f}) on the most loaded stage with recompute "
        f"{recompute!r}, but {budget.describe()}.{more} To fix: {', '.join(fixes)}.")
