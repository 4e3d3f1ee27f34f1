"""Where an execution plan completes each gradient: the points where a data-parallel reduction
may start while the rest of the backward still runs (Megatron-LM's ``--overlap-grad-reduce``).

megatron-core's DDP sums every micro-batch's gradients locally while its ``no_sync`` is in
force and, outside it, counts each parameter's gradient as ready and launches a bucket's
reduction once every parameter of the bucket is (as many times as in the first iteration).
A plan therefore runs each gradient-producing backward of a model chunk under ``no_sync``
except the last one that produces each parameter's gradient. Which backward that is comes
from the plan's own instruction order, so it holds for any schedule:

- whole backwards (1F1B, interleaved): the chunk's last backward;
- split backwards (zero-bubble): the input part produces the gradients of everything but the
  deferred linear weights (norms, biases, embeddings, the output layer) and the weight part
  those weights' gradients, so two instructions run outside ``no_sync``: the chunk's last input
  part and its last weight part. Between them, earlier micro-batches' weight parts still
  accumulate under ``no_sync``; each parameter is counted ready exactly once an iteration.

A chunk whose plan mixes whole and split backwards has no such pair (its last whole backward
would count the linear weights a second time after the weight part), and is refused.
"""
from __future__ import annotations

from typing import Callable, Iterable, Optional

from dynapipe.errors import DynaPipeError
from dynapipe.plan.instructions import BackwardPass, Instruction

# Which kinds of gradient each backward part produces: "rest" is every parameter but the
# linear weights a split backward defers, "weights" those.
_PRODUCES = {"full": ("rest", "weights"), "input": ("rest",), "weight": ("weights",)}


def grad_sync_points(instructions: Iterable[Instruction],
                     group_of: Optional[Callable[[int], int]] = None) -> frozenset[tuple[int, int, str]]:
    """The ``(chunk, mb, part)`` of the backwards in ``instructions`` (this rank's plan, in
    execution order) that must run outside ``no_sync``: per gradient group, the last one
    producing each kind of gradient (see the module docstring).

    ``group_of(chunk)`` names the gradient buffer (the DDP module) a chunk's parameters live in;
    by default every chunk has its own. A forward-only plan has none. Raises
    :class:`DynaPipeError` for a group whose backwards are part whole and part split."""
    group_of = group_of or (lambda chunk: chunk)
    last: dict[tuple[int, str], tuple[int, int, str]] = {}
    split: dict[int, set[bool]] = {}
    for ins in instructions:
        if not isinstance(ins, BackwardPass):
            continue
        group = group_of(ins.chunk)
        split.setdefault(group, set()).add(ins.part != "full")
        for kind in _PRODUCES[ins.part]:
            last[group, kind] = (ins.chunk, ins.mb, ins.part)
    mixed = sorted(g for g, kinds in split.items() if len(kinds) > 1)
    if mixed:
        raise DynaPipeError(f"the plan mixes whole and split backwards in the gradient group of chunk(s) {mixed}; "
                            f"--overlap-grad-reduce needs one kind per chunk (plan every backward split, or none).")
    return frozenset(last.values())
