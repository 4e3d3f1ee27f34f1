"""Waiting for a device's queued work while watching for other ranks' failures.

On CUDA the executor's transfer waits only order streams, so a rank's host reaches the end of
its plan long before the device does; the first blocking read after it (a loss, a timing split)
would then sit in the driver until the process group's timeout (``--distributed-timeout-minutes``,
10 by default) if a peer died and one of this rank's receives can never complete. Polling an
event instead lets the rank stop as soon as the failure is reported.
"""
from __future__ import annotations

import time
from typing import Callable, Optional, Protocol

from dynapipe.runtime.abort_channel import AbortChannel
from dynapipe.runtime.p2p import RemoteFailure


class DeviceEvent(Protocol):
    """What is polled: ``torch.cuda.Event`` recorded after the work to wait for."""

    def query(self) -> bool: ...


def wait_for_device(done: DeviceEvent, abort: Optional[AbortChannel], failure: Callable[[], str],
                    spin_s: float = 0.0005, check_every_s: float = 0.01) -> None:
    """Return once ``done`` has completed; raise :class:`RemoteFailure` with ``failure()`` as its
    message as soon as ``abort`` counts a failure report. ``spin_s``: sleep between event
    queries (s; it bounds the latency this adds to a healthy iteration); ``check_every_s``: how
    often the abort channel, a store read, is asked (s)."""
    next_check = time.monotonic()
    while not done.query():
        if abort is not None and time.monotonic() >= next_check:
            if abort.count():
                raise RemoteFailure(failure())
            next_check = time.monotonic() + check_every_s
        time.sleep(spin_s)
