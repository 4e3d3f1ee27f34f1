"""Checkpoint files that prove their own integrity: a SHA-256 next to every file.

Each file a checkpoint writes (``model_optim_rng.pt``, ``rng_dp_XXX.pt``,
``distrib_optim.pt``) gets a sidecar ``FILE.sha256`` holding its digest and size in
bytes, written after the file itself is complete. Loading verifies both before the file
is unpickled, so an empty, truncated or bit-flipped file is refused with one line naming
it, instead of a ``RuntimeError``/``EOFError`` traceback or, worse, weights that load
silently with a changed value. The mechanism knows nothing of what is inside the files,
so it applies unchanged to any other checkpoint format's files.

:func:`check_writable_dir` runs at start-up, so a ``--save`` that cannot be written is found
before any work is done, not at the first save.
"""
from __future__ import annotations

import hashlib
import os
import re
import shutil
import tempfile
from typing import Any, Callable, Optional

from dynapipe.errors import DynaPipeError
from megatron_integration.agreement import attempt, everyone, same_error_everywhere

CHECKSUM_SUFFIX = ".sha256"
_READ_BLOCK = 8 << 20


def check_writable_dir(path: str, flag: str = "--save", what: str = "the checkpoints") -> None:
    """Create ``path`` if needed and prove a file can be written in it; one-line error naming
    ``flag`` if not (``what``: what goes there, for the message)."""
    if os.path.exists(path) and not os.path.isdir(path):
        raise DynaPipeError(f"{flag} {path!r} is a file, not a directory; give a directory for {what}.")
    try:
        os.makedirs(path, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=".write-test-", dir=path)
        os.close(fd)
        os.remove(probe)
    except OSError as e:
        raise DynaPipeError(f"{flag} {path!r} cannot be written ({e.strerror}); give a writable directory.") from None


# Where a save writes before its files move into place (see move_into_place).
STAGING_SUFFIX = ".saving"


def fresh_dir(path: str) -> None:
    """``path`` as a new empty directory (what an unfinished save left there removed)."""
    if os.path.isdir(path):
        shutil.rmtree(path)
    os.makedirs(path)


def save_failed_advice(root: str) -> str:
    """What a failed save's message tells the user: whether an earlier checkpoint under ``root``
    (``--save``) is still the latest, and what to do."""
    latest = os.path.join(root, "latest_checkpointed_iteration.txt")
    if os.path.exists(latest):
        return (f"{latest} still names the previous checkpoint (nothing is lost); fix the cause (a full disk?) "
                f"and resume from it.")
    return "No earlier checkpoint exists under --save; fix the cause (a full disk?) and start again."


def sync_file(path: str) -> None:
    """Flush ``path``'s data to its disk: a rename or the tracker written after it must never
    name data a node crash (not a killed process) can still lose."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def sync_dir(path: str) -> None:
    """Flush ``path``'s entries (renames into it) to its disk; a no-op where directories cannot
    be opened (not POSIX)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:  # some file systems refuse fsync on a directory; the data itself is synced
        pass
    finally:
        os.close(fd)


def move_into_place(staging: str, iter_dir: str) -> None:
    """Replace ``iter_dir`` (if any) by the complete ``staging``: two renames, the old directory
    removed last. Why: a save of an iteration ``--save`` already holds must not destroy the
    complete one before the new one is complete."""
    old = None
    if os.path.lexists(iter_dir):
        old = iter_dir + ".replaced"
        if os.path.isdir(old):
            shutil.rmtree(old)
        os.rename(iter_dir, old)
    try:
        os.rename(staging, iter_dir)
    except OSError:
        if old is not None:  # the complete earlier one back where the latest marker looks
            os.rename(old, iter_dir)
        raise
    sync_dir(os.path.dirname(os.path.abspath(iter_dir)))
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


