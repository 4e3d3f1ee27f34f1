"""Saving and resuming in the format ``--ckpt-format`` names, with Megatron-LM's log lines.

* ``torch_dist`` (the default, as in Megatron-LM): megatron-core's ``dist_checkpointing``
  (:mod:`megatron_integration.checkpoint_dist`); Megatron-LM loads it and this project loads
  Megatron-LM's and megatron-core's.
* ``dynapipe``: this project's per-rank ``torch.save`` files (:mod:`megatron_integration.checkpoint`),
  which only this project reads.

``--load`` reads whichever of the two the newest checkpoint is (Megatron-LM's
``--auto-detect-ckpt-format`` behaviour), so changing ``--ckpt-format`` between runs is
fine. ``--finetune`` (Megatron's meaning): load the weights only and start at iteration 0.
Every loading error is raised on every rank as the same one line, so no rank goes on to
wait for the others in training.
"""
from __future__ import annotations

import glob
import math
import os
import shutil
from datetime import datetime
from types import SimpleNamespace
from typing import Callable, Optional

from dynapipe.errors import DynaPipeError
from megatron_integration import checkpoint_compat, checkpoint_dist, checkpoint_dist_save
from megatron_integration.agreement import attempt, everyone, same_error_everywhere
from megatron_integration.checkpoint import (BLEND_RECORD_KEY, GLOBAL_BATCH_KEY, LATEST, RELEASE, ResumeState,
                                             _iter_dir, _rank_dir, latest_iteration, load_checkpoint, publish_latest,
                                             save_checkpoint)
from megatron_integration.checkpoint_files import CHECKSUM_SUFFIX
from megatron_integration.initialize import RankInfo
from megatron_integration.non_persistent import other_checkpoints, save_config
from megatron_integration.scheduler_state import fixed_global_batch
from megatron_integration.train_config import DistCkptArgs

CKPT_FORMATS = ("torch_dist", "dynapipe")

Log = Callable[[str], None]


def _now() -> str:
    return datetime.now().strftime("%Y-%m-%d %H:%M:%S.%f")


def _layout(info: RankInfo) -> str:
    return f"[ t {info.tp_rank + 1}/{info.tp_size}, p {info.pp_rank + 1}/{info.pp_size} ]"


def save(cfg, iteration: int, consumed_samples: int, gpt, optimizer, scheduler, info: RankInfo, log: Log,
         extra: Optional[dict] = None, args_update: Optional[dict] = None,
         model_values: Optional[dict] = None, training_blend: Optional[list] = None,
         flops_so_far: float = 0.0, persistent: bool = True) -> str:
    """Save the checkpoint of ``iteration`` to ``cfg.save`` in ``cfg.ckpt_format``; collective.

    Returns the iteration directory. ``latest_checkpointed_iteration.txt`` is replaced last,
    after every rank finished, so a job that dies mid-save resumes from the previous one.
    ``extra``: what the ``dynapipe`` format records besides the state (see ``load``'s
    ``check_extra``); ``args_update``: values that replace or add to the ``args`` a ``torch_dist``
    checkpoint records (another model's Megatron-LM arguments, T5's); ``model_values``: the
    model arguments a ``dynapipe`` checkpoint records for ``load`` to compare (T5's; default
    GPT's); ``training_blend``: the weighted training blend's size, which a resumed run keeps
    (:mod:`megatron_integration.blend_resume`; None: nothing to record); ``flops_so_far``: the
    model FLOPs trained so far, recorded as Megatron-LM's ``num_floating_point_operations_so_far``;
    ``persistent=False``: a non-persistent checkpoint, saved where
    :mod:`megatron_integration.non_persistent` puts them, the others there deleted once it is saved."""
    if not persistent:
        cfg = save_config(cfg)
    blend = {} if training_blend is None else {BLEND_RECORD_KEY: list(training_blend)}
    root = cfg.save
    retain = getattr(cfg, "save_retain_interval", None)
    previous = latest_iteration(root) if retain else None
    log(f"[{_now()}] saving checkpoint at iteration {iteration:7d} to {root} in {cfg.ckpt_format} format")
    if cfg.ckpt_format == "torch_dist":
        iter_dir = _iter_dir(root, iteration)
        args = checkpoint_dist.megatron_args(cfg.megatron_args, cfg, info, iteration, consumed_samples)
        vars(args).update({**(args_update or {}), **blend})
        checkpoint_dist_save.save_dist(iter_dir, iteration, gpt, optimizer, scheduler, info, args,
                                       cfg.optimizer.distributed, cfg.dist_ckpt.fully_parallel_save,
                                       fixed_global_batch(cfg), flops_so_far)
        publish_latest(root, iteration, info)
    else:
        # The model's Megatron-LM arguments, compared on load as torch_dist's recorded args are,
        # and the fixed global batch the schedule's steps were taken at (None: a token budget).
        extra = {**(extra or {}), **blend, "model_args": checkpoint_compat.recorded_model_args(cfg, model_values),
                 GLOBAL_BATCH_KEY: fixed_global_batch(cfg)}
        iter_dir = save_checkpoint(root, iteration, consumed_samples, gpt, optimizer, scheduler, info, extra=extra,
                                   dtype=cfg.model.dtype, flops_so_far=flops_so_far)
    log(f"  [{_now()}] successfully saved checkpoint from iteration {iteration:7d} to {root} {_layout(info)}")
    if retain and previous is not None and 0 < previous != iteration and previous % retain:
        _retire(root, previous, info, log)
    if not persistent and info.rank == 0:
        for old in other_checkpoints(root, iteration):
            _delete(old, log, f"  deleting {old} (non-persistent: only the newest is kept)")
    return iter_dir


