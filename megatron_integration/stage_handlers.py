"""What every model's executor handlers share: taking an iteration's tensors, loading a
micro-batch's, summing the last stage's token loss, and the backward at a recompute level.

A model's handlers (:class:`~megatron_integration.dynapipe_step.MegatronStageHandlers` for
GPT, :class:`~megatron_integration.t5_handlers.T5StageHandlers` for T5) subclass
:class:`ModelStageHandlers` and supply ``forward`` and ``_level`` (how the model switches its
recompute level); the executor sees them through the
:class:`~dynapipe.runtime.contract.StageHandlers` protocol.
"""
from __future__ import annotations

from typing import Optional

import torch

from dynapipe.errors import DynaPipeError
from dynapipe.plan.instructions import BackwardPass, MicroBatchInfo, TensorSpec
from dynapipe.runtime.buffers import backward_from, to_device
from dynapipe.runtime.weight_grad_store import WeightGradStore
from megatron_integration.ddp import backward_syncs
from megatron_integration.model import Stage
from megatron_integration.split_backward import install_split_backward


class ModelStageHandlers:
    """The model-independent half of a stage's executor handlers."""

    #: Why a global batch without loss tokens cannot train, in the model's words.
    no_loss_tokens = "the global batch has no loss tokens; the loss cannot be normalised."

    def __init__(self, stage: Stage, device: torch.device, split_backward: bool = False):
        """``split_backward``: give the stage's linear layers a backward that a zero-bubble
        plan can split (raises :class:`DynaPipeError` where the stage cannot)."""
        self.stage = stage
        self.device = device
        self.tensors: dict = {}
        self.syncs = backward_syncs(stage.modules, None)
        self.weight_grads = WeightGradStore()
        self.split_layers = install_split_backward(stage.modules, self.weight_grads) if split_backward else 0
        self._reset_loss()

    def trace_note(self, op) -> Optional[dict]:
        """What an executor trace adds to a forward or backward: its ``recompute`` level, at
        which a calibration prices it (``megatron_integration.bench_calibrate``)."""
        level = getattr(op, "recompute", None)
        return None if level is None else {"recompute": level}

    def _reset_loss(self) -> None:
        # Accumulated on the device: reading them per micro-batch would stall the pipeline.
        self.loss_sum = torch.zeros((), dtype=torch.float64, device=self.device)
        self.loss_tokens = torch.zeros((), dtype=torch.float64, device=self.device)

    def begin(self, micro_batch_tensors: dict, global_loss_tokens: int, plan=None) -> None:
        """Take one iteration's tensors (``{mb: {name: tensor or array}}``) before the
        executor runs ``plan`` (this rank's ``ExecutionPlan``; None: forward only);
        ``global_loss_tokens`` (tokens, every replica) must be > 0."""
        if global_loss_tokens <= 0:
            raise DynaPipeError(self.no_loss_tokens)
        self.tensors = micro_batch_tensors
        self.syncs = backward_syncs(self.stage.modules, plan)
        splits = plan is not None and any(getattr(x, "part", "full") != "full" for x in plan.instructions)
        if splits and not self.split_layers:
            raise DynaPipeError("the plan splits the backward (a zero-bubble schedule), but this stage's linear "
                                "layers were built without the split; train with --dynapipe-schedule zb-h1.")
        # An iteration whose plan does not split (auto chose 1f1b or adaptive, or evaluation)
        # runs megatron-core's own linear backward.
        self.weight_grads.active = splits
        # A failed iteration may leave weight parts behind; their gradients went with it.
        self.weight_grads.clear()
        self._reset_loss()

    def load(self, mb: MicroBatchInfo, specs: tuple[TensorSpec, ...]) -> dict[str, torch.Tensor]:
        """The tensors ``specs`` names for micro-batch ``mb``, on this rank's device."""
        data = self.tensors.get(mb.mb)
        if data is None:
            raise DynaPipeError(f"the plan loads micro-batch {mb.mb}, but its data source gave no tensors for it.")
        return {s.name: to_device(data[s.name], self.device) for s in specs}

    def grad_scale(self, loss: torch.Tensor) -> torch.Tensor:
        """The loss the backward starts from: ``loss`` times the optimizer's loss scale when it
        has one (``attach_training_hooks``), which it divides the gradients by before stepping;
        the executor's reported losses stay unscaled."""
        scale = self.stage.config.grad_scale_func
        return loss if scale is None else scale(loss)

    def _level(self, op) -> None:
        """Switch the stage to ``op.recompute`` (``op`` None: leave it)."""
        raise NotImplementedError

    def _sum_loss(self, per_token_loss: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
        """The micro-batch's summed token loss (fp32) over ``loss_mask``, counted into the
        iteration's loss and loss tokens."""
        loss_sum = torch.sum(per_token_loss.float() * loss_mask)
        self.loss_sum += loss_sum.detach()
        self.loss_tokens += loss_mask.sum()
        return loss_sum

    def backward(self, mb: MicroBatchInfo, roots, grads, op: BackwardPass) -> None:
        """Backward of one micro-batch at its level: a layer rematerialised under ``full``
        must not checkpoint its core attention again because a later forward is ``selective``."""
        self._level(op)
        # With --overlap-grad-reduce, only each chunk's last backward of the plan (split: its
        # last input and last weight part) lets DDP start reducing; the others accumulate
        # under no_sync.
        with self.syncs.context(op.chunk, op.mb, op.part):
            if op.part == "input":
                with self.weight_grads.input_part((op.chunk, op.mb)):
                    backward_from(roots, grads)
            else:
                backward_from(roots, grads)

    def backward_weight(self, mb: MicroBatchInfo, op: BackwardPass) -> None:
        """The weight part of a split backward: the linear layers' weight gradients that the
        input part of (``op.chunk``, ``op.mb``) deferred."""
        with self.syncs.context(op.chunk, op.mb, op.part):
            ran = self.weight_grads.run((op.chunk, op.mb))
        if not ran and self.split_layers:
            # Every split linear defers its weight gradient from the input part; none deferred
            # means the input part computed them all and the schedule's split did not happen.
            raise DynaPipeError(f"the weight part of micro-batch {op.mb} (chunk {op.chunk}) found no deferred "
                                f"weight gradient: its input part computed them all (internal error, please "
                                f"report).")
