"""The DynaPipe data loader of a Megatron run: its settings from the run's config, this rank's
place on its node, and the early start of the process planner workers fork from.
"""
from __future__ import annotations

import os

from megatron_integration.data import dataset_config, reshuffles
from megatron_integration.initialize import RankInfo
from megatron_integration.train_config import DynaPipeTrainingConfig


def loader_config(cfg: DynaPipeTrainingConfig, start_iteration: int, consumed_samples: int, dataset=None):
    """The data loader's settings (:class:`~dynapipe.runtime.loader.LoaderConfig`) of a run
    resumed at ``start_iteration`` after ``consumed_samples`` samples, of ``dataset`` (a dataset
    config; None: the run's GPT data), whose order decides whether the sampler shuffles
    (:func:`~megatron_integration.data.reshuffles`)."""
    from dynapipe.runtime.loader import LoaderConfig

    d = cfg.dynapipe
    tokens = cfg.data.tokens_per_global_batch or 0
    return LoaderConfig(global_batch_size=0 if tokens else cfg.global_batch_size,
                        tokens_per_global_batch=tokens, seed=cfg.seed, shuffle=reshuffles(dataset),
                        consumed_samples=consumed_samples, start_iteration=start_iteration,
                        # A run resumed at or past its end plans nothing (it still evaluates).
                        train_iters=max(cfg.train_iters - start_iteration, 0), num_workers=d.planner_workers,
                        planner_nodes=d.planner_nodes, split_replicas=d.split_replicas,
                        prefetch=d.prefetch, kv_backend=d.kv_backend, redis_host=d.redis_host,
                        redis_port=d.redis_port, plan_timeout_s=d.timeout_s, store_retry_s=d.store_retry_s)


def rank_layout(info: RankInfo):
    """This rank's place in the job and on its node, as the DynaPipe loader sees it."""
    from dynapipe.runtime.loader_config import RankLayout

    # Without torchrun's LOCAL_WORLD_SIZE the job is one node to the planners (one planner rank);
    # a LOCAL_RANK alone (a launcher that sets it for the GPU) would make every node's first
    # rank a planner for "node 0".
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", info.world_size))
    local_rank = int(os.environ.get("LOCAL_RANK", info.rank % local_world)) if "LOCAL_WORLD_SIZE" in os.environ \
        else info.rank
    return RankLayout(rank=info.rank, world_size=info.world_size, dp_rank=info.dp_rank, dp_size=info.dp_size,
                      pp_rank=info.pp_rank, pp_size=info.pp_size, local_rank=local_rank,
                      local_world_size=local_world).validate()


def start_planner_server_early(cfg: DynaPipeTrainingConfig, info: RankInfo):
    """On a rank that will start its node's planner workers in a DynaPipe run, start the
    process they fork from now (:func:`dynapipe.runtime.process_start.start_helper_server`),
    while the model is built; the thread starting it, or None on the other ranks and runs."""
    from dynapipe.runtime.loader_config import plans_here
    from dynapipe.runtime.process_start import start_helper_server

    d = cfg.dynapipe
    if not d.enabled or not plans_here(d.planner_nodes, d.split_replicas, rank_layout(info)):
        return None
    return start_helper_server()


def make_loader(cfg: DynaPipeTrainingConfig, info: RankInfo, start_iteration: int, consumed_samples: int,
                dataset=None, settings=None):
    """This rank's data loader (planner workers on each node's local rank 0); ``dataset`` /
    ``settings`` replace the run's GPT dataset config and planner settings (T5 runs)."""
    from dynapipe.runtime.loader import DynaPipeDataLoader
    from megatron_integration.args_dynapipe import check_planner_nodes
    from megatron_integration.dynapipe_step import planner_settings

    loader_cfg = loader_config(cfg, start_iteration, consumed_samples, dataset)
    layout = rank_layout(info)
    # The command line may have been parsed without the node count (T5, jobs started from
    # Python); the loader would quietly plan on fewer nodes than asked, so refuse it here,
    # on every rank alike, before any planner starts.
    check_planner_nodes(loader_cfg.planner_nodes, loader_cfg.split_replicas, layout.num_nodes, layout.dp_size)
    return DynaPipeDataLoader(loader_cfg, dataset or dataset_config(cfg), settings or planner_settings(cfg, info),
                              layout)