def _retire(root: str, iteration: int, info: RankInfo, log: Log) -> None:
    """Delete the checkpoint of ``iteration`` under ``root`` (``--save-retain-interval``: a newer
    one is saved and named in the tracker, and ``iteration`` is no multiple of the interval), as
    Megatron-LM does: rank 0 deletes it, after every rank has saved the newer one (the save's
    last barrier); a symbolic link is left alone. A failure to delete is said, not raised: the
    newer checkpoint is complete and training goes on."""
    if info.rank != 0:
        return
    path = _iter_dir(root, iteration)
    if os.path.islink(path):
        log(f"  skipping deleting checkpoint from iteration {iteration:7d} at {root} since it is a symbolic link")
        return
    _delete(path, log, f"  deleting checkpoint from iteration {iteration:7d} at {root} (--save-retain-interval)")


def _delete(path: str, log: Log, line: str) -> None:
    """Delete the checkpoint directory ``path`` (rank 0, after the newer one is complete), said
    by ``line``; a failure is said, not raised: the newer checkpoint is complete and training
    goes on."""
    log(line)
    try:
        shutil.rmtree(path)
    except OSError as e:
        log(f"  could not delete {path}: {e.strerror}; it stays, and training goes on")


def _kind(iter_dir: str) -> str:
    if checkpoint_dist.is_dist_checkpoint(iter_dir):
        return "torch_dist"
    if glob.glob(os.path.join(iter_dir, "mp_rank_*", "model_optim_rng.pt" + CHECKSUM_SUFFIX)):
        return "dynapipe"
    if glob.glob(os.path.join(iter_dir, "mp_rank_*", "model_optim_rng.pt")):
        raise DynaPipeError(f"{iter_dir} is in Megatron-LM's legacy --ckpt-format torch, which this project does "
                            f"not read; resave it as torch_dist (Megatron-LM's tools/checkpoint/convert.py or a "
                            f"Megatron-LM run with --ckpt-format torch_dist).")
    raise DynaPipeError(f"{iter_dir} holds no checkpoint (no metadata.json, no mp_rank_* files) although "
                        f"{os.path.dirname(iter_dir)}/{LATEST} names it; resume from a complete one.")


def _newest_everywhere(root: str) -> tuple[Optional[int], Optional[str]]:
    """The newest checkpoint's iteration under ``root`` and its format, the same on every rank;
    collective.

    Why: each rank reads ``root`` itself. A node that cannot see it (a directory that is not
    on a shared file system) would otherwise start from random while the others resume."""
    def look():
        it = latest_iteration(root)
        return it, (None if it is None else _kind(_iter_dir(root, it)))

    seen, error = attempt(look, f"reading --load {root}")
    gathered = everyone((seen, error))  # one collective for both the errors and the views
    same_error_everywhere(error, [e for _, e in gathered])
    views = [v for v, _ in gathered]
    if len(set(views)) > 1:
        by_view: dict = {}
        for rank, view in enumerate(views):
            by_view.setdefault(view, []).append(rank)
        text = "; ".join(_ranks(r) + ("no checkpoint" if v[0] is None else f"iteration {v[0]} ({v[1]})")
                         for v, r in by_view.items())
        raise DynaPipeError(f"the ranks disagree on the newest checkpoint under --load {root}: {text}. Every rank "
                            f"must read the same directory: put it on a file system every node sees.")
    return seen


def _ranks(ranks: list) -> str:
    """'rank 3 sees ' or 'ranks 0,1,... (12 ranks) see '."""
    if len(ranks) == 1:
        return f"rank {ranks[0]} sees "
    return "ranks " + ",".join(map(str, ranks[:8])) + (f",... ({len(ranks)} ranks)" if len(ranks) > 8 else "") + " see "


