"""``--ckpt-format dynapipe``: this project's own per-rank checkpoint files (model, optimizer,
LR schedule, consumed samples, RNG), read only by this project; Megatron's ``torch_dist`` is
:mod:`megatron_integration.checkpoint_dist`, and :mod:`megatron_integration.checkpoint_formats`
chooses between the two.

Layout (Megatron's directory names, so they look familiar)::

    SAVE/latest_checkpointed_iteration.txt              # the newest complete iteration
    SAVE/iter_0000100/mp_rank_00_001/model_optim_rng.pt # per (tensor, pipeline) rank, written by DP rank 0
    SAVE/iter_0000100/mp_rank_00_001/rng_dp_001.pt      # RNG states of every data-parallel rank
    SAVE/iter_0000100/mp_rank_00_001/distrib_optim.pt   # sharded optimizer state (distributed optimizer)

Data-parallel replicas hold identical weights and optimizer state, so one replica
writes them; every rank writes its own RNG states (dropout masks differ per rank).
With ``--use-distributed-optimizer`` the optimizer state is sharded over the replicas:
megatron-core's ``save_parameter_state`` gathers it into ``distrib_optim.pt``
(collective over the data-parallel group) and ``load_parameter_state`` scatters it back.
``latest_checkpointed_iteration.txt`` is written last, after a barrier, so a job that
dies mid-save resumes from the previous complete checkpoint. Files are loaded with
``torch.load(weights_only=True)``: nothing but tensors and plain values is unpickled.
Every file has a ``.sha256`` sidecar, verified before loading
(:mod:`megatron_integration.checkpoint_files`).
"""
from __future__ import annotations

import os
import random
import re
from dataclasses import dataclass
from typing import Callable, Optional

import numpy as np
import torch
import torch.distributed as dist

from dynapipe.errors import DynaPipeError
from megatron_integration.agreement import attempt, same_error_everywhere
from megatron_integration.checkpoint_files import (TRACKER, StagedSave, load_verified, save_with_checksum,
                                                   sync_dir, verify_file, write_checksum, write_text_synced)
from megatron_integration.initialize import RankInfo
from megatron_integration.scheduler_state import align_schedule_bounds, load_scheduler_state

LATEST = TRACKER
FORMAT_VERSION = 1


@dataclass(frozen=True)
class ResumeState:
    """Where a loaded checkpoint left training: iterations done, samples consumed and the
    model FLOPs trained so far (Megatron-LM's ``num_floating_point_operations_so_far``; 0
    where the checkpoint records none)."""

    iteration: int
    consumed_samples: int
    flops_so_far: float = 0.0


# Where a checkpoint records the training blend's size: a key of a dynapipe-format checkpoint's
# ``extra``, an attribute of a torch_dist checkpoint's Megatron ``args`` (read before the load:
# checkpoint_formats.recorded_training_blend).
BLEND_RECORD_KEY = "dynapipe_training_blend"
# In ``extra``: the fixed global batch (samples) the schedule's steps were taken at; None under a
# token budget, absent in checkpoints of earlier builds.
GLOBAL_BATCH_KEY = "global_batch_size"


# A tracker that reads "release" names Megatron-LM's release checkpoint: directory release/,
# weights only, training from iteration 0 (converted checkpoints are published this way).
RELEASE = -1


def _iter_dir(root: str, iteration: int) -> str:
    return os.path.join(root, "release" if iteration == RELEASE else f"iter_{iteration:07d}")


def _rank_dir(root: str, iteration: int, info: RankInfo) -> str:
    return os.path.join(_iter_dir(root, iteration), f"mp_rank_{info.tp_rank:02d}_{info.pp_rank:03d}")