class StagedSave:
    """One save of ``iter_dir``, written under ``iter_dir + .saving`` by every rank and moved into
    place by rank 0 once all are complete; collective. Each step a rank can fail alone ends in
    :meth:`agree` (which is also the barrier): one rank's full disk stops every rank with its line,
    and the partial staging directory is removed (it may hold a full disk's worth of shards)."""

    def __init__(self, iter_dir: str, rank: int):
        self.iter_dir, self.rank = iter_dir, rank
        self.staging = iter_dir + STAGING_SUFFIX

    def begin(self) -> None:
        """A fresh staging directory (what an unfinished save left there removed)."""
        self.agree(attempt(lambda: fresh_dir(self.staging), f"creating {self.staging}", self.kept())[1]
                   if self.rank == 0 else None)

    def kept(self) -> str:
        """What a failed save leaves, and what to do: the fix part of its line."""
        root = os.path.dirname(self.iter_dir.rstrip(os.sep))
        return (f"nothing of this save was kept, and the checkpoints already in {root} are untouched "
                f"(latest_checkpointed_iteration.txt still names the last complete one); make --save writable "
                f"(or free space) and resume from it")

    def agree(self, error: Optional[str]) -> None:
        """Every rank's ``error`` (None: fine); on any, the staging dropped and the first raised."""
        errors = everyone(error)
        if any(e is not None for e in errors):
            self.abandon()
            same_error_everywhere(None, errors)

    def abandon(self) -> None:
        """Remove the staging directory (rank 0, best effort): the save failed."""
        if self.rank == 0:
            shutil.rmtree(self.staging, ignore_errors=True)

    def complete(self) -> None:
        """Move the complete save into place (rank 0), agreed on."""
        self.agree(attempt(lambda: move_into_place(self.staging, self.iter_dir), f"completing {self.iter_dir}",
                           self.kept())[1] if self.rank == 0 else None)


def file_digest(path: str) -> tuple[str, int]:
    """SHA-256 (hex) and size in bytes of a file."""
    h = hashlib.sha256()
    size = 0
    with open(path, "rb") as f:
        while True:
            block = f.read(_READ_BLOCK)
            if not block:
                break
            h.update(block)
            size += len(block)
    return h.hexdigest(), size


def write_text_synced(path: str, text: str) -> None:
    """Write ``text`` to ``path`` atomically: a synced sibling renamed over it (the caller syncs
    the folder when the rename itself must survive a crash)."""
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def write_checksum(path: str) -> None:
    """Record ``path``'s digest and size in ``path + .sha256`` (atomically)."""
    digest, size = file_digest(path)
    write_text_synced(path + CHECKSUM_SUFFIX, f"{digest} {size}\n")


def verify_file(path: str) -> None:
    """Raise :class:`DynaPipeError` unless ``path`` matches its recorded digest and size."""
    if not os.path.isfile(path):
        what = "a directory" if os.path.isdir(path) else "missing"
        raise DynaPipeError(f"checkpoint file {path} is {what}; resume from a complete checkpoint.")
    record = path + CHECKSUM_SUFFIX
    try:
        with open(record) as f:
            fields = f.read().split()
        digest, size = fields[0], int(fields[1])
        if len(digest) != 64 or len(fields) != 2:
            raise ValueError
    except FileNotFoundError:
        raise DynaPipeError(f"checkpoint file {path} has no checksum ({record} is missing), so it cannot be "
                            f"verified; resume from a checkpoint this version saved.") from None
    except (OSError, ValueError, IndexError, UnicodeDecodeError):
        raise DynaPipeError(f"checksum file {record} is unreadable or corrupted; the checkpoint cannot be "
                            f"verified.") from None
    actual = os.path.getsize(path)
    if actual == 0:
        raise DynaPipeError(f"checkpoint file {path} is empty (0 of {size:,} bytes); it was not written completely.")
    if actual != size:
        kind = "truncated" if actual < size else "longer than when it was saved"
        raise DynaPipeError(f"checkpoint file {path} is {kind} ({actual:,} bytes, {size:,} saved).")
    if file_digest(path)[0] != digest:
        raise DynaPipeError(f"checkpoint file {path} is corrupted: its SHA-256 differs from the one recorded at "
                            f"save time; resume from another checkpoint.")


