"""The replica balancing (compiled merge loop and numpy loop) returns exactly the assignment
of the original pure-Python one."""
from __future__ import annotations

import numpy as np
import pytest

import balance_reference as ref
from dynapipe.batching import _balance_kernel
from dynapipe.batching.balance import _improve, balance_replicas, karmarkar_karp


def _cases():
    rng = np.random.default_rng(1234)
    for seed in range(12):
        n = int(rng.integers(1, 900))
        parts = int(rng.choice([2, 3, 4, 7, 8, 16, 64]))
        kind = seed % 3
        if kind == 0:
            w = rng.lognormal(2.0, 0.8, n)
        elif kind == 1:  # many exact ties, as micro-batches of equal shape have
            w = rng.integers(1, 6, n).astype(float) * 2.5
        else:
            w = np.round(rng.uniform(0.0, 30.0, n), 1)
        yield w.tolist(), parts


@pytest.mark.parametrize("compiled", [True, False], ids=["kernel", "numpy"])
@pytest.mark.parametrize("case", list(_cases()))
def test_balancing_matches_the_reference(case, compiled, monkeypatch):
    if compiled and not _balance_kernel.compiled():
        pytest.skip("numba is not installed")
    if not compiled:  # the loop used where numba is missing
        monkeypatch.setattr(_balance_kernel, "compiled", lambda: False)
    w, parts = case
    kk = karmarkar_karp(w, parts)
    assert kk == ref.karmarkar_karp(w, parts)
    assert _improve(w, list(kk), parts) == ref._improve(w, list(kk), parts)
    assert balance_replicas(w, parts) == ref.balance_replicas(w, parts)


def test_swap_search_cap_matches_the_reference():
    w = np.random.default_rng(7).lognormal(1.0, 1.0, 600).tolist()
    kk = ref.karmarkar_karp(w, 2)
    for cap in (0, 10, 40_000):
        assert _improve(w, list(kk), 2, max_pairs=cap) == ref._improve(w, list(kk), 2, max_pairs=cap)
