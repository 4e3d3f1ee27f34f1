"""``--data-path`` (and the per-split paths) as Megatron-LM reads them: paths, optionally
preceded by blend weights. No torch or megatron import.
"""
from __future__ import annotations

import os
from typing import Optional, Sequence

from dynapipe.errors import DynaPipeError


def _weight(text: str) -> Optional[float]:
    try:
        return float(text)
    except ValueError:
        return None


def parse_blend(data_path: Sequence[str], flag: str = "--data-path") -> tuple[list[str], Optional[list[float]]]:
    """``--data-path`` as Megatron-LM reads it: ``P1 P2 ...`` (no weights) or ``W1 P1 W2 P2 ...``
    (an even count whose every other item is a number). Raises :class:`DynaPipeError` for a
    list that mixes the two or has a weight that is not positive, naming ``flag`` (the flag, or
    the file and split, that gave the list)."""
    items = list(data_path)
    weights = [_weight(w) for w in items[0::2]]
    if len(items) % 2 == 0 and items and all(w is not None for w in weights):
        bad = [items[2 * i] for i, w in enumerate(weights) if not (w > 0 and w != float("inf"))]
        if bad:
            raise DynaPipeError(f"{flag} weight {bad[0]}: blend weights must be positive numbers.")
        return items[1::2], weights
    # A number that names data (a prefix such as 2024 whose 2024.bin exists) is a path, as
    # Megatron-LM reads a list that is not weight/path pairs.
    numbers = [x for x in items if _weight(x) is not None and not _names_data(x)]
    if numbers:
        raise DynaPipeError(f"{flag} {' '.join(items)}: {numbers[0]!r} looks like a blend weight but the list "
                            f"is not weight/path pairs; give W1 P1 W2 P2 ... or paths only.")
    return items, None


def _names_data(path: str) -> bool:
    return any(os.path.exists(path + ext) for ext in ("", ".bin", ".idx"))


def data_files(data_path: Sequence[str], flag: str = "--data-path") -> list[str]:
    """The paths of ``--data-path`` (without Megatron-style blend weights); errors name ``flag``."""
    return parse_blend(data_path, flag)[0]
