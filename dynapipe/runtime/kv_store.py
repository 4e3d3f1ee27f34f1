"""Key-value stores that carry plans to every rank: the job's torch.distributed store, or Redis.

The default backend is the TCPStore the job already has from its rendezvous (no extra
server): training ranks use it through torch.distributed, planner worker processes
connect to the same host and port as clients. Redis (``backend="redis"``) suits large
clusters, where thousands of ranks polling one TCPStore would queue behind each other.

Values are bytes only; nothing read from a store is ever unpickled. Large values are
split into chunks (the TCPStore server refuses messages over 8 MiB) behind a small
manifest that is written last, so a reader that sees the manifest finds every chunk.
"""
from __future__ import annotations

import datetime
import re
import struct
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Callable, Optional

from dynapipe.errors import DynaPipeError, arg, given

KV_BACKENDS = ("store", "redis")
_MAGIC = b"DPKV"
_HEADER = struct.Struct("<4sBIQ")  # magic, version, chunk count (0: inline), total bytes
_VERSION = 1
# Below the TCPStore server's 8 MiB message limit, leaving room for the key.
STORE_CHUNK_BYTES = 4 << 20
REDIS_CHUNK_BYTES = 64 << 20


class StoreUnreachableError(DynaPipeError):
    """The plan store could not be reached within the connect timeout."""


class KVStore(ABC):
    """The operations the plan delivery needs; keys are strings, values bytes."""

    chunk_bytes: int = STORE_CHUNK_BYTES

    @abstractmethod
    def set(self, key: str, value: bytes) -> None: ...

    @abstractmethod
    def get(self, key: str) -> Optional[bytes]:
        """The value, or None when the key does not exist (never blocks)."""

    @abstractmethod
    def add(self, key: str, amount: int) -> int:
        """Atomically add ``amount`` to the integer at ``key`` (0 if absent); the new value."""

    @abstractmethod
    def delete(self, key: str) -> bool:
        """Delete ``key``; whether it existed."""

    @abstractmethod
    def keys(self, prefix: str) -> list[str]:
        """Every key starting with ``prefix`` (for cleanup checks; may be slow)."""

    def close(self) -> None:
        """Release the connection (a no-op where the job owns it)."""


class TorchStoreKV(KVStore):
    """A torch.distributed ``Store`` (a TCPStore in practice)."""

    chunk_bytes = STORE_CHUNK_BYTES

    def __init__(self, store, owned: bool = False):
        self.store = store
        self._owned = owned

    def set(self, key: str, value: bytes) -> None:
        self.store.set(key, value)

    def get(self, key: str) -> Optional[bytes]:
        # A torch store's get blocks until the key exists; check first.
        if not self.store.check([key]):
            return None
        return bytes(self.store.get(key))

    def add(self, key: str, amount: int) -> int:
        return int(self.store.add(key, amount))

    def delete(self, key: str) -> bool:
        return bool(self.store.delete_key(key))

    def keys(self, prefix: str) -> list[str]:
        return [k for k in self.store.list_keys() if k.startswith(prefix)]


