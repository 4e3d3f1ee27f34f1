"""Failure reports every rank of a job shares through a key-value store (:class:`AbortChannel`).

A rank that fails publishes its message; a rank waiting on a transfer polls for reports, so
it stops with the first rank's cause instead of waiting out its timeout on a peer that will
never send (:class:`~dynapipe.runtime.p2p.Waiter`).
"""
from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass
from typing import Optional

import torch.distributed as dist


@dataclass
class AbortChannel:
    """Failure reports shared by every rank of the job through a key-value store.

    A failing rank writes its message (with its traceback) under its own key and bumps a
    counter; waiting ranks poll the counter and, once it moves, stop with the report of
    the rank that failed first. Primary reports (a handler exception, a tensor that differs
    from the plan) outrank the secondary ones of ranks that lost a connection or timed out
    because of it.
    """

    store: dist.Store
    world_size: int
    prefix: str = "dynapipe/abort"

    def report(self, rank: int, message: str, primary: bool) -> None:
        """Publish this rank's failure; never raises (the store may be gone as well): when it
        cannot be published, this rank's stderr says so, since its peers will see a timeout."""
        try:
            doc = {"rank": rank, "primary": primary, "time": time.time(), "message": message}
            self.store.set(f"{self.prefix}/{rank}", json.dumps(doc))
            self.store.add(f"{self.prefix}/count", 1)
        except Exception as e:  # noqa: BLE001 - reporting is best effort while failing
            print(f"dynapipe: global rank {rank} could not tell the other ranks of its failure "
                  f"({type(e).__name__}: {e}): {message.splitlines()[0] if message else ''}",
                  file=sys.stderr, flush=True)

    def count(self) -> int:
        """How many failure reports exist (0 while all is well, or when the store is gone:
        the wait that asks is bounded by its own timeout)."""
        try:
            return int(self.store.add(f"{self.prefix}/count", 0))
        except Exception:  # noqa: BLE001
            return 0

    def reports(self) -> list[dict]:
        """Every report, primary ones first, then by time."""
        out = []
        for r in range(self.world_size):
            key = f"{self.prefix}/{r}"
            try:
                if self.store.check([key]):
                    out.append(json.loads(self.store.get(key)))
            except Exception:  # noqa: BLE001
                break
        return sorted(out, key=lambda d: (not d["primary"], d["time"]))

    def failure_of_another(self, rank: int) -> Optional[str]:
        """The root cause (:meth:`root_cause`) once a rank other than ``rank`` reported; None
        before (one store round trip while nobody failed)."""
        reports = self.reports() if self.count() else []
        if all(d["rank"] == rank for d in reports):
            return None
        return _first_failed(reports[0])

    def root_cause(self, grace_s: float = 0.0) -> Optional[str]:
        """The first primary report (or the earliest one), waiting up to ``grace_s`` for one."""
        deadline = time.monotonic() + grace_s
        while True:
            try:
                reports = self.reports() if self.count() else []
            except Exception:  # noqa: BLE001 - the store went away with its host
                return None
            if reports and (reports[0]["primary"] or time.monotonic() >= deadline):
                return _first_failed(reports[0])
            if time.monotonic() >= deadline:
                return None
            time.sleep(0.05)


def _first_failed(report: dict) -> str:
    """How a report reads as the root cause of the others' failures."""
    return f"global rank {report['rank']} failed first:\n{report['message']}"
