"""The executor's contract with a model integration: the handlers it implements for one
stage, the configuration it sets, the result it gets back.

The executor calls the handlers per instruction type; everything else (transfers, receive
buffers, gradients of received activations, buffer lifetimes, loss normalisation,
failures) is the executor's.

- ``load(mb, specs)`` (``LoadInput``) returns the micro-batch's data as
  ``{spec.name: tensor}``, each tensor exactly as the plan's specs say (for a GPT:
  ``tokens``/``position_ids`` on the first stage, ``labels``/``loss_mask`` on the last,
  ``[mbs, seqlen]``). ``mb`` is the plan's :class:`MicroBatchInfo`: sample indices into
  the global batch, ``mbs``, ``seqlen``, loss tokens.
- ``forward(mb, inputs, op)`` (``ForwardPass``) gets the received activations
  (``requires_grad`` already set) and the loaded data in one dict, by name. On every
  stage but the last it returns the activation to send (``[seqlen, mbs, hidden]``): one
  tensor, or ``{name: tensor}`` for a message of several (an encoder-decoder stage's
  hidden states and encoder output). On the last stage it returns the SUM of the
  per-token losses over the micro-batch's loss tokens, a scalar: the executor divides it
  by ``run(plan, loss_tokens=N)``, default ``plan.global_loss_tokens`` (loss tokens of
  the whole global batch, every replica, as the planner counts them),
  so the gradients equal one unpipelined pass over the global batch whatever the
  micro-batching; replicas' gradients are then summed, not averaged. ``op`` carries the
  recompute level and the virtual-pipeline chunk.
- ``backward(mb, roots, grads, op)`` (``BackwardPass``, optional) replaces the
  executor's backward from the stage's outputs ``roots`` with gradients ``grads``
  (``None`` for the scalar loss); it must leave the gradients of the received
  activations in their ``.grad``. The default,
  :func:`dynapipe.runtime.buffers.backward_from`, also works on outputs whose data was
  released after their send.
- ``backward_weight(mb, op)`` (optional; needed by plans that split the backward, see
  :mod:`dynapipe.runtime.weight_grad_store`): the weight part of micro-batch ``mb``'s
  backward. With such a plan ``backward`` gets the input part (``op.part == "input"``):
  it must leave the received activations' gradients as above and may defer the weight
  gradients until this call.
- ``grad_scale(loss)`` (optional): what the backward starts from instead of the
  normalised loss, for a mixed-precision optimizer that scales the loss (Megatron's
  ``config.grad_scale_func``). The forward returns the unscaled sum, so the losses the
  executor reports are never scaled; an attribute set to None scales nothing.
- ``trace_note(op)`` (optional, called only when tracing) returns a small dict of
  JSON values the trace adds to the forward or backward it just ran, or None: what the
  plan cannot know of the op (a T5 stage: whether it applied an attention mask).

A handler that raises stops every rank: the executor raises :class:`HandlerFailure`
with the traceback, and the other ranks raise with it in their message.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Protocol, Union

import torch

from dynapipe.errors import DynaPipeError, ExecutorError, flag, positive_number
from dynapipe.plan.instructions import ForwardPass, MicroBatchInfo, TensorSpec
from dynapipe.runtime.exec_trace import ExecTrace


class HandlerFailure(ExecutorError):
    """A handler (load, forward, backward) raised on this rank; the message holds its traceback."""


class StageHandlers(Protocol):
    """One pipeline stage's handlers (see the module doc); ``backward`` is optional."""

    def load(self, mb: MicroBatchInfo, specs: tuple[TensorSpec, ...]) -> dict[str, torch.Tensor]: ...

    def forward(self, mb: MicroBatchInfo, inputs: dict[str, torch.Tensor],
                op: ForwardPass) -> Union[torch.Tensor, dict[str, torch.Tensor]]: ...


@dataclass
class ExecutorConfig:
    """How the executor runs.

    ``timeout_s``: bound on every wait for a transfer on CPU, and on the plans and the peer
    plan check everywhere (s); on CUDA a transfer waits on the NCCL stream, bounded by the
    process group's timeout (``init_distributed(timeout_s=...)``). ``poll_s``: how often a
    waiting rank checks whether another rank failed (s). ``trace``: record per-instruction
    timing. ``check_peers``: compare every rank's plan digests before each iteration
    (through the store, or one small all-gather without one). ``release_sent_activations``: drop the data of an activation
    once sent, keeping its graph (a sent tensor another tensor of the same message was
    computed from keeps its data: autograd may have saved it). ``normalise_loss``: backpropagate the loss divided by
    the global batch's real tokens (the default); ``False`` backpropagates the summed
    token loss, for a framework that divides the gradients by the token count itself
    (Megatron's ``calculate_per_token_loss``). The reported loss is normalised either way.
    ``watch_failures`` (with a store, CPU transfers): wait for transfers on helper threads
    so that a failure reported by any rank interrupts a wait at once, even while the
    failed process lingers; off, a rank stops when the failed process's connections close
    or at the timeout. It costs a few percent where ranks share CPU cores. ``ring``: under
    NCCL, set up the last stage's link to the first at start, as for the interleaved plans
    that send over it; ``False`` (one chunk a rank) saves that communicator.
    """

    timeout_s: float = 300.0
    poll_s: float = 0.1
    trace: bool = False
    check_peers: bool = True
    release_sent_activations: bool = True
    normalise_loss: bool = True
    watch_failures: bool = True
    ring: bool = True

    @staticmethod
    def of(config: Optional["ExecutorConfig"]) -> "ExecutorConfig":
        """``config``, the defaults for None; anything else (a dict of the fields) refused."""
        if config is None:
            return ExecutorConfig()
        if not isinstance(config, ExecutorConfig):
            raise DynaPipeError(f"config {config!r:.60}: give an ExecutorConfig (ExecutorConfig(timeout_s=...)).")
        return config

    def __post_init__(self):
        # A negative timeout failed every transfer at once, blaming the peer; "False" counted as on.
        positive_number("ExecutorConfig timeout_s", self.timeout_s, "s")
        positive_number("ExecutorConfig poll_s", self.poll_s, "s")
        for name in ("trace", "check_peers", "release_sent_activations", "normalise_loss", "watch_failures", "ring"):
            flag(f"ExecutorConfig {name}", getattr(self, name))


@dataclass
class IterationResult:
    """What one iteration on one rank produced.

    ``loss``: on the last stage, this replica's share of the global-batch mean token
    loss (the sum over replicas is the mean); 0 elsewhere. ``mb_loss_sums``: per
    micro-batch, the summed token loss the handler returned. ``wall_ms``: time from the
    first instruction to the last (on CUDA with an abort channel, to the end of the device's
    work for them; else the host's, which on CUDA only launched it). ``peak_buffer_bytes``: most bytes the executor's
    buffers held at once; ``released_bytes``: data of sent activations released early;
    ``transfers``: tensors sent or received; ``unfreed_buffers``: buffers the plan never
    freed (dropped at the end of the iteration; empty for plans from the compiler).
    """

    iteration: int
    loss: float = 0.0
    mb_loss_sums: dict[int, float] = field(default_factory=dict)
    wall_ms: float = 0.0
    peak_buffer_bytes: int = 0
    released_bytes: int = 0
    transfers: int = 0
    trace: Optional[ExecTrace] = None
    unfreed_buffers: list[str] = field(default_factory=list)
