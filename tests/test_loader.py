"""DynaPipeDataLoader in one process: what it yields, determinism, resume, key cleanup,
worker failures and shutdown (no orphan processes)."""
import hashlib
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from dynapipe.config import load_device_config, load_model_config
from dynapipe.data.mixture_dataset import MixtureDataset
from dynapipe.data.sampler import GlobalBatchSampler, SamplerConfig
from dynapipe.data.samples import LengthLimits
from dynapipe.errors import DynaPipeError
from dynapipe.runtime.kv_store import KVStore, get_blob
from dynapipe.runtime.loader import DynaPipeDataLoader, LoaderConfig, RankLayout, default_store_for_single_process
from dynapipe.runtime.plan_payload import decode_payload
from dynapipe.runtime.plan_source import IterationPlanner, PlannerSettings, encode_plan
from dynapipe.runtime.planner_workers import Keyspace, PlannerWorkerError, WorkerJob, plan_and_publish

SEQ, N, GBS, SEED = 256, 400, 16, 5
TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(TESTS_DIR)


def planner_settings(stages=1, dp=1):
    return PlannerSettings(load_model_config("gpt-tiny"), load_device_config("cpu"), stages, dp,
                           seq_length=SEQ)


def dataset():
    return MixtureDataset(N, 11, LengthLimits(SEQ), vocab_size=512)


class SlowDataset(MixtureDataset):
    """Reads every sample slowly, as a slow file system would."""

    def _read(self, idx, input_len, target_len):
        time.sleep(0.02)
        return super()._read(idx, input_len, target_len)


class ExplodingDataset(MixtureDataset):
    """Fails reading one sample, as a corrupt file would."""

    def _read(self, idx, input_len, target_len):
        if idx == self.bad:
            raise RuntimeError(f"corrupt sample {idx}")
        return super()._read(idx, input_len, target_len)


def make_loader(kv_backend="store", redis=None, store=None, ds=None, settings=None, **cfg):
    base = dict(global_batch_size=GBS, seed=SEED, kv_backend=kv_backend, plan_timeout_s=60, connect_timeout_s=10)
    if redis is not None:
        base.update(redis_host=redis.host, redis_port=redis.port, connect_timeout_s=redis.connect_timeout_s)
    base.update(cfg)
    if kv_backend == "store" and store is None:
        store = default_store_for_single_process()
    return DynaPipeDataLoader(LoaderConfig(**base), ds or dataset(), settings or planner_settings(), RankLayout(),
                              store=store)


def digest(arr) -> str:
    arr = np.ascontiguousarray(arr)
    return hashlib.sha256(str((arr.dtype.str, arr.shape)).encode() + arr.tobytes()).hexdigest()


def summarize_plan_and_tensors(plan_bytes: bytes, tensors: dict) -> dict:
    return {"plan": hashlib.sha256(plan_bytes).hexdigest(),
            "tensors": {int(mb): {n: digest(np.asarray(t)) for n, t in d.items()} for mb, d in tensors.items()}}


def summarize(d) -> dict:
    out = summarize_plan_and_tensors(encode_plan(d.plan), {mb: {n: t.numpy() for n, t in x.items()}
                                                         for mb, x in d.micro_batches.items()})
    out["consumed"] = d.meta.consumed_samples
    return out


class DictKV(KVStore):
    """An in-process store, for computing what the workers publish without workers."""

    def __init__(self):
        self.d = {}

    def set(self, key, value):
        self.d[key] = bytes(value)

    def get(self, key):
        return self.d.get(key)

    def add(self, key, amount):
        self.d[key] = int(self.d.get(key, 0)) + amount
        return self.d[key]

    def delete(self, key):
        return self.d.pop(key, None) is not None

    def keys(self, prefix):
        return [k for k in self.d if k.startswith(prefix)]


