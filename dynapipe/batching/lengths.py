"""Sample lengths of one global batch: reading a lengths file and validating arrays.

A lengths file holds one positive integer a line (decoder-only: tokens of the sample)
or two (encoder-decoder: input and target tokens). Blank lines and lines starting with
``#`` are skipped. Every error names the line (files) or the index (arrays) at fault.
"""
from __future__ import annotations

import re
import sys
from typing import Iterable, Optional, TextIO

import numpy as np

from dynapipe.errors import DynaPipeError, file_read_errors

# A sign and ASCII digits: int() alone also takes "1_000", blanks and non-ASCII digits.
_INTEGER = re.compile(r"[+-]?[0-9]+\Z")
# No sample is longer than this (tokens); it also keeps lengths well inside int64.
MAX_LENGTH = 2**31 - 1


def _parse_lines(lines: Iterable[str], source: str) -> np.ndarray:
    rows: list[list[int]] = []
    width: Optional[int] = None
    first_line = 0
    for lineno, raw in enumerate(lines, start=1):
        # An editor's byte-order mark is not part of the first length (stdin too; files are
        # opened as utf-8-sig).
        text = (raw.lstrip("\ufeff") if lineno == 1 else raw).strip()
        if not text or text.startswith("#"):
            continue
        fields = text.split()
        if len(fields) not in (1, 2):
            raise DynaPipeError(
                f"{source}, line {lineno}: {text!r} has {len(fields)} values; write one length a line "
                f"(decoder-only) or two, 'input target' (encoder-decoder).")
        if width is None:
            width, first_line = len(fields), lineno
        elif len(fields) != width:
            raise DynaPipeError(
                f"{source}, line {lineno}: {text!r} has {len(fields)} value(s) but line {first_line} has "
                f"{width}; use one column (decoder-only) or two (encoder-decoder) throughout.")
        row = []
        for field in fields:
            if not _INTEGER.match(field):
                raise DynaPipeError(f"{source}, line {lineno}: {field!r} is not an integer length in tokens "
                                    f"(ASCII digits only).")
            value = int(field, 10)
            if value <= 0:
                # The line as written: '1 00' is read as two lengths, which the value alone hides.
                raise DynaPipeError(f"{source}, line {lineno}: length {value} must be a positive number of tokens"
                                    f"{f' (the line reads {text!r})' if len(fields) > 1 else ''}.")
            if value > MAX_LENGTH:
                raise DynaPipeError(f"{source}, line {lineno}: length {field[:24]}{'...' if len(field) > 24 else ''} "
                                    f"is above {MAX_LENGTH:,} tokens, longer than any sample can be.")
            row.append(value)
        rows.append(row)
    if not rows:
        raise DynaPipeError(f"{source}: the batch is empty (no lengths found); give at least one sample.")
    arr = np.asarray(rows, dtype=np.int64)
    return arr[:, 0] if width == 1 else arr


def read_lengths(path: str, stdin: Optional[TextIO] = None) -> np.ndarray:
    """Read a lengths file (``-`` reads ``stdin``): ``(n,)`` or ``(n, 2)`` int64 tokens."""
    if path == "-":
        stream = stdin if stdin is not None else sys.stdin
        return _parse_lines(stream, "<stdin>")
    with file_read_errors("lengths file", path, missing="write one with `python -m dynapipe synth`.",
                          directory="give a file with one length a line.",
                          not_text="is not a text file of integers."):
        # utf-8-sig: an editor's byte-order mark is not part of the first length.
        with open(path, encoding="utf-8-sig") as f:
            return _parse_lines(f, path)


def read_lengths_for(path: str, model_name: str, encoder_decoder: bool, flag: str = "--lengths") -> np.ndarray:
    """:func:`read_lengths`, refusing a file of the other kind than the model's (one length a
    sample for a decoder-only model, (input, target) pairs for an encoder-decoder one) in a
    line naming the file, the model and the fix."""
    arr = read_lengths(path)
    pairs = arr.ndim == 2
    if pairs != encoder_decoder:
        has, kind = ("(input, target) pairs", "decoder-only") if pairs else ("one length a sample", "encoder-decoder")
        want = "one length a sample" if pairs else "two a sample, input and target tokens"
        synth = "--encoder-decoder " if encoder_decoder else ""
        raise DynaPipeError(f"{flag} {path} holds {has}, and model {model_name!r} is {kind}: give {want} "
                            f"(`python -m dynapipe synth {synth}...` writes them) or a model of the other kind.")
    return arr


