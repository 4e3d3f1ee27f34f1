"""Megatron-LM's ``--result-rejected-tracker-filename``: a log of rejected results across jobs,
and the iterations it tells later jobs to skip.

Every rejected result (a NaN or Inf loss or gradient norm, an injected error, a spike) appends
one line a rank to the file, in Megatron-LM's format, so a file written by Megatron-LM is read
here and the other way round::

    ts=2026-12-07 10:00:00.123456 node=n1 device=0 jobID=4711 rank=3 iteration=12 \
status=RerunValidationStatus.FIRST_RERUN_REPRODUCIBLE result=nan message='loss'

``iteration`` is the iteration as the log lines name it (from 1), ``jobID`` is ``SLURM_JOBID``
(``N/A`` outside Slurm). A job that starts with the file skips, as Megatron-LM's does, each
iteration that one rank reported twice with a status that says the result is the run's own
(``rerun_disabled``, ``first_rerun_reproducible``, ``second_rerun_reproducible``: a NaN that
comes back every time the batch is trained), unless several ranks reported it within one job (a
fault of the whole run, which skipping one batch does not mend). The skipped iterations join
``--iterations-to-skip``.

Rank 0 writes every rank's line (the results and places are gathered on every rank), so lines of
one event never interleave with another writer's; the file must be on a filesystem every rank of
the next job reads.
"""
from __future__ import annotations

import datetime
import os
import re
from dataclasses import dataclass
from typing import Iterable, Optional

from dynapipe.errors import DynaPipeError

STATUSES = ("RERUN_DISABLED", "INITIAL_RUN", "FIRST_RERUN_NOT_REPRODUCIBLE", "FIRST_RERUN_REPRODUCIBLE",
            "SECOND_RERUN_NOT_REPRODUCIBLE", "SECOND_RERUN_REPRODUCIBLE")
# The statuses that say a result is the run's own, not a device's (Megatron-LM's choice).
REPRODUCIBLE = ("RERUN_DISABLED", "FIRST_RERUN_REPRODUCIBLE", "SECOND_RERUN_REPRODUCIBLE")
_LINE = re.compile(r"ts=.+ node=.+ device=.+ jobID=(.+) rank=(.+) iteration=(.+) status=(.+) result=.+ message=.+")
FLAG = "--result-rejected-tracker-filename"


@dataclass(frozen=True)
class TrackedSkips:
    """What a tracker file says at a job's start: the iterations to skip (from 1, as logged) and
    those several ranks of one job reported, which are not skipped."""

    path: str
    skip: tuple[int, ...] = ()
    not_skipped: tuple[int, ...] = ()

    def lines(self) -> list[str]:
        """What the job's log says of them (nothing when the file named none)."""
        out = []
        if self.skip:
            out.append(f"{FLAG} {self.path}: skipping iterations {list(self.skip)}, each rejected twice on one rank "
                       f"with a result that reproduced")
        if self.not_skipped:
            out.append(f"{FLAG} {self.path}: not skipping iterations {list(self.not_skipped)}, rejected on several "
                       f"ranks of one job")
        return out


def check_appendable(path: str) -> None:
    """Create ``path`` if it is missing and make sure it can be appended to, as Megatron-LM does
    at start-up (a tracker that cannot be written loses what the next job needs)."""
    try:
        with open(path, "a"):
            pass
    except OSError as e:
        raise DynaPipeError(f"{FLAG} {path}: cannot append to it ({e.strerror or e}); name a writable file on a "
                            f"filesystem every rank reads.") from None


def tracked_skips(path: Optional[str]) -> Optional[TrackedSkips]:
    """A job's start with ``--result-rejected-tracker-filename path``: the file made appendable
    (:func:`check_appendable`) and what it says (:func:`read_skips`); None without the flag."""
    if path is None:
        return None
    check_appendable(path)
    return read_skips(path)


