"""Orders of the samples that the DP cuts into consecutive micro-batches.

A micro-batch is padded to its longest sample, so the DP wants neighbours of similar
length. Decoder-only samples are simply sorted. Encoder-decoder samples have two
lengths and no order keeps both sorted, so the planner tries a few orders that keep
both close and keeps the one whose optimum is lowest.
"""
from __future__ import annotations

import math

import numpy as np

PAD_MULTIPLE = 8


def padded_length(lengths: np.ndarray, cap: int | None = None, multiple: int = PAD_MULTIPLE) -> np.ndarray:
    """Round token counts up to a multiple of ``multiple``, never above ``cap`` tokens.

    The cap (the sequence length limit) wins over rounding: a 2,047-token sample under a
    2,047-token limit is padded to 2,047, not 2,048.
    """
    lengths = np.asarray(lengths, dtype=np.int64)
    padded = -(-lengths // multiple) * multiple
    return padded if cap is None else np.minimum(padded, np.maximum(cap, lengths))


def sort_by_length(lengths: np.ndarray) -> np.ndarray:
    """Indices of decoder-only samples by ascending length (stable: ties keep arrival order)."""
    return np.argsort(np.asarray(lengths), kind="stable")


def snake_order(inputs: np.ndarray, targets: np.ndarray) -> np.ndarray:
    """Encoder-decoder order: bands of similar input length, targets sorted inside each
    band in alternating direction, so both lengths change slowly along the order.

    About sqrt(n) bands of equal size: neighbours then differ little in input length (the
    band is narrow) and in target length (sorted within the band, and the band ends
    meet at similar targets because the direction alternates).
    """
    n = len(inputs)
    by_input = np.lexsort((targets, inputs))
    bands = max(1, int(math.isqrt(n)))
    out = []
    for b, chunk in enumerate(np.array_split(by_input, bands)):
        inner = chunk[np.lexsort((inputs[chunk], targets[chunk]))]
        out.append(inner if b % 2 == 0 else inner[::-1])
    return np.concatenate(out)


#: Names of the encoder-decoder candidate orders, as plans report them (``extra["order"]``).
ORDER_NAMES = ("input-major", "target-major", "snake")


def named_candidate_orders(lengths: np.ndarray) -> list[tuple[str, np.ndarray]]:
    """The sample orders the DP tries, each with its name: ``sorted`` for decoder-only; for
    encoder-decoder (``lengths`` ``(n, 2)``: input, target) the input-major sort, the
    target-major sort and :func:`snake_order`, an order equal to an earlier one dropped (and
    its name with it, so a plan never reports an order it did not take)."""
    lengths = np.asarray(lengths)
    if lengths.ndim == 1:
        return [("sorted", sort_by_length(lengths))]
    inputs, targets = lengths[:, 0], lengths[:, 1]
    orders = [np.lexsort((targets, inputs)), np.lexsort((inputs, targets)), snake_order(inputs, targets)]
    unique: list[tuple[str, np.ndarray]] = []
    for name, o in zip(ORDER_NAMES, orders):
        if not any(np.array_equal(o, u) for _, u in unique):
            unique.append((name, o))
    return unique


def candidate_orders(lengths: np.ndarray) -> list[np.ndarray]:
    """The orders of :func:`named_candidate_orders`: one for decoder-only, up to three for
    encoder-decoder ``(n, 2)`` lengths (input-major, target-major, snake)."""
    return [o for _, o in named_candidate_orders(lengths)]