class RedisKV(KVStore):
    """A Redis server; every key expires after ``ttl_s`` so a crashed job leaves nothing behind.

    A lost connection is retried with exponential backoff (50 ms doubling to 1 s) for up
    to ``retry_s`` seconds, so a restarted server costs a pause, not the job; only then
    is :class:`StoreUnreachableError` raised. What a restarted server lost is the
    caller's to redo (:meth:`server_id` tells one server from its restart).
    """

    chunk_bytes = REDIS_CHUNK_BYTES

    def __init__(self, client, ttl_s: int, retry_s: float = 30.0, address: str = "redis"):
        self.client = client
        self.ttl_s = int(ttl_s)
        self.retry_s = float(retry_s)
        self.address = address
        # Set once a retry window ran out: later calls (reporting the failure, cleaning up)
        # try once and fail at once, so a lost server costs one window, not one a call.
        self._lost: Optional[str] = None

    def _call(self, op: Callable):
        import redis

        deadline = None
        delay = 0.05
        while True:
            try:
                result = op()
                self._lost = None
                return result
            except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError) as e:
                if self._lost is not None:
                    raise StoreUnreachableError(self._lost) from None
                now = time.monotonic()
                deadline = deadline if deadline is not None else now + self.retry_s
                if now >= deadline:
                    self._lost = (f"lost Redis at {self.address} for more than the retry window "
                                  f"({given('store_retry_s', self.retry_s)} s; {' '.join(str(e).split())}); restart "
                                  f"the server or raise the retry window.")
                    raise StoreUnreachableError(self._lost) from None
                time.sleep(min(delay, max(deadline - now, 0.0)))
                delay = min(delay * 2, 1.0)
            except redis.exceptions.ResponseError as e:
                # The server refused the command: out of memory under --maxmemory, most often.
                raise DynaPipeError(f"{self.address} refused a command: {' '.join(str(e).split())[:200].rstrip('.')}. "
                                    f"If it is out of memory, raise its maxmemory (with the noeviction policy, "
                                    f"so no plan is evicted unread) or lower {arg('prefetch')}.") from None

    def set(self, key: str, value: bytes) -> None:
        self._call(lambda: self.client.set(key, value, ex=self.ttl_s))

    def get(self, key: str) -> Optional[bytes]:
        return self._call(lambda: self.client.get(key))

    def add(self, key: str, amount: int) -> int:
        def incr():
            pipe = self.client.pipeline()
            pipe.incrby(key, amount)
            pipe.expire(key, self.ttl_s)
            return int(pipe.execute()[0])
        return self._call(incr)

    def delete(self, key: str) -> bool:
        return bool(self._call(lambda: self.client.delete(key)))

    @staticmethod
    def _match(prefix: str) -> str:
        """A SCAN pattern of every key under ``prefix``, whose glob characters are literal (a
        namespace may hold any of them)."""
        return re.sub(r"([*?\[\]\\])", r"\\\1", prefix) + "*"

    def keys(self, prefix: str) -> list[str]:
        return self._call(lambda: [k.decode() for k in self.client.scan_iter(match=self._match(prefix))])

    def refresh(self, prefix: str) -> int:
        """Restart the expiry (``ttl_s`` seconds) of every key under ``prefix``; how many there
        were. A job alive keeps its keys however long they wait unread; a crashed one's go."""
        def expire_all() -> int:
            keys = list(self.client.scan_iter(match=self._match(prefix)))
            if keys:
                pipe = self.client.pipeline()
                for key in keys:
                    pipe.expire(key, self.ttl_s)
                pipe.execute()
            return len(keys)
        return self._call(expire_all)

    def server_id(self) -> str:
        """The server process's run id: it changes when the server restarts (and loses its data)."""
        return str(self._call(lambda: self.client.info("server")["run_id"]))

    def close(self) -> None:
        self.client.close()


@dataclass(frozen=True)
class KVStoreSpec:
    """How any process (a training rank or a planner worker) reaches the store.

    ``backend`` ``store``: the TCPStore at ``host:port``; ``redis``: a Redis server at
    ``host:port`` database ``db``. ``connect_timeout_s`` bounds connecting (seconds);
    ``retry_s`` how long a Redis connection lost later is retried before giving up.
    """

    backend: str
    host: str
    port: int
    db: int = 0
    connect_timeout_s: float = 30.0
    ttl_s: int = 3600
    retry_s: float = 30.0

    def connect(self) -> KVStore:
        """Open a client connection; :class:`StoreUnreachableError` after the timeout."""
        if self.backend == "store":
            return _connect_tcp_store(self.host, self.port, self.connect_timeout_s)
        if self.backend == "redis":
            return _connect_redis(self.host, self.port, self.db, self.connect_timeout_s, self.ttl_s, self.retry_s)
        raise DynaPipeError(f"{given('kv_backend', self.backend)} is not known; use one of {list(KV_BACKENDS)}.")


