"""Where an execution plan completes each gradient: the points where a data-parallel reduction
may start while the rest of the backward still runs (Megatron-LM's ``--overlap-grad-reduce``).

megatron-core's DDP sums every micro-batch's gradients locally while its ``no_sync`` is in
force and, outside it, launches a bucket's reduction as soon as the backward has produced that
bucket's last gradient. A plan therefore runs each gradient-producing backward of a model chunk
under ``no_sync`` except the chunk's last one. Which backward is last is read from the plan's
own instruction order, so it holds for any schedule (1F1B, interleaved, or one that splits the
backward into its input and weight parts: then the weight part is the one that completes the
parameters' gradients).
"""
from __future__ import annotations

from typing import Callable, Iterable, Optional

from dynapipe.plan.instructions import BackwardPass, Instruction

# Backward parts that complete the parameter gradients. An "input" part produces some too
# (norms, biases, embeddings, the output layer): the weight part after it is what finishes a
# gradient group, which is also why an overlapped reduction cannot start from it yet.
WEIGHT_GRADIENT_PARTS = ("full", "weight")


def grad_sync_points(instructions: Iterable[Instruction],
                     group_of: Optional[Callable[[int], int]] = None) -> frozenset[tuple[int, int]]:
    """The ``(chunk, mb)`` of each gradient group's last weight-gradient backward in
    ``instructions`` (this rank's plan, in execution order).

    ``group_of(chunk)`` names the gradient buffer (the DDP module) a chunk's parameters live in;
    by default every chunk has its own. A forward-only plan has none."""
    group_of = group_of or (lambda chunk: chunk)
    last: dict[int, tuple[int, int]] = {}
    for ins in instructions:
        if isinstance(ins, BackwardPass) and ins.part in WEIGHT_GRADIENT_PARTS:
            last[group_of(ins.chunk)] = (ins.chunk, ins.mb)
    return frozenset(last.values())
