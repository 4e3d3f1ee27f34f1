"""Restoring the learning-rate schedule from a checkpoint, with Megatron-LM's rule.

megatron-core's ``OptimizerParamScheduler`` compares each value the run's arguments give
(peak and minimum learning rate, warm-up and decay steps, decay style, weight decay) with
the checkpoint's. Megatron-LM refuses a difference unless ``--override-opt_param-scheduler``
(this run's values win) or ``--use-checkpoint-opt_param-scheduler`` (the checkpoint's win)
is given: a resumed run with another ``--train-iters`` would otherwise follow a schedule
its user did not ask for. megatron-core signals the difference with a bare assertion; this
module turns it into one line that names the value and the fix.

Units: this project's scheduler steps once an iteration; Megatron-LM's steps by each
iteration's samples. ``torch_dist`` checkpoints hold Megatron-LM's units (:func:`in_samples`
on save), and a checkpoint whose step count is its consumed samples is read back in
iterations (:func:`load_scheduler_state`), so either side resumes the other's schedule.
"""
from __future__ import annotations

import math
from collections import Counter
from typing import Optional

from dynapipe.errors import DynaPipeError

# The scheduler's values counted in steps (the rest are rates and styles).
STEP_KEYS = ("lr_warmup_steps", "num_steps", "lr_decay_steps", "wd_incr_steps")


# Recorded in a torch_dist checkpoint's ``args``: the units of its scheduler state, so a reader
# need not guess them ("samples", Megatron-LM's, or "iterations" for token-budget batches).
UNITS_ARG = "dynapipe_scheduler_units"


def fixed_global_batch(cfg) -> Optional[int]:
    """The run's global batch in samples, None where a token budget forms the batches (their
    sample counts vary); ``cfg``: a DynaPipeTrainingConfig."""
    return None if cfg.data.tokens_per_global_batch else cfg.global_batch_size


def in_samples(state: dict, samples_per_iteration: Optional[int]) -> dict:
    """``state`` (a scheduler state in iterations: one step a successful optimizer step; an fp16
    overflow skips it, as Megatron-LM skips its own) in Megatron-LM's units, samples, for a run of
    ``samples_per_iteration`` samples an iteration: every count times the global batch, as
    Megatron-LM counts its bounds and steps (its steps add each stepped iteration's samples).
    A resume at another ``--global-batch-size`` reads the checkpoint's counts at its own batch
    (:func:`load_scheduler_state`), so the counts saved here are Megatron-LM's too. Unchanged
    when the batch is not fixed (None: global
    batches formed by a token budget, whose sample counts vary)."""
    if not samples_per_iteration:
        return dict(state)
    return {k: (v * samples_per_iteration if k in STEP_KEYS and v is not None else v) for k, v in state.items()}


def _in_iterations(state: dict, scheduler, iteration: Optional[int], consumed_samples: Optional[int],
                   samples_per_iteration: Optional[int] = None, units: Optional[str] = None) -> dict:
    """A checkpoint's scheduler state in iterations. ``units``: what the checkpoint records
    (:data:`UNITS_ARG`): ``samples`` is converted, ``iterations`` kept; None (Megatron-LM's own
    checkpoints, which are in samples, and this project's older ones, in either) is told by a
    step count equal to the consumed samples. Every count is divided by the global batch the
    checkpoint was saved with (``samples_per_iteration``, its ``global_batch_size``; None: the
    mean batch, consumed samples over iterations), as Megatron-LM computed them from it."""
    steps = state.get("num_steps")
    if units == "iterations" or not iteration or not consumed_samples:
        return state
    if units != "samples" and (consumed_samples == iteration or steps != consumed_samples):
        return state
    per_iteration = samples_per_iteration or consumed_samples / iteration
    out = dict(state)
    for k in STEP_KEYS:
        if k in out and out[k] is not None:
            value = out[k] / per_iteration
            mine = getattr(scheduler, k, None)
            # The run's own value where the two agree but for rounding (x / b * b != x in floats).
            out[k] = mine if mine is not None and math.isclose(value, mine, rel_tol=1e-9) else value
    if "num_steps" in out and math.isclose(out["num_steps"], round(out["num_steps"]), abs_tol=1e-6):
        out["num_steps"] = int(round(out["num_steps"]))
    return out


