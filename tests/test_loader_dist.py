"""Plan delivery across gloo ranks (spawned processes, the job's TCPStore): every rank gets
exactly its own plan and tensors, planning is split over planner nodes, keys are cleaned."""
import json
import os
import time

import pytest
import torch.distributed as dist
import torch.multiprocessing as tmp

from dynapipe.runtime.distributed import free_port as _free_port
from test_loader import GBS, SEED, dataset, planner_settings, reference_iterations, summarize

ITERATIONS = 4


def _rank_main(rank, world, port, dp, pp, local_world, out_dir, split=False):
    import datetime

    from dynapipe.runtime.kv_store import job_tcp_store
    from dynapipe.runtime.loader import DynaPipeDataLoader, LoaderConfig, RankLayout

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    tp = world // (dp * pp)
    # Megatron's rank order: tensor-parallel fastest, then data-parallel, then pipeline.
    layout = RankLayout(rank, world, (rank // tp) % dp, dp, rank // (tp * dp), pp, rank % local_world, local_world)
    ds = dataset() if layout.local_rank == 0 else None  # only planner nodes read data
    cfg = LoaderConfig(global_batch_size=GBS, seed=SEED, train_iters=ITERATIONS, prefetch=3, plan_timeout_s=60,
                       split_replicas=split)
    loader = DynaPipeDataLoader(cfg, ds, planner_settings(pp, dp), layout)
    records = []
    for d in loader:
        rec = summarize(d)
        rec.update(iteration=d.iteration, replica=d.plan.replica, stage=d.plan.stage,
                   planner_node=d.meta.planner_node, names=sorted({n for t in d.micro_batches.values() for n in t}))
        records.append(rec)
    dist.barrier()
    loader.close()
    dist.barrier()
    leftover = [k for k in job_tcp_store().list_keys() if k.startswith(cfg.namespace + "/")]
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump({"layout": [layout.dp_rank, layout.pp_rank], "records": records, "leftover": leftover,
                   "is_planner": loader.is_planner}, f)
    dist.barrier()
    dist.destroy_process_group()


def run_ranks(world, dp, pp, local_world, out_dir, timeout_s=150, split=False):
    ctx = tmp.start_processes(_rank_main, args=(world, _free_port(), dp, pp, local_world, str(out_dir), split),
                              nprocs=world, join=False, start_method="spawn")
    deadline = time.monotonic() + timeout_s
    while not ctx.join(timeout=1):
        if time.monotonic() > deadline:
            for p in ctx.processes:
                p.kill()
            pytest.fail(f"{world} ranks did not finish within {timeout_s} s")
    out = []
    for r in range(world):
        with open(os.path.join(out_dir, f"rank{r}.json")) as f:
            out.append(json.load(f))
    return out


def _json(x):
    return json.loads(json.dumps(x))


def check_delivery(results, dp, pp, planner_nodes, split=False):
    ref = reference_iterations(ITERATIONS, stages=pp, dp=dp)
    for res in results:
        r, s = res["layout"]
        assert [x["iteration"] for x in res["records"]] == list(range(ITERATIONS))
        for it, rec in enumerate(res["records"]):
            expected = _json(ref[it][(r, s)] if (dp, pp) != (1, 1) else ref[it])
            assert (rec["replica"], rec["stage"]) == (r, s)
            assert rec["plan"] == expected["plan"], f"iteration {it}: rank with replica {r} stage {s} got another plan"
            assert rec["tensors"] == expected["tensors"]
            want = set()
            if s == 0:
                want |= {"tokens", "position_ids"}
            if s == pp - 1:
                want |= {"labels", "loss_mask"}
            assert set(rec["names"]) == want
            # Split: each node publishes its replicas' plans of every iteration.
            assert rec["planner_node"] == (r if split else it) % planner_nodes
        assert res["leftover"] == [], f"keys left in the store: {res['leftover']}"


def test_two_pipeline_ranks_on_two_planner_nodes(tmp_path):
    results = run_ranks(world=2, dp=1, pp=2, local_world=1, out_dir=tmp_path)
    assert [r["is_planner"] for r in results] == [True, True]
    check_delivery(results, dp=1, pp=2, planner_nodes=2)


def test_two_tensor_parallel_ranks_read_one_payload(tmp_path):
    results = run_ranks(world=2, dp=1, pp=1, local_world=2, out_dir=tmp_path)
    assert [r["is_planner"] for r in results] == [True, False]
    check_delivery(results, dp=1, pp=1, planner_nodes=1)
    assert results[0]["records"] == results[1]["records"]


def test_four_ranks_pp2_dp2_on_two_nodes_splitting_the_replicas(tmp_path):
    # Each planner node plans every iteration and publishes only its replica's plans
    # (LoaderConfig.split_replicas); every rank still gets exactly the single-planner plans.
    results = run_ranks(world=4, dp=2, pp=2, local_world=2, out_dir=tmp_path, split=True)
    assert [r["is_planner"] for r in results] == [True, False, True, False]
    assert sorted(tuple(r["layout"]) for r in results) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    check_delivery(results, dp=2, pp=2, planner_nodes=2, split=True)


def _split_kill_main(rank, world, port, out_dir):
    """2 nodes x 2 ranks, PP2 x DP2, split replicas: node 1 publishes replica 1's plans, and its
    planner rank (rank 2, replica 0) reads node 0's. Rank 2 kills its node's workers after
    iteration 0; every rank's outcome."""
    import datetime
    import signal

    from dynapipe.runtime.loader import DynaPipeDataLoader, LoaderConfig, RankLayout

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    layout = RankLayout(rank, world, rank % 2, 2, rank // 2, 2, rank % 2, 2)
    cfg = LoaderConfig(global_batch_size=GBS, seed=SEED, train_iters=ITERATIONS, prefetch=1, plan_timeout_s=60,
                       split_replicas=True, namespace="dynapipe-split-kill")
    loader = DynaPipeDataLoader(cfg, dataset() if layout.local_rank == 0 else None, planner_settings(2, 2), layout)
    seen, error, t0 = [], None, time.monotonic()
    try:
        for d in loader:
            seen.append(d.iteration)
            if rank == 2 and d.iteration == 0:
                for pid in loader.worker_pids:
                    os.kill(pid, signal.SIGKILL)
                t0 = time.monotonic()
            if rank == 2:
                time.sleep(0.5)  # an iteration's training: its plans (node 0's) are all there at once
    except Exception as e:
        error = f"{type(e).__name__}: {e}"
    out = {"seen": seen, "error": error, "elapsed": time.monotonic() - t0}
    loader.close()
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(out, f)
    dist.barrier()
    dist.destroy_process_group()


def test_a_killed_worker_of_a_node_that_plans_for_others_is_seen_by_its_planner_rank(tmp_path):
    # Before, node 1's planner rank looked at its workers only while its own plan was late, and
    # node 0 publishes that plan: ranks awaiting node 1's plans waited out the plan timeout.
    results = _spawn_fault_ranks(_split_kill_main, 4, tmp_path, "ranks did not stop after a planner worker was killed")
    # Rank 0 needs only node 0's plans: it may finish first. Every rank that needs node 1's
    # (ranks 1 and 3) or holds its workers (rank 2) stops with the cause within seconds.
    assert results[0]["error"] is None or "without a report" in results[0]["error"], results[0]
    for r, res in enumerate(results[1:], start=1):
        assert res["error"] is not None and res["error"].startswith("PlannerWorkerError"), (r, res)
        assert "was killed by signal 9 (out of memory?), without a report" in res["error"], (r, res)
        assert res["elapsed"] < 30, f"rank {r} took {res['elapsed']:.1f} s to stop"


def _fault_loader(rank, world, namespace, exploding):
    from dynapipe.data.sampler import GlobalBatchSampler, SamplerConfig
    from dynapipe.data.samples import LengthLimits
    from dynapipe.runtime.loader import DynaPipeDataLoader, LoaderConfig, RankLayout
    from test_loader import N, SEQ, ExplodingDataset

    layout = RankLayout(rank, world, 0, 1, rank, world, rank, world)  # one node: rank 0 plans
    ds = None
    if rank == 0:
        ds = ExplodingDataset(N, 11, LengthLimits(SEQ), vocab_size=512)
        bad = int(GlobalBatchSampler(ds.sample_tokens(), SamplerConfig(GBS, seed=SEED)).batch(1).indices[0])
        ds.bad = bad if exploding else -1
    cfg = LoaderConfig(global_batch_size=GBS, seed=SEED, prefetch=1, plan_timeout_s=60, namespace=namespace)
    return DynaPipeDataLoader(cfg, ds, planner_settings(world, 1), layout)


def _crash_rank_main(rank, world, port, out_dir):
    """Two faults in one process group: a worker raising on a sample of iteration 1, then a
    worker killed by a signal (no report of its own) after iteration 0."""
    import datetime
    import signal

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    out = {}
    for case in ("crash", "kill"):
        loader = _fault_loader(rank, world, f"dynapipe-{case}", exploding=case == "crash")
        seen, error = [], None
        t0 = time.monotonic()
        try:
            for d in loader:
                seen.append(d.iteration)
                if case == "kill" and rank == 0 and d.iteration == 0:
                    for pid in loader.worker_pids:
                        os.kill(pid, signal.SIGKILL)
                    t0 = time.monotonic()
        except Exception as e:
            error = f"{type(e).__name__}: {e}"
        out[case] = {"seen": seen, "error": error, "elapsed": time.monotonic() - t0, "pids": loader.worker_pids}
        loader.close()
        dist.barrier()
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(out, f)
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def worker_faults(tmp_path_factory):
    return _spawn_fault_ranks(_crash_rank_main, 2, tmp_path_factory.mktemp("worker_faults"),
                              "ranks did not stop after a planner worker failed")


def _spawn_fault_ranks(fn, world: int, out_dir, failure: str, timeout_s: float = 150) -> list:
    """Run ``fn(rank, world, port, out_dir)`` on ``world`` spawned ranks; each rank's JSON
    outcome. A job still running after ``timeout_s`` is killed and the test fails with ``failure``."""
    ctx = tmp.start_processes(fn, args=(world, _free_port(), str(out_dir)), nprocs=world, join=False,
                              start_method="spawn")
    deadline = time.monotonic() + timeout_s
    while not ctx.join(timeout=1):
        if time.monotonic() > deadline:
            for p in ctx.processes:
                p.kill()
            pytest.fail(failure)
    results = []
    for r in range(world):
        with open(os.path.join(out_dir, f"rank{r}.json")) as f:
            results.append(json.load(f))
    return results


def test_a_crashing_worker_stops_every_rank_with_its_traceback(worker_faults):
    from test_loader import wait_gone

    for r, res in enumerate(x["crash"] for x in worker_faults):
        assert res["seen"] == [0], f"rank {r} trained past the failed iteration"
        assert res["error"] is not None and res["error"].startswith("PlannerWorkerError")
        assert "failed while planning iteration 2" in res["error"]
        assert "RuntimeError: corrupt sample" in res["error"] and "Traceback" in res["error"]
        assert res["elapsed"] < 30
    assert wait_gone(worker_faults[0]["crash"]["pids"], 5) == []


def test_a_killed_worker_stops_every_rank_with_the_cause_not_a_plan_timeout(worker_faults):
    # The killed worker writes nothing; the planner rank sees it die and must tell the
    # others, who would otherwise wait out the 60 s plan timeout with "may be stuck".
    for r, res in enumerate(x["kill"] for x in worker_faults):
        assert res["seen"] in ([0], [0, 1]), f"rank {r}: {res['seen']}"
        assert res["error"] is not None and res["error"].startswith("PlannerWorkerError"), res["error"]
        assert "was killed by signal 9 (out of memory?), without a report" in res["error"]
        assert "did not arrive" not in res["error"]
        assert res["elapsed"] < 30, f"rank {r} took {res['elapsed']:.1f} s to stop"
    # Both ranks stop at the same iteration: the planner rank does not fail ahead of the others.
    assert worker_faults[0]["kill"]["seen"] == worker_faults[1]["kill"]["seen"]
