"""Checks of a bench request that the GPT and the T5 bench share, made before any run starts.

A bench trains for minutes before it writes anything, so what it would fail on at the end
(an output path it cannot write, a picture matplotlib cannot save) and what would make its
figures wrong (a negative warm-up) is refused up front, in one line naming the value.
Pure Python: the command line calls these before importing torch.
"""
from __future__ import annotations

import os
from typing import Optional

from dynapipe.errors import DynaPipeError


def check_warmup_iters(warmup: int) -> None:
    """Refuse a negative ``--warmup-iters``: the timed iterations start at it
    (:func:`megatron_integration.bench_report.timed_indices`), and a negative start would time
    the warm-up and count the last iteration twice."""
    if warmup < 0:
        raise DynaPipeError(f"--warmup-iters {warmup}: must be >= 0 (0 times every iteration).")


def check_output_path(path: str, flag: str) -> None:
    """Refuse a file path the bench could not write once its runs are done: a directory, a
    folder that cannot be created (a file in the way) or one this user cannot write in."""
    if not path:
        raise DynaPipeError(f"{flag} {path!r}: give a file path.")
    if path.endswith(("/", os.sep)) or os.path.isdir(path):
        raise DynaPipeError(f"{flag} {path}: is a directory; give a file path such as "
                            f"{os.path.join(path, 'bench.json' if flag == '--output' else 'bench.png')}.")
    parent = os.path.dirname(os.path.abspath(path))
    existing = parent
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        raise DynaPipeError(f"{flag} {path}: cannot create its directory {parent}: {existing} is not a directory.")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise DynaPipeError(f"{flag} {path}: cannot write in {existing} (permission denied); choose a writable "
                            f"directory.")
    if os.path.exists(path) and not os.access(path, os.W_OK):
        raise DynaPipeError(f"{flag} {path}: the file exists and is not writable; choose another path.")


def check_bench_outputs(output: str, png: Optional[str] = None) -> None:
    """Refuse ``--output`` (the JSON; its profile and traces go next to it) and ``--png`` paths
    the bench could not write after its runs, a picture not named ``.png`` (matplotlib picks the
    format from the suffix) and a picture that would overwrite the JSON."""
    check_output_path(output, "--output")
    if png is None:
        return
    if not png.lower().endswith(".png"):
        raise DynaPipeError(f"--png {png!r}: the comparison is drawn as a PNG; give a path ending in .png.")
    if os.path.realpath(png) == os.path.realpath(output):
        raise DynaPipeError(f"--png {png}: the same file as --output {output}; give the picture its own path.")
    check_output_path(png, "--png")


def make_output_dir(path: str) -> None:
    """Create the folder ``path`` goes in (once every check has passed)."""
    out_dir = os.path.dirname(os.path.abspath(path))
    try:
        os.makedirs(out_dir, exist_ok=True)
    except OSError as e:
        raise DynaPipeError(f"{path}: cannot create its directory {out_dir}: {e.strerror}.") from None


def parse_t5_sweep(text: str) -> tuple[int, ...]:
    """``--t5-sweep`` (``1,2,4``): the T5 baselines' micro-batch sizes, each positive and given
    once (a size given twice would run twice under one label and trace directory, its runs then
    merged as if they were rounds)."""
    try:
        sweep = tuple(int(x) for x in text.split(","))
    except ValueError:
        sweep = ()
    if not sweep or min(sweep) < 1:
        raise DynaPipeError(f"--t5-sweep {text!r}: give micro-batch sizes like 1,2,4.")
    repeated = sorted({s for s in sweep if sweep.count(s) > 1})
    if repeated:
        raise DynaPipeError(f"--t5-sweep {text!r}: {', '.join(map(str, repeated))} given more than once; give each "
                            f"micro-batch size once (repeat runs with --rounds).")
    return sweep
