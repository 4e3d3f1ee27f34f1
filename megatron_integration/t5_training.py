"""The T5 training loop shared by ``scripts/pretrain_t5.py``, ``bench --model t5`` and the tests.

``pretrain_t5(cfg)`` initialises megatron, builds this rank's T5 stage (megatron-core DDP,
its optimizer and learning-rate schedule), then runs ``--train-iters`` iterations of the
chosen method through the DynaPipe executor (:mod:`megatron_integration.t5_step`), logging
in Megatron's format; resumes from ``--load`` and saves on ``--save-interval`` and at the end,
in ``--ckpt-format`` as GPT does (:mod:`megatron_integration.t5_checkpoint`: ``torch_dist`` under
megatron-core ``T5Model``'s keys, loadable at any stage placement, or this project's per-stage
files); evaluates every ``--eval-interval`` iterations and after training, as GPT does
(:mod:`megatron_integration.t5_eval`). Every method sees the same global batches and starts from the same weights for a given
``--seed``.
"""
from __future__ import annotations

import sys
import time
from dataclasses import replace
from functools import partial
from typing import Callable, Optional, TextIO

from megatron_integration import checkpoint_formats
from megatron_integration.agreement import attempt, same_error_everywhere
from megatron_integration.blend_resume import blend_record, keep_resumed_blend
from megatron_integration.out_of_memory import MODEL_TOO_LARGE, named_out_of_memory
from megatron_integration.initialize import RankInfo, initialize_megatron
from megatron_integration.profile_check import check_threads_at_start, extrapolation_lines
from megatron_integration.run_report import parameter_count_line, write_line
from megatron_integration.baseline_step import StepResult
from megatron_integration.model import Stage, grad_scale_func
from megatron_integration.optimizer import build_optimizer
from megatron_integration.dynapipe_loader import start_planner_server_early
from megatron_integration.non_persistent import newer_load
from megatron_integration.params_norm import params_l2_norm
from megatron_integration.weight_hash import weight_hash_check
from megatron_integration.t5_config import T5TrainingConfig
from megatron_integration.t5_eval import make_t5_evaluator
from megatron_integration.training import result_validator, vocab_padding_line
from megatron_integration.training_loop import LoopParts, TrainingRun, print_rank_0, run_iterations
from megatron_integration.flag_spelling import t5_spelled


def build_t5_training_stage(cfg: T5TrainingConfig, info: RankInfo) -> Stage:
    """This rank's T5 stage wrapped in megatron-core's ``DistributedDataParallel`` (and, with
    ``--bf16`` or ``--fp16``, in its ``Float16Module``, as Megatron-LM wraps a half-precision
    model: half-precision weights and activations, fp32 gradient buffers and optimizer main copies)."""
    from megatron_integration.ddp import attach_grad_sync, count_parameters, wrap_chunk
    from megatron_integration.t5_model import build_t5_stage

    with named_out_of_memory("building this rank's stage", MODEL_TOO_LARGE):
        t5 = build_t5_stage(cfg, info)
    inner = t5
    if cfg.base.model.dtype in ("bf16", "fp16"):
        from megatron.core.transformer.module import Float16Module

        inner = Float16Module(t5.config, t5)
    # One DDP over the rank's chunks (interleaved placements too: their chunks share parameters).
    module = wrap_chunk(cfg.base, t5.config, inner, 0, count_parameters([t5]))
    attach_grad_sync(t5.config, [module])
    return Stage(module=module, gpt=t5, config=t5.config, info=info, spec_name=t5.spec_name)


