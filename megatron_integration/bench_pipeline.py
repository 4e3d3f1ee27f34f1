"""megatron-core's own 1F1B driving any pipeline-stage callable, for machinery benchmarks.

``scripts/bench_executor.py`` compares pipeline machinery (schedule bookkeeping,
point-to-point transfers, buffer handling) with the model compute held equal. This
module lets megatron-core's ``get_forward_backward_func`` (the non-interleaved 1F1B,
``forward_backward_pipelining_without_interleaving``, with its ``P2PCommunicator``)
run the very stage the other runners run: :class:`ScheduleStage` gives a stage callable
the three things the schedule looks up on its model (``config``, ``model_type``,
``set_input_tensor``), and :class:`MegatronPipeline` supplies the ``forward_step_func``
and loss-function contract.

The stage callable takes the micro-batch's tensors by name (plus ``hidden_states``,
the received activation, on every stage but the first) and returns the activation to
send, or on the last stage the summed token loss of the micro-batch. The loss is divided
by the global batch's real-token count before the backward, as the project's executor
does, with ``calculate_per_token_loss`` so megatron-core adds no further scaling; no
gradient finaliser runs (there is no data parallelism to reduce over). Everything else
is megatron-core's defaults: fixed ``[seq_length, micro_batch_size, hidden]`` receive
buffers (no shape exchange), batched p2p, outputs pseudo-freed after their send and the
backward run through the autograd engine directly.
"""
from __future__ import annotations

from functools import partial
from typing import Callable, Optional, Sequence

import torch

from dynapipe.errors import DynaPipeError

StageFn = Callable[[dict], torch.Tensor]


def init_pipeline_parallel(pp_size: int) -> None:
    """megatron-core's parallel state (tensor parallel 1, ``pp_size`` pipeline stages) on the
    already initialised default process group; the CPU compatibility layer first when
    there is no CUDA. Idempotent. Every rank must call it (it creates process groups)."""
    import torch.distributed as dist

    from megatron_integration.initialize import init_model_parallel, quiet_megatron_warnings

    if not dist.is_initialized():
        raise DynaPipeError("init_pipeline_parallel needs torch.distributed initialised first "
                            "(dist.init_process_group or dynapipe.runtime.distributed.spawn).")
    if dist.get_world_size() % pp_size:
        raise DynaPipeError(f"pipeline size {pp_size} does not divide the world size {dist.get_world_size()}.")
    quiet_megatron_warnings()
    init_model_parallel(1, pp_size)


def schedule_config(*, hidden_size: int, num_layers: int, num_attention_heads: int, pp_size: int,
                    dtype: torch.dtype = torch.float32):
    """The ``TransformerConfig`` megatron-core's schedule and p2p read (hidden size for the
    receive shape, pipeline dtype, loss scaling, output deallocation); megatron-core's
    defaults otherwise."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    return TransformerConfig(num_layers=num_layers, hidden_size=hidden_size, num_attention_heads=num_attention_heads,
                             pipeline_model_parallel_size=pp_size, params_dtype=dtype, pipeline_dtype=dtype,
                             calculate_per_token_loss=True, deallocate_pipeline_outputs=True,
                             use_cpu_initialization=not torch.cuda.is_available())


class ScheduleStage:
    """A stage callable as megatron-core's schedule sees a model stage.

    The schedule hands the received activation to :meth:`set_input_tensor` before each
    forward (a list of one tensor; ``[None]`` on the first stage), as it does for
    ``GPTModel``; :meth:`__call__` passes it to the stage as ``hidden_states`` and returns
    the stage's output, contiguous.
    """

    def __init__(self, stage: StageFn, config):
        from megatron.core.enums import ModelType

        self.stage = stage
        self.config = config
        self.model_type = ModelType.encoder_or_decoder
        self._input: Optional[torch.Tensor] = None

    def set_input_tensor(self, tensors: Sequence[Optional[torch.Tensor]]) -> None:
        self._input = tensors[0] if isinstance(tensors, (list, tuple)) else tensors

    def __call__(self, data: dict) -> torch.Tensor:
        if self._input is not None:
            data = dict(data)
            data["hidden_states"] = self._input
        out = self.stage(data)
        # megatron-core sends a stage's output as it is and gloo refuses strided tensors
        # (a GPTModel stage's output is contiguous); the other runners make the same copy.
        return out if out.is_contiguous() else out.contiguous()


def _loss_func(global_tokens: int, loss_mask: Optional[torch.Tensor], loss_sum: torch.Tensor):
    """megatron-core's three-value loss contract: (loss to backpropagate, loss tokens, report)."""
    tokens = loss_mask.sum().to(torch.int) if loss_mask is not None else torch.zeros((), dtype=torch.int)
    return loss_sum.reshape(()) / global_tokens, tokens, {"loss_sum": loss_sum.detach()}


class MegatronPipeline:
    """One rank's side of megatron-core's 1F1B over fixed-shape micro-batches.

    ``stage``: this rank's stage callable (see the module doc). ``seq_length`` and
    ``micro_batch_size`` give every micro-batch's activation shape
    ``[seq_length, micro_batch_size, hidden_size]``; ``global_tokens`` (tokens) divides
    each micro-batch's summed loss. Call :func:`init_pipeline_parallel` first.
    """

    def __init__(self, stage: StageFn, *, hidden_size: int, num_layers: int, num_attention_heads: int,
                 seq_length: int, micro_batch_size: int, global_tokens: int):
        from megatron.core import parallel_state
        from megatron.core.pipeline_parallel import get_forward_backward_func

        if global_tokens <= 0:
            raise DynaPipeError(f"global_tokens is {global_tokens}; the loss needs a positive real-token count.")
        pp = parallel_state.get_pipeline_model_parallel_world_size()
        self.config = schedule_config(hidden_size=hidden_size, num_layers=num_layers,
                                      num_attention_heads=num_attention_heads, pp_size=pp)
        self.model = ScheduleStage(stage, self.config)
        self.seq_length, self.micro_batch_size, self.global_tokens = seq_length, micro_batch_size, global_tokens
        self.forward_backward = get_forward_backward_func()
        self.last = parallel_state.is_pipeline_last_stage()

    @property
    def schedule_name(self) -> str:
        """The megatron-core function that runs the iteration."""
        return self.forward_backward.__name__

    @property
    def batched_p2p(self) -> bool:
        """Whether megatron-core posts each exchange with ``batch_isend_irecv``."""
        return bool(self.config.batch_p2p_comm)

    def _forward_step(self, data_iterator, model: ScheduleStage):
        data = next(data_iterator)
        return model(data), partial(_loss_func, self.global_tokens, data.get("loss_mask"))

    def run(self, batches: Sequence[dict]) -> float:
        """Forward and backward over ``batches`` (this stage's tensors of each micro-batch, by
        name), gradients accumulated into the stage's parameters. Returns, on the last
        stage, the global-batch mean token loss over these micro-batches; 0 elsewhere."""
        reports = self.forward_backward(forward_step_func=self._forward_step, data_iterator=iter(batches),
                                        model=[self.model], num_microbatches=len(batches),
                                        seq_length=self.seq_length, micro_batch_size=self.micro_batch_size,
                                        forward_only=False)
        if not self.last:
            return 0.0
        return sum(float(r["loss_sum"]) for r in reports) / self.global_tokens
