"""Key-value stores (the job's TCPStore and a real Redis server) and the payload format.

The Redis tests start ``redis-server`` on a free loopback port. Without the binary they
skip, unless DYNAPIPE_REQUIRE_REDIS=1 (CI), where they fail.
"""
import datetime
import os
import threading
import pickle
import shutil
import struct
import subprocess
import time
import zlib

import numpy as np
import pytest
from torch.distributed import TCPStore

from dynapipe.errors import DynaPipeError
from dynapipe.runtime.distributed import free_port
from dynapipe.runtime.kv_store import (KVStoreSpec, StoreUnreachableError, TorchStoreKV, delete_blob, get_blob,
                                       put_blob, wait_blob)
from dynapipe.runtime.plan_payload import decode_payload, encode_payload


@pytest.fixture(scope="module")
def tcp_store():
    store = TCPStore("127.0.0.1", free_port(), world_size=1, is_master=True, wait_for_workers=False,
                     timeout=datetime.timedelta(seconds=20))
    yield store


def _redis_client_or_skip() -> None:
    """Skip without the redis client package, unless DYNAPIPE_REQUIRE_REDIS=1 (CI) makes it a failure."""
    try:
        import redis  # noqa: F401 - only whether it imports
    except ImportError:
        if os.environ.get("DYNAPIPE_REQUIRE_REDIS") == "1":
            pytest.fail("the redis package is not installed but DYNAPIPE_REQUIRE_REDIS=1 requires the Redis tests")
        pytest.skip("the redis package is not installed (pip install redis)")


