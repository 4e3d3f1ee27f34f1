"""Megatron's distributed checkpoint format (``--ckpt-format torch_dist``).

Written and read by megatron-core's ``dist_checkpointing`` with the state dict Megatron-LM's
``generate_state_dict`` builds, so Megatron-LM and megatron-core load these checkpoints and
this project loads theirs::

    SAVE/latest_checkpointed_iteration.txt
    SAVE/iter_0000100/metadata.json       # dist_checkpointing's format marker
    SAVE/iter_0000100/common.pt           # args, iteration, checkpoint_version, opt_param_scheduler (0.16)
    SAVE/iter_0000100/.metadata           # torch.distributed.checkpoint's index of the shards
    SAVE/iter_0000100/__R_I.distcp        # tensor shards (model, optimizer) and the RNG objects

megatron-core 0.19 writes no ``common.pt``: the common part is the ``common_state`` object
inside rank 0's shard file, and ``load_common_state_dict`` reads either layout
(:func:`common_state_file` names whichever holds it).

State dict keys (Megatron-LM's): ``args`` (an ``argparse.Namespace`` with Megatron's names,
``consumed_train_samples`` among them), ``checkpoint_version`` (3.0), ``iteration``, ``model``
(``GPTModel.sharded_state_dict()``: global layer numbers, so a checkpoint saved at one
pipeline split loads at another), ``optimizer`` (megatron-core's ``sharded_state_dict`` of
the optimizer), ``opt_param_scheduler`` and ``rng_state`` (a ``ShardedObject`` per
(pipeline, tensor) rank holding every data-parallel rank's generators, so each replica
resumes its own dropout stream; Megatron-LM reads element 0 unless
``--data-parallel-random-init``).

Written by :mod:`megatron_integration.checkpoint_dist_save`, read here.

Integrity: after a save every file gets a ``.sha256`` sidecar (each rank digests the shard
files it wrote, rank 0 the rest), verified before loading; a checkpoint without sidecars
(written by Megatron-LM or megatron-core directly) loads unverified, and whatever
``dist_checkpointing`` raises on it comes back as one line naming the directory.
"""
from __future__ import annotations

import argparse
import os
import random
import warnings
from typing import Optional

import numpy as np
import torch
import torch.distributed as dist

from dynapipe.errors import DynaPipeError
from dynapipe.megatron_core import installed_release
from megatron_integration.checkpoint import check_distributed_optimizer, check_precision, check_rng_fits
from megatron_integration.checkpoint_files import CHECKSUM_SUFFIX, verify_file
from megatron_integration.initialize import RankInfo
from megatron_integration.checkpoint_compat import check_optimizer_resharding, model_mismatch, scheduler_units
from megatron_integration.megatron_resolved import megatron_resolved_args
from megatron_integration.scheduler_state import align_schedule_bounds, fixed_global_batch, load_scheduler_state

CHECKPOINT_VERSION = 3.0

def is_dist_checkpoint(iter_dir: str) -> bool:
    """Whether ``iter_dir`` holds a ``dist_checkpointing`` checkpoint (its ``metadata.json``)."""
    return os.path.isfile(os.path.join(iter_dir, "metadata.json"))


def consumed_valid_samples(cfg, iteration: int) -> int:
    """Validation samples Megatron-LM has read by the save at ``iteration``: ``--eval-iters``
    global batches per periodic evaluation, every ``--eval-interval`` iterations up to it (its
    loop evaluates before it saves). This project positions its validation stream from the
    iteration (:func:`megatron_integration.evaluation.valid_first_batch`); Megatron-LM resumes
    its validation loader from this count. An evaluation that ``--exit-duration-in-mins`` cut
    short counts whole here (Megatron-LM counts the batches it ran)."""
    e = cfg.evaluation
    done = iteration // e.eval_interval if e.eval_interval and e.eval_iters > 0 else 0
    return done * e.eval_iters * cfg.global_batch_size


def megatron_args(recorded: dict, cfg, info: RankInfo, iteration: int, consumed_samples: int) -> argparse.Namespace:
    """The ``args`` Megatron-LM stores in a checkpoint: the run's parsed arguments under Megatron's
    names, with the values Megatron-LM derives (padded vocabulary, parallel sizes, consumed samples),
    which its ``load_checkpoint`` and ``check_checkpoint_args`` read."""
    values = megatron_resolved_args(recorded, cfg)
    values.update(iteration=iteration, consumed_train_samples=consumed_samples,
                  consumed_valid_samples=consumed_valid_samples(cfg, iteration), ckpt_format="torch_dist",
                  ckpt_fully_parallel_save=cfg.dist_ckpt.fully_parallel_save, data_parallel_random_init=False,
                  no_save_optim=False, no_save_rng=False)
    return argparse.Namespace(**values)


