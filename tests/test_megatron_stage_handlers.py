"""MegatronStageHandlers and the training hooks, with stand-in stages (no process group)."""
import types

import torch

from dynapipe.plan.instructions import MicroBatchInfo
from megatron_integration.model import attach_training_hooks
from megatron_integration.dynapipe_step import MegatronStageHandlers


def _last_stage(per_token_loss: torch.Tensor, grad_scale_func=None):
    module = lambda tokens, position_ids, mask, labels=None: per_token_loss  # noqa: E731
    config = types.SimpleNamespace(grad_scale_func=grad_scale_func)
    # One chunk that is the whole model: it embeds and computes the loss.
    gpt = types.SimpleNamespace(pre_process=True, post_process=True)
    return types.SimpleNamespace(module=module, gpt=None, config=config, pre_process=True, post_process=True,
                                 modules=[module], gpts=[gpt], chunked=False)


def _forward(handlers, mask):
    inputs = {"tokens": torch.zeros_like(mask, dtype=torch.long), "loss_mask": mask}
    return handlers.forward(MicroBatchInfo(mb=0, samples=(0,), mbs=1, seqlen=mask.shape[1]), inputs, None)


def test_last_stage_returns_the_unscaled_loss_and_scales_what_the_backward_starts_from():
    losses = torch.tensor([[1.0, 2.0, 3.0, 4.0]])
    mask = torch.tensor([[0.0, 1.0, 1.0, 1.0]])
    handlers = MegatronStageHandlers(_last_stage(losses, grad_scale_func=lambda loss: loss * 1024.0),
                                     torch.device("cpu"))
    handlers.begin({}, global_loss_tokens=6)
    out = _forward(handlers, mask)
    assert float(out) == 9.0  # the loss the executor reports: unscaled
    assert float(handlers.grad_scale(out)) == 9.0 * 1024.0  # what the backward sees: the fp16 loss scale
    _forward(handlers, mask)
    assert float(handlers.loss_sum) == 18.0 and int(handlers.loss_tokens) == 6  # reported loss: unscaled
    handlers.begin({}, global_loss_tokens=6)
    assert float(handlers.loss_sum) == 0.0 and int(handlers.loss_tokens) == 0


def test_last_stage_without_loss_scaling_returns_the_summed_loss():
    handlers = MegatronStageHandlers(_last_stage(torch.tensor([[2.0, 5.0]])), torch.device("cpu"))
    handlers.begin({}, global_loss_tokens=1)
    assert float(_forward(handlers, torch.tensor([[1.0, 0.0]]))) == 2.0


def test_fp16_training_scales_the_loss_by_the_optimizer():
    # fp16 always; bf16 when the optimizer holds a static --loss-scale (its scale is not 1).
    for fp16, bf16, scale, expect_scaled in ((True, False, 4.0, True), (False, False, 1.0, False),
                                             (False, True, 4.0, True), (False, True, 1.0, False)):
        optimizer = types.SimpleNamespace(scale_loss=lambda loss, s=scale: loss * s,
                                          get_loss_scale=lambda s=scale: torch.tensor(s))
        module = types.SimpleNamespace(no_sync=lambda: None)
        stage = types.SimpleNamespace(config=types.SimpleNamespace(fp16=fp16, bf16=bf16, grad_scale_func="unset"),
                                      module=module, modules=[module], chunked=False)
        attach_training_hooks(stage, optimizer)
        assert stage.config.no_sync_func is stage.module.no_sync
        assert callable(stage.config.finalize_model_grads_func)
        if expect_scaled:
            assert stage.config.grad_scale_func(torch.tensor(2.0)) == 8.0
        else:
            assert stage.config.grad_scale_func is None