def read_skips(path: str) -> TrackedSkips:
    """The iterations ``path`` tells a job to skip (a missing file: none). A line that is not in
    the tracker's format is refused, naming it: the iterations it holds would be lost."""
    if not os.path.exists(path):
        return TrackedSkips(path)
    seen: set[tuple[int, int]] = set()  # (rank, iteration)
    by_job: dict[tuple[str, int], set[int]] = {}  # (job, iteration) -> ranks
    skip: set[int] = set()
    with open(path, errors="replace") as f:
        for number, text in enumerate(f, 1):
            if not text.strip():
                continue
            job, rank, iteration, status = _parse(path, number, text)
            if status not in REPRODUCIBLE:
                continue
            if (rank, iteration) in seen:
                skip.add(iteration)
            seen.add((rank, iteration))
            by_job.setdefault((job, iteration), set()).add(rank)
    several = {it for (_, it), ranks in by_job.items() if len(ranks) > 1}
    return TrackedSkips(path, tuple(sorted(skip - several)), tuple(sorted(skip & several)))


def _parse(path: str, number: int, text: str) -> tuple[str, int, int, str]:
    match = _LINE.search(text)
    fix = "correct or remove the line"
    if match is None:
        raise DynaPipeError(f"{FLAG} {path}, line {number}: not a tracker line ({text.strip()[:80]!r}); {fix}.")
    job, rank, iteration, status = match.groups()
    status = status.split(".")[-1].upper()
    try:
        rank_n, iteration_n = int(rank), int(iteration)
    except ValueError:
        raise DynaPipeError(f"{FLAG} {path}, line {number}: rank {rank!r} or iteration {iteration!r} is not a whole "
                            f"number; {fix}.") from None
    if status not in STATUSES:
        raise DynaPipeError(f"{FLAG} {path}, line {number}: status {status!r} is none of {', '.join(STATUSES)}; "
                            f"{fix}.")
    return job, rank_n, iteration_n, status


def same_skips_everywhere(every_rank: list) -> None:
    """Refuse a job whose ranks skip different iterations (``every_rank``: each rank's tracker
    path and its ``--iterations-to-skip`` with the tracker's): the files they read differ, and
    ranks that skip different batches wait on each other forever."""
    path0, skips0 = every_rank[0]
    differing = [r for r, (_, skips) in enumerate(every_rank) if tuple(skips) != tuple(skips0)]
    if differing:
        r = differing[0]
        raise DynaPipeError(f"{FLAG}: rank 0 skips iterations {list(skips0)} ({path0}) and rank {r} "
                            f"{list(every_rank[r][1])} ({every_rank[r][0]}); the ranks read different files. Name one "
                            f"file on a filesystem every rank reads.")


@dataclass(frozen=True)
class Rejection:
    """One rank's line: its rank, node and device, the rejected value and what it is
    (``loss``, ``gradient norm``, an injected error)."""

    rank: int
    node: str
    device: object
    result: float
    message: str


def append(path: str, iteration: int, status: str, rejections: Iterable[Rejection],
           now: Optional[datetime.datetime] = None) -> None:
    """Append one line a rejection (``iteration`` from 1, ``status`` one of :data:`STATUSES`)
    to ``path`` (rank 0 calls it). A failing write is raised: it would lose the record the
    next job skips by."""
    if status not in STATUSES:
        raise ValueError(f"unknown tracker status {status!r}")
    ts = now or datetime.datetime.now()
    job = os.environ.get("SLURM_JOBID", "N/A")
    lines = "".join(f"ts={ts} node={r.node} device={r.device} jobID={job} rank={r.rank} iteration={iteration} "
                    f"status=RerunValidationStatus.{status} result={r.result} message='{r.message}'\n"
                    for r in rejections)
    if not lines:
        return
    try:
        with open(path, "a") as f:
            f.write(lines)
            f.flush()
            os.fsync(f.fileno())
    except OSError as e:
        raise DynaPipeError(f"{FLAG} {path}: could not record the rejected result of iteration {iteration} "
                            f"({e.strerror or e}); the lines were:\n{lines.rstrip()}") from None