def _sharding_metadata(distributed_optimizer: bool) -> dict:
    """Megatron-LM's content metadata (how the model and optimizer were cut into shards)."""
    meta = {"singleton_local_shards": False, "chained_optim_avoid_prefix": True}
    if distributed_optimizer:
        meta["distrib_optim_sharding_type"] = "dp_reshardable"
    return meta


def _rng_state() -> dict:
    from megatron.core import tensor_parallel

    state = {"random_rng_state": random.getstate(), "np_rng_state": np.random.get_state(),
             "torch_rng_state": torch.get_rng_state(),
             "rng_tracker_states": tensor_parallel.get_cuda_rng_tracker().get_states()}
    if torch.cuda.is_available():
        state["cuda_rng_state"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict) -> None:
    from megatron.core import tensor_parallel

    check_rng_fits(state["rng_tracker_states"])
    random.setstate(state["random_rng_state"])
    np.random.set_state(state["np_rng_state"])
    torch.set_rng_state(state["torch_rng_state"])
    if "cuda_rng_state" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda_rng_state"])
    tensor_parallel.get_cuda_rng_tracker().set_states(state["rng_tracker_states"])


def _rng_sharded_object(info: RankInfo, payload):
    from megatron.core import parallel_state as ps
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    return ShardedObject("rng_state", payload, (info.pp_size, info.tp_size), (info.pp_rank, info.tp_rank),
                         replica_id=ps.get_data_parallel_rank())


def _gathered_rng(info: RankInfo) -> list:
    from megatron.core import parallel_state as ps

    mine = _rng_state()
    if info.dp_size == 1:
        return [mine]
    states = [None] * info.dp_size
    dist.all_gather_object(states, mine, group=ps.get_data_parallel_group())
    return states


def _sharded_state_dict(gpt, optimizer, metadata: dict, with_optim: bool, is_loading: bool) -> dict:
    from megatron.core import parallel_state as ps

    meta = dict(metadata, dp_cp_group=ps.get_data_parallel_group())
    state = {"model": gpt.sharded_state_dict(metadata=meta)}
    if with_optim:
        state["optimizer"] = optimizer.sharded_state_dict(state["model"], is_loading=is_loading, metadata=meta)
    return state


def _load_strategy(iter_dir: str, fully_parallel: bool):
    """The torch_dist reader; with ``--ckpt-fully-parallel-load`` wrapped so the data-parallel
    replicas split the reading and exchange the shards. None: megatron-core's default."""
    if not fully_parallel:
        return None
    from megatron.core import parallel_state as ps
    from megatron.core.dist_checkpointing.serialization import get_default_load_sharded_strategy
    from megatron.core.dist_checkpointing.strategies.fully_parallel import FullyParallelLoadStrategyWrapper

    return FullyParallelLoadStrategyWrapper(get_default_load_sharded_strategy(iter_dir),
                                            ps.get_data_parallel_group(with_context_parallel=True))


def _checkpoint_files(iter_dir: str) -> list[str]:
    files = []
    for dirpath, _, names in os.walk(iter_dir):
        files.extend(os.path.join(dirpath, n) for n in names
                     if not n.endswith(CHECKSUM_SUFFIX) and not n.endswith(".tmp"))
    return sorted(files)


def verify_dist_checkpoint(iter_dir: str, rank: int = 0, world_size: int = 1) -> bool:
    """Verify this rank's share (every ``world_size``-th file) of ``iter_dir`` against the sidecars.

    Returns False when no file has a sidecar (a checkpoint written by Megatron-LM or
    megatron-core itself): then only the shards' sizes are checked against the index, so a
    truncated shard is named rather than failing as an empty ``EOFError``. A checkpoint with
    some sidecars must have them all. Raises :class:`DynaPipeError` naming the first bad file.
    """
    files = _checkpoint_files(iter_dir)
    if not any(os.path.exists(f + CHECKSUM_SUFFIX) for f in files):
        _check_shard_sizes(iter_dir, rank, world_size)
        return False
    for path in files[rank::world_size]:
        verify_file(path)
    return True


def _check_shard_sizes(iter_dir: str, rank: int = 0, world_size: int = 1) -> None:
    """Every shard of this rank's share holds the bytes the torch_dist index places in it."""
    try:
        from torch.distributed.checkpoint import FileSystemReader

        storage = FileSystemReader(iter_dir).read_metadata().storage_data
    except Exception:  # noqa: BLE001 - no readable index: megatron-core's load names it
        return
    need: dict = {}
    for info in storage.values():
        need[info.relative_path] = max(need.get(info.relative_path, 0), info.offset + info.length)
    for rel in sorted(need)[rank::world_size]:
        path = os.path.join(iter_dir, rel)
        if not os.path.isfile(path):
            raise DynaPipeError(f"checkpoint file {path} is missing, but the checkpoint's index names it; resume "
                                f"from a complete checkpoint.")
        have = os.path.getsize(path)
        if have < need[rel]:
            raise DynaPipeError(f"checkpoint file {path} is truncated ({have:,} bytes, its index needs "
                                f"{need[rel]:,}); copy it again or resume from another checkpoint.")