def load_scheduler_state(scheduler, state: dict, where: str, iteration: Optional[int] = None,
                         consumed_samples: Optional[int] = None, samples_per_iteration: Optional[int] = None,
                         units: Optional[str] = None, checkpoint_batch: Optional[int] = None,
                         run_batch: Optional[int] = None) -> None:
    """Load ``state`` (a checkpoint's scheduler state) into ``scheduler``; ``where``: the
    checkpoint, for the message; ``iteration``, ``consumed_samples``, ``samples_per_iteration``
    (the global batch) and ``units`` (:data:`UNITS_ARG`), all the checkpoint's, say how a state
    in samples is read in iterations (:func:`_in_iterations`). ``checkpoint_batch`` and
    ``run_batch``: the fixed global batches (samples) of the checkpoint's run and of this one
    (None: a token budget, or not recorded); where they differ the checkpoint's counts are read
    at this run's batch, as Megatron-LM, whose schedule counts samples and steps by the batch
    of the run that resumes, reads them: its bounds then differ from this run's and are refused
    unless a flag picks a schedule. Raises :class:`DynaPipeError` when a value differs and
    neither flag says which one to keep."""
    mine = _in_iterations(state, scheduler, iteration, consumed_samples, samples_per_iteration, units)
    rebatched = bool(checkpoint_batch and run_batch and checkpoint_batch != run_batch)
    if rebatched:
        mine = {k: (v * checkpoint_batch / run_batch if k in STEP_KEYS and v is not None else v)
                for k, v in mine.items()}
    try:
        scheduler.load_state_dict(mine)
    except AssertionError as e:
        detail = " ".join(str(e).replace("checkpointvalue", "checkpoint value").split())
        if rebatched:
            detail += (f"; the checkpoint's steps read at this run's --global-batch-size {run_batch}, its own "
                       f"{checkpoint_batch}, as Megatron-LM counts the schedule in samples")
        raise DynaPipeError(f"{where}: the checkpoint's learning-rate schedule differs from this run's arguments "
                            f"({detail}); resume with the arguments it was saved with, or add "
                            f"--override-opt_param-scheduler (use this run's) or "
                            f"--use-checkpoint-opt_param-scheduler (keep the checkpoint's).") from None


# The parameter-group keys that hold the schedule's bounds. megatron-core 0.19 and newer match
# a saved group to this run's by every key of ``param_group_identifier_keys``, these included, so
# a resume under another --lr would fail to find its groups before the schedule rule is applied.
SCHEDULE_GROUP_KEYS = ("max_lr", "min_lr", "start_wd", "end_wd")


def _identity(group: dict, keys) -> tuple:
    return tuple(group.get(k, group.get(f"pre_{k}")) for k in keys)


def _group_lists(state, optimizer) -> list[tuple[list, list]]:
    """``(saved groups, this run's groups)`` for every optimizer ``state`` holds (a chained
    optimizer's state is one entry per optimizer; a mixed-precision one nests its inner optimizer's)."""
    subs = getattr(optimizer, "chained_optimizers", None)
    if isinstance(state, list) and subs is not None and len(subs) == len(state):
        return [pair for s, o in zip(state, subs) for pair in _group_lists(s, o)]
    if isinstance(state, dict):
        for holder in (state, state.get("optimizer")):
            if isinstance(holder, dict) and isinstance(holder.get("param_groups"), list):
                return [(holder["param_groups"], list(optimizer.param_groups))]
    return []


def _decoupled_by_position(saved: list, mine: list, keys) -> None:
    """Checkpoints saved before ``is_decoupled_lr`` was set on the ``--decoupled-lr`` groups
    (:func:`megatron_integration.optimizer.mark_decoupled_groups`) hold two groups of one
    identity; megatron-core builds the groups in one order for one model and flags, so the
    saved group at a decoupled group's position is the decoupled one."""
    flag = "is_decoupled_lr"
    if flag not in keys or len(saved) != len(mine) or not any(g.get(flag) for g in mine):
        return
    if len({_identity(g, keys) for g in saved}) == len(saved):
        return  # already told apart
    others = [k for k in keys if k != flag]
    if all(_identity(a, others) == _identity(b, others) for a, b in zip(saved, mine)):
        for group, own in zip(saved, mine):
            group[flag] = bool(own.get(flag))


def align_schedule_bounds(state, optimizer, keep_checkpoint: bool) -> None:
    """Before ``optimizer.load_state_dict(state)``: give each saved parameter group and its
    counterpart in this run (the one group equal in every other identifying key) the same
    :data:`SCHEDULE_GROUP_KEYS` values, so megatron-core pairs them whatever the two runs'
    --lr/--min-lr/weight decay. The values kept are the checkpoint's with ``keep_checkpoint``
    (--use-checkpoint-opt_param-scheduler), else this run's; whether the two may differ at all
    is :func:`load_scheduler_state`'s rule, applied right after. Groups whose other keys do not
    tell them apart are left to megatron-core's own matching."""
    try:
        from megatron.core.optimizer.optimizer import param_group_identifier_keys
    except ImportError:  # a release that matches groups by position
        return
    keys = [k for k in param_group_identifier_keys if k not in SCHEDULE_GROUP_KEYS]
    for saved, mine in _group_lists(state, optimizer):
        _decoupled_by_position(saved, mine, keys)
        by_identity: dict = {}
        for group in mine:
            by_identity.setdefault(_identity(group, keys), []).append(group)
        saved_count = Counter(_identity(group, keys) for group in saved)
        for group in saved:
            matches = by_identity.get(_identity(group, keys), [])
            # Groups told apart only by their bounds on either side: giving them one set of bounds
            # would merge them in megatron-core's pairing.
            if len(matches) != 1 or saved_count[_identity(group, keys)] != 1:
                continue
            source, target = (group, matches[0]) if keep_checkpoint else (matches[0], group)
            for k in SCHEDULE_GROUP_KEYS:
                if k in source:
                    target[k] = source[k]