def check_adam_settings(optimizer, opt, where: str) -> None:
    """Refuse an optimizer state whose Adam betas or epsilon differ from this run's
    ``--adam-beta1``/``--adam-beta2``/``--adam-eps``: loading puts back the saved parameter
    groups, these with them, so Megatron-LM trains on with the saved values and the flags do
    nothing. ``where``: the checkpoint directory, for the message."""
    for group in optimizer.param_groups:
        if "betas" not in group:
            continue
        for flag, saved, ours in (("--adam-beta1", group["betas"][0], opt.adam_beta1),
                                  ("--adam-beta2", group["betas"][1], opt.adam_beta2),
                                  ("--adam-eps", group["eps"], opt.adam_eps)):
            if not math.isclose(float(saved), float(ours), rel_tol=1e-9, abs_tol=0.0):
                raise DynaPipeError(f"{where}: the optimizer state was saved with {flag} {float(saved):g}, this run "
                                    f"gives {float(ours):g}, which its loaded state would override; resume with "
                                    f"{flag} {float(saved):g}, or add --no-load-optim to start a fresh optimizer.")


def override_group_lrs(optimizer, scheduler, opt, iteration: int, consumed_samples: Optional[int] = None,
                       run_batch: Optional[int] = None) -> None:
    """Under ``--override-opt_param-scheduler``, the loaded optimizer's parameter groups take
    this run's ``--lr``/``--min-lr`` (``--decoupled-lr``/``--decoupled-min-lr`` for the
    decoupled groups), as Megatron-LM's ``load_checkpoint`` sets them: the optimizer state
    restores the saved bounds, and megatron-core's scheduler reads the groups' over its own.
    The schedule resumes at ``iteration`` (iterations done), as Megatron-LM's sets its step
    count to the consumed samples: the saved count leaves out iterations skipped on an fp16
    overflow, so the new schedule would start behind the data. With this run's fixed global
    batch ``run_batch`` (samples) it resumes at ``consumed_samples / run_batch``, Megatron-LM's
    count in this run's steps, which differs where the checkpoint's batch did."""
    steps = consumed_samples / run_batch if consumed_samples is not None and run_batch else iteration
    scheduler.num_steps = int(steps) if steps == int(steps) else steps  # whole where it is, as Megatron-LM's
    for group in optimizer.param_groups:
        decoupled = group.get("is_decoupled_lr", False)
        max_lr = opt.decoupled_lr if decoupled else opt.lr
        min_lr = opt.decoupled_min_lr if decoupled else opt.min_lr
        if max_lr is not None:
            group["max_lr"] = max_lr
        if min_lr is not None:
            group["min_lr"] = min_lr
    scheduler.step(increment=0)  # the rates of the current step, from the new bounds


def recorded_training_blend(cfg, info: RankInfo) -> Optional[list]:
    """The weighted training blend's size that the checkpoint ``--load`` resumes recorded
    (:mod:`megatron_integration.blend_resume`), read before the model exists so that the data
    the run starts from is the blend it will train on; collective. None without a checkpoint
    to resume (none yet, ``--finetune``, a release checkpoint) or without a record. Read
    without loading the state: the common part of a ``torch_dist`` checkpoint, this rank's file
    of a ``dynapipe`` one memory-mapped; every rank that reads a record must read the same one
    (else the error names the rank). Where a rank cannot read its file (another layout, a node
    that does not see ``--load``, damage) none is used, and the load proper says what is wrong."""
    unreadable = "unreadable"

    def read():
        if not cfg.load or cfg.finetune:
            return None
        iteration = latest_iteration(cfg.load)
        if iteration is None or iteration == RELEASE:
            return None
        iter_dir = _iter_dir(cfg.load, iteration)
        try:
            if _kind(iter_dir) == "torch_dist":
                return getattr(checkpoint_dist.read_common(iter_dir).get("args"), BLEND_RECORD_KEY, None)
            import torch

            path = os.path.join(_rank_dir(cfg.load, iteration, info), "model_optim_rng.pt")
            # Not verified yet (the load proper checks its checksum): tensors and plain data only.
            payload = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
            return (payload.get("extra") or {}).get(BLEND_RECORD_KEY)
        except Exception:  # noqa: BLE001 - the load proper verifies the files and names what is wrong
            return unreadable

    mine, error = attempt(read, f"reading {cfg.load}")
    values = everyone(unreadable if error is not None else mine)
    if unreadable in values:
        return None
    if any(v != values[0] for v in values):
        first = next(r for r, v in enumerate(values) if v != values[0])
        raise DynaPipeError(f"--load {cfg.load}: rank {first} reads another record of the training blend "
                            f"({values[first]!r}) than rank 0 ({values[0]!r}); every rank must see the same "
                            f"checkpoint.")
    return values[0]