try:
    # torch.distributed.checkpoint's wrapper of the ranks' read errors derives from BaseException;
    # megatron-core 0.19 reads the common part through it (0.16 through a plain torch.load).
    from torch.distributed.checkpoint.api import CheckpointException as _DcpException
except ImportError:  # pragma: no cover - a torch without it raises plain exceptions only
    _DcpException = Exception
_LOAD_ERRORS = (Exception, _DcpException)


def _checkpoint_error(path: str, e: BaseException) -> DynaPipeError:
    if isinstance(e, _DcpException) and getattr(e, "failures", None):
        # The first failing rank's own exception, not the wrapper's multi-line traceback dump.
        e = next(iter(e.failures.values()))[0]
    text = " ".join(str(e).split())[:300]
    return DynaPipeError(f"checkpoint {path} cannot be loaded ({type(e).__name__}: {text}).")


def common_state_file(iter_dir: str) -> str:
    """The file of ``iter_dir`` that holds the common part (args, iteration, scheduler).

    ``common.pt`` where megatron-core wrote one (0.16); otherwise the shard file that the
    torch_dist index maps the ``common_state`` object to (0.19). ``iter_dir`` itself when
    neither can be found (a broken or foreign index), so an error still names a path.
    """
    legacy = os.path.join(iter_dir, "common.pt")
    if os.path.exists(legacy):
        return legacy
    try:
        from torch.distributed.checkpoint import FileSystemReader

        storage = FileSystemReader(iter_dir).read_metadata().storage_data
    except Exception:
        return iter_dir
    for index, info in storage.items():
        if index.fqn.split("/", 1)[0] == "common_state":
            return os.path.join(iter_dir, info.relative_path)
    return iter_dir


def read_common(iter_dir: str) -> dict:
    """The checkpoint's common part (args, iteration, scheduler; see :func:`common_state_file`);
    one-line errors naming the file that holds it."""
    from megatron.core import dist_checkpointing

    try:
        return dist_checkpointing.load_common_state_dict(iter_dir)
    except _LOAD_ERRORS as e:
        if isinstance(e, ValueError) and type(e).__name__ == "JSONDecodeError":  # megatron-core reads it first
            raise _checkpoint_error(os.path.join(iter_dir, "metadata.json"), e) from None
        where = common_state_file(iter_dir)
        if where == iter_dir:
            raise DynaPipeError(f"checkpoint {iter_dir} is incomplete: it holds no common state (no common.pt, and "
                                f"no index entry for one; {type(e).__name__} in megatron-core); resume from a "
                                f"complete checkpoint.") from None
        installed = installed_release()
        if os.path.basename(where) != "common.pt" and installed is not None and installed < (0, 19):
            # 0.19 moved the common part into the shards; 0.16 reads only common.pt.
            raise DynaPipeError(f"checkpoint {iter_dir} keeps its common state (args, iteration, scheduler) in "
                                f"{where}, as megatron-core 0.19 and newer write it; the installed megatron-core "
                                f"{'.'.join(map(str, installed))} reads only common.pt: resume with megatron-core "
                                f"0.19 or newer (a checkpoint of 0.16 loads on 0.19, not the reverse).") from None
        raise _checkpoint_error(where, e) from None



