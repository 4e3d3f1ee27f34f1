"""Forward-only execution plans (evaluation), derived from training plans.

Evaluation runs the same planned micro-batches as training but no backward: from a
compiled plan, keep its loads, forwards, activation transfers and the frees of input and
activation buffers, and drop the backward passes, the gradient transfers and the frees of
gradient buffers. Activation messages between two stages keep their order on both sides,
and every remaining dependency points down the pipeline (a stage waits only for the stage
before it), so the plan is deadlock-free whatever schedule it came from (1F1B, adaptive,
and later interleaved or zero-bubble ones, whose backward parts are dropped the same way).
The plan keeps its instruction format: the executor runs it like any other plan.
"""
from __future__ import annotations

from dataclasses import replace

from dynapipe.plan.instructions import (BackwardPass, ExecutionPlan, FreeBuffer, RecvGradFinish, RecvGradStart,
                                        SendGradFinish, SendGradStart)

_BACKWARD_ONLY = (BackwardPass, SendGradStart, SendGradFinish, RecvGradStart, RecvGradFinish)
_GRAD_BUFFERS = ("grad_in:", "grad_out:")


def forward_only(plan: ExecutionPlan) -> ExecutionPlan:
    """``plan`` without its backward passes, gradient transfers and gradient-buffer frees
    (``meta["forward_only"]`` is True); see the module docstring."""
    kept = tuple(x for x in plan.instructions
                 if not isinstance(x, _BACKWARD_ONLY)
                 and not (isinstance(x, FreeBuffer) and x.buffer.startswith(_GRAD_BUFFERS)))
    return replace(plan, instructions=kept, meta=dict(plan.meta, forward_only=True))


__all__ = ["forward_only"]