def get_rng_state() -> dict:
    """Python, numpy, torch (CPU and CUDA) and megatron's model-parallel tracker states."""
    from megatron.core import tensor_parallel

    kind, keys, pos, has_gauss, cached = np.random.get_state()
    state = {
        "python": [list(random.getstate()[1]), random.getstate()[0], random.getstate()[2]],
        "numpy": {"kind": kind, "keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos),
                  "has_gauss": int(has_gauss), "cached": float(cached)},
        "torch": torch.get_rng_state(),
        "tracker": tensor_parallel.get_cuda_rng_tracker().get_states(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


# A CUDA generator's state is a seed and an offset (16 bytes); a CPU one's is the Mersenne
# Twister's (5,056).
_CUDA_STATE_MAX_BYTES = 64


def _generator_device(state_bytes: int) -> str:
    return "GPU" if state_bytes <= _CUDA_STATE_MAX_BYTES else "CPU"


def check_rng_fits(tracker_states: dict) -> None:
    """Refuse the model-parallel tracker's generator states of a checkpoint (``tracker_states``)
    when they are another kind of generator's than this run's: saved on GPU ranks and loaded on
    CPU ones, or the other way round. They loaded, and the first dropout failed with torch's
    size error."""
    from megatron.core import tensor_parallel

    current = tensor_parallel.get_cuda_rng_tracker().get_states()
    for name, state in tracker_states.items():
        saved, ours = torch.as_tensor(state).numel(), current[name].numel() if name in current else None
        if ours is not None and saved != ours:
            raise DynaPipeError(f"the checkpoint's random state was saved on {_generator_device(saved)} ranks and "
                                f"this run is on {_generator_device(ours)} ranks, whose generators differ; resume "
                                f"with --no-load-rng (weights, optimizer and data position still load exactly; "
                                f"dropout draws afresh).")


def set_rng_state(state: dict) -> None:
    """Restore what :func:`get_rng_state` captured."""
    from megatron.core import tensor_parallel

    check_rng_fits(state["tracker"])
    internal, version, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    n = state["numpy"]
    np.random.set_state((n["kind"], n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["cached"]))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    tensor_parallel.get_cuda_rng_tracker().set_states(state["tracker"])


def _atomic_save(obj, path: str) -> None:
    save_with_checksum(lambda tmp: torch.save(obj, tmp), path)


def _load(path: str, map_location) -> dict:
    return load_verified(lambda p: torch.load(p, map_location=map_location, weights_only=True), path)


def _is_distributed(optimizer) -> bool:
    inner = getattr(optimizer, "chained_optimizers", [optimizer])
    return any(hasattr(o, "get_parameter_state_dp_zero") for o in inner)


def save_checkpoint(root: str, iteration: int, consumed_samples: int, gpt: torch.nn.Module, optimizer,
                    scheduler, info: RankInfo, extra: Optional[dict] = None, dtype: Optional[str] = None,
                    flops_so_far: float = 0.0) -> str:
    """Write this rank's part of the checkpoint of ``iteration``; collective over all ranks.

    Returns the iteration directory. A rank that cannot write its files makes every rank
    raise the same line, and ``latest_checkpointed_iteration.txt`` still names the previous
    checkpoint (nothing is lost). The files are written under ``iter_N.saving`` and moved to
    ``iter_N`` once every rank's are complete, so an earlier save of the same iteration stays
    whole until then, and none of its files (another data-parallel size's RNG states, a
    distributed optimizer's state) mixes with the new ones.
    """
    iter_dir = _iter_dir(root, iteration)
    staged = StagedSave(iter_dir, info.rank)
    rank_dir = os.path.join(staged.staging, os.path.basename(_rank_dir(root, iteration, info)))
    staged.begin()

    def write_own() -> None:
        os.makedirs(rank_dir, exist_ok=True)
        if info.dp_rank == 0:
            payload = {
                "format_version": FORMAT_VERSION,
                "iteration": iteration,
                "consumed_samples": consumed_samples,
                "num_floating_point_operations_so_far": float(flops_so_far),
                "model_parallel": (info.tp_size, info.pp_size),
                "model": gpt.state_dict(),
                "optimizer": optimizer.state_dict(),
                "scheduler": scheduler.state_dict(),
                "extra": extra or {},
                "dtype": dtype,  # fp32, bf16 or fp16: the optimizer state's layout depends on it
                # Its state is sharded into distrib_optim.pt, not in "optimizer": resuming across it is refused.
                "distributed_optimizer": _is_distributed(optimizer),
            }
            _atomic_save(payload, os.path.join(rank_dir, "model_optim_rng.pt"))
        _atomic_save(get_rng_state(), os.path.join(rank_dir, f"rng_dp_{info.dp_rank:03d}.pt"))

    staged.agree(attempt(write_own, f"saving {rank_dir} (rank {info.rank})")[1])
    if _is_distributed(optimizer):
        # Collective over the data-parallel group: entered by every rank or by none. Only data-parallel
        # rank 0 writes, after the gather, so its failure is caught and agreed on like the others'.
        optim_path = os.path.join(rank_dir, "distrib_optim.pt")

        def write_optimizer() -> None:
            optimizer.save_parameter_state(optim_path)
            if info.dp_rank == 0 and os.path.exists(optim_path):
                write_checksum(optim_path)
        staged.agree(attempt(write_optimizer, f"saving {optim_path} (rank {info.rank})")[1])
    staged.complete()
    publish_latest(root, iteration, info)
    return iter_dir


def publish_latest(root: str, iteration: int, info: RankInfo) -> None:
    """Name ``iteration`` in ``latest_checkpointed_iteration.txt`` once every rank has written
    its part; collective. A failed write is raised on every rank."""
    dist.barrier()

    def write() -> None:
        write_text_synced(os.path.join(root, LATEST), str(iteration))
        sync_dir(root)

    error = attempt(write, f"writing {os.path.join(root, LATEST)}")[1] if info.rank == 0 else None
    same_error_everywhere(error)


def latest_iteration(root: str) -> Optional[int]:
    """The newest complete checkpoint's iteration under ``root`` (:data:`RELEASE` for a release
    checkpoint), or None when there is none."""
    path = os.path.join(root, LATEST)
    if not os.path.exists(path):
        return None
    try:
        with open(path, "rb") as f:
            raw = f.read(64)
    except OSError as e:
        raise DynaPipeError(f"{path} cannot be read: {e.strerror}.") from None
    text = raw.decode("ascii", errors="replace").strip()
    if text == "release":
        return RELEASE
    if not text.isascii() or not text.isdigit():
        raise DynaPipeError(f"{path}: expected an iteration number, found {text[:20]!r}; the file is corrupted.")
    return int(text)


def load_checkpoint(root: str, gpt: torch.nn.Module, optimizer, scheduler, info: RankInfo,
                    load_optim: bool = True, load_rng: bool = True,
                    check_extra: Optional[Callable[[dict, str], None]] = None,
                    dtype: Optional[str] = None, run_batch: Optional[int] = None) -> Optional[ResumeState]:
    """Restore this rank's part of the newest checkpoint under ``root``; collective.

    Returns None when ``root`` holds no checkpoint yet (a fresh start). Every file is
    verified against its checksum first. ``check_extra(extra, path)`` may refuse what
    :func:`save_checkpoint` recorded in ``extra`` (raising :class:`DynaPipeError`) before
    anything is loaded; ``dtype`` (this run's ``fp32``/``bf16``/``fp16``) refuses an optimizer state
    saved in the other of full and mixed precision; ``run_batch``: this run's fixed global batch
    (samples; None under a token budget), against which the schedule's recorded one is read
    (:func:`~megatron_integration.scheduler_state.load_scheduler_state`). A rank that cannot load its part makes every rank raise the same
    one-line error, so none goes on to wait for it in training; the distributed optimizer's
    collective load starts only once every rank has read and applied its own files.
    """
    read, error = attempt(lambda: _read_rank(root, info, optimizer, load_optim, load_rng, check_extra, dtype),
                          f"reading the checkpoint under {root} (rank {info.rank})")
    same_error_everywhere(error)
    if read is None:
        return None
    payload, main, optim_path, rng = read
    _, error = attempt(lambda: _apply_rank(payload, main, gpt, optimizer, scheduler, load_optim, rng, run_batch),
                       f"loading {main} (rank {info.rank})", "resume with the arguments it was saved with, or "
                       "with --no-load-optim / --no-load-rng")
    same_error_everywhere(error)
    if optim_path is not None:
        optimizer.load_parameter_state(optim_path)
    return ResumeState(iteration=int(payload["iteration"]), consumed_samples=int(payload["consumed_samples"]),
                       flops_so_far=float(payload.get("num_floating_point_operations_so_far", 0.0)))


def check_precision(saved: Optional[str], ours: Optional[str], where: str) -> None:
    """Refuse loading an optimizer state saved in ``saved`` precision (``fp32``, ``bf16``, ``fp16``;
    None: not recorded) into a run in ``ours``: mixed precision keeps fp32 main copies of the
    weights in the optimizer, full precision does not, so the states do not fit each other."""
    if saved is None or ours is None or (saved == "fp32") == (ours == "fp32"):
        return

    def flag(dtype):
        return "fp32 (no --bf16/--fp16)" if dtype == "fp32" else f"--{dtype}"
    raise DynaPipeError(f"{where}: the optimizer state was saved in {flag(saved)}, this run trains in {flag(ours)}; "
                        f"resume at the precision it was saved at, or add --no-load-optim to load the weights and "
                        f"start a fresh optimizer.")


def check_distributed_optimizer(saved: Optional[bool], ours: bool, where: str) -> None:
    """Refuse loading an optimizer state saved with(out) ``--use-distributed-optimizer``
    (``saved``; None: not recorded, checkpoints of earlier builds) into a run without (with)
    it: the distributed optimizer keeps its state sharded in ``distrib_optim.pt``, the other in
    the rank's main file."""
    if saved is None or bool(saved) == bool(ours):
        return
    said = "with" if saved else "without"
    raise DynaPipeError(f"{where}: the optimizer state was saved {said} --use-distributed-optimizer and this run "
                        f"is {'with' if ours else 'without'} it; resume as it was saved, or add --no-load-optim to "
                        f"load the weights and start a fresh optimizer.")


def _read_rank(root: str, info: RankInfo, optimizer, load_optim: bool, load_rng: bool, check_extra=None,
               dtype: Optional[str] = None):
    """This rank's verified files: the payload, its path, the distributed optimizer's file
    (or None) and the RNG state (or None); None when ``root`` holds no checkpoint yet."""
    iteration = latest_iteration(root)
    if iteration is None:
        return None
    rank_dir = _rank_dir(root, iteration, info)
    main = os.path.join(rank_dir, "model_optim_rng.pt")
    if not os.path.exists(main):
        raise DynaPipeError(f"checkpoint {main} is missing: was it saved with the same "
                            f"--tensor/--pipeline-model-parallel-size, and does every node see --load {root} "
                            f"(a shared file system)?")
    payload = _load(main, info.device)
    version = payload.get("format_version") if isinstance(payload, dict) else None
    if version != FORMAT_VERSION:
        raise DynaPipeError(f"{main}: checkpoint format {version!r} is not supported (expected {FORMAT_VERSION}).")
    saved = payload.get("model_parallel")  # (TP, PP); absent in checkpoints of earlier builds
    if saved is not None and tuple(saved) != (info.tp_size, info.pp_size):
        raise DynaPipeError(f"{_iter_dir(root, iteration)} was saved at --tensor-model-parallel-size {saved[0]} "
                            f"--pipeline-model-parallel-size {saved[1]}, this run is {info.tp_size} x "
                            f"{info.pp_size}; resume at the sizes it was saved at, or save in --ckpt-format "
                            f"torch_dist, which loads at any split.")
    if check_extra is not None:
        check_extra(payload.get("extra") or {}, main)
    if load_optim:
        check_precision(payload.get("dtype"), dtype, _iter_dir(root, iteration))
        check_distributed_optimizer(payload.get("distributed_optimizer"), _is_distributed(optimizer),
                                    _iter_dir(root, iteration))
    optim_path = None
    if load_optim and _is_distributed(optimizer):
        optim_path = os.path.join(rank_dir, "distrib_optim.pt")
        verify_file(optim_path)
    rng = None
    if load_rng:
        rng_path = os.path.join(rank_dir, f"rng_dp_{info.dp_rank:03d}.pt")
        if not os.path.exists(rng_path):
            raise DynaPipeError(_missing_rng(rng_path, rank_dir, info.dp_rank))
        rng = _load(rng_path, "cpu")
    return payload, main, optim_path, rng


def _missing_rng(rng_path: str, rank_dir: str, dp_rank: int) -> str:
    """Why ``rng_path`` (data-parallel rank ``dp_rank``'s RNG file) is missing: a checkpoint
    saved with fewer data-parallel ranks (its files are those of ranks 0..N-1, all below this
    one), or else one that is incomplete or damaged (a file lost or deleted)."""
    saved = sorted(int(m.group(1)) for f in os.listdir(rank_dir) if (m := re.fullmatch(r"rng_dp_(\d+)\.pt", f)))
    if saved and saved == list(range(len(saved))) and dp_rank >= len(saved):
        return (f"{rng_path} is missing: the checkpoint was saved with {len(saved)} data-parallel rank(s), this run "
                f"has more; resume with --no-load-rng (each new rank then starts from --seed's RNG state).")
    held = (f"while the directory's other RNG files are there ({', '.join(f'rng_dp_{r:03d}.pt' for r in saved)})"
            if saved else "and so is every RNG file of its directory")
    return (f"{rng_path} is missing {held}: the checkpoint is incomplete or damaged; restore the file, point "
            f"{LATEST} at an earlier iteration, or resume with --no-load-rng.")


def _apply_rank(payload: dict, main: str, gpt: torch.nn.Module, optimizer, scheduler, load_optim: bool,
                rng: Optional[dict], run_batch: Optional[int] = None) -> None:
    try:
        gpt.load_state_dict(payload["model"], strict=True)
    except RuntimeError as e:
        detail = " ".join(str(e).split())  # torch's first line names only the class
        detail = detail if len(detail) <= 300 else detail[:297] + "..."
        raise DynaPipeError(f"{main}: the checkpoint does not fit this model ({detail}); "
                            f"use the model arguments it was saved with.") from None
    if load_optim:
        align_schedule_bounds(payload["optimizer"], optimizer,
                              getattr(scheduler, "use_checkpoint_opt_param_scheduler", False))
        optimizer.load_state_dict(payload["optimizer"])
        load_scheduler_state(scheduler, payload["scheduler"], main,
                             checkpoint_batch=(payload.get("extra") or {}).get(GLOBAL_BATCH_KEY), run_batch=run_batch)
    else:
        # As Megatron-LM (and the torch_dist path): half-precision runs keep fp32 main copies of
        # the weights in the optimizer; without its state they must come from the loaded
        # weights, or the first step writes the random start back into the model.
        optimizer.reload_model_params()
    if rng is not None:
        set_rng_state(rng)