@pytest.fixture(scope="module")
def redis_server():
    exe = shutil.which("redis-server")
    if exe is None:
        if os.environ.get("DYNAPIPE_REQUIRE_REDIS") == "1":
            pytest.fail("redis-server is not installed but DYNAPIPE_REQUIRE_REDIS=1 requires the Redis tests")
        pytest.skip("redis-server binary not found (apt-get install redis-server); "
                    "set DYNAPIPE_REQUIRE_REDIS=1 to make this a failure")
    port = free_port()
    proc = subprocess.Popen([exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    spec = KVStoreSpec("redis", "127.0.0.1", port, connect_timeout_s=1.0)
    deadline = time.monotonic() + 10
    while True:
        try:
            spec.connect().close()
            break
        except StoreUnreachableError:
            if time.monotonic() > deadline or proc.poll() is not None:
                proc.kill()
                pytest.fail(f"redis-server did not start on port {port}")
            time.sleep(0.05)
    yield spec
    proc.terminate()
    proc.wait(10)


def _kvs(request):
    if request.param == "store":
        return TorchStoreKV(request.getfixturevalue("tcp_store"))
    return request.getfixturevalue("redis_server").connect()


@pytest.fixture(params=["store", "redis"])
def kv(request):
    store = _kvs(request)
    store.chunk_bytes = 1000  # exercise chunking with small values
    yield store


def test_blob_round_trip_small_and_chunked(kv):
    for n in (0, 10, 999, 1000, 1001, 5432):
        data = os.urandom(n)
        put_blob(kv, f"t/blob{n}", data)
        assert get_blob(kv, f"t/blob{n}") == data
    assert kv.keys("t/blob5432/") != []  # chunks exist
    for n in (0, 10, 999, 1000, 1001, 5432):
        delete_blob(kv, f"t/blob{n}")
    assert kv.keys("t/blob") == []
    assert get_blob(kv, "t/absent") is None


def test_keys_takes_the_prefix_literally(kv):
    for key in ("g[1]/a", "g1/b", "g?x/c", "gQx/d", "g\\y/e", "g*z/f", "gzz/g"):
        kv.set(key, b"v")
    assert kv.keys("g[1]/") == ["g[1]/a"]
    assert kv.keys("g?x/") == ["g?x/c"]
    assert kv.keys("g\\y/") == ["g\\y/e"]
    assert kv.keys("g*z/") == ["g*z/f"]


def test_counter_and_delete(kv):
    assert kv.add("t/n", 1) == 1
    assert kv.add("t/n", 2) == 3
    assert kv.delete("t/n") and not kv.delete("t/n")


def test_corrupted_manifest_rejected(kv):
    kv.set("t/bad", b"not a manifest at all")
    with pytest.raises(DynaPipeError, match="not a payload of this version"):
        get_blob(kv, "t/bad")
    kv.set("t/short", b"x")
    with pytest.raises(DynaPipeError, match="too short"):
        get_blob(kv, "t/short")
    data = os.urandom(3000)
    put_blob(kv, "t/lost", data)
    kv.delete("t/lost/c1")
    with pytest.raises(DynaPipeError, match="chunk 1 of 3 is missing"):
        get_blob(kv, "t/lost")
    for k in ("t/bad", "t/short"):
        kv.delete(k)
    delete_blob(kv, "t/lost")


def test_wait_blob_times_out_clearly_and_polls(kv):
    polls = []
    t0 = time.monotonic()
    with pytest.raises(DynaPipeError, match="did not arrive within 0.2 s"):
        wait_blob(kv, "t/never", 0.2, lambda: polls.append(1), what="the plan of iteration 9")
    assert time.monotonic() - t0 < 2.0 and len(polls) > 3

    def fail():
        raise DynaPipeError("worker crashed")
    with pytest.raises(DynaPipeError, match="worker crashed"):
        wait_blob(kv, "t/never", 30, fail, what="x")


def test_a_payload_half_lost_by_a_restart_is_waited_for_until_it_is_written_again(kv):
    # A restarted Redis keeps the later chunks and the manifest of a payload whose first chunks
    # it lost; the replanning writes it again. The reader waits for that instead of failing.
    data = os.urandom(3000)
    put_blob(kv, "t/half", data)
    kv.delete("t/half/c0")
    with pytest.raises(DynaPipeError, match=r"did not arrive within 0.2 s .*Its manifest was there but chunk 0 "
                                            r"of 3 is missing\. The planner"):
        wait_blob(kv, "t/half", 0.2, lambda: None, what="the plan of iteration 5")
    rewrite = threading.Timer(0.2, lambda: put_blob(kv, "t/half", data))
    rewrite.start()
    assert wait_blob(kv, "t/half", 30, lambda: None, what="x") == data
    rewrite.join()
    delete_blob(kv, "t/half")


def test_redis_answers_that_waiting_cannot_change_fail_at_once(redis_server):
    # A database the server does not have was retried for the whole connect timeout, then blamed
    # on an unreachable server.
    from dataclasses import replace

    t0 = time.monotonic()
    with pytest.raises(DynaPipeError, match=r"Redis at 127\.0\.0\.1:\d+ \(db 99\) refused the connection: .*"
                                            r"database number"):
        replace(redis_server, db=99, connect_timeout_s=20.0).connect()
    assert time.monotonic() - t0 < 5


def test_a_redis_out_of_memory_is_a_one_line_error(redis_server):
    # A command the server refuses (maxmemory reached) came out as redis' own exception, a
    # traceback on every rank.
    kv = redis_server.connect()
    try:
        kv.client.config_set("maxmemory", "1mb")
        kv.client.config_set("maxmemory-policy", "noeviction")
        with pytest.raises(DynaPipeError, match=r"^Redis at 127\.0\.0\.1:\d+ \(db 0\) refused a command: .*maxmemory.*"
                                                r"raise its maxmemory") as e:
            for i in range(8):
                kv.set(f"oom-test/{i}", b"x" * (512 << 10))
        assert "\n" not in str(e.value)
    finally:
        kv.client.config_set("maxmemory", "0")
        kv.client.flushdb()
        kv.close()


def test_a_planner_failure_is_posted_even_when_redis_is_out_of_memory(redis_server):
    # Out of memory, Redis refuses the error report too (a SET), and every rank but the planner
    # waited out the plan timeout blaming slow planners. Deletes pass: the stopping job's
    # payloads make room for the report.
    from dynapipe.runtime.planner_workers import Keyspace, post_error

    kv = redis_server.connect()
    keys = Keyspace("oom-job/run1")
    try:
        kv.client.config_set("maxmemory", "2mb")
        kv.client.config_set("maxmemory-policy", "noeviction")
        with pytest.raises(DynaPipeError, match="maxmemory"):
            for i in range(16):
                kv.set(keys.payload(i, 0, 0), b"x" * (512 << 10))
        kv.set("other-job/it0/r0/s0", b"kept")  # not this job's: never deleted
        with pytest.raises(DynaPipeError, match="maxmemory"):
            kv.set(keys.error, b"x" * (512 << 10))  # the refusal post_error meets
        post_error(kv, keys, "planner worker 0 on planner node 0 failed: out of memory")
        assert kv.get(keys.error) == b"planner worker 0 on planner node 0 failed: out of memory"
        assert kv.keys(f"{keys.prefix}/it") == [] and kv.get("other-job/it0/r0/s0") == b"kept"
    finally:
        kv.client.config_set("maxmemory", "0")
        kv.client.flushdb()
        kv.close()


def test_a_lost_redis_costs_one_retry_window_not_one_per_call(redis_server):
    # After the window ran out, the failure report and the clean-up that follow must not each
    # wait it out again (a planner rank took 4 windows to exit); a server back again is used.
    from dataclasses import replace

    exe, port = shutil.which("redis-server"), free_port()
    args = [exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
    proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    spec = replace(redis_server, port=port, connect_timeout_s=10.0, retry_s=1.0)
    kv = spec.connect()
    kv.set("k", b"v")
    proc.kill()
    proc.wait(10)
    t0 = time.monotonic()
    with pytest.raises(StoreUnreachableError, match=r"for more than the retry window \(store_retry_s=1.0 s"):
        kv.get("k")
    assert time.monotonic() - t0 >= 0.9
    t0 = time.monotonic()
    for call in (lambda: kv.set("k", b"w"), lambda: kv.delete("k"), lambda: kv.add("n", 1)):
        with pytest.raises(StoreUnreachableError, match=r"for more than the retry window \(store_retry_s=1.0 s"):
            call()
    assert time.monotonic() - t0 < 0.9
    proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 10
        while True:
            try:
                kv.set("k", b"back")
                break
            except StoreUnreachableError:
                assert time.monotonic() < deadline, "redis-server did not come back"
                time.sleep(0.05)
        assert kv.get("k") == b"back"
        kv.close()
    finally:
        proc.kill()
        proc.wait(10)


def test_a_port_that_accepts_but_never_answers_is_given_up_at_the_connect_timeout():
    # Another service on the Redis port (the job's TCPStore, say) took the 60 s read timeout and a
    # client retry: two minutes for a 3 s limit.
    import socket

    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(8)
    port = server.getsockname()[1]
    held = []
    accept = threading.Thread(target=lambda: [held.append(server.accept()) for _ in range(64)], daemon=True)
    accept.start()
    t0 = time.monotonic()
    try:
        with pytest.raises(StoreUnreachableError, match=rf"could not reach Redis at 127\.0\.0\.1:{port} .* within 1 s"):
            KVStoreSpec("redis", "127.0.0.1", port, connect_timeout_s=1.0).connect()
        assert time.monotonic() - t0 < 8
    finally:
        server.close()
        for conn, _ in held:
            conn.close()


def test_unreachable_tcp_store_times_out_with_clear_error():
    t0 = time.monotonic()
    with pytest.raises(StoreUnreachableError, match=r"could not reach the job's TCPStore at 127\.0\.0\.1:\d+ within 1 s"):
        KVStoreSpec("store", "127.0.0.1", free_port(), connect_timeout_s=1.0).connect()
    assert time.monotonic() - t0 < 15


def test_unreachable_redis_times_out_with_clear_error():
    _redis_client_or_skip()
    with pytest.raises(StoreUnreachableError, match=r"could not reach Redis at 127\.0\.0\.1:\d+"):
        KVStoreSpec("redis", "127.0.0.1", free_port(), connect_timeout_s=0.5).connect()


def test_unknown_backend():
    with pytest.raises(DynaPipeError, match="'etcd' is not known"):
        KVStoreSpec("etcd", "h", 1).connect()


# ---- payload format ------------------------------------------------------------------------

def _payload():
    tensors = {0: {"tokens": np.arange(12, dtype=np.int64).reshape(3, 4),
                   "loss_mask": np.ones((3, 4), dtype=np.float32)},
               2: {"labels": np.zeros((1, 8), dtype=np.int64)}}
    return encode_payload(7, 1, 2, b"PLANBYTES", tensors, {"real_tokens": 11, "planning_ms": 1.5}), tensors


def test_payload_round_trip():
    blob, tensors = _payload()
    p = decode_payload(blob)
    assert (p.iteration, p.replica, p.stage, p.plan_bytes) == (7, 1, 2, b"PLANBYTES")
    assert p.meta == {"real_tokens": 11, "planning_ms": 1.5}
    assert sorted(p.tensors) == [0, 2]
    for mb, d in tensors.items():
        for name, arr in d.items():
            np.testing.assert_array_equal(p.tensors[mb][name], arr)
            assert p.tensors[mb][name].dtype == arr.dtype


def test_payload_is_deterministic():
    # The same content built in another insertion order (micro-batches, tensor names, meta keys)
    # encodes to the same bytes: a payload's bytes must not depend on how a worker filled it.
    blob, tensors = _payload()
    reordered = {mb: dict(reversed(list(tensors[mb].items()))) for mb in reversed(list(tensors))}
    assert blob == encode_payload(7, 1, 2, b"PLANBYTES", reordered, {"planning_ms": 1.5, "real_tokens": 11})


def test_a_payload_planned_again_has_the_same_content_digest():
    # After a store restart the iteration is planned again: another planning time, another
    # worker. The ranks that compare digests (a stage's TP ranks, one of which may have read
    # the first copy) must see the same plan as the same; another plan or other tokens differ.
    blob, tensors = _payload()
    first = decode_payload(blob)
    again = decode_payload(encode_payload(7, 1, 2, b"PLANBYTES", tensors,
                                          {"real_tokens": 11, "planning_ms": 9.25, "planner_worker": 3}))
    assert again.crc != first.crc and again.content_crc == first.content_crc
    other_plan = decode_payload(encode_payload(7, 1, 2, b"PLANBYTEZ", tensors, {"real_tokens": 11}))
    flipped = {mb: {n: a.copy() for n, a in d.items()} for mb, d in tensors.items()}
    flipped[0]["tokens"][1, 2] += 1
    other_tokens = decode_payload(encode_payload(7, 1, 2, b"PLANBYTES", flipped, {"real_tokens": 11}))
    reshaped = {**tensors, 2: {"labels": tensors[2]["labels"].reshape(2, 4)}}
    other_shape = decode_payload(encode_payload(7, 1, 2, b"PLANBYTES", reshaped, {"real_tokens": 11}))
    assert len({first.content_crc, other_plan.content_crc, other_tokens.content_crc, other_shape.content_crc}) == 4


def test_truncated_or_corrupted_payload_rejected():
    blob, _ = _payload()
    for cut in (3, 20, len(blob) - 5):
        with pytest.raises(DynaPipeError):
            decode_payload(blob[:cut])
    with pytest.raises(DynaPipeError, match="bad magic"):
        decode_payload(b"XXXX" + blob[4:])
    with pytest.raises(DynaPipeError, match="version 9"):
        decode_payload(blob[:4] + struct.pack("<H", 9) + blob[6:])
    hlen = struct.unpack_from("<I", blob, 8)[0]

    def reheader(header: bytes) -> bytes:
        # A well-formed payload (valid CRC32) whose header says something impossible.
        rest = header + blob[16 + hlen:]
        return blob[:8] + struct.pack("<II", len(header), zlib.crc32(rest)) + rest

    with pytest.raises(DynaPipeError, match="CRC32 mismatch"):
        decode_payload(blob[:16] + blob[16:16 + hlen].replace(b'"float32"', b'"object!"') + blob[16 + hlen:])
    with pytest.raises(DynaPipeError, match="dtype 'object!'"):
        decode_payload(reheader(blob[16:16 + hlen].replace(b'"float32"', b'"object!"')))
    with pytest.raises(DynaPipeError, match="do not hold shape"):
        decode_payload(reheader(blob[16:16 + hlen].replace(b'"shape":[3,4]', b'"shape":[3,5]', 1)))


def test_pickle_is_never_accepted():
    with pytest.raises(DynaPipeError, match="bad magic"):
        decode_payload(pickle.dumps({"tensors": [1, 2, 3]}))


# ---- the loader on Redis ---------------------------------------------------------------------

def test_loader_over_redis_delivers_and_cleans_up(redis_server):
    from test_loader import run_single_process, reference_iterations

    got, leftover = run_single_process(kv_backend="redis", redis=redis_server, iterations=3)
    ref = reference_iterations(3)
    assert [g["plan"] for g in got] == [r["plan"] for r in ref]
    assert [g["tensors"] for g in got] == [r["tensors"] for r in ref]
    assert leftover == []


def test_garbage_collection_stops_a_redis_loaders_threads_and_workers(redis_server):
    # The restart watcher's thread held the loader's bound methods, so the loader was never
    # collected and its finalizer never stopped the fetch thread or the workers.
    import gc

    from test_loader import make_loader, wait_gone

    dl = make_loader(kv_backend="redis", redis=redis_server, num_workers=1)
    next(dl)
    pids, thread = dl.worker_pids, dl._fetcher._thread
    del dl
    gc.collect()
    thread.join(5)
    assert not thread.is_alive(), "the fetch thread outlived its loader"
    assert wait_gone(pids, 5) == []


def test_loader_with_unreachable_redis_fails_clearly():
    _redis_client_or_skip()
    from test_loader import make_loader

    with pytest.raises(StoreUnreachableError, match="could not reach Redis"):
        make_loader(kv_backend="redis", redis=KVStoreSpec("redis", "127.0.0.1", free_port(), connect_timeout_s=0.5))


def test_a_live_planner_keeps_its_runs_redis_keys_past_their_expiry(redis_server):
    # Keys expire after the spec's ttl_s so a crashed job leaves nothing behind; a payload of a
    # live job may wait unread longer (a long evaluation or save), so the planner node's watcher
    # thread restarts the expiry of its run's keys every quarter ttl.
    import dataclasses

    from dynapipe.runtime.store_watch import RestartWatcher

    spec = dataclasses.replace(redis_server, ttl_s=2)
    kv = spec.connect()
    kv.set("keep[1]/run/it0/r0/s0", b"payload")  # glob characters in the namespace are literal
    kv.set("keep1/run/x", b"another run")
    watcher = RestartWatcher(spec, lambda: None, poll_s=0.05, keep_alive="keep[1]/run")
    try:
        time.sleep(3.5)
        assert kv.get("keep[1]/run/it0/r0/s0") == b"payload"
        assert kv.get("keep1/run/x") is None  # not under the prefix: expired
    finally:
        watcher.close()
    time.sleep(2.6)
    assert kv.get("keep[1]/run/it0/r0/s0") is None  # the job gone, its keys go
    kv.close()


def test_delete_blob_deletes_the_chunks_after_one_a_restart_lost(kv):
    # A restarted server that lost chunk 0 kept chunks 1 and 2: deleting up to the first absent
    # chunk left them until their expiry (forever on a TCPStore).
    put_blob(kv, "t/gap", os.urandom(3000))
    kv.delete("t/gap/c0")
    delete_blob(kv, "t/gap")
    assert [kv.get(k) for k in ("t/gap", "t/gap/c1", "t/gap/c2")] == [None, None, None]
    # Without a manifest (a write cut short) the chunks written so far go.
    kv.set("t/cut/c0", b"a")
    kv.set("t/cut/c1", b"b")
    delete_blob(kv, "t/cut")
    assert kv.get("t/cut/c0") is None and kv.get("t/cut/c1") is None
