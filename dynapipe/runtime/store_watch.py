"""Notice a restarted Redis server, so what it lost can be planned again.

A restarted server (without persistence) comes back empty: payloads published but not
yet read are gone, and the ranks waiting for them would wait until the plan timeout.
:class:`RestartWatcher` runs on each planner node: a thread with its own connection
that reads the server's run id every ``poll_s`` seconds and calls ``on_restart`` when it
changes. Planning is deterministic (same seed, same batches, same plans), so publishing
a lost iteration again gives every rank exactly what it would have read. The same thread
keeps the run's keys from expiring while the job lives (``keep_alive``).
"""
from __future__ import annotations

import sys
import threading
import time
import traceback
from typing import Callable, Optional

from dynapipe.runtime.kv_store import KVStoreSpec


class RestartWatcher:
    """Calls ``on_restart()`` from a daemon thread whenever the Redis server's run id changes.

    A server that stays away longer than the spec's ``retry_s`` ends the thread quietly:
    the ranks' own store calls report that, with the same one-line error. An exception of
    ``on_restart`` itself (the replanning failed) ends the thread too, and its traceback goes
    to ``on_error`` (the loader posts it where every rank's fetcher looks), never nowhere.
    """

    def __init__(self, spec: KVStoreSpec, on_restart: Callable[[], None], poll_s: float = 0.2,
                 on_error: Optional[Callable[[str], None]] = None, keep_alive: Optional[str] = None):
        self.spec = spec
        # Keys under ``keep_alive`` (the run's) get their expiry restarted every quarter of the
        # spec's ttl_s: a payload may wait unread longer than the ttl (a long evaluation or save).
        self.keep_alive = keep_alive
        self._refresh_s = max(spec.ttl_s / 4.0, poll_s)
        self._refreshed = time.monotonic()
        self.on_restart = on_restart
        self.on_error = on_error
        self.poll_s = poll_s
        self.restarts = 0
        self._stop = threading.Event()
        self._kv = spec.connect()
        self._server: Optional[str] = self._kv.server_id()
        self._thread = threading.Thread(target=self._run, daemon=True, name="dynapipe-redis-watch")
        self._thread.start()

    def _run(self) -> None:
        try:
            while not self._stop.wait(self.poll_s):
                if self.keep_alive is not None and time.monotonic() - self._refreshed >= self._refresh_s:
                    self._refreshed = time.monotonic()
                    try:
                        self._kv.refresh(self.keep_alive)
                    except Exception:  # noqa: BLE001 - the keys then expire as before; restarts are still watched
                        pass
                server = self._kv.server_id()
                if server != self._server:
                    self._server = server
                    self.restarts += 1
                    try:
                        self.on_restart()
                    except Exception:  # noqa: BLE001 - reported, then the watch ends
                        self._report(traceback.format_exc())
                        return
        except Exception:  # noqa: BLE001
            pass  # the server is lost for good, or closing: the training ranks report it
        finally:
            try:
                self._kv.close()
            except Exception:
                pass

    def _report(self, tb: str) -> None:
        text = f"replanning the iterations a restarted Redis server lost failed:\n{tb.rstrip()}"
        if self.on_error is not None:
            self.on_error(text)
        else:
            print(f"dynapipe: {text}", file=sys.stderr, flush=True)

    def close(self, timeout_s: float = 2.0) -> None:
        """Stop the thread."""
        self._stop.set()
        self._thread.join(timeout_s)