def _connect_tcp_store(host: str, port: int, timeout_s: float) -> TorchStoreKV:
    from torch.distributed import TCPStore

    try:
        store = TCPStore(host, int(port), is_master=False, wait_for_workers=False,
                         timeout=datetime.timedelta(seconds=timeout_s))
    except (RuntimeError, OSError) as e:
        raise StoreUnreachableError(
            f"could not reach the job's TCPStore at {host}:{port} within {timeout_s:g} s ({e}). "
            f"Check that MASTER_ADDR/MASTER_PORT are reachable from every node, or use "
            f"{given('kv_backend', 'redis')}.") from None
    return TorchStoreKV(store, owned=True)


def _connect_redis(host: str, port: int, db: int, timeout_s: float, ttl_s: int, retry_s: float = 30.0) -> RedisKV:
    try:
        import redis
        from redis.backoff import ExponentialBackoff, NoBackoff
        from redis.retry import Retry
    except ImportError:
        raise DynaPipeError(f"{given('kv_backend', 'redis')} needs the redis package: pip install redis") from None
    where = f"Redis at {host}:{port} (db {db})"

    def client(socket_timeout: float, retry: Retry):
        return redis.Redis(host=host, port=int(port), db=db, socket_connect_timeout=min(timeout_s, 5.0),
                           socket_timeout=socket_timeout, retry=retry)

    # Connecting pings without the client's own retries and with reads bounded by the time
    # left, so something that accepts connections but never answers (another service on the
    # port) is given up on at the timeout; the operations client then gets one quick retry
    # per command (RedisKV retries lost connections for retry_s).
    deadline = time.monotonic() + timeout_s
    while True:
        probe = client(max(min(deadline - time.monotonic(), 5.0), 0.05), Retry(NoBackoff(), 0))
        try:
            probe.ping()
            break
        except (redis.exceptions.AuthenticationError, redis.exceptions.ResponseError) as e:
            # The server answered: waiting would not change its answer.
            raise DynaPipeError(f"{where} refused the connection: {e}. Check the database number "
                                f"(LoaderConfig.redis_db: 0 to the server's databases - 1); servers that need a "
                                f"password are not supported.") from None
        except redis.exceptions.RedisError as e:
            if time.monotonic() >= deadline:
                raise StoreUnreachableError(
                    f"could not reach {where} within {timeout_s:g} s ({e}). Check "
                    f"{arg('redis_host')}/{arg('redis_port')} and that the server runs.") from None
            time.sleep(0.05)
        finally:
            probe.close()
    return RedisKV(client(max(timeout_s, 60.0), Retry(ExponentialBackoff(0.05, 0.01), 1)), ttl_s, retry_s, where)


def tcp_store_address(store) -> tuple[str, int]:
    """Host and port of the TCPStore under a torch.distributed store (through PrefixStores)."""
    seen = store
    while hasattr(seen, "underlying_store"):
        seen = seen.underlying_store
    host, port = getattr(seen, "host", None), getattr(seen, "port", None)
    if host is None or port is None:
        raise DynaPipeError(
            f"the job's torch.distributed store is a {type(seen).__name__}, which planner workers cannot "
            f"connect to; initialise torch.distributed with env:// or tcp:// (a TCPStore), or use "
            f"{given('kv_backend', 'redis')}.")
    return str(host), int(port)


def job_tcp_store():
    """The TCPStore of the initialised default process group (not a prefixed view)."""
    import torch.distributed as dist

    if not dist.is_initialized():
        raise DynaPipeError("torch.distributed is not initialised; the 'store' backend uses the job's store.")
    store = dist.distributed_c10d._get_default_store()
    while hasattr(store, "underlying_store"):
        store = store.underlying_store
    return store


# ---- chunked values -------------------------------------------------------------------

def _chunk_key(key: str, i: int) -> str:
    return f"{key}/c{i}"