def reference_iterations(k, stages=1, dp=1, consumed=0, start=0):
    """What rank (replica r, stage s) must receive, computed in-process: list (per
    iteration) of {(r, s): summary}; for one stage and replica, the summary itself."""
    ds = dataset()
    sampler_cfg = SamplerConfig(GBS, 0, SEED, True, min_samples=dp)
    job = WorkerJob(ds, sampler_cfg, consumed, start, planner_settings(stages, dp), None, Keyspace("ref"), 0)
    planner = IterationPlanner(job.planner)
    sampler = GlobalBatchSampler(ds.sample_tokens(), sampler_cfg, consumed)
    kv = DictKV()
    out = []
    for it in range(start, start + k):
        plan_and_publish(job, planner, sampler, kv, it)
        per = {}
        for r in range(dp):
            for s in range(stages):
                p = decode_payload(get_blob(kv, job.keys.payload(it, r, s)))
                per[(r, s)] = summarize_plan_and_tensors(p.plan_bytes, p.tensors)
        out.append(per if (stages, dp) != (1, 1) else per[(0, 0)])
    return out


def run_single_process(iterations=3, **kw):
    """Iterate a fresh loader; returns (summaries, keys left in the store after close)."""
    store = None if kw.get("kv_backend") == "redis" else default_store_for_single_process()
    dl = make_loader(store=store, **kw)
    try:
        got = [summarize(next(dl)) for _ in range(iterations)]
    finally:
        dl.close()
    kv = dl._kv if kw.get("kv_backend") != "redis" else kw["redis"].connect()
    return got, kv.keys(dl.keys.prefix)


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def wait_gone(pids, timeout_s=10.0) -> list:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and any(alive(p) for p in pids):
        time.sleep(0.05)
    return [p for p in pids if alive(p)]


# ---- what the loader yields --------------------------------------------------------------------

def test_yields_plan_tensors_and_metadata_matching_the_samples():
    ds = dataset()
    sampler = GlobalBatchSampler(ds.sample_tokens(), SamplerConfig(GBS, seed=SEED))
    with make_loader(train_iters=3) as dl:
        items = list(dl)
    assert [d.iteration for d in items] == [0, 1, 2]
    for d in items:
        batch = sampler.batch(d.iteration)
        assert d.plan.iteration == d.iteration and (d.plan.stage, d.plan.replica) == (0, 0)
        seen = []
        for info in d.plan.micro_batches:
            t = d.micro_batches[info.mb]
            assert set(t) == {"tokens", "position_ids", "labels", "loss_mask"}  # one stage: first and last
            assert tuple(t["tokens"].shape) == (info.mbs, info.seqlen)
            for row, pos in enumerate(info.samples):
                s = ds[int(batch.indices[pos])]
                seq = np.concatenate([s.input_ids, s.target_ids])
                assert t["tokens"][row, :len(seq)].tolist() == seq.tolist()
                assert t["tokens"][row, len(seq):].eq(0).all()
                seen.append(pos)
        assert sorted(seen) == list(range(GBS))  # every sample exactly once
        m = d.meta
        lengths = ds.planner_lengths(batch.indices)
        assert m.num_samples == GBS and m.consumed_samples == batch.end
        assert m.global_real_tokens == m.real_tokens == int(lengths.sum())
        assert m.padded_tokens == sum(i.mbs * i.seqlen for i in d.plan.micro_batches) >= m.real_tokens
        assert m.global_loss_tokens == int(sum(t["loss_mask"].sum() for t in d.micro_batches.values()))
        assert m.wait_ms >= 0 and m.truncated_samples == 0


@pytest.fixture(scope="module")
def full_run():
    """Five iterations with two workers planning up to eight ahead (three never read)."""
    return run_single_process(iterations=5, num_workers=2, prefetch=8)


def test_matches_what_the_planner_publishes(full_run):
    got, _ = full_run
    ref = reference_iterations(5)
    assert [g["plan"] for g in got] == [r["plan"] for r in ref]
    assert [g["tensors"] for g in got] == [r["tensors"] for r in ref]


def test_two_runs_are_identical(full_run):
    again, _ = run_single_process(iterations=5, num_workers=1, prefetch=1)
    assert again == full_run[0]


def test_resume_from_consumed_samples_continues_the_same_stream(full_run):
    full = full_run[0]
    k = 2
    resumed, _ = run_single_process(iterations=3, consumed_samples=full[k - 1]["consumed"], start_iteration=k)
    assert resumed == full[k:]


