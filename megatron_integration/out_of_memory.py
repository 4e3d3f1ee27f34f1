"""Running out of memory named in one line: what was being built or measured, and the flags
that shrink it.

A CPU's failed allocation is a RuntimeError ("can't allocate memory"), a GPU's a
torch.OutOfMemoryError; either would otherwise end the ranks with a traceback from deep inside
torch that names no flag. Used where sizes come straight from the command line: a profile's
grid points, and a training rank's model (a --max-position-embeddings or --vocab-size of
billions is a table no device holds).
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch

from dynapipe.errors import DynaPipeError


def is_out_of_memory(e: BaseException) -> bool:
    """Whether ``e`` is torch running out of device or host memory."""
    if isinstance(e, getattr(torch, "OutOfMemoryError", ())):
        return True
    text = str(e)
    return isinstance(e, RuntimeError) and ("can't allocate memory" in text or "out of memory" in text.lower())


@contextmanager
def named_out_of_memory(doing: str, fix: str) -> Iterator[None]:
    """Turn running out of memory while ``doing`` into one :class:`DynaPipeError` line: ``the
    <doing> ran out of memory (<torch's first words>); <fix>``."""
    try:
        yield
    except RuntimeError as e:
        if not is_out_of_memory(e):
            raise
        first = " ".join(str(e).split())[:160]
        raise DynaPipeError(f"{doing} ran out of memory ({first}); {fix}") from None


# What sizes a model built from the command line: its tables and its layers.
MODEL_TOO_LARGE = ("check the sizes it was built with (--max-position-embeddings, --vocab-size, --seq-length, "
                   "--hidden-size, --ffn-hidden-size, the layers) or spread it over more stages (--pipeline-model-"
                   "parallel-size, --tensor-model-parallel-size).")


def point_fits(where: str):
    """:func:`named_out_of_memory` for a profile's grid point ``where`` (such as ``layer at
    mbs=4 seqlen=8192``)."""
    return named_out_of_memory(f"the profile measuring {where}",
                               "measure a grid this device holds: smaller --mbs or --seqlens (--dec-seqlens for "
                               "T5), up to the shapes a training rank runs.")
