"""The one place the data loader calls the planner and the plan serializer.

:class:`IterationPlanner` turns the lengths of one global batch into one
:class:`~dynapipe.plan.instructions.ExecutionPlan` per (replica, stage) through
:func:`dynapipe.pipeline_planner.plan_iteration`; :func:`encode_plan` /
:func:`decode_plan` are the plan's own versioned serialization (never pickle).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np

from dynapipe.batching.types import LengthLimit
from dynapipe.config import ClusterConfig, DeviceConfig, ModelConfig
from dynapipe.errors import DynaPipeError
from dynapipe.plan import deserialize_plan, serialize_plan
from dynapipe.plan.instructions import ExecutionPlan
from dynapipe.schedule.types import SPLITTING_SCHEDULE_NAMES


@dataclass(frozen=True)
class PlannerSettings:
    """Everything a planner worker needs to plan an iteration (picklable, no torch).

    ``method``: batching method (``dynapipe``, ``padding``, ``padding-mb``, ``packing``,
    ``token-budget``); ``schedule``: ``auto``, ``adaptive``, ``1f1b`` or ``zb-h1``;
    ``split_backward``: whether the stages can split their backward (``auto`` tries ``zb-h1``).
    ``cost_profile``: a measured profile (None: the analytic model).
    ``memory_limit_mib`` / ``reserved_mib``: None takes the device config's.
    ``recompute``: a level, or None to let the schedule search choose.
    ``seq_length``: the length limit (tokens) every method truncates at and the baselines pad
    to, or an encoder-decoder model's (input, target) pair of limits; ``max_tokens``: the
    token-budget baseline's (0: unset). ``tp``: tensor-parallel size of every stage (the cost model then prices one
    TP rank, its collectives on the cluster's intra-node link); ``sequence_parallel``:
    Megatron's sequence parallelism (activations between stages are ``[seqlen / tp, mbs,
    hidden]``); ``zero``: sharded optimizer states. ``validate`` checks every plan before it
    is published.
    """

    model: ModelConfig
    device: DeviceConfig
    num_stages: int
    dp: int = 1
    method: str = "dynapipe"
    schedule: str = "auto"
    memory_limit_mib: Optional[float] = None
    reserved_mib: Optional[float] = None
    cost_profile: Optional[str] = None
    recompute: Optional[str] = None
    micro_batch_size: int = 1
    seq_length: LengthLimit = 0
    max_tokens: int = 0
    cluster: Optional[ClusterConfig] = None
    tp: int = 1
    zero: bool = False
    validate: bool = False
    sequence_parallel: bool = False
    # Layers per stage (a dynapipe.cost.placement.StagePlacement); None: Megatron's even split.
    placement: Optional[object] = None
    split_backward: bool = True


class IterationPlanner:
    """Plans global batches with fixed settings; one per planner worker process."""

    backend = "pipeline_planner"

    def __init__(self, settings: PlannerSettings):
        from dynapipe.cost import build_cost_model

        check_planner_settings(settings)
        self.settings = settings
        self.cost_model = build_cost_model(settings.model, settings.device, settings.num_stages,
                                           settings.cost_profile, tensor_parallel_config(settings))
        if settings.placement is not None:
            # Priced and compiled for the stages the model builds; the plans carry it in meta.
            self.cost_model = self.cost_model.with_placement(settings.placement)

    def plan(self, lengths: np.ndarray, iteration: int) -> list[list[ExecutionPlan]]:
        """``[replica][stage]`` plans for a global batch of ``lengths`` (tokens; ``(n,)``, or
        ``(n, 2)`` input and target). Micro-batch ``samples`` index into ``lengths``."""
        return self.plan_iteration(lengths, iteration).plans

    def plan_iteration(self, lengths: np.ndarray, iteration: int, replicas: Optional[Sequence[int]] = None):
        """The whole :class:`~dynapipe.pipeline_planner.IterationPlan`; ``replicas``: compile
        only these replicas' plans (the others' rows are empty), as a node does that
        publishes a share of the replicas."""
        from dynapipe.batching.planner import DP_METHODS
        from dynapipe.pipeline_planner import plan_iteration

        s = self.settings
        # The DP methods size their own micro-batches (a training job's --micro-batch-size,
        # always given in Megatron's scripts, is for the baselines).
        mbs = 1 if s.method in DP_METHODS else s.micro_batch_size
        return plan_iteration(lengths, self.cost_model, stages=s.num_stages, dp=s.dp, method=s.method,
                              schedule=s.schedule, memory_limit_mib=s.memory_limit_mib,
                              reserved_mib=s.reserved_mib, cluster=s.cluster, recompute=s.recompute,
                              iteration=iteration, micro_batch_size=mbs,
                              seq_length=s.seq_length or None, max_tokens=s.max_tokens or None,
                              tp=s.tp, zero=s.zero, validate=s.validate, replicas=replicas,
                              split_backward=s.split_backward)


def tensor_parallel_config(settings: PlannerSettings):
    """The cost model's :class:`~dynapipe.config.TensorParallelConfig` of ``settings`` (see
    :func:`tensor_parallel_of`)."""
    return tensor_parallel_of(settings.tp, settings.sequence_parallel, settings.cluster)


def tensor_parallel_of(tp: int, sequence_parallel: bool, cluster=None):
    """A cost model's :class:`~dynapipe.config.TensorParallelConfig` for ``tp`` ranks a stage
    (None at TP 1 without sequence parallelism); collectives priced on ``cluster``'s intra-node
    link when a cluster config is given, or on its inter-node link where a TP group spans nodes
    (more ranks than a node's GPUs, or a size that does not divide them): Megatron-LM allows
    that layout, and its ring runs at the slower link's speed."""
    from dynapipe.config import TensorParallelConfig

    if tp == 1 and not sequence_parallel:
        return None
    if cluster is None:
        return TensorParallelConfig(tp, sequence_parallel)
    spans_nodes = tp > cluster.gpus_per_node or cluster.gpus_per_node % tp != 0
    return TensorParallelConfig(tp, sequence_parallel, cluster.inter_node if spans_nodes else cluster.intra_node)


def encode_plan(plan: ExecutionPlan) -> bytes:
    """The plan's own serialization (deterministic bytes, never pickle)."""
    return serialize_plan(plan)


def decode_plan(data: bytes) -> ExecutionPlan:
    """Inverse of :func:`encode_plan`; a corrupted payload raises :class:`~dynapipe.errors.PlanError`."""
    return deserialize_plan(data)


def check_planner_settings(settings: PlannerSettings) -> None:
    """Reject settings that cannot plan, before any worker starts."""
    if settings.num_stages < 1 or settings.dp < 1:
        raise DynaPipeError(f"pipeline stages ({settings.num_stages}) and data-parallel replicas "
                            f"({settings.dp}) must be at least 1.")
    if not isinstance(settings.model, ModelConfig) or not isinstance(settings.device, DeviceConfig):
        raise DynaPipeError("planner settings need a ModelConfig and a DeviceConfig.")
    from dynapipe.batching.planner import check_method
    from dynapipe.schedule.search_space import check_schedule

    # Found here, not by the first worker's first plan, which a training job sees seconds later.
    check_method(settings.method, settings.max_tokens)
    check_schedule(settings.schedule)
    if not settings.split_backward and settings.schedule in SPLITTING_SCHEDULE_NAMES:
        # Found here, not by the first worker's first plan a few seconds into the run.
        raise DynaPipeError(f"schedule {settings.schedule!r} splits every backward, and split_backward=False says "
                            f"the stages cannot split theirs; use another schedule, or auto (which then leaves "
                            f"the split schedules out).")
    tp = tensor_parallel_config(settings)
    if tp is not None:
        tp.validate(settings.model)