def test_keys_are_deleted_and_prefetched_payloads_removed_on_close(full_run):
    got, leftover = full_run
    assert len(got) == 5 and leftover == []


def test_token_budget_batches():
    with make_loader(global_batch_size=0, tokens_per_global_batch=3000, train_iters=4) as dl:
        metas = [d.meta for d in dl]
    assert all(m.global_real_tokens <= 3000 for m in metas)
    assert len({m.num_samples for m in metas}) > 1  # sample counts follow the lengths


# ---- failures and shutdown -----------------------------------------------------------------------

def test_close_stops_every_worker():
    dl = make_loader(num_workers=2)
    next(dl)
    pids = dl.worker_pids
    assert len(pids) == 2 and all(alive(p) for p in pids)
    dl.close()
    assert wait_gone(pids, 5) == []
    with pytest.raises(DynaPipeError, match="closed"):
        next(dl)


def test_garbage_collection_stops_the_fetch_thread_and_the_workers():
    import gc
    import threading

    dl = make_loader(num_workers=1)
    next(dl)
    pids, thread = dl.worker_pids, dl._fetcher._thread
    assert thread.is_alive()
    del dl
    gc.collect()
    thread.join(5)
    assert not thread.is_alive(), "the fetch thread outlived its loader"
    assert wait_gone(pids, 5) == []
    assert not any(t.name.startswith("dynapipe-fetch") for t in threading.enumerate())


def test_a_prefixed_store_is_written_where_the_workers_and_fetchers_read():
    # The workers and fetchers connect to the TCPStore under a PrefixStore; the loader wrote its
    # error reports (and deletes) through the prefix, where nobody reads them.
    from torch.distributed import PrefixStore

    from dynapipe.runtime.kv_store import TorchStoreKV

    tcp = default_store_for_single_process()
    dl = make_loader(store=PrefixStore("job7", tcp), num_workers=1)
    try:
        next(dl)
        dl.report_failure("rank 3 died")
        assert TorchStoreKV(tcp).get(dl.keys.error) is not None
    finally:
        dl.close()


def test_crashing_worker_surfaces_its_traceback():
    ds = ExplodingDataset(N, 11, LengthLimits(SEQ), vocab_size=512)
    sampler = GlobalBatchSampler(ds.sample_tokens(), SamplerConfig(GBS, seed=SEED))
    ds.bad = int(sampler.batch(2).indices[3])  # batch 2 (iteration 3 in messages, as logged) fails
    dl = make_loader(ds=ds, num_workers=2, prefetch=1)  # iteration 2 is planned when asked for
    try:
        next(dl), next(dl)
        t0 = time.monotonic()
        with pytest.raises(PlannerWorkerError) as e:
            next(dl)
        assert time.monotonic() - t0 < 10
        msg = str(e.value)
        assert "failed while planning iteration 3" in msg
        assert "Traceback" in msg and f"RuntimeError: corrupt sample {ds.bad}" in msg
    finally:
        pids = dl.worker_pids
        dl.close()
    assert wait_gone(pids, 5) == []


def test_a_worker_killed_while_this_rank_is_elsewhere_is_reported_to_the_store():
    # The planner rank may be in a step's transfers, not in the loader, when its worker dies
    # (after publishing this rank's payload): the other ranks waited out the plan timeout.
    dl = make_loader(num_workers=1)
    try:
        next(dl)
        os.kill(dl.worker_pids[0], signal.SIGKILL)
        deadline, text = time.monotonic() + 10, None
        while text is None and time.monotonic() < deadline:  # no next(): this rank is elsewhere
            text = dl._kv.get(dl.keys.error)
            time.sleep(0.1)
        assert text is not None, "nothing told the other ranks"
        assert "planner worker 0" in text.decode() and "killed by signal 9" in text.decode()
        with pytest.raises(DynaPipeError, match="killed by signal 9"):  # at the first payload it never wrote
            for _ in range(10):
                next(dl)
    finally:
        dl.close()


