"""--dynapipe-planner-nodes / --dynapipe-split-replicas: parsed, validated against the job's
nodes and replicas, and carried into the data loader's LoaderConfig (no processes started)."""
import pytest
import torch

from dynapipe.errors import DynaPipeError
from megatron_integration.arguments import build_parser, parse_training_args
from megatron_integration.initialize import RankInfo
from megatron_integration.dynapipe_loader import loader_config, make_loader

BASE = ("--num-layers 4 --hidden-size 64 --num-attention-heads 4 --seq-length 256 --micro-batch-size 2 "
        "--global-batch-size 16 --train-iters 5 --lr 1e-3 --mock-data --pipeline-model-parallel-size 2")


def parse(extra: str = "", world: int = 8, num_nodes=None):
    # world 8 at PP2: 4 data-parallel replicas.
    return parse_training_args(f"{BASE} {extra}".split(), world, cuda=False, num_nodes=num_nodes)


def test_defaults_keep_every_node_planning():
    args = build_parser().parse_args(BASE.split())
    assert args.dynapipe_planner_nodes == 0 and args.dynapipe_split_replicas is False
    loader = loader_config(parse("--use-dynapipe"), start_iteration=0, consumed_samples=0)
    assert (loader.planner_nodes, loader.split_replicas) == (0, False)


def test_flags_reach_the_loader_config_with_the_other_loader_settings():
    cfg = parse("--use-dynapipe --dynapipe-planner-nodes 2 --dynapipe-split-replicas --dynapipe-planner-workers 3 "
                "--dynapipe-prefetch 6 --dynapipe-timeout-s 40", num_nodes=4)
    assert (cfg.dynapipe.planner_nodes, cfg.dynapipe.split_replicas) == (2, True)
    loader = loader_config(cfg, start_iteration=2, consumed_samples=32).validate()
    assert (loader.planner_nodes, loader.split_replicas, loader.num_workers, loader.prefetch) == (2, True, 3, 6)
    assert (loader.plan_timeout_s, loader.start_iteration, loader.train_iters, loader.consumed_samples) == (40, 2, 3, 32)
    # Taking turns by iteration (no split) on as many nodes as the job has.
    cfg = parse("--use-dynapipe --dynapipe-planner-nodes 4", num_nodes=4)
    assert (loader_config(cfg, 0, 0).planner_nodes, loader_config(cfg, 0, 0).split_replicas) == (4, False)


def test_split_over_one_planner_node_is_accepted():
    # One planner node plans every replica: the same as without the flag, so nothing to refuse.
    cfg = parse("--use-dynapipe --dynapipe-planner-nodes 1 --dynapipe-split-replicas", world=2, num_nodes=1)
    assert (cfg.dynapipe.planner_nodes, cfg.dynapipe.split_replicas) == (1, True)


@pytest.mark.parametrize("extra, world, num_nodes, needle", [
    ("--use-dynapipe --dynapipe-planner-nodes 3", 8, 2,
     "--dynapipe-planner-nodes 3: the job runs on 2 node(s); give at most 2 (0: every node plans)."),
    ("--use-dynapipe --dynapipe-planner-nodes -1", 8, None, "--dynapipe-planner-nodes -1: must be non-negative."),
    ("--dynapipe-planner-nodes 2", 8, 4, "--dynapipe-planner-nodes 2 needs --use-dynapipe"),
    ("--dynapipe-split-replicas", 8, 4, "--dynapipe-split-replicas needs --use-dynapipe"),
    # 4 nodes but only 2 replicas (world 4 at PP2) to share out.
    ("--use-dynapipe --dynapipe-planner-nodes 4 --dynapipe-split-replicas", 4, 4,
     "--dynapipe-planner-nodes 4 --dynapipe-split-replicas: the job has 2 data-parallel replica(s)"),
])
def test_what_the_job_cannot_honour_is_refused(extra, world, num_nodes, needle):
    with pytest.raises(DynaPipeError) as e:
        parse(extra, world=world, num_nodes=num_nodes)
    assert needle in str(e.value)


def test_loader_refuses_more_planner_nodes_than_the_launched_job_has(monkeypatch):
    # Parsed without the node count (as the T5 script and Python-started jobs do): the check
    # happens when the loader is made, from the launched layout, before any store or worker.
    cfg = parse("--use-dynapipe --dynapipe-planner-nodes 3", world=4)
    info = RankInfo(rank=0, world_size=4, pp_rank=0, pp_size=2, dp_rank=0, dp_size=2, tp_rank=0, tp_size=1,
                    device=torch.device("cpu"))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")  # 2 nodes of 2 ranks
    monkeypatch.setenv("LOCAL_RANK", "0")
    with pytest.raises(DynaPipeError, match=r"--dynapipe-planner-nodes 3: the job runs on 2 node\(s\)"):
        make_loader(cfg, info, 0, 0)
