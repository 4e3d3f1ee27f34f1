"""wait_for_device: the executor's end-of-plan wait on CUDA, where transfer waits only order
streams; stood in for by events and abort channels whose answers are scripted."""
import pytest

from dynapipe.runtime.device_wait import wait_for_device
from dynapipe.runtime.p2p import RemoteFailure


class Event:
    def __init__(self, done_after: int):
        self.left, self.queries = done_after, 0

    def query(self) -> bool:
        self.queries += 1
        self.left -= 1
        return self.left < 0


class Abort:
    def __init__(self, reports_from: float):
        self.reports_from, self.asked = reports_from, 0

    def count(self) -> int:
        self.asked += 1
        return int(self.asked >= self.reports_from)


def test_returns_once_the_device_is_done():
    event, abort = Event(done_after=5), Abort(reports_from=float("inf"))
    wait_for_device(event, abort, lambda: "unused", spin_s=0.0, check_every_s=0.0)
    assert event.queries == 6 and abort.asked == 5
    wait_for_device(Event(done_after=3), None, lambda: "unused", spin_s=0.0)  # no channel: just waits


def test_a_peer_failure_stops_the_wait_before_the_device_finishes():
    # The device never finishes (a receive from a dead peer): the failure report ends the wait.
    event, abort = Event(done_after=10**9), Abort(reports_from=3)
    with pytest.raises(RemoteFailure, match="^rank 1 failed: out of memory$"):
        wait_for_device(event, abort, lambda: "rank 1 failed: out of memory", spin_s=0.0, check_every_s=0.0)
    assert abort.asked == 3


def test_the_channel_is_asked_at_its_own_pace():
    # Each ask is a store read: a healthy iteration's spin must not hammer the store.
    event, abort = Event(done_after=50), Abort(reports_from=float("inf"))
    wait_for_device(event, abort, lambda: "unused", spin_s=0.0001, check_every_s=10.0)
    assert event.queries == 51 and abort.asked == 1
