"""megatron-core's optimizer and learning-rate / weight-decay schedule for a run's stage.

Adam with decoupled weight decay (torch's implementation when Apex and Transformer Engine are
absent), the precision's main copies and Megatron's loss scaling (fp16; bf16 with a static
``--loss-scale``); Megatron-LM's
schedule: warm-up, then constant / linear / cosine decay of the rate, and the weight decay
from ``--start-weight-decay`` to ``--end-weight-decay`` (``--weight-decay-incr-style``).
"""
from __future__ import annotations

from megatron_integration.model import TORCH_DTYPES, Stage
from megatron_integration.train_config import DynaPipeTrainingConfig


def optimizer_config(cfg: DynaPipeTrainingConfig):
    """megatron-core's ``OptimizerConfig`` for the run: Adam, the precision and Megatron's loss
    scaling (a static ``--loss-scale`` under fp16 or bf16, else under fp16 dynamic from
    ``--initial-loss-scale`` with ``--min-loss-scale``, ``--loss-scale-window`` and ``--hysteresis``)."""
    from megatron.core.optimizer import OptimizerConfig

    o = cfg.optimizer
    # Only when asked: megatron-core releases without the field keep their own default.
    extra = {"apply_wd_to_qk_layernorm": True} if o.apply_wd_to_qk_layernorm else {}
    return OptimizerConfig(optimizer="adam", lr=o.lr, min_lr=o.min_lr, weight_decay=o.weight_decay,
                           adam_beta1=o.adam_beta1, adam_beta2=o.adam_beta2, adam_eps=o.adam_eps,
                           clip_grad=o.clip_grad, bf16=cfg.model.dtype == "bf16", fp16=cfg.model.dtype == "fp16",
                           params_dtype=TORCH_DTYPES[cfg.model.dtype],
                           use_distributed_optimizer=cfg.optimizer.distributed,
                           loss_scale=o.loss_scale, initial_loss_scale=o.initial_loss_scale,
                           min_loss_scale=o.min_loss_scale, loss_scale_window=o.loss_scale_window,
                           hysteresis=o.hysteresis, decoupled_lr=o.decoupled_lr,
                           decoupled_min_lr=o.decoupled_min_lr, log_num_zeros_in_grad=o.log_num_zeros_in_grad,
                           **extra)


def build_optimizer(cfg: DynaPipeTrainingConfig, stage: Stage):
    """megatron-core's optimizer (AdamW; torch's implementation without Apex/TE) and its
    scheduler (learning rate: warm-up, then constant / linear / cosine / inverse-square-root /
    WSD decay; weight decay from
    its start to its end value over ``--train-iters``, as Megatron-LM's over the training samples)."""
    from megatron.core.optimizer import get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    optimizer = get_megatron_optimizer(optimizer_config(cfg), stage.modules)
    if cfg.optimizer.decoupled_lr is not None:
        mark_decoupled_groups(optimizer, cfg.optimizer.decoupled_lr)
    return optimizer, OptimizerParamScheduler(optimizer, **scheduler_arguments(cfg))


def mark_decoupled_groups(optimizer, decoupled_lr: float) -> None:
    """Set ``is_decoupled_lr`` on the parameter groups ``--decoupled-lr`` made (the embedding and
    output layer's: their own ``max_lr``, and not megatron-core's default schedule).

    megatron-core gives those groups their rates but leaves the flag False, so they share their
    identity (``wd_mult``, ``lr_mult``, expert, decoupled: the keys it pairs a checkpoint's groups
    with this run's by) with the other weights' groups; one saved group then shadowed the other
    and no --decoupled-lr run could load its own optimizer state. The flag also tells
    ``--override-opt_param-scheduler`` which groups take the decoupled rates."""
    for group in optimizer.param_groups:
        if not group.get("default_config", True) and group.get("max_lr") == decoupled_lr:
            group["is_decoupled_lr"] = True


def scheduler_arguments(cfg: DynaPipeTrainingConfig) -> dict:
    """megatron-core ``OptimizerParamScheduler``'s keyword arguments for the run, in
    iterations: the warm-up from ``--lr-warmup-init`` to ``--lr``, then the decay."""
    o = cfg.optimizer
    return dict(init_lr=o.lr_warmup_init if o.lr_warmup_iters else o.lr, max_lr=o.lr, min_lr=o.min_lr,
                lr_warmup_steps=o.lr_warmup_iters, lr_decay_steps=max(o.lr_decay_iters, 1),
                lr_decay_style=o.lr_decay_style, start_wd=o.weight_decay_range[0], end_wd=o.weight_decay_range[1],
                wd_incr_steps=o.wd_incr_iters or max(cfg.train_iters, 1), wd_incr_style=o.weight_decay_incr_style,
                override_opt_param_scheduler=o.override_scheduler,
                use_checkpoint_opt_param_scheduler=o.use_checkpoint_scheduler,
                wsd_decay_steps=o.wsd_decay_iters, lr_wsd_decay_style=o.lr_wsd_decay_style)
