"""Train / validation / test splits, as Megatron-LM's ``--split`` cuts a dataset.

Megatron-LM reads ``--split "969, 30, 1"`` (its default with ``--data-path``) as three
proportions, pads missing ones with 0 and normalises them to sum to 1
(megatron-core's ``parse_and_normalize_split``); the split matrix
(``convert_split_vector_to_split_matrix``) gives each split a range ``[lo, hi)`` of the
dataset, and split ``s`` of a dataset of ``n`` documents is documents
``round(lo x n) .. round(hi x n) - 1`` (what ``BlendedMegatronDatasetBuilder`` takes).
A document therefore belongs to exactly one split, before any document is cut into pieces,
so the splits are disjoint by construction. Each path of a blend is split on its own and
the blend's weights then mix the parts of the same split.
"""
from __future__ import annotations

import re
from typing import Optional

import numpy as np

from dynapipe.errors import DynaPipeError

SPLITS = ("train", "valid", "test")
MEGATRON_DEFAULT_SPLIT = "969, 30, 1"
# A split range [lo, hi) as fractions of a dataset's documents: the whole dataset.
WHOLE = (0.0, 1.0)


class EmptySplitError(DynaPipeError):
    """A split (or the part of a blend path in it) holds no document. ``empty_documents``: the
    documents its range did hold, every one of them empty (0 tokens) and so skipped: then a
    larger share of ``--split`` is not what the data needs."""

    def __init__(self, message: str, empty_documents: int = 0):
        super().__init__(message)
        self.empty_documents = int(empty_documents)

    def reason(self, flag: str = "--split") -> str:
        """Why the split is empty, for a message: ``its N document(s), all empty (skipped)`` or
        ``its {flag} share of the data rounds to none``."""
        if self.empty_documents:
            return f"its {self.empty_documents:,} document(s) are all empty (0 tokens, skipped)"
        return f"its {flag} share of the data rounds to none"


def parse_split(text: str) -> list[float]:
    """``--split`` as three train/valid/test proportions normalised to sum to 1, as
    megatron-core's ``parse_and_normalize_split`` reads it (missing ones are 0); raises
    :class:`DynaPipeError` where megatron-core would assert or divide by zero. Pure Python,
    so a bad command line is refused before megatron-core is imported."""
    # Quotes kept by a launch script that expands "--split '99,1,0'" unquoted (Megatron-LM's
    # own do) are not part of the value: megatron-core's number search skips them.
    text = text.strip().strip("'\"")
    items = [x for x in re.split(r"[\s,/:;]+", text) if x]  # megatron-core reads any separator
    values = [float(x) for x in items if re.fullmatch(r"[.0-9]+", x) and x.count(".") <= 1 and x != "."]
    if not 1 <= len(items) <= 3 or len(values) != len(items) or sum(values) <= 0:
        raise DynaPipeError(f"--split {text!r}: give up to three non-negative train, validation and test "
                            f"proportions with a positive sum, e.g. --split \"{MEGATRON_DEFAULT_SPLIT}\".")
    values += [0.0] * (len(SPLITS) - len(values))
    total = sum(values)
    return [v / total for v in values]


def split_ranges(proportions: list[float]) -> dict[str, Optional[tuple[float, float]]]:
    """Each split's ``[lo, hi)`` range of a dataset (None for an empty split), from
    megatron-core's split matrix."""
    from megatron.core.datasets.blended_megatron_dataset_config import convert_split_vector_to_split_matrix

    matrix = convert_split_vector_to_split_matrix(list(proportions))
    return {name: (None if r is None else (float(r[0]), float(r[1]))) for name, r in zip(SPLITS, matrix)}


def documents_per_split(proportions: list[float], n: int) -> dict[str, Optional[int]]:
    """Documents of each split of a dataset of ``n`` documents (None for a split of no share),
    by megatron-core's split matrix and rounding, in pure Python (argument checks run before
    megatron-core is imported)."""
    bounds, acc = [], 0.0
    for share in proportions:  # the running sums megatron-core's split matrix takes
        bounds.append((acc, acc + share))
        acc += share
    return {name: (None if hi <= lo else range_indices((lo, hi), n)[1] - range_indices((lo, hi), n)[0])
            for name, (lo, hi) in zip(SPLITS, bounds)}


def range_indices(split_range: tuple[float, float], n: int) -> tuple[int, int]:
    """First and one-past-last document of ``split_range`` in a dataset of ``n`` documents
    (Megatron's rounding)."""
    lo, hi = split_range
    return int(round(lo * float(n))), int(round(hi * float(n)))


def per_file_indices(file_of_sample: np.ndarray, split_range: tuple[float, float]) -> np.ndarray:
    """Indices of the samples of ``split_range`` when each file is split on its own, as
    megatron-core splits every path of ``--data-path``: ``file_of_sample[i]`` names the file
    of sample ``i`` (files hold contiguous runs of samples, in order)."""
    files = np.asarray(file_of_sample)
    keep = []
    for f in np.unique(files):
        mine = np.flatnonzero(files == f)
        begin, end = range_indices(split_range, len(mine))
        keep.append(mine[begin:end])
    return np.concatenate(keep) if keep else np.zeros(0, np.int64)


__all__ = ["EmptySplitError", "MEGATRON_DEFAULT_SPLIT", "SPLITS", "WHOLE", "documents_per_split", "parse_split", "per_file_indices", "range_indices", "split_ranges"]