def test_a_worker_ignores_the_signals_that_end_a_job_and_plans_on():
    # torchrun forwards a scheduler's SIGTERM (Ctrl-C: SIGINT) to a rank's whole process group:
    # the worker must outlive it, for the rank to finish its iteration and save
    # (--exit-signal-handler); it ends with its rank.
    dl = make_loader(num_workers=1)
    try:
        next(dl)
        pid = dl.worker_pids[0]
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2):
            os.kill(pid, sig)
        for _ in range(6):  # past the prefetched plans: the worker planned them after the signals
            next(dl)
        assert dl.worker_pids == [pid] and wait_gone([pid], 0.2) == [pid]
        assert dl._kv.get(dl.keys.error) is None
    finally:
        dl.close()
    assert wait_gone([pid], 5) == []


def test_a_plan_timeout_is_raised_again_by_every_later_next():
    # A caller that retried got a fresh timeout, then data: one rank going on where the others stopped.
    dl = make_loader(ds=SlowDataset(N, 11, LengthLimits(SEQ), vocab_size=512), plan_timeout_s=0.1)
    try:
        with pytest.raises(DynaPipeError, match="did not arrive within 0.1 s") as first:
            next(dl)
        time.sleep(2.0)  # the plan arrives meanwhile
        with pytest.raises(DynaPipeError) as again:
            next(dl)
        assert again.value is first.value
    finally:
        dl.close()


def test_a_failure_reported_elsewhere_stops_the_wait_for_a_plan(monkeypatch):
    # A planner failure the plan store cannot carry (Redis out of memory) reaches the job's own
    # store through the failing rank's executor; a rank waiting for its plan asks there.
    from dynapipe.runtime.abort_channel import AbortChannel
    from dynapipe.runtime.p2p import RemoteFailure

    store = default_store_for_single_process()
    channel = AbortChannel(store, world_size=2, prefix="watch-test/abort")
    assert channel.failure_of_another(0) is None
    channel.report(0, "rank 0's own failure", primary=True)
    assert channel.failure_of_another(0) is None  # a rank's own report is not another's
    # Stage 1 of a node whose planner (rank 0, stage 0) never starts: no plan ever comes. (The
    # run id two ranks would agree on through torch.distributed, stood in for.)
    from dynapipe.runtime import loader as loader_module

    monkeypatch.setattr(loader_module, "agreed_run_id", lambda layout, namespace: "watch-test-run")
    cfg = LoaderConfig(global_batch_size=GBS, seed=SEED, plan_timeout_s=30, connect_timeout_s=10)
    dl = DynaPipeDataLoader(cfg, None, planner_settings(stages=2), RankLayout(1, 2, 0, 1, 1, 2, 1, 2), store=store)
    dl.failure_watch = lambda: channel.failure_of_another(1)
    try:
        t0 = time.monotonic()
        with pytest.raises(RemoteFailure, match="^stopped waiting for the plan of iteration 1: global rank 0 "
                                                "failed first:\nrank 0's own failure"):
            next(dl)
        assert time.monotonic() - t0 < 5
    finally:
        dl.close()


def test_workers_exit_when_the_training_process_is_killed(tmp_path):
    import queue
    import threading

    code = (f"import sys, time\nsys.path.insert(0, {TESTS_DIR!r})\n"
            "from test_loader import make_loader\n"
            "dl = make_loader(num_workers=2)\nnext(dl)\n"
            "print(' '.join(map(str, dl.worker_pids)), flush=True)\ntime.sleep(120)\n")
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    stderr_path = tmp_path / "child.stderr"
    with open(stderr_path, "w") as stderr:
        proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=stderr, env=env,
                                cwd=REPO, text=True)
    try:
        # Read on a thread: a child stuck before its print must fail the test, not hang it.
        lines: queue.Queue = queue.Queue()
        threading.Thread(target=lambda: lines.put(proc.stdout.readline()), daemon=True).start()
        try:
            line = lines.get(timeout=120)
        except queue.Empty:
            line = None
        pids = [int(p) for p in (line or "").split()]
        assert len(pids) == 2, (f"no worker pids from the child within 120 s: {line!r} (exit code {proc.poll()}); "
                                f"its stderr:\n{stderr_path.read_text()[-3000:]}")
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(10)
        assert wait_gone(pids, 10) == [], "planner workers outlived their training process"
    finally:
        if proc.poll() is None:
            proc.kill()