def save_with_checksum(save: Callable[[str], None], path: str) -> None:
    """Write ``path`` through ``save(tmp_path)``, rename it into place, then record its checksum."""
    tmp = path + ".tmp"
    save(tmp)
    sync_file(tmp)
    os.replace(tmp, path)
    write_checksum(path)
    sync_dir(os.path.dirname(os.path.abspath(path)))


def load_verified(load: Callable[[str], Any], path: str) -> Any:
    """Verify ``path`` against its checksum, then ``load(path)``; any failure is one line."""
    verify_file(path)
    try:
        return load(path)
    except DynaPipeError:
        raise
    except Exception as e:  # a file that passes its checksum but cannot be read: wrong format or version
        text = " ".join(str(e).split())[:300]
        raise DynaPipeError(f"checkpoint file {path} cannot be loaded ({type(e).__name__}: {text}).") from None


#: Megatron-LM's tracker file of a checkpoint directory: the iteration to resume (``checkpoint.LATEST``).
TRACKER = "latest_checkpointed_iteration.txt"
_ITERATION_DIR = re.compile(r"(iter_\d{7}|release)$")


def _one_checkpoint(path: str) -> bool:
    """Whether ``path`` holds one saved iteration's files (a ``torch_dist`` checkpoint's
    metadata, or per-rank ``mp_rank_*`` folders); by its contents, not its name: an empty
    ``release/`` made for a first launch is none."""
    try:
        names = os.listdir(path)
    except OSError:
        return False
    return any(n in ("metadata.json", ".metadata", "common.pt") or n.startswith("mp_rank_") for n in names)


def same_dir(a: Optional[str], b: Optional[str]) -> bool:
    """Whether ``a`` and ``b`` name one directory, through symbolic links (``/scratch`` and the
    ``/lustre/scratch`` it links to) and relative paths alike."""
    return bool(a and b) and os.path.realpath(a) == os.path.realpath(b)


def check_checkpoint_dirs(load: Optional[str], save: Optional[str], finetune: bool = False) -> None:
    """Refuse, before any work, a ``--load`` or ``--save`` that would lose a checkpoint:

    * ``--load`` naming one saved iteration (``iter_N/``) rather than the directory holding its
      tracker, or a directory of ``iter_*`` folders whose tracker is gone: either would start
      from random (Megatron-LM's reading of a directory without a tracker) and, with ``--save``
      there, move the tracker to the fresh model;
    * ``--save`` naming a directory that holds another run's checkpoints (a tracker) while
      ``--load`` does not resume them: this run would overwrite them (``finetune``: the run was
      given ``--finetune``, which the advice then says to drop).

    An empty ``--load`` is a fresh start, as in Megatron-LM."""
    if load and os.path.isdir(load) and not os.path.exists(os.path.join(load, TRACKER)):
        if _one_checkpoint(load):
            parent = os.path.dirname(os.path.normpath(load)) or "."
            raise DynaPipeError(f"--load {load}: is one saved iteration, not the directory that holds {TRACKER}; "
                                f"give --load {parent} (it resumes the iteration its {TRACKER} names).")
        saved = sorted(n for n in os.listdir(load)
                       if _ITERATION_DIR.match(n) and _one_checkpoint(os.path.join(load, n)))
        if saved:
            raise DynaPipeError(f"--load {load}: holds {len(saved)} saved iteration(s) ({saved[-1]} the last) but no "
                                f"{TRACKER}, so the run would start from random; write the iteration to resume "
                                f"into {os.path.join(load, TRACKER)} (the number alone, as Megatron-LM writes it), or "
                                f"give another --load.")
    if save and os.path.exists(os.path.join(save, TRACKER)) and not same_dir(load, save):
        # A fine-tuning job relaunched after preemption lands here too: it resumes with --load
        # of its own --save and no --finetune (which would start it again at iteration 0).
        resume = f"--load {save}" + (" without --finetune" if finetune else "")
        raise DynaPipeError(f"--save {save}: holds another run's checkpoints ({TRACKER}), which this run "
                            f"{'loads from ' + repr(load) + ' and ' if load else ''}would overwrite; give "
                            f"{resume} to resume that run, or another --save.")
