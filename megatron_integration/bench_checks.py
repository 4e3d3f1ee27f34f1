"""Checks of a bench request that the GPT and the T5 bench share, made before any run starts.

A bench trains for minutes before it writes anything, so what it would fail on at the end
(an output path it cannot write, a picture matplotlib cannot save) and what would make its
figures wrong (a negative warm-up) is refused up front, in one line naming the value.
Pure Python: the command line calls these before importing torch.
"""
from __future__ import annotations

import os
from typing import Optional, Sequence

from dynapipe.errors import DynaPipeError
from dynapipe.output_paths import check_output_file, check_outputs_apart


def check_warmup_iters(warmup: int) -> None:
    """Refuse a negative ``--warmup-iters``: the timed iterations start at it
    (:func:`megatron_integration.bench_report.timed_indices`), and a negative start would time
    the warm-up and count the last iteration twice."""
    if warmup < 0:
        raise DynaPipeError(f"--warmup-iters {warmup}: must be >= 0 (0 times every iteration).")


def check_bench_outputs(output: str, png: Optional[str] = None, argv: Sequence[str] = ()) -> None:
    """Refuse ``--output`` (the JSON; its profile and traces go next to it) and ``--png`` paths
    the bench could not write after its runs, a picture not named ``.png`` (matplotlib picks the
    format from the suffix), and any file the bench writes (the JSON, the picture, the measured
    and calibrated profiles) that is a file the runs read (``argv``'s training arguments: data,
    a cost model, a tokenizer, a run config) or another output (:mod:`dynapipe.output_paths`,
    as the other commands check theirs), and a picture without matplotlib to draw it."""
    if not output:
        raise DynaPipeError(f"--output {output!r}: give a file path.")
    check_output_file(output, "--output")
    if png is not None:
        check_output_file(png, "--png", suffix=".png")
        import importlib.util

        if importlib.util.find_spec("matplotlib") is None:
            raise DynaPipeError("--png needs matplotlib: pip install matplotlib (or the 'plot' extra).")
    written = [("--output", output), ("--png", png)]
    if not any(a.split("=")[0] == "--dynapipe-cost-model" for a in argv):
        # The profile the bench measures, and calibrates, goes next to --output.
        measured = measured_profile_path(output)
        written += [("--output", measured), ("--output", calibrated_profile_path(measured))]
    check_outputs_apart(argv_input_files(argv), written)


def measured_profile_path(output: str) -> str:
    """Where a bench with ``--output`` writes the profile it measures (next to the JSON)."""
    return os.path.splitext(output)[0] + ".profile.json"


def calibrated_profile_path(profile: str) -> str:
    """Where a bench writes the calibrated copy of the profile at ``profile``."""
    return os.path.splitext(profile)[0] + ".calibrated.json"


def argv_input_files(argv: Sequence[str]) -> list[tuple[str, str]]:
    """``(flag, path)`` for every value in ``argv`` that names an existing file, or an indexed
    dataset's prefix (its ``.bin`` and ``.idx``): what a bench's runs read."""
    out, flag = [], "a training argument"
    for token in argv:
        value = token
        if token.startswith("--"):
            flag, _, value = token.partition("=")
            if not value:
                continue
        for path in (value, value + ".bin", value + ".idx"):
            if os.path.isfile(path):
                out.append((flag, path))
    return out


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
