"""A resumed run continues the weighted training blend its checkpoint trained on.

A weighted blend (``--data-path W1 P1 W2 P2 ...``) is sized by the run (``--train-iters`` x
``--global-batch-size``, or token budgets; :func:`~megatron_integration.data.training_blend_size`),
and the sampler shuffles over its length, so a blend of another size is another order of
samples: a run resumed with another ``--train-iters`` would index a different stream with the
checkpoint's consumed samples (some samples repeated, some skipped). Megatron-LM's blends behave
that way; here the checkpoint records its blend's size and the resumed run builds the same
blend, whose later epochs carry the stream on when the new run is longer. Blends whose size
cannot matter (unweighted or single paths, the synthetic mixture, megatron-core's span-corruption
blends, which stay Megatron-LM's) record nothing.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Optional, Sequence

from dynapipe.errors import DynaPipeError
from megatron_integration.data import training_blend_size
from megatron_integration.train_config import DynaPipeTrainingConfig


def weighted_training_blend(cfg: DynaPipeTrainingConfig) -> bool:
    """Whether the run trains on a weighted blend of two or more paths of this project's
    datasets (JSONL or indexed documents)."""
    d = cfg.data
    if d.mock_data:
        return False
    weights = d.train_data_weights if d.train_data_path else d.data_weights
    return len(weights) > 1


def blend_record(cfg: DynaPipeTrainingConfig, megatron_blend: bool = False) -> Optional[list]:
    """What a checkpoint records of the training blend: ``[kind, count]`` (see
    :func:`~megatron_integration.data.training_blend_size`), None where no blend's size
    matters. ``megatron_blend``: the data is megatron-core's own blend (T5 span corruption)."""
    if megatron_blend or not weighted_training_blend(cfg):
        return None
    kind, count = training_blend_size(cfg)
    return [kind, int(count)]


def keep_resumed_blend(cfg: DynaPipeTrainingConfig, recorded: Optional[Sequence],
                       megatron_blend: bool = False) -> tuple[DynaPipeTrainingConfig, Optional[str]]:
    """``(cfg, line)``: ``cfg`` building the blend ``recorded`` by the checkpoint (from
    :func:`blend_record`) where this run would size it otherwise, with a line saying so for the
    log; ``cfg`` unchanged and None where the sizes agree, nothing was recorded (a checkpoint of
    an earlier build, or of a run without a weighted blend) or this run has no such blend."""
    mine = blend_record(cfg, megatron_blend)
    if not recorded or mine is None:
        return cfg, None
    if (not isinstance(recorded, (list, tuple)) or len(recorded) != 2 or recorded[0] not in ("samples", "tokens")
            or not isinstance(recorded[1], int) or recorded[1] <= 0):
        raise DynaPipeError(f"the checkpoint records its training blend's size as {recorded!r}, not [\"samples\" or "
                            f"\"tokens\", a positive count]; resume from a checkpoint this project wrote.")
    kind, count = str(recorded[0]), int(recorded[1])
    if [kind, count] == mine:
        return cfg, None
    kept = replace(cfg, data=replace(cfg.data, resumed_blend_size=(kind, count)))
    return kept, (f" > keeping the weighted blend as the checkpoint sized it ({count:,} {kind}; this run's "
                  f"--train-iters {cfg.train_iters} would size it for {mine[1]:,} {mine[0]}), so the consumed samples "
                  f"continue its order")
