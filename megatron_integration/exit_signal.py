"""Megatron-LM's ``--exit-signal-handler`` and ``--exit-signal``: a signal ends the run at the next
iteration boundary with a checkpoint, instead of killing it mid-step.

A scheduler that preempts or times out a job (Slurm, Kubernetes) sends SIGTERM to its processes
and kills them a grace period later; ``torchrun`` forwards it to each rank's process group. With
the handler on, the signal only marks this rank. After every trained iteration the ranks all-reduce
their marks (any rank's signal counts, since a scheduler's signals reach the ranks at different
moments), so every rank decides at the same iteration: it saves a checkpoint there (with
``--save``) and the run ends, with exit status 0, as Megatron-LM's does.

DynaPipe's planner worker processes share their rank's process group; they ignore the signals
that end a job (:mod:`dynapipe.runtime.planner_workers`) and end with their rank.
"""
from __future__ import annotations

import signal
from typing import Optional

import torch
import torch.distributed as dist

from dynapipe.errors import DynaPipeError
from dynapipe.runtime.planner_workers import JOB_SIGNALS

FLAG = "--exit-signal"
# Signals a process cannot catch: a handler for them would never run.
UNCATCHABLE = ("SIGKILL", "SIGSTOP")


def signal_number(name: str) -> int:
    """The number of the signal ``name`` (``SIGTERM``, as Megatron-LM's ``--exit-signal`` takes
    it); refused when it cannot be caught, or is none of the signals that end a job, which
    DynaPipe's planner workers ignore (any other would end them under their rank)."""
    if name in UNCATCHABLE:
        raise DynaPipeError(f"{FLAG} {name}: a process cannot catch {name}; give a signal a handler can catch "
                            f"(SIGTERM, the default, is what schedulers send before killing a job).")
    if name not in JOB_SIGNALS:
        raise DynaPipeError(f"{FLAG} {name}: give one of {', '.join(JOB_SIGNALS)} (SIGTERM by default), the "
                            f"signals launchers and schedulers send to end a job.")
    return int(signal.Signals[name])


class ExitSignal:
    """The handler of one run: installed by :meth:`install`, removed by :meth:`release` (the
    previous handler back). ``received()`` is collective over the job."""

    def __init__(self, name: str, device: torch.device):
        self.name, self.number, self.device = name, signal_number(name), device
        self._mark = False
        self._installed = False
        self._previous = None

    def install(self) -> "ExitSignal":
        """Mark this rank on the signal from now on (main thread only, as Python requires)."""
        self._previous = signal.getsignal(self.number)
        signal.signal(self.number, self._on_signal)
        self._installed = True
        return self

    def _on_signal(self, signum, frame) -> None:
        self._mark = True

    def received(self) -> bool:
        """Whether any rank got the signal so far; every rank gets the same answer (a MAX
        all-reduce over the job)."""
        flag = torch.tensor([1 if self._mark else 0], dtype=torch.int32, device=self.device)
        if dist.is_available() and dist.is_initialized():
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())

    def release(self) -> None:
        """Put the previous handler back (once); one Python did not set (None: a C library's) is
        given back as the default action, not left caught."""
        if self._installed:
            signal.signal(self.number, signal.SIG_DFL if self._previous is None else self._previous)
            self._installed = False


def exit_signal_line(name: str, iteration: int) -> str:
    """What rank 0 prints when the signal ended the run after ``iteration`` iterations."""
    return f"exiting program after receiving {name}, after iteration {iteration}"


def exit_signal_from_args(handler: bool, name: Optional[str]) -> Optional[str]:
    """The run's exit signal (None: no handler) from ``--exit-signal-handler`` and
    ``--exit-signal`` (None when not given); ``--exit-signal`` alone would be accepted and do
    nothing, so it is refused."""
    if not handler:
        if name is not None:
            raise DynaPipeError(f"{FLAG} {name} names the signal --exit-signal-handler catches, which is off; add "
                                f"--exit-signal-handler or drop {FLAG}.")
        return None
    name = name or "SIGTERM"
    signal_number(name)
    return name
