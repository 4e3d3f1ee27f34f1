"""The data-parallel step after the pipeline drains: what comparing layouts must add.

Every method on one layout pays the same gradient reduction, so the pipeline simulation
leaves it out; layouts differ in it (the replicas, the parameters a GPU holds, whether the
replicas share a node), so :func:`dp_sync_ms` prices it for the layout advisor. Megatron
without ``--overlap-grad-reduce`` / ``--overlap-param-gather`` runs it after the last
backward and before the next forward: all-reduce of the gradients, or with the distributed
optimizer a reduce-scatter of the gradients and an all-gather of the updated parameters.
Ring collectives over the slowest link of a stage's data-parallel group; the slowest stage
sets the time. Pure Python: no torch.
"""
from __future__ import annotations

from typing import Optional

from dynapipe.config import ClusterConfig
from dynapipe.errors import whole_number
from dynapipe.schedule.comm import stage_global_rank

#: Bytes a gradient is reduced in: Megatron-LM reduces bf16 models' gradients in fp32
#: (``--accumulate-allreduce-grads-in-fp32``, which it sets for ``--bf16``), fp16 ones in fp16.
GRAD_REDUCE_BYTES = {"bf16": 4, "fp16": 2, "fp32": 4}


def ring_ms(link, nbytes: float, ranks: int, steps_per_rank: int) -> float:
    """A ring collective over ``ranks`` ranks moving ``nbytes`` in all (ms): ``steps_per_rank``
    rounds of ``ranks - 1`` steps, each sending ``nbytes / ranks`` over ``link`` (1: a
    reduce-scatter or an all-gather; 2: an all-reduce)."""
    if ranks <= 1:
        return 0.0
    return steps_per_rank * (ranks - 1) * link.transfer_ms(nbytes / ranks)


def dp_sync_ms(cost_model, *, dp: int, zero: bool, cluster: Optional[ClusterConfig], tp: int = 1) -> float:
    """ms the slowest stage's data-parallel group spends reducing gradients (and, with
    ``zero``, Megatron's distributed optimizer, gathering the updated parameters) after the
    pipeline drains, not overlapped with compute. ``cost_model``'s layouts give the
    parameters of one TP rank of each stage; a stage's ``dp`` replicas sit ``tp`` ranks apart
    (Megatron's rank order: TP innermost, then DP), so their ring runs over the inter-node
    link once they span nodes. No ``cluster``: 0, as the simulator prices every transfer."""
    dp = whole_number("dp", dp)
    if dp == 1 or cluster is None:
        return 0.0
    model = cost_model.model
    grad_b = GRAD_REDUCE_BYTES.get(model.dtype, 4)
    worst = 0.0
    for s, layout in enumerate(cost_model.layouts):
        params = cost_model.layout_param_count(layout)
        link = cluster.link(stage_global_rank(s, dp=dp, tp=tp, replica=0),
                            stage_global_rank(s, dp=dp, tp=tp, replica=dp - 1))
        if zero:
            ms = ring_ms(link, params * grad_b, dp, 1) + ring_ms(link, params * model.dtype_bytes, dp, 1)
        else:
            ms = ring_ms(link, params * grad_b, dp, 2)
        worst = max(worst, ms)
    return worst
