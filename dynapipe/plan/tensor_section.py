"""The tensor-list section of a binary plan body, gathered from arrays.

A plan set at cluster scale has a few hundred tensor lists per rank (one per message
or load shape) but few distinct ones: the compiler shares one tuple per shape across
every rank and replica. Each distinct tuple is read into flat arrays once; a rank's
section is then a handful of numpy gathers instead of a Python loop over its lists.
"""
from __future__ import annotations

from typing import Callable, Sequence

import numpy as np

from dynapipe.errors import PlanError
from dynapipe.plan.instructions import DTYPES

_DTYPE_INDEX = {d: i for i, d in enumerate(DTYPES)}
# Lists held before the registry starts over (each costs a few hundred bytes).
_MAX_LISTS = 1 << 16


class _Registry:
    """Every tensor list seen, by identity (the tuples are held, so identities stay
    valid): per list its number of tensors and dims, its first tensor and first dim; per
    tensor its name number, dtype number and rank; the dims."""

    def __init__(self):
        self.number: dict[int, int] = {}
        self.held: list = []
        self.names: dict[str, int] = {}
        self.name_list: list[str] = []
        self.count = np.zeros(0, np.int64)
        self.dim_count = np.zeros(0, np.int64)
        self.item_start = np.zeros(0, np.int64)
        self.dim_start = np.zeros(0, np.int64)
        self.items = np.zeros((0, 3), np.int64)
        self.dims = np.zeros(0, np.int64)

    def add(self, lists: Sequence[tuple], stage: int) -> None:
        """Register the lists not seen yet (each checked as the encoder requires); a
        list that fails its check leaves the registry as it was."""
        count, dim_count, items, dims = [], [], [], []
        n_items, n_dims = len(self.items), len(self.dims)
        item_start, dim_start = [], []
        fresh: dict[int, tuple] = {}
        names = dict(self.names)
        for ts in lists:
            if id(ts) in self.number or id(ts) in fresh:
                continue
            rows, shape_dims = [], []
            for t in ts:
                d = _DTYPE_INDEX.get(t.dtype)
                if d is None:
                    raise PlanError(f"tensor {t.name!r} has dtype {t.dtype!r}, not one of {DTYPES}.")
                if type(t.name) is not str:
                    raise PlanError(f"plan of stage {stage}: expected a string, got {t.name!r}.")
                code = names.get(t.name)
                if code is None:
                    code = names[t.name] = len(names)
                rows.append((code, d, len(t.shape)))
                shape_dims.extend(t.shape)
            fresh[id(ts)] = ts
            count.append(len(rows))
            dim_count.append(len(shape_dims))
            item_start.append(n_items + len(items))
            dim_start.append(n_dims + len(dims))
            items.extend(rows)
            dims.extend(shape_dims)
        if count:
            dims_arr = np.array(dims, np.int64)
            for ts in fresh.values():
                self.number[id(ts)] = len(self.held)
                self.held.append(ts)
            self.name_list.extend(list(names)[len(self.name_list):])
            self.names = names
            self.count = np.concatenate([self.count, np.array(count, np.int64)])
            self.dim_count = np.concatenate([self.dim_count, np.array(dim_count, np.int64)])
            self.item_start = np.concatenate([self.item_start, np.array(item_start, np.int64)])
            self.dim_start = np.concatenate([self.dim_start, np.array(dim_start, np.int64)])
            self.items = np.concatenate([self.items, np.array(items, np.int64).reshape(-1, 3)])
            self.dims = np.concatenate([self.dims, dims_arr])


_REGISTRY = _Registry()


def _ranges(starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """Concatenated ``arange(start, start + length)`` of every pair."""
    total = int(lengths.sum())
    if not total:
        return np.zeros(0, np.int64)
    ends = np.cumsum(lengths)
    return np.repeat(starts - (ends - lengths), lengths) + np.arange(total)


def tensor_section(lists: Sequence[tuple], sid: Callable[[str], int],
                   stage: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(list lengths, items [n, 3], dims)`` of a rank's tensor lists, as the body
    stores them: items are (name string number, dtype number, ndim). ``sid`` numbers a
    string in the plan's string table; names are numbered in order of first use."""
    global _REGISTRY
    reg = _REGISTRY
    got = list(map(reg.number.get, map(id, lists)))
    if None in got:
        if len(reg.held) > _MAX_LISTS:
            reg = _REGISTRY = _Registry()
        reg.add(lists, stage)
        got = list(map(reg.number.get, map(id, lists)))
    idx = np.array(got, dtype=np.int64)
    lens = reg.count[idx]
    items = reg.items[_ranges(reg.item_start[idx], lens)]
    dims = reg.dims[_ranges(reg.dim_start[idx], reg.dim_count[idx])]
    if len(items):
        codes, first = np.unique(items[:, 0], return_index=True)
        local = np.zeros(int(codes.max()) + 1, np.int64)
        for c in codes[np.argsort(first)].tolist():
            local[c] = sid(reg.name_list[c])
        items[:, 0] = local[items[:, 0]]   # a gathered copy: the registry is untouched
    return lens, items, dims

