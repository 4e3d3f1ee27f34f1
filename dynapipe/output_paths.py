"""Output paths of the commands, checked before any planning is spent.

A command that plans for seconds and then cannot write its result (a directory where a
file belongs, a folder path through a file, the input file given again as output) wastes
the run and may leave half of its outputs behind. :func:`check_output_file` and
:func:`check_distinct` refuse such paths up front; :func:`make_parent` creates a missing
folder right before the write, as ``--plan-out`` creates its directory.
"""
from __future__ import annotations

import os
from typing import Optional, Sequence

from dynapipe.errors import DynaPipeError

STDIO = "-"  # stdin for an input, stdout for an output


def _nearest_existing(path: str) -> str:
    """``path``'s closest ancestor (or itself) that exists."""
    here = os.path.abspath(path)
    while not os.path.exists(here):
        up = os.path.dirname(here)
        if up == here:
            break
        here = up
    return here


def check_output_file(path: str, flag: str, suffix: Optional[str] = None) -> None:
    """Refuse a file output ``flag PATH`` that cannot be written: an existing directory, a
    name without ``suffix`` (such as ``.png``) when one is required, or a folder that
    neither exists nor can be created (a file in its way, or no write permission).
    ``-`` (stdout) always passes."""
    if path == STDIO:
        return
    if os.path.isdir(path) or path.endswith(("/", os.sep)):
        raise DynaPipeError(f"{flag} {path!r} is a directory; give a file path"
                            + (f" ending in {suffix}" if suffix else "") + ".")
    if suffix and not path.lower().endswith(suffix):
        stem = os.path.splitext(path)[0] if os.path.splitext(path)[1] else path
        raise DynaPipeError(f"{flag} {path!r} does not end in {suffix}, the only format it writes; "
                            f"use {stem + suffix!r}.")
    _check_creatable(os.path.dirname(os.path.abspath(path)), path, flag)


def check_output_dir(path: str, flag: str) -> None:
    """Refuse a directory output ``flag DIR`` that is a file or cannot be created."""
    if os.path.exists(path) and not os.path.isdir(path):
        raise DynaPipeError(f"{flag} {path!r} is a file, not a directory; give a directory "
                            f"(created if missing).")
    _check_creatable(os.path.abspath(path), path, flag)


def _check_creatable(folder: str, path: str, flag: str) -> None:
    """Refuse a ``folder`` (of ``flag path``) that neither exists nor can be made."""
    existing = _nearest_existing(folder)
    if not os.path.isdir(existing):
        raise DynaPipeError(f"{flag} {path!r}: {existing!r} is a file, not a folder, so nothing can be written "
                            f"under it; choose another path.")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise DynaPipeError(f"{flag} {path!r}: the folder {existing!r} is not writable; choose a path in a "
                            f"folder you can write.")


def check_distinct(paths: Sequence[tuple[str, Optional[str]]]) -> None:
    """Refuse two of ``(flag, path)`` naming the same file (an output would overwrite an
    input, or two outputs each other); unset paths and ``-`` are skipped."""
    seen: dict[str, str] = {}
    for flag, path in paths:
        if not path or path == STDIO:
            continue
        key = os.path.realpath(path)
        if key in seen:
            raise DynaPipeError(f"{seen[key]} and {flag} name the same file {path!r}, which {flag} would "
                                f"overwrite; give {flag} another path.")
        seen[key] = flag


def make_parent(path: str) -> None:
    """Create the folder of the file ``path`` if it is missing (checked by :func:`check_output_file`)."""
    parent = os.path.dirname(os.path.abspath(path))
    os.makedirs(parent, exist_ok=True)