def load(cfg, gpt, optimizer, scheduler, info: RankInfo, log: Log,
         check_extra: Optional[Callable[[dict, str], None]] = None,
         model_values: Optional[dict] = None) -> Optional[ResumeState]:
    """Restore the newest checkpoint under ``cfg.load`` (either format); collective.

    Returns None when there is none yet (a fresh start, as in Megatron-LM). ``check_extra``
    may refuse what a ``dynapipe`` checkpoint recorded in ``extra``; ``model_values`` replaces
    GPT's model arguments in the check of a ``torch_dist`` checkpoint's ``args``
    (:func:`~megatron_integration.checkpoint_dist.load_dist`)."""
    root = cfg.load
    iteration, kind = _newest_everywhere(root)
    if iteration is None:
        if cfg.finetune or cfg.exit_on_missing_checkpoint:
            # Fine-tuning random weights, or told to stop: never a silent fresh start.
            why = "--finetune" if cfg.finetune else "--exit-on-missing-checkpoint"
            raise DynaPipeError(f"--load {root} holds no checkpoint (no {LATEST}) and {why} was given; point "
                                f"--load at the directory that holds {LATEST} (not an iter_* directory inside "
                                f"it).")
        log(f"WARNING: could not find the metadata file {os.path.join(root, LATEST)}")
        log("    will not load any checkpoints and will start from random")
        return None
    iter_dir = _iter_dir(root, iteration)
    release = iteration == RELEASE  # as Megatron-LM: the weights only, from iteration 0
    load_optim = cfg.load_optim and not cfg.finetune and not release
    load_rng = cfg.load_rng and not cfg.finetune and not release
    at = "(release)" if release else f"at iteration {iteration}"
    if kind == "torch_dist":
        log(f" loading distributed checkpoint from {root} {at}")
        verified, error = attempt(lambda: checkpoint_dist.verify_dist_checkpoint(iter_dir, info.rank, info.world_size),
                                  f"verifying {iter_dir}")
        same_error_everywhere(error)
        if not verified:
            log(f" {iter_dir} has no checksums (not written by dynapipe-megatron): loading it unverified")
        result, error = attempt(lambda: checkpoint_dist.load_dist(iter_dir, cfg, gpt, optimizer, scheduler, info,
                                                                  load_optim, load_rng, log, model_values),
                                f"loading {iter_dir}")
        same_error_everywhere(error)
        resumed = ResumeState(*result)
    else:
        d = cfg.dist_ckpt
        given = [f for f, on in (("--ckpt-fully-parallel-load", d.fully_parallel_load),
                                 (f"--dist-ckpt-strictness {d.strictness}", d.strictness != DistCkptArgs.strictness))
                 if on]
        if given:  # every rank read the same format (_newest_everywhere), so every rank stops here
            raise DynaPipeError(f"{given[0]}: {iter_dir} is a dynapipe-format checkpoint, which it does not apply "
                                f"to (it sets how torch_dist checkpoints are read; a dynapipe checkpoint loads key "
                                f"for key or not at all); drop it.")
        log(f" loading checkpoint from {root} {at}")

        def check_model_then_extra(extra: dict, path: str) -> None:
            recorded = extra.get("model_args")  # absent in checkpoints of earlier builds
            mismatch = (checkpoint_compat.model_mismatch(SimpleNamespace(**recorded), cfg, model_values)
                        if recorded else None)
            mismatch = mismatch or checkpoint_compat.impl_mismatch(recorded or {}, cfg)
            if mismatch:
                raise DynaPipeError(f"{iter_dir}: the checkpoint does not fit this model ({mismatch}); use the "
                                    f"model arguments it was saved with.")
            if check_extra is not None:
                check_extra(extra, path)

        resumed = load_checkpoint(root, gpt, optimizer, scheduler, info, load_optim, load_rng,
                                  check_model_then_extra, cfg.model.dtype, run_batch=fixed_global_batch(cfg))
    if load_optim:
        check_adam_settings(optimizer, cfg.optimizer, iter_dir)
    if load_optim and cfg.optimizer.override_scheduler:
        override_group_lrs(optimizer, scheduler, cfg.optimizer, resumed.iteration, resumed.consumed_samples,
                           fixed_global_batch(cfg))
    if cfg.finetune or release:
        resumed = ResumeState(iteration=0, consumed_samples=0)  # and no FLOPs: a new run
    log(f"  successfully loaded checkpoint from {root} {_layout(info)} at iteration {resumed.iteration}")
    return resumed