def test_config_and_layout_errors():
    with pytest.raises(DynaPipeError, match="'zookeeper'"):
        LoaderConfig(global_batch_size=4, kv_backend="zookeeper").validate()
    with pytest.raises(DynaPipeError, match="prefetch=0"):
        LoaderConfig(global_batch_size=4, prefetch=0).validate()
    with pytest.raises(DynaPipeError, match="^start_iteration=-2: must be >= 0"):
        LoaderConfig(global_batch_size=4, start_iteration=-2).validate()
    # The same words as every other positive setting.
    for value in (0, -2.5):
        with pytest.raises(DynaPipeError, match=rf"^plan_timeout_s={value}: must be a finite number of s above 0\.$"):
            LoaderConfig(global_batch_size=4, plan_timeout_s=value).validate()
    with pytest.raises(DynaPipeError, match=r"^connect_timeout_s=-1\.0: must be a finite number of s above 0\.$"):
        LoaderConfig(global_batch_size=4, connect_timeout_s=-1.0).validate()
    for port in (0, 70000):
        with pytest.raises(DynaPipeError, match=f"^redis_port={port}: must be a TCP port, 1 to 65535"):
            LoaderConfig(global_batch_size=4, redis_port=port).validate()
    with pytest.raises(DynaPipeError, match="^redis_db=-1: a Redis database number is 0 or more"):
        LoaderConfig(global_batch_size=4, redis_db=-1).validate()
    # No rank would plan, and every rank would wait out the plan timeout naming a node 0.
    with pytest.raises(DynaPipeError, match="^planner_nodes=-1: must be non-negative"):
        LoaderConfig(global_batch_size=4, planner_nodes=-1).validate()
    with pytest.raises(DynaPipeError, match="disagree with the rank layout"):
        DynaPipeDataLoader(LoaderConfig(global_batch_size=4), dataset(), planner_settings(stages=2), RankLayout(),
                           store=default_store_for_single_process())
    with pytest.raises(DynaPipeError, match="not a multiple"):
        RankLayout(world_size=3, pp_size=2).validate()
    with pytest.raises(DynaPipeError, match="^seed=-1: must be >= 0"):  # numpy's traceback in a worker before
        LoaderConfig(global_batch_size=4, seed=-1).validate()
    for field in ("dp_size", "pp_size", "local_world_size"):  # a ZeroDivisionError before
        with pytest.raises(DynaPipeError, match=f"^rank layout: {field} 0 must be at least 1"):
            RankLayout(**{field: 0}).validate()
    # A LOCAL_RANK that is not the rank's place on its node made a second planner for one node.
    with pytest.raises(DynaPipeError, match="global rank 1 is local rank 1 of nodes of 2 ranks .* not 0"):
        RankLayout(rank=1, world_size=2, pp_size=2, pp_rank=1, local_rank=0, local_world_size=2).validate()


