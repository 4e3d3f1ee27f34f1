"""A profile's grid point that does not fit the device's memory, named in one line.

Shared by the GPT and the T5 profilers: a CPU's failed allocation is a RuntimeError ("can't
allocate memory"), a GPU's a torch.OutOfMemoryError; either would otherwise end the profiling
ranks with a traceback that names no point of the grid.
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch

from dynapipe.errors import DynaPipeError


@contextmanager
def point_fits(where: str) -> Iterator[None]:
    """Turn running out of memory while measuring ``where`` (a grid point, such as ``mbs=4
    seqlen=8192``) into one line naming it and the flags that shrink the grid; a CPU's failed
    allocation is a RuntimeError, a GPU's torch.OutOfMemoryError (itself one)."""
    try:
        yield
    except RuntimeError as e:
        text = str(e)
        if not isinstance(e, getattr(torch, "OutOfMemoryError", ())) and "can't allocate memory" not in text \
                and "out of memory" not in text.lower():
            raise
        first = " ".join(text.split())[:160]
        raise DynaPipeError(f"the profile ran out of memory measuring {where} ({first}); measure a grid this "
                            f"device holds: smaller --mbs or --seqlens (--dec-seqlens for T5), up to the shapes a "
                            f"training rank runs.") from None
