"""megatron-core's ``DistributedDataParallel`` as Megatron-LM configures it, for GPT and T5 stages.

One place builds the ``DistributedDataParallelConfig`` from the run's arguments
(:class:`~megatron_integration.train_config.DDPArgs`: ``--overlap-grad-reduce`` and the bucket
flags; fp32 or bf16 reduction; the distributed optimizer) and wraps each model chunk; and one
place says which backward of an execution plan runs outside ``no_sync``
(:func:`backward_syncs`), so DynaPipe's executor overlaps the reduction exactly where
megatron-core's schedules do: during each chunk's last backward of the iteration (under a
split-backward schedule, its last input part and its last weight part).
"""
from __future__ import annotations

import functools
from contextlib import nullcontext
from typing import Optional, Sequence

import torch

from dynapipe.errors import DynaPipeError
from dynapipe.plan.grad_sync import grad_sync_points


def ddp_config(cfg, num_parameters: int):
    """The ``DistributedDataParallelConfig`` of a run (``cfg``: its
    :class:`~megatron_integration.train_config.DynaPipeTrainingConfig`); ``num_parameters``:
    this rank's parameters over all its chunks, which ``--ddp-num-buckets`` divides
    (Megatron-LM's rule). A fresh object each call: megatron-core's DDP writes its resolved
    bucket size into the one it is given."""
    from megatron.core.distributed import DistributedDataParallelConfig

    d = cfg.ddp
    bucket_size = d.bucket_size
    if d.num_buckets is not None:
        bucket_size = max(1, num_parameters // d.num_buckets)
    return DistributedDataParallelConfig(grad_reduce_in_fp32=cfg.optimizer.grad_reduce_in_fp32,
                                         overlap_grad_reduce=d.overlap_grad_reduce, bucket_size=bucket_size,
                                         pad_buckets_for_high_nccl_busbw=d.pad_buckets_for_high_nccl_busbw,
                                         use_distributed_optimizer=cfg.optimizer.distributed)


def wrap_chunk(cfg, tconfig, module: torch.nn.Module, chunk: int, num_parameters: int) -> torch.nn.Module:
    """``module`` (chunk ``chunk`` of this rank, already in its ``Float16Module`` if any) in DDP.
    Chunks after the first keep one bucket, as Megatron-LM wraps them (their reductions start
    while the first chunk's backward still runs)."""
    from megatron.core.distributed import DistributedDataParallel

    ddp = DistributedDataParallel(config=tconfig, ddp_config=ddp_config(cfg, num_parameters), module=module,
                                  disable_bucketing=chunk > 0)
    if ddp.ddp_config.overlap_grad_reduce:
        launch_in_bucket_order(ddp)
    return ddp


def launch_in_bucket_order(ddp: torch.nn.Module) -> None:
    """Make ``ddp`` (megatron-core's DDP, ``--overlap-grad-reduce``) launch its bucket groups'
    reductions in bucket-list order on every replica.

    megatron-core launches a bucket group's reduction from the backward hook that completes
    its gradients, so a replica sends its buckets in the order its backward finished them,
    while a replica without micro-batches (or one still in megatron-core's first batch, which
    launches from ``finish_grad_sync``) sends them in list order. Collectives on one group pair
    in the order they are sent: buckets of different sizes then abort the job, buckets of
    equal sizes are summed into each other without a word (a zero-bubble schedule finishes
    the embedding's and the norms' buckets in its input parts, before the linear weights'
    buckets listed ahead of them; 1F1B finishes an attention projection before its QKV). Here
    a group asked to launch waits until every group listed before it has launched, so all
    replicas send in list order, which megatron-core lays out in the backward's usual order
    (the reductions still overlap the backward wherever the two orders agree)."""
    groups = list(getattr(ddp, "bucket_groups", ())) + list(getattr(ddp, "expert_parallel_bucket_groups", ()))
    if len(groups) < 2:
        return
    launches = [g.start_grad_sync for g in groups]
    state = {"next": 0, "asked": set()}

    def start(k: int, *args, **kwargs) -> None:
        state["asked"].add(k)
        while state["next"] < len(groups) and state["next"] in state["asked"]:
            launches[state["next"]](*args, **kwargs)
            state["next"] += 1
        if state["next"] == len(groups):  # every group launched: the next iteration starts over
            state["next"], state["asked"] = 0, set()

    for k, group in enumerate(groups):
        group.start_grad_sync = functools.partial(start, k)


def count_parameters(modules: Sequence[torch.nn.Module]) -> int:
    """Parameters (elements) of this rank's chunks, each counted once."""
    seen = {id(p): p.numel() for m in modules for p in m.parameters()}
    return sum(seen.values())


def attach_grad_sync(tconfig, ddps: Sequence[torch.nn.Module]) -> None:
    """Point megatron-core's schedules at the chunks' ``no_sync`` and, with
    ``--overlap-grad-reduce``, at their ``start_grad_sync`` (Megatron-LM's ``grad_sync_func``:
    the interleaved schedule launches a chunk's reduction once its last backward is done)."""
    ddps = list(ddps)
    one = len(ddps) == 1
    tconfig.no_sync_func = ddps[0].no_sync if one else [m.no_sync for m in ddps]
    if overlaps(ddps):
        tconfig.grad_sync_func = ddps[0].start_grad_sync if one else [m.start_grad_sync for m in ddps]


def overlaps(ddps: Sequence[torch.nn.Module]) -> bool:
    """Whether the chunks reduce their gradients during the backward (``--overlap-grad-reduce``)."""
    return any(getattr(getattr(m, "ddp_config", None), "overlap_grad_reduce", False) for m in ddps)


class BackwardSyncs:
    """For one iteration's plan on this rank: which backward runs outside ``no_sync``.

    Without the overlap every backward runs as it is (gradients are reduced after the plan,
    by ``finalize_model_grads``). With it, each DDP module's last backward of the plan runs
    outside ``no_sync`` and every other one inside, as megatron-core's schedules run theirs
    (split backwards: its last input part and its last weight part, see
    :mod:`dynapipe.plan.grad_sync`); a chunk of the plan without a DDP module of its own shares
    the rank's only one."""

    def __init__(self, ddps: Sequence[torch.nn.Module], instructions=None):
        self.ddps = list(ddps)
        self.overlap = overlaps(self.ddps) and instructions is not None
        self.points = grad_sync_points(instructions, self._index) if self.overlap else frozenset()

    def _index(self, chunk: int) -> int:
        return chunk if len(self.ddps) > 1 else 0

    def context(self, chunk: int, mb: int, part: str = "full"):
        """The context the backward (``part``: whole, input or weight part) of (``chunk``,
        ``mb``) runs in."""
        if not self.overlap or (chunk, mb, part) in self.points:
            return nullcontext()
        return self.ddps[self._index(chunk)].no_sync()

    def start_unreduced(self) -> None:
        """After a training plan ran: start the overlapped reduction of every DDP module that
        no backward of the plan started (a replica the planner left without micro-batches, as
        padding and packing do when a global batch has fewer micro-batches than replicas).
        Its gradients are zeros, but the other replicas' all-reduce waits for it, and
        megatron-core's ``finish_grad_sync`` refuses a bucket whose reduction never began."""
        if not self.overlap:
            return
        started = {self._index(chunk) for chunk, _, _ in self.points}
        idle = [ddp for i, ddp in enumerate(self.ddps) if i not in started]
        if idle and len(self.ddps) > 1:
            # Replicas that ran backwards start their chunks' reductions from the hooks, the last
            # chunk's first, or (in megatron-core's first batch) in finish_grad_sync, chunk 0
            # first; this replica cannot tell which order the others took, and collectives
            # issued out of order on one group pair the wrong buckets.
            raise DynaPipeError(f"this data-parallel replica has no micro-batch to run on {len(idle)} of its "
                                f"{len(self.ddps)} model chunks, and --overlap-grad-reduce cannot order their "
                                f"reductions with the other replicas'; drop --overlap-grad-reduce, or make global "
                                f"batches of at least as many micro-batches as replicas.")
        for ddp in idle:
            ddp.start_grad_sync()


def backward_syncs(ddps: Sequence[torch.nn.Module], plan: Optional[object]) -> BackwardSyncs:
    """:class:`BackwardSyncs` of ``plan`` (an ``ExecutionPlan``; None: forward only)."""
    return BackwardSyncs(ddps, None if plan is None else plan.instructions)
