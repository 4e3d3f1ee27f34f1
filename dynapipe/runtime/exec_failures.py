"""How a rank's failure reaches its peers, and how a peer's failure is read.

:class:`FailureOps` is the part of :class:`~dynapipe.runtime.executor.Executor` that
publishes this rank's failures on the job's abort channel (inside the instruction loop and
outside it: the data loader, the gradient reduction, the optimizer step) and names another
rank's root cause when this one stops because of it. Without a store there is no channel:
ranks then stop on a broken connection or the timeout.
"""
from __future__ import annotations

import traceback
from typing import Callable, Optional, TypeVar

import torch.distributed as dist

from dynapipe.errors import DynaPipeError, ExecutorError
from dynapipe.plan.instructions import ExecutionPlan
from dynapipe.runtime.p2p import RemoteFailure

T = TypeVar("T")


class FailureOps:
    """Failure reports of :class:`~dynapipe.runtime.executor.Executor` (a mixin: it uses the
    executor's ``abort`` channel, ``global_rank`` and ``_failed``, the first line of this
    rank's failure once it has one)."""

    def report_outside(self, exc: BaseException, where: str) -> Optional[RemoteFailure]:
        """Publish a failure of this rank outside :meth:`run` (the data loader, a check, the
        gradient reduction, the optimizer step, an interrupt), so ranks waiting on this one in
        their plans stop now with its cause instead of at the timeout. ``where``: what was
        running (for example ``"iteration 7"``).

        Returns the error to raise instead of ``exc`` when another rank failed first and
        ``exc`` is most likely its consequence (a broken connection in a collective): a
        :class:`RemoteFailure` naming both; else None (raise ``exc``). A failure the
        instruction loop already reported is not reported again."""
        if self.abort is None:
            return None
        if self._failed is None:
            comm = isinstance(exc, ExecutorError) or isinstance(exc, getattr(dist, "DistError", ()))
            text = f"{where}, global rank {self.global_rank}: {type(exc).__name__}: {exc}"
            if not isinstance(exc, ExecutorError):
                text += "\n" + "".join(traceback.format_exception(exc)).rstrip()
            self._failed = text.splitlines()[0]
            self.abort.report(self.global_rank, text, primary=not comm)
        if isinstance(exc, DynaPipeError) or not isinstance(exc, Exception):
            return None  # an error of its own (agreed ones such as a NaN included), or an interrupt
        first = self.abort.reports()
        if not first or first[0]["rank"] == self.global_rank:
            return None
        line = " ".join(str(exc).split())[:300]
        return RemoteFailure(f"{where}: {type(exc).__name__}: {line}; global rank {first[0]['rank']} failed first:\n"
                             f"{first[0]['message']}")

    def reporting(self, where: str, fn: Callable[[], T]) -> T:
        """``fn()``, with any failure published by :meth:`report_outside` (and replaced by the
        root cause it returns); ``where`` names what ran, for example ``"iteration 7"``."""
        try:
            return fn()
        except BaseException as e:
            instead = self.report_outside(e, where)
            if instead is not None:
                raise instead from e
            raise

    def failure_elsewhere(self) -> Optional[str]:
        """The root cause another rank reported (None: none did, or no store): a data loader's
        ``failure_watch``, so ranks waiting for their plans stop with it."""
        return None if self.abort is None else self.abort.failure_of_another(self.global_rank)

    def _remote_failure(self, plan: ExecutionPlan) -> str:
        """Why this rank stops after running its plan: another rank reported a failure."""
        message = (f"pipeline rank {plan.stage} (global rank {self.global_rank}) finished its plan "
                   f"but another rank failed; {self.abort.root_cause()}")
        self._failed = message.splitlines()[0]
        return message

    def _fail(self, err: ExecutorError, primary: bool) -> None:
        self._failed = str(err).splitlines()[0]
        if self.abort is not None:
            self.abort.report(self.global_rank, str(err), primary)
