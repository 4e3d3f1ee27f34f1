"""Output paths of the commands, checked before any planning is spent, and written whole.

A command that plans for seconds and then cannot write its result (a directory where a
file belongs, a folder path through a file, the input file given again as output, an
empty path) wastes the run and may leave half of its outputs behind. :func:`check_output_file`
and :func:`check_distinct` refuse such paths up front; :func:`write_output` writes a file
beside its final name and renames it over that name, so a failed write (a full disk) leaves
an earlier file as it was instead of truncated; :func:`make_parent` creates a missing folder
right before the write, as ``--plan-out`` creates its directory.
"""
from __future__ import annotations

import os
import sys
from typing import Optional, Sequence, Union

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


def check_output_file(path: str, flag: str, suffix: Optional[str] = None, stdout: bool = False) -> None:
    """Refuse a file output ``flag PATH`` that cannot be written: an empty path, an existing
    directory, a name without ``suffix`` (such as ``.png``) when one is required, or a folder
    that neither exists nor can be created (a file in its way, or no write permission).
    ``-`` passes where the command writes that output to stdout (``stdout``), and is refused
    elsewhere rather than written as a file named ``-``."""
    _check_not_empty(path, flag)
    if path == STDIO:
        if stdout:
            return
        raise DynaPipeError(f"{flag} -: this output cannot go to stdout; give a file path.")
    if os.path.isdir(path) or path.endswith(("/", os.sep)):
        raise DynaPipeError(f"{flag} {path!r} is a directory; give a file path"
                            + (f" ending in {suffix}" if suffix else "") + ".")
    if suffix and not path.lower().endswith(suffix):
        stem = os.path.splitext(path)[0] if os.path.splitext(path)[1] else path
        raise DynaPipeError(f"{flag} {path!r} does not end in {suffix}, the only format it writes; "
                            f"use {stem + suffix!r}.")
    _check_not_shipped(path, flag)
    _check_creatable(os.path.dirname(os.path.abspath(path)), path, flag)


def _check_not_shipped(path: str, flag: str) -> None:
    """Refuse an output over a file of the shipped ``configs/`` folder: a command naming a
    shipped config by its short name (``--model gpt-7b``, or the cluster a device picks)
    would otherwise write over the config it reads, and every later run would read that."""
    from dynapipe.config import CONFIG_DIR

    shipped, real = os.path.realpath(CONFIG_DIR), os.path.realpath(path)
    if os.path.isfile(real) and os.path.commonpath([real, shipped]) == shipped:
        raise DynaPipeError(f"{flag} {path!r} is {os.path.relpath(real, os.path.dirname(shipped))}, a config file "
                            f"of this project's configs/ folder, which the commands read by name; give another "
                            f"path.")


def _check_not_empty(path: str, flag: str) -> None:
    if not path or not path.strip():
        raise DynaPipeError(f"{flag} {path!r}: an empty path; give a path, or leave {flag} out.")


def check_output_dir(path: str, flag: str) -> None:
    """Refuse a directory output ``flag DIR`` that is empty, ``-`` (stdout, not a folder), a
    file or cannot be created."""
    _check_not_empty(path, flag)
    if path == STDIO:
        raise DynaPipeError(f"{flag} -: this output is a directory of files and cannot go to stdout; give a "
                            f"directory path.")
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


def _file_key(path: str):
    """What identifies the file at ``path``: its device and inode when it exists (so a hard
    link is the file it links), else its resolved path."""
    try:
        st = os.stat(path)
        return ("inode", st.st_dev, st.st_ino)
    except OSError:
        return ("path", os.path.realpath(path))


def check_distinct(paths: Sequence[tuple[str, Optional[str]]]) -> None:
    """Refuse two of ``(flag, path)`` naming the same file (an output would overwrite an
    input, or two outputs each other), through symbolic and hard links alike; unset paths
    and ``-`` are skipped."""
    seen: dict = {}
    for flag, path in paths:
        if not path or path == STDIO:
            continue
        key = _file_key(path)
        if key in seen:
            raise DynaPipeError(f"{seen[key]} and {flag} name the same file {path!r}, which {flag} would "
                                f"overwrite; give {flag} another path.")
        seen[key] = flag


def check_outputs_apart(inputs: Sequence[tuple[str, Optional[str]]],
                        outputs: Sequence[tuple[str, Optional[str]]]) -> None:
    """Refuse an output of ``outputs`` (``(flag, path)``) naming the same file as an input of
    ``inputs`` or as another output (through links alike); inputs may name one file twice (a
    training and a validation split of one dataset)."""
    read = {}
    for flag, path in inputs:
        if path and path != STDIO:
            read.setdefault(_file_key(path), flag)
    for flag, path in outputs:
        if path and path != STDIO and _file_key(path) in read:
            raise DynaPipeError(f"{read[_file_key(path)]} and {flag} name the same file {path!r}, which {flag} "
                                f"would overwrite; give {flag} another path.")
    check_distinct(outputs)


def make_parent(path: str) -> None:
    """Create the folder of the file ``path`` if it is missing (checked by :func:`check_output_file`)."""
    parent = os.path.dirname(os.path.abspath(path))
    os.makedirs(parent, exist_ok=True)


def config_inputs(args, flags: Sequence[str] = ("model", "device", "cluster", "profile", "mixture")) -> list:
    """``(flag, path)`` of the config options of ``args`` that name existing files (a shipped
    config's name names none), for :func:`check_distinct`: an output must not overwrite one."""
    out = []
    for name in flags:
        value = getattr(args, name, None)
        if isinstance(value, str) and value and os.path.isfile(value):
            out.append(("--" + name.replace("_", "-"), value))
    return out


def write_output(path: str, data: Union[str, bytes], flag: str) -> None:
    """Write ``data`` (text or bytes) to ``path`` whole or not at all (``-``: text to stdout).

    The file is written as a hidden sibling and renamed over ``path``, so a failure (a full
    disk, a quota) leaves any earlier file there unchanged, never truncated. Raises
    :class:`DynaPipeError` naming ``flag`` when it cannot be written."""
    if path == STDIO:
        sys.stdout.write(data if isinstance(data, str) else data.decode())
        sys.stdout.flush()
        return

    def save(tmp: str) -> None:
        with open(tmp, "wb" if isinstance(data, bytes) else "w") as f:
            f.write(data)

    saved_whole(path, save, flag)


def saved_whole(path: str, save, flag: str) -> None:
    """Run ``save(tmp_path)`` (a writer that takes a file name, such as matplotlib's) on a
    hidden sibling of ``path`` with the same suffix, then rename it over ``path``: as
    :func:`write_output`, an earlier file survives a failed save."""
    folder, name = os.path.split(os.path.abspath(path))
    stem, suffix = os.path.splitext(name)
    tmp = os.path.join(folder, f".{stem}.{os.getpid()}.tmp{suffix}")
    try:
        make_parent(path)
        save(tmp)
        os.replace(tmp, path)
    except OSError as e:
        raise DynaPipeError(f"{flag} {path!r} cannot be written: {e.strerror or e}; an earlier file there, if "
                            f"any, is unchanged.") from None
    finally:
        if os.path.exists(tmp):
            try:
                os.remove(tmp)
            except OSError:
                pass
