"""Micro-batch orders the schedule search tries.

Each function maps per-micro-batch weights (ms of forward + backward, summed over the
stages) to a permutation: position ``i`` runs the planner's micro-batch ``order[i]``.
Sorting is stable, so equal weights keep the planner's order and results are
deterministic.
"""
from __future__ import annotations

import numpy as np


def planned(w: np.ndarray) -> list[int]:
    """The order the micro-batch planner produced."""
    return list(range(len(w)))


def longest_first(w: np.ndarray) -> list[int]:
    """Heaviest micro-batches first."""
    return np.argsort(-np.asarray(w), kind="stable").tolist()


def shortest_first(w: np.ndarray) -> list[int]:
    """Lightest micro-batches first."""
    return np.argsort(np.asarray(w), kind="stable").tolist()


def clustered(w: np.ndarray) -> list[int]:
    """Similar sizes next to each other, heaviest in the middle, lightest at both ends.

    Pipeline fill costs the first micro-batch's forwards and drain the last one's
    backwards, so light micro-batches belong at the ends; neighbours of similar size
    keep the steady state free of bubbles.
    """
    asc = np.argsort(np.asarray(w), kind="stable").tolist()
    front, back = asc[0::2], asc[1::2]
    return front + back[::-1]


ORDERS = {"planned": planned, "longest-first": longest_first, "shortest-first": shortest_first,
          "clustered": clustered}
