"""The inputs of a method comparison (:mod:`dynapipe.method_compare`), checked before any
simulation.

A comparison tries every recompute level and micro-batch size and reads a failure as "does
not fit in memory"; an input error raised inside those loops would be reported as one, so
the lengths, sizes and options are checked here first, once, with errors that name them.
"""
from __future__ import annotations

from typing import Optional

import numpy as np

from dynapipe.batching.lengths import validate_lengths
from dynapipe.config import ClusterConfig
from dynapipe.cost.base import CostModel, require_cost_model
from dynapipe.errors import DynaPipeError, flags, real_number, shown, whole_number


def checked_batch(lengths, cost_model: CostModel, *, dp: int = 1, tp: int = 1, seq_length: Optional[int] = None,
                  memory_limit_mib: Optional[float] = None, reserved_mib: Optional[float] = None,
                  cluster: Optional[ClusterConfig] = None, zero: bool = False, split_backward: bool = True,
                  micro_batch_size: Optional[int] = None, **_) -> np.ndarray:
    """``lengths`` (tokens; ``(n, 2)`` for encoder-decoder models) as int64, after checking them
    against ``cost_model``'s model and every option a simulation of them takes; other
    keywords (the method's schedule or recompute, checked where they are read) pass."""
    require_cost_model(cost_model)
    if lengths is None or isinstance(lengths, (str, bytes)) or np.isscalar(lengths):
        raise DynaPipeError(f"lengths {lengths!r:.60}: give one global batch, a sequence of sample lengths in tokens "
                            f"((n, 2) input and target lengths for an encoder-decoder model).")
    arr = validate_lengths(lengths, cost_model.model.is_encoder_decoder)
    if micro_batch_size is not None:
        whole_number("micro_batch_size", micro_batch_size)
    if seq_length is not None:
        whole_number("seq_length", seq_length)
    whole_number("dp", dp)
    whole_number("tp", tp)
    if dp > len(arr):
        raise DynaPipeError(f"dp {dp} exceeds the {len(arr)} sample(s) of the global batch; every replica needs one.")
    if memory_limit_mib is not None:
        real_number("memory_limit_mib", memory_limit_mib, unlimited=True)
    if reserved_mib is not None:
        real_number("reserved_mib", reserved_mib)
    _check_cluster(cluster)
    flags(zero=zero, split_backward=split_backward)
    return arr


def _check_cluster(cluster) -> None:
    if cluster is not None and not isinstance(cluster, ClusterConfig):
        raise DynaPipeError(f"cluster {cluster!r:.60}: give a ClusterConfig (dynapipe.config.load_cluster_config("
                            f"name)) or None.")


def not_a_batch(value) -> bool:
    """Whether ``value`` cannot be one global batch (a number or None where a sequence is due:
    a flat batch given as the list of batches). Ragged rows are left to validate_lengths."""
    return value is None or isinstance(value, (str, bytes)) or np.isscalar(value)


def checked_batches(batches, model, device, *, cluster=None, seq_length: Optional[int] = None,
                    layouts=None) -> list[np.ndarray]:
    """The global ``batches`` of a layout comparison (:func:`dynapipe.advise.advise`) as int64
    arrays, after checking them against ``model`` and the other inputs every layout reads: a
    bad one would otherwise be reported once per layout, as a layout that does not fit."""
    from dynapipe.config import DeviceConfig, ModelConfig

    if not isinstance(model, ModelConfig):
        raise DynaPipeError(f"model {shown(model)}: give a ModelConfig (dynapipe.config.load_model_config(name)).")
    if not isinstance(device, DeviceConfig):
        raise DynaPipeError(f"device {shown(device)}: give a DeviceConfig (dynapipe.config.load_device_config(name)).")
    _check_cluster(cluster)
    if batches is None or isinstance(batches, (str, bytes)) or (len(batches) and not_a_batch(batches[0])):
        raise DynaPipeError("batches: give a sequence of global batches, each a sequence of sample lengths "
                            "(a single batch goes in a list: [lengths]).")
    if not len(batches):
        raise DynaPipeError("no global batch to simulate.")
    if seq_length is not None and whole_number("seq_length", seq_length) > model.max_seq_length:
        raise DynaPipeError(f"seq_length {seq_length} exceeds the max_seq_length {model.max_seq_length} of model "
                            f"{model.name!r}.")
    if layouts is not None and not len(layouts):
        raise DynaPipeError("layouts is empty; give at least one layout, or None for every layout of the GPUs.")
    return [validate_lengths(b, model.is_encoder_decoder) for b in batches]