@t5_spelled
def pretrain_t5(cfg: T5TrainingConfig, stream: TextIO = sys.stdout,
                on_iteration: Optional[Callable[[int, StepResult], None]] = None) -> TrainingRun:
    """Train ``cfg.base.train_iters`` iterations (stopping early at ``--exit-interval``)."""
    from megatron_integration.t5_checkpoint import t5_megatron_args, t5_model_values
    from megatron_integration.t5_model import EmbeddingSync, stage_places
    from megatron_integration.t5_placement import check_checkpoint_placement, checkpoint_record, resolve_t5_placement
    from megatron_integration.t5_step import T5Stepper

    base = cfg.base
    megatron_blend = cfg.span_corruption is not None  # megatron-core's blend: Megatron-LM's behaviour
    started_s = time.time()  # --exit-duration-in-mins counts from here
    info = initialize_megatron(base.parallel, base.seed, base.model.deterministic_mode, base.logging_level)
    from megatron_integration.device_default import analytic_on_gpu_note, default_device_for
    from dynapipe.megatron_core import untested_release_note

    dynapipe, device_note = default_device_for(base.dynapipe, info.device)
    base = replace(base, dynapipe=dynapipe)
    cfg = replace(cfg, base=base)
    start_planner_server_early(base, info)  # while the model is built and loaded
    for note in (untested_release_note(), device_note, analytic_on_gpu_note(base.dynapipe, info.device)):
        if info.rank == 0 and note is not None:
            write_line(stream, note)
    if info.rank == 0 and vocab_padding_line(base) is not None:
        write_line(stream, vocab_padding_line(base))
    # A CPU profile of other threads prices another machine; every rank checks its own threads.
    # The profile prices DynaPipe's plans, and every method's placement under --dynapipe-placement auto.
    priced = base.dynapipe.enabled or cfg.placement_flag == "auto"
    same_error_everywhere(attempt(lambda: check_threads_at_start(base.dynapipe.cost_model, priced,
                                                                 info.device.type == "cpu"),
                                  "checking the cost profile")[1])
    if info.rank == 0:
        for line in extrapolation_lines(base.dynapipe.cost_model, priced,
                                        {"seqlen": ("--encoder-seq-length", base.model.seq_length),
                                         "dec_seqlen": ("--decoder-seq-length", cfg.decoder_seq_length)}):
            write_line(stream, line)
    # --non-persistent-ckpt-type: the newer of --load's checkpoint and the non-persistent one.
    base = newer_load(base, partial(print_rank_0, info, stream, []))
    cfg = replace(cfg, base=base)
    # A resumed run trains on the weighted blend its checkpoint trained on: known before any data is read.
    base, kept_blend = keep_resumed_blend(base, checkpoint_formats.recorded_training_blend(base, info), megatron_blend)
    if kept_blend:
        cfg = replace(cfg, base=base)
    # GPT's per-split data lines, which also stop every rank on a token budget over the data
    # before any stage is built. Rank 0 reads (input, target) pairs alone; span-corrupted data is
    # megatron-core's, built by every rank together (its index and length caches, written here,
    # make the training loader's second opening a read).
    from megatron_integration.data import data_summary_lines

    lines, error = (attempt(lambda: data_summary_lines(base, cfg.dataset_config), "reading the data")
                    if info.rank == 0 or megatron_blend else ([], None))
    same_error_everywhere(error)
    for line in lines if info.rank == 0 else ():
        write_line(stream, line)
    # --dynapipe-placement auto is chosen here, before any stage is built.
    cfg = resolve_t5_placement(cfg, info.pp_size, info.dp_size)
    placement = cfg.stage_placement()
    if info.rank == 0 and cfg.placement_flag != "even":
        write_line(stream, f" > stage placement (encoder+decoder layers per stage): {placement} "
                           f"(--dynapipe-placement {cfg.placement_flag})")
    stage = build_t5_training_stage(cfg, info)
    parameters = sum(p.nelement() for p in stage.gpt.parameters())
    if info.dp_rank == 0:
        # One write per line: the stages share the job's stdout.
        write_line(stream, parameter_count_line(info.tp_rank, info.pp_rank, parameters))
    optimizer, scheduler = build_optimizer(base, stage)
    # The last stage's loss is multiplied by the optimizer's loss scale before the backward (the
    # optimizer divides the gradients by it), as GPT's attach_training_hooks arranges.
    stage.config.grad_scale_func = grad_scale_func(stage.config, optimizer)
    sync = EmbeddingSync.create(stage_places(cfg.planner_model(), info.pp_size, placement), base.model.tie_embeddings,
                                info.pp_size)
    run = TrainingRun(spec_name=stage.spec_name, parameters=parameters)
    log = partial(print_rank_0, info, stream, run.checkpoint_lines)
    if base.load:
        resumed = checkpoint_formats.load(base, stage.gpt, optimizer, scheduler, info, log,
                                          check_extra=lambda extra, path: check_checkpoint_placement(
                                              extra, placement, cfg.planner_model(), path),
                                          model_values=t5_model_values(cfg))
        if resumed is not None:
            run.start_iteration, run.consumed_samples = resumed.iteration, resumed.consumed_samples
            run.flops_so_far = resumed.flops_so_far
            if kept_blend:
                log(kept_blend)
    stepper = T5Stepper.create(cfg, info, stage, optimizer, scheduler, sync, run.start_iteration,
                               run.consumed_samples)
    stepper.validator = result_validator(base, info, stage.module, stream, run.start_iteration,
                                         split=checkpoint_record(placement))

    def save(iteration: int, consumed_samples: int, flops_so_far: float, persistent: bool = True) -> None:
        checkpoint_formats.save(base, iteration, consumed_samples, stage.gpt, optimizer, scheduler, info, log,
                                extra=checkpoint_record(placement), args_update=t5_megatron_args(cfg),
                                model_values=t5_model_values(cfg), training_blend=blend_record(base, megatron_blend),
                                flops_so_far=flops_so_far, persistent=persistent)

    parts = LoopParts(base, info, optimizer, stepper, save, lambda: make_t5_evaluator(cfg, info, stage, stepper),
                      started_s,
                      params_norm=partial(params_l2_norm, stage.modules, info.device) if base.log_params_norm else None,
                      weight_hashes=weight_hash_check(base, stage.modules, info.device),
                      model=cfg.planner_model())
    return run_iterations(parts, run, stream, on_iteration)
