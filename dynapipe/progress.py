"""Progress bars for long command-line phases (profiling, benchmarking, planning).

A bar is drawn with ``tqdm`` when it is installed, the stream is a terminal, the caller
has not switched bars off (``--no-progress``) and this process is rank 0 of its job; in
every other case the phase's lines are printed as plain lines, so logs and CI output
stay readable. Pure Python: no torch.
"""
from __future__ import annotations

import os
import sys
from typing import Optional, TextIO


def bars_wanted(enabled: bool = True, stream: Optional[TextIO] = None) -> bool:
    """Whether to draw a bar: switched on, on rank 0 (``RANK``), a terminal, tqdm importable."""
    stream = sys.stderr if stream is None else stream
    if not enabled or os.environ.get("RANK", "0") != "0":
        return False
    isatty = getattr(stream, "isatty", None)
    if isatty is None or not isatty():
        return False
    try:
        import tqdm  # noqa: F401
    except ImportError:
        return False
    return True


class Progress:
    """A phase of ``total`` steps: ``step(line)`` advances it by one and shows ``line`` (above the
    bar, or as a plain line without one); ``close()`` ends it. Usable as a context manager.

    For steps that take long, ``begin(head)`` announces one first (the bar's label, or ``head``
    printed without a line break); ``step(tail)`` then completes the line ``head tail``."""

    def __init__(self, total: int, desc: str, enabled: bool = True, stream: Optional[TextIO] = None):
        self.stream = sys.stderr if stream is None else stream
        self.quiet = os.environ.get("RANK", "0") != "0"  # other ranks print nothing
        self.bar = None
        self.head: Optional[str] = None
        if bars_wanted(enabled, self.stream):
            from tqdm import tqdm

            self.bar = tqdm(total=total, desc=desc, file=self.stream, leave=False, dynamic_ncols=True)

    def begin(self, head: str) -> None:
        """A step starts: ``head`` says what it does."""
        self.head = head
        if self.bar is not None:
            self.bar.set_description_str(head)
        elif not self.quiet:
            print(head, end=" ", file=self.stream, flush=True)

    def step(self, line: Optional[str] = None) -> None:
        """One step done; ``line``: what it measured or did (after ``begin``: the rest of its line)."""
        head, self.head = self.head, None
        if self.bar is not None:
            full = " ".join(filter(None, (head, line)))
            if full:
                self.bar.write(full, file=self.stream)
            self.bar.update(1)
        elif not self.quiet and (line or head):
            print(line or "", file=self.stream, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None

    def __enter__(self) -> "Progress":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