def test_only_a_planner_rank_of_a_dynapipe_run_starts_its_planner_server_early(monkeypatch):
    # The rank that will start its node's planner workers starts their forkserver before its
    # model is built; no other rank, and no baseline run, starts one.
    from types import SimpleNamespace

    from megatron_integration import dynapipe_loader

    started = []
    monkeypatch.setattr("dynapipe.runtime.process_start.start_helper_server", lambda: started.append(1) or "thread")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")

    def early(rank: int, enabled: bool = True, planner_nodes: int = 0) -> bool:
        monkeypatch.setenv("LOCAL_RANK", str(rank % 2))
        cfg = SimpleNamespace(dynapipe=SimpleNamespace(enabled=enabled, planner_nodes=planner_nodes,
                                                       split_replicas=False))
        info = SimpleNamespace(rank=rank, world_size=4, dp_rank=rank // 2, dp_size=2, pp_rank=rank % 2, pp_size=2)
        before = len(started)
        result = dynapipe_loader.start_planner_server_early(cfg, info)
        assert (result == "thread") == (len(started) > before)
        return len(started) > before

    # Two nodes of two ranks: each node's local rank 0 plans.
    assert [early(r) for r in range(4)] == [True, False, True, False]
    assert not early(0, enabled=False)  # padding and packing plan nothing
    assert [early(r, planner_nodes=1) for r in range(4)] == [True, False, False, False]


def test_the_planner_server_started_early_is_the_one_the_workers_fork_from(tmp_path):
    # In a fresh process (a process has one forkserver): one server, started by the thread, and
    # a helper process started afterwards is its child, not a second server's, with numba's
    # compiled kernels already loaded.
    import json
    import textwrap

    script = tmp_path / "early.py"
    script.write_text(textwrap.dedent("""
        import json
        import time

        import psutil

        from dynapipe.runtime.process_start import helper_context, start_helper_server


        def servers():
            return [c.pid for c in psutil.Process().children() if "forkserver" in " ".join(c.cmdline())]


        def kernels_loaded():
            # The server loaded a compiled kernel (numba set up) before this process forked.
            from dynapipe.plan import validate_fast

            raise SystemExit(0 if validate_fast._replay.overloads else 3)


        if __name__ == "__main__":
            start_helper_server().join(120)
            before = servers()
            p = helper_context().Process(target=time.sleep, args=(30,))
            p.start()
            parent = psutil.Process(p.pid).ppid()
            p.kill()
            p.join()
            q = helper_context().Process(target=kernels_loaded)
            q.start()
            q.join(60)
            print("RESULT", json.dumps({"before": before, "parent": parent, "after": servers(),
                                        "kernels": q.exitcode}))
        """))
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]))
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=240, env=env)
    lines = [l for l in done.stdout.splitlines() if l.startswith("RESULT ")]
    assert lines, done.stdout + done.stderr[-3000:]
    result = json.loads(lines[0][len("RESULT "):])
    assert len(result["before"]) == 1 and result["after"] == result["before"], result
    assert result["parent"] == result["before"][0], result
    assert result["kernels"] == 0, result  # dynapipe.runtime.preload_kernels ran in the server