def _refuse_truth_values(lengths, arr: np.ndarray) -> None:
    """Refuse ``True``/``False`` among the lengths: numpy turns ``[True, 6]`` into ``[1, 6]``,
    which would plan a 1-token sample that nobody asked for."""
    if arr.dtype.kind == "b":
        raise DynaPipeError("lengths are True/False values, not numbers of tokens; give integer lengths.")
    if isinstance(lengths, np.ndarray):
        return  # a numeric array holds no truth values
    for i, row in enumerate(lengths):
        for v in (row if isinstance(row, (list, tuple, np.ndarray)) else (row,)):
            if isinstance(v, (bool, np.bool_)):
                raise DynaPipeError(f"sample {i}: length {v!r} is not an integer number of tokens.")


def validate_lengths(lengths, encoder_decoder: bool) -> np.ndarray:
    """Check an array of lengths for the planner and return it as int64.

    ``(n,)`` for decoder-only models, ``(n, 2)`` (input, target tokens) for
    encoder-decoder ones. Raises :class:`DynaPipeError` naming the first bad sample.
    """
    try:
        arr = np.asarray(lengths)
    except ValueError as e:  # ragged rows: some samples with two lengths, some with one
        raise DynaPipeError(f"lengths are not one row per sample of equal size ({e}); give (n,) lengths, or "
                            f"(n, 2) (input, target) pairs.") from None
    if arr.size == 0:
        raise DynaPipeError("the batch is empty (no lengths); give at least one sample.")
    if arr.ndim == 0 or not hasattr(lengths, "__iter__"):  # None, one number, an object numpy wraps whole
        raise DynaPipeError(f"lengths {lengths!r:.60}: give a sequence of sample lengths in tokens (a list or an "
                            f"array; (n, 2) input and target lengths for an encoder-decoder model).")
    _refuse_truth_values(lengths, arr)
    if arr.ndim not in (1, 2) or (arr.ndim == 2 and arr.shape[1] != 2):
        raise DynaPipeError(f"lengths have shape {arr.shape}; expected (n,) for decoder-only models "
                            f"or (n, 2) (input, target) for encoder-decoder ones.")
    if encoder_decoder and arr.ndim != 2:
        raise DynaPipeError("the model is encoder-decoder: give two lengths a sample (input and target tokens).")
    if not encoder_decoder and arr.ndim != 1:
        raise DynaPipeError("the model is decoder-only: give one length a sample, not (input, target) pairs "
                            "(add them up, or choose an encoder-decoder model).")
    if arr.dtype.kind not in "iu":
        flat = arr.reshape(len(arr), -1)
        for i, row in enumerate(flat):
            for v in row:
                # Each value on its own: an object array (a None among numbers) is judged value by value.
                ok = isinstance(v, (int, float, np.integer, np.floating)) and not isinstance(v, (bool, np.bool_)) \
                    and float(v).is_integer()
                if not ok:
                    shown = v.item() if hasattr(v, "item") else v
                    raise DynaPipeError(f"sample {i}: length {shown!r} is not an integer number of tokens.")
                if abs(float(v)) > MAX_LENGTH:
                    raise DynaPipeError(f"sample {i}: length {float(v):g} is above {MAX_LENGTH:,} tokens.")
        arr = np.asarray(arr, dtype=np.int64)
    bad = np.flatnonzero((arr.reshape(len(arr), -1) <= 0).any(axis=1))
    if len(bad):
        i = int(bad[0])
        raise DynaPipeError(f"sample {i}: length {arr[i].tolist()} must be a positive number of tokens.")
    big = np.flatnonzero((arr.reshape(len(arr), -1) > MAX_LENGTH).any(axis=1))
    if len(big):
        i = int(big[0])
        raise DynaPipeError(f"sample {i}: length {arr[i].tolist()} is above {MAX_LENGTH:,} tokens.")
    return np.ascontiguousarray(arr, dtype=np.int64)
