"""CPU time of a training rank and of the processes it started, per iteration.

DynaPipe's planner workers are child processes of the rank that hosts them; on a
shared CPU their work competes with the training ranks, so a fair benchmark counts it.
:class:`IterationCpu` records, after every iteration, the CPU time (user + system, ms)
this rank's process and its descendant processes used since the previous record.
Descendants are read from Linux ``/proc``; elsewhere their figure is ``None``. It also
records the rank's minor page faults and system CPU ms: memory faulted in for the first time
(a new high-water mark of the heap) shows there, a cost a long run pays once.
"""
from __future__ import annotations

import os
import resource
import time
from typing import Optional

_TICK_MS = 1000.0 / os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 10.0


def _proc_stats() -> Optional[dict[int, tuple[int, float]]]:
    """``pid -> (parent pid, CPU ms)`` of every process visible in /proc (None without /proc)."""
    if not os.path.isdir("/proc"):
        return None
    out = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                text = f.read()
        except OSError:  # gone meanwhile
            continue
        # Fields after the command name (which may hold spaces) in parentheses.
        fields = text[text.rfind(")") + 2:].split()
        out[int(name)] = (int(fields[1]), (int(fields[11]) + int(fields[12])) * _TICK_MS)
    return out


def descendants_cpu_ms(pid: Optional[int] = None) -> Optional[float]:
    """CPU ms used so far by the live descendant processes of ``pid`` (default: this process)."""
    stats = _proc_stats()
    if stats is None:
        return None
    root = os.getpid() if pid is None else pid
    children: dict[int, list[int]] = {}
    for p, (ppid, _) in stats.items():
        children.setdefault(ppid, []).append(p)
    total, todo = 0.0, list(children.get(root, []))
    while todo:
        p = todo.pop()
        total += stats[p][1]
        todo.extend(children.get(p, []))
    return total


def _faults_and_system_ms() -> tuple[int, float]:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_minflt, usage.ru_stime * 1e3


class IterationCpu:
    """Per-iteration CPU ms of this process (``rank_ms``), of its descendants
    (``children_ms``; ``None`` entries without /proc), and this process's minor page faults
    (``minor_faults``) and system CPU ms (``system_ms``, part of ``rank_ms``). Call
    :meth:`record` after each iteration."""

    def __init__(self):
        self.rank_ms: list[float] = []
        self.children_ms: list[Optional[float]] = []
        self.minor_faults: list[int] = []
        self.system_ms: list[float] = []
        self._rank = time.process_time() * 1e3
        self._children = descendants_cpu_ms()
        self._faults, self._system = _faults_and_system_ms()

    def record(self, *_args) -> None:
        rank = time.process_time() * 1e3
        children = descendants_cpu_ms()
        self.rank_ms.append(rank - self._rank)
        # A child that exited between records takes its CPU with it: never report a negative share.
        self.children_ms.append(None if children is None or self._children is None
                                else max(children - self._children, 0.0))
        self._rank, self._children = rank, children
        faults, system = _faults_and_system_ms()
        self.minor_faults.append(faults - self._faults)
        self.system_ms.append(system - self._system)
        self._faults, self._system = faults, system