def test_a_launch_without_local_world_size_plans_on_one_rank(monkeypatch):
    # A launcher that sets LOCAL_RANK (for the GPU) but not LOCAL_WORLD_SIZE: the job is one node
    # to the planners, whose only planner is global rank 0, whatever LOCAL_RANK says.
    from types import SimpleNamespace

    from megatron_integration import dynapipe_loader

    made = []
    monkeypatch.setattr("dynapipe.runtime.loader.DynaPipeDataLoader", lambda cfg, ds, s, layout: made.append(layout))
    monkeypatch.setattr(dynapipe_loader, "loader_config", lambda *a: LoaderConfig(global_batch_size=4))
    monkeypatch.setattr("megatron_integration.args_dynapipe.check_planner_nodes", lambda *a: None)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    for rank in range(4):
        monkeypatch.setenv("LOCAL_RANK", str(rank % 2))
        info = SimpleNamespace(rank=rank, world_size=4, dp_rank=rank % 2, dp_size=2, pp_rank=rank // 2, pp_size=2)
        dynapipe_loader.make_loader(None, info, 0, 0, dataset=object(), settings=object())
    assert [(x.local_rank, x.local_world_size, x.node) for x in made] == [(r, 4, 0) for r in range(4)]
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", "1")
    dynapipe_loader.make_loader(None, SimpleNamespace(rank=3, world_size=4, dp_rank=1, dp_size=2, pp_rank=1, pp_size=2),
                              0, 0, dataset=object(), settings=object())
    assert (made[-1].local_rank, made[-1].node) == (1, 1)


def test_encoder_decoder_jsonl_through_the_loader(tmp_path):
    import json

    from dynapipe.config import model_config_from_dict
    from dynapipe.data.config import DatasetConfig

    rng = np.random.default_rng(3)
    path = tmp_path / "t5.jsonl"
    with open(path, "w") as f:
        for i in range(40):
            f.write(json.dumps({"input": "x" * int(rng.integers(5, 120)), "target": "y" * int(rng.integers(1, 30)),
                                "task": f"t{i % 3}"}) + "\n")
    model = model_config_from_dict({"name": "t5-test", "arch": "t5", "encoder_layers": 2, "decoder_layers": 2,
                                    "hidden_size": 64, "num_attention_heads": 4, "vocab_size": 512,
                                    "max_seq_length": 256, "dtype": "fp32"})
    data = DatasetConfig("jsonl", 128, paths=(str(path),), encoder_decoder=True, dec_seq_length=64)
    ds = data.build()
    planner = PlannerSettings(model, load_device_config("cpu"), 1, 1)
    cfg = LoaderConfig(global_batch_size=8, seed=1, train_iters=2, plan_timeout_s=60)
    sampler = GlobalBatchSampler(ds.sample_tokens(), SamplerConfig(8, seed=1))
    with DynaPipeDataLoader(cfg, data, planner, RankLayout(), store=default_store_for_single_process()) as dl:
        for d in dl:
            batch = sampler.batch(d.iteration)
            assert d.meta.global_loss_tokens == int(ds.target_lengths[batch.indices].sum()) == d.plan.global_loss_tokens
            for info in d.plan.micro_batches:
                t = d.micro_batches[info.mb]
                assert set(t) == {"tokens", "dec_tokens", "labels", "loss_mask", "enc_mask", "dec_mask"}
                assert tuple(t["tokens"].shape) == (info.mbs, info.seqlen)
                assert tuple(t["labels"].shape) == (info.mbs, info.dec_seqlen)
                for row, pos in enumerate(info.samples):
                    s = ds[int(batch.indices[pos])]
                    n_in, n_tg = len(s.input_ids), len(s.target_ids)
                    assert t["tokens"][row, :n_in].tolist() == s.input_ids.tolist()
                    assert t["labels"][row, :n_tg].tolist() == s.target_ids.tolist()
                    assert t["dec_tokens"][row, 1:n_tg].tolist() == s.target_ids[:-1].tolist()
                    assert t["loss_mask"][row].sum().item() == n_tg
                    # The padding masks the stages build their attention masks from.
                    assert t["enc_mask"][row].tolist() == [1] * n_in + [0] * (info.seqlen - n_in)
                    assert t["dec_mask"][row].tolist() == [1] * n_tg + [0] * (info.dec_seqlen - n_tg)


def test_planner_nodes_splitting_the_replicas_publish_their_share_of_the_same_payloads():
    # Nodes that split the replicas (LoaderConfig.split_replicas) each publish only their
    # replicas' payloads, and those are the payloads one node planning everything
    # publishes: same plan bytes, tensors and iteration totals.
    ds, dp, stages = dataset(), 3, 2
    sampler_cfg = SamplerConfig(GBS, 0, SEED, True, min_samples=dp)
    settings = planner_settings(stages, dp)
    planner = IterationPlanner(settings)

    def publish(node, replicas):
        job = WorkerJob(ds, sampler_cfg, 0, 0, settings, None, Keyspace("k"), node, replicas)
        kv = DictKV()
        plan_and_publish(job, planner, GlobalBatchSampler(ds.sample_tokens(), sampler_cfg, 0), kv, 0)
        return {(r, s): get_blob(kv, job.keys.payload(0, r, s)) for r in range(dp) for s in range(stages)}

    # Planned again (as after a store restart, by another worker): the same bytes, so a reader
    # never joins the chunks of two copies and TP ranks that read different copies agree.
    assert publish(0, None) == publish(0, None)

    def same(a, b):
        pa, pb = decode_payload(a), decode_payload(b)
        timing = {"planner_node"}
        assert pa.plan_bytes == pb.plan_bytes
        assert {m: sorted(d) for m, d in pa.tensors.items()} == {m: sorted(d) for m, d in pb.tensors.items()}
        assert all(np.array_equal(pa.tensors[m][n], pb.tensors[m][n]) for m in pa.tensors for n in pa.tensors[m])
        assert {k: v for k, v in pa.meta.items() if k not in timing} == \
            {k: v for k, v in pb.meta.items() if k not in timing}

    whole = publish(0, None)
    assert all(v is not None for v in whole.values())
    shares = {0: (0, 2), 1: (1,)}
    for node, replicas in shares.items():
        got = publish(node, replicas)
        for (r, s), blob in got.items():
            if r in replicas:
                same(blob, whole[(r, s)])
                assert decode_payload(blob).meta["planner_node"] == node
            else:
                assert blob is None, f"node {node} published replica {r}, which is not its share"


def test_a_planner_refusal_is_one_line_in_the_callers_flags():
    """A DynaPipeError in a worker (here: nothing fits the memory limit) is the user's to fix: its
    message with the flags the training job's user gave, not a traceback with the plan command's."""
    from dataclasses import replace

    from dynapipe.errors import spelled_as
    from megatron_integration.flag_spelling import MEGATRON_SPELLING

    settings = replace(planner_settings(), memory_limit_mib=1)
    with spelled_as(MEGATRON_SPELLING):  # as a training job's start-up: its workers take it over
        dl = make_loader(settings=settings, num_workers=1, prefetch=1)
    try:
        with pytest.raises(PlannerWorkerError) as e:
            next(dl)
        msg = str(e.value)
        assert "failed while planning iteration 1: " in msg and "Traceback" not in msg
        assert "--dynapipe-memory-limit-mb" in msg and "--pipeline-model-parallel-size" in msg
        assert " --memory-limit-mb" not in msg and "--stages" not in msg
    finally:
        pids = dl.worker_pids
        dl.close()
    assert wait_gone(pids, 5) == []


def test_worker_reports_are_taken_every_iteration_even_when_no_plan_is_late():
    # Only a late plan consulted the workers, so a run whose plans were always ready left every
    # "done" report in the workers' queue buffers for the whole run.
    with make_loader(train_iters=6, prefetch=2) as dl:
        next(dl)
        time.sleep(1.0)  # iteration 1 (the prefetch window) is planned meanwhile; its report is queued
        next(dl)
        assert {0, 1} <= set(dl._pool.worker_ms), dl._pool.worker_ms
        list(dl)


def test_planning_stats_keep_the_latest_iterations_only(monkeypatch):
    # A run may plan millions of iterations; the pool's per-iteration times must not grow with it.
    from dynapipe.runtime import planner_workers

    monkeypatch.setattr(planner_workers, "STATS_KEPT", 3)
    pool = object.__new__(planner_workers.PlannerPool)  # the bookkeeping alone, no worker started
    pool.planning_ms, pool.worker_ms, pool._failure = {}, {}, None
    for it in range(6):
        pool._handle(("done", 0, it, 1.0 + it, 2.0 + it))
    assert sorted(pool.worker_ms) == sorted(pool.planning_ms) == [3, 4, 5] and pool.worker_ms[5] == 7.0


def test_a_rank_layout_from_torchruns_environment(monkeypatch):
    # Megatron's order: TP innermost, then DP, PP outermost; 16 ranks = TP2 x DP2 x PP4, 8 a node.
    env = dict(RANK="13", WORLD_SIZE="16", LOCAL_RANK="5", LOCAL_WORLD_SIZE="8")
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    layout = RankLayout.from_env(dp_size=2, pp_size=4)
    assert (layout.dp_rank, layout.pp_rank, layout.local_rank, layout.local_world_size) == (0, 3, 5, 8)
    monkeypatch.setenv("RANK", "2")
    monkeypatch.setenv("LOCAL_RANK", "2")
    assert (RankLayout.from_env(2, 4).dp_rank, RankLayout.from_env(2, 4).pp_rank) == (1, 0)
    with pytest.raises(DynaPipeError, match="WORLD_SIZE 16 is not a multiple of dp_size 3 x pp_size 4"):
        RankLayout.from_env(dp_size=3, pp_size=4)
    for k in env:
        monkeypatch.delenv(k)
    assert RankLayout.from_env(1, 1) == RankLayout()  # one process, no torchrun