def load_dist(iter_dir: str, cfg, gpt, optimizer, scheduler, info: RankInfo, load_optim: bool,
              load_rng: bool, log, model_values: Optional[dict] = None) -> tuple[int, int, float]:
    """Load ``iter_dir`` into this rank's stage (and optimizer, scheduler and RNG unless told not
    to); collective. Returns (iteration, consumed samples, model FLOPs so far) as the checkpoint
    records them (Megatron-LM's ``num_floating_point_operations_so_far``; 0 where absent).
    ``log(line)`` prints Megatron-LM's notices (rank 0). ``model_values`` (Megatron-LM argument
    name -> value) replaces GPT's shape arguments in the check of the checkpoint's ``args``."""
    from megatron.core import dist_checkpointing

    common = read_common(iter_dir)
    ckpt_args = common.get("args")
    saved = _saved_keys(iter_dir)
    mismatch = model_mismatch(ckpt_args, cfg, model_values, saved) if ckpt_args is not None else None
    if mismatch:
        raise DynaPipeError(f"{iter_dir}: the checkpoint does not fit this model ({mismatch}); use the model "
                            f"arguments it was saved with.")
    metadata = dict(dist_checkpointing.load_content_metadata(preloaded_state_dict=common) or {})
    metadata.pop("dp_cp_group", None)
    ckpt_layout = (getattr(ckpt_args, "tensor_model_parallel_size", info.tp_size),
                   getattr(ckpt_args, "pipeline_model_parallel_size", info.pp_size))
    if load_rng and ckpt_layout != (info.tp_size, info.pp_size):
        log(f"(TP, PP) mismatch after resume (({info.tp_size}, {info.pp_size}) vs {ckpt_layout} from "
            f"checkpoint): RNG state will be ignored")
        load_rng = False
    if load_rng and not any(k.startswith("rng_state") for k in saved):
        raise DynaPipeError(f"{iter_dir} holds no RNG state; add --no-load-rng (or --finetune) to start the "
                            f"generators from --seed.")
    has_optim = load_optim and any(k.startswith("optimizer.") for k in saved)
    if has_optim:
        check_distributed_optimizer("distrib_optim_sharding_type" in metadata, cfg.optimizer.distributed, iter_dir)
        check_optimizer_resharding(metadata.get("distrib_optim_sharding_type"), ckpt_layout,
                                   (info.tp_size, info.pp_size), iter_dir)
        check_precision(_saved_dtype(ckpt_args), cfg.model.dtype, iter_dir)
    # Saved before the optimizer's first step (every iteration so far an fp16 overflow, skipped):
    # it holds no Adam moments, and megatron-core's loading state would ask for them (a KeyError).
    # This run's optimizer has not stepped either, so its state as it is matches the saved one.
    never_stepped = (has_optim and not cfg.optimizer.distributed
                     and not any(k.startswith("optimizer.state.exp_avg") for k in saved))
    state = _sharded_state_dict(gpt, optimizer, metadata, with_optim=has_optim, is_loading=not never_stepped)
    if load_rng:
        state["rng_state"] = _rng_sharded_object(info, [_rng_state()])
    try:
        with warnings.catch_warnings():
            # torch's notices about its own deprecated ShardedTensor/load_state_dict, which
            # megatron-core 0.16 calls; nothing the user can act on.
            warnings.simplefilter("ignore", FutureWarning)
            loaded = dist_checkpointing.load(state, iter_dir, sharded_strategy=_load_strategy(
                iter_dir, cfg.dist_ckpt.fully_parallel_load), strict=cfg.dist_ckpt.strictness)
        gpt.load_state_dict(loaded["model"], strict=True)
    except _LOAD_ERRORS as e:
        raise _checkpoint_error(iter_dir, e) from None
    if has_optim:
        align_schedule_bounds(loaded["optimizer"], optimizer,
                              getattr(scheduler, "use_checkpoint_opt_param_scheduler", False))
        optimizer.load_state_dict(loaded["optimizer"])
        if "opt_param_scheduler" in loaded:
            units = scheduler_units(ckpt_args)
            saved_batch = getattr(ckpt_args, "global_batch_size", None)
            load_scheduler_state(scheduler, loaded["opt_param_scheduler"], iter_dir, int(common.get("iteration", 0)),
                                 getattr(ckpt_args, "consumed_train_samples", None), saved_batch, units,
                                 checkpoint_batch=saved_batch if units != "iterations" else None,
                                 run_batch=fixed_global_batch(cfg))
    else:
        # As Megatron-LM: half-precision runs keep fp32 main copies of the weights in the
        # optimizer; without its state they are refreshed from the loaded weights.
        optimizer.reload_model_params()
    if load_rng:
        states = loaded["rng_state"]
        _set_rng_state(states[info.dp_rank] if len(states) == info.dp_size else states[0])
    iteration = int(common.get("iteration", 0))
    consumed = int(getattr(ckpt_args, "consumed_train_samples", iteration * cfg.global_batch_size))
    return iteration, consumed, float(common.get("num_floating_point_operations_so_far", 0) or 0)


def _saved_dtype(ckpt_args) -> Optional[str]:
    """``fp32``, ``bf16`` or ``fp16`` as Megatron-LM's ``args`` record it (None: not recorded)."""
    if ckpt_args is None or not hasattr(ckpt_args, "bf16"):
        return None
    return "bf16" if ckpt_args.bf16 else "fp16" if getattr(ckpt_args, "fp16", False) else "fp32"


def _saved_keys(iter_dir: str) -> set:
    """The keys of the checkpoint's tensors and objects (``optimizer.*``, ``rng_state/*``, ...)."""
    from megatron.core.dist_checkpointing.serialization import load_sharded_metadata

    try:
        return set(load_sharded_metadata(iter_dir).keys())
    except _LOAD_ERRORS as e:
        raise _checkpoint_error(iter_dir, e) from None