def put_blob(kv: KVStore, key: str, data: bytes) -> None:
    """Store ``data`` under ``key``, chunked when larger than the backend's limit."""
    n = len(data)
    if n <= kv.chunk_bytes:
        kv.set(key, _HEADER.pack(_MAGIC, _VERSION, 0, n) + data)
        return
    view = memoryview(data)
    chunks = (n + kv.chunk_bytes - 1) // kv.chunk_bytes
    for i in range(chunks):
        kv.set(_chunk_key(key, i), bytes(view[i * kv.chunk_bytes:(i + 1) * kv.chunk_bytes]))
    kv.set(key, _HEADER.pack(_MAGIC, _VERSION, chunks, n))  # last: readers wait for it


class MissingChunk(DynaPipeError):
    """A payload's manifest is in the store but one of its chunks is not (a restarted server
    kept the later writes of a payload whose earlier ones it lost)."""


def get_blob(kv: KVStore, key: str) -> Optional[bytes]:
    """The value stored by :func:`put_blob`, or None while ``key`` is absent."""
    head = kv.get(key)
    if head is None:
        return None
    if len(head) < _HEADER.size:
        raise DynaPipeError(f"store key {key!r}: value of {len(head)} bytes is too short to be a payload.")
    magic, version, chunks, total = _HEADER.unpack_from(head)
    if magic != _MAGIC or version != _VERSION:
        raise DynaPipeError(f"store key {key!r}: not a payload of this version (magic {magic!r}, "
                            f"version {version}); is another job or version using the same store?")
    if chunks == 0:
        data = head[_HEADER.size:]
    else:
        parts = []
        for i in range(chunks):
            part = kv.get(_chunk_key(key, i))
            if part is None:
                raise MissingChunk(f"store key {key!r}: chunk {i} of {chunks} is missing.")
            parts.append(part)
        data = b"".join(parts)
    if len(data) != total:
        raise DynaPipeError(f"store key {key!r}: read {len(data)} bytes, the manifest says {total}.")
    return data


def delete_blob(kv: KVStore, key: str) -> None:
    """Delete a value stored by :func:`put_blob`, its chunks included (even half-written ones).

    The manifest gives the chunk count, so chunks after one a restarted server lost are deleted
    too; without a manifest (a write cut short) chunks are deleted up to the first absent one.
    """
    head = kv.get(key)
    chunks = 0
    if head is not None and len(head) >= _HEADER.size:
        magic, version, count, _ = _HEADER.unpack_from(head)
        if magic == _MAGIC and version == _VERSION:
            chunks = count
    kv.delete(key)  # first: from here on readers see the value as absent, not as half there
    for i in range(chunks):
        kv.delete(_chunk_key(key, i))
    i = chunks
    while kv.delete(_chunk_key(key, i)):
        i += 1


def wait_blob(kv: KVStore, key: str, timeout_s: float, on_poll: Callable[[], None],
              what: str) -> bytes:
    """Poll for ``key`` until it exists, calling ``on_poll`` (which may raise) between polls.

    Polls back off from 0.2 ms to 20 ms, so a value that is already there costs one round
    trip and a late one is seen within 20 ms. Raises a clear error after ``timeout_s``.
    """
    deadline = time.monotonic() + timeout_s
    delay = 0.0002
    partial = ""
    while True:
        try:
            data = get_blob(kv, key)
        except MissingChunk as e:
            # Half of a payload outlived a server restart: the replanning of what the restart lost
            # writes it again, so wait for that as for a late payload.
            data, partial = None, f" Its manifest was there but {str(e).split(': ', 1)[1].rstrip('.')}."
        if data is not None:
            return data
        on_poll()
        if time.monotonic() > deadline:
            raise DynaPipeError(f"{what} did not arrive within {timeout_s:g} s (store key {key!r}).{partial} The "
                                f"planner workers may be stuck or too slow: raise the plan timeout or the number "
                                f"of planner workers, and check the planner nodes' logs.")
        time.sleep(delay)
        delay = min(delay * 2, 0.02)
