"""The training loop shared by ``scripts/pretrain_gpt.py``, ``python -m dynapipe bench`` and the tests.

``pretrain(cfg)`` initialises megatron, builds this rank's stage, optimizer and
schedule, resumes from ``--load`` when given, then runs ``--train-iters`` iterations
of the chosen method (``dynapipe``: planned variable-shape micro-batches through the
DynaPipe executor; ``padding`` / ``packing``: megatron-core's fixed-shape 1F1B),
logging in Megatron's format, evaluating (forward only) every ``--eval-interval`` iterations
and after training, and saving checkpoints on ``--save-interval`` and at the end.
Every method sees the same global batches (same samples, same order) and starts from
the same weights for a given ``--seed``.
"""
from __future__ import annotations

import sys
import time
from dataclasses import dataclass, replace
from functools import partial
from typing import Callable, Optional, TextIO

from dynapipe.cost.model_flops import samples_work
from dynapipe.errors import DynaPipeError
from dynapipe.megatron_core import untested_release_note
from megatron_integration import checkpoint_formats
from megatron_integration.agreement import attempt, everyone, same_error_everywhere
from megatron_integration.blend_resume import blend_record, keep_resumed_blend
from megatron_integration.out_of_memory import MODEL_TOO_LARGE, named_out_of_memory
from megatron_integration.data import GlobalBatches, data_summary_lines
from megatron_integration.device_default import analytic_on_gpu_note, default_device_for
from megatron_integration.dynapipe_loader import start_planner_server_early
from megatron_integration.initialize import RankInfo, initialize_megatron
from megatron_integration.arguments import block_layers, check_uniform_recompute
from megatron_integration.baseline_step import (StepResult, build_micro_batches, megatron_train_step, schedule_group,
                                                sp_shards)
from megatron_integration.model import Stage, attach_training_hooks, build_stage
from megatron_integration.optimizer import build_optimizer
from megatron_integration.non_persistent import newer_load
from megatron_integration.params_norm import params_l2_norm
from megatron_integration.weight_hash import weight_hash_check
from megatron_integration.rerun import ResultValidator
from megatron_integration.rerun_record import load_record
from megatron_integration.rerun_tracker import same_skips_everywhere
from megatron_integration.placement_auto import resolve_gpt_split
from megatron_integration.profile_check import check_threads_at_start, extrapolation_lines
from megatron_integration.run_report import parameter_count_line, write_line
from megatron_integration.train_config import DynaPipeTrainingConfig
# Re-exported: the T5 loop, the command line and the tests import them from here.
from megatron_integration.flag_spelling import megatron_spelled
from megatron_integration.training_loop import (LoopParts, Stepper, TrainingRun,
                                                print_rank_0, run_iterations)


@dataclass
class MegatronStepper:
    """``padding`` / ``packing``: fixed-shape micro-batches through megatron-core's 1F1B."""

    cfg: DynaPipeTrainingConfig
    info: RankInfo
    stage: Stage
    optimizer: object
    scheduler: object
    batches: GlobalBatches
    # What a rejected loss or gradient norm leads to (--rerun-mode); set by pretrain.
    validator: Optional[ResultValidator] = None

    def step(self, iteration: int) -> StepResult:
        cfg = self.cfg
        batch = self.batches.batch(iteration)
        # The whole global batch's (every replica's), known on every rank: one without any would
        # train on a zero loss, Adam's moments and weight decay still moving the weights.
        loss_tokens = self.batches.dataset.loss_tokens(batch.indices)
        if loss_tokens == 0:
            from megatron_integration.dynapipe_step import NO_LOSS_TOKENS

            raise DynaPipeError(f"iteration {iteration + 1}: {NO_LOSS_TOKENS}")
        samples = self.batches.samples(batch)
        lengths = self.batches.lengths(batch)
        micro_batches, executed = build_micro_batches(cfg.method, samples, lengths, cfg.model.seq_length,
                                                      cfg.micro_batch_size, self.info, cfg.reset_position_ids,
                                                      cfg.reset_attention_mask, schedule_group(self.stage),
                                                      sp_shards=sp_shards(cfg), packed_attention=cfg.packed_attention)
        result = megatron_train_step(self.stage, self.optimizer, self.scheduler, micro_batches, cfg.model.seq_length,
                                     cfg.micro_batch_size, self.info, int(lengths.sum()), executed.tokens,
                                     validate=partial(self._validator().run, iteration),
                                     memory_level=cfg.empty_unused_memory_level, loss_divisor=float(loss_tokens))
        result.consumed_samples = batch.consumed_samples
        result.truncated = int(self.batches.dataset.truncated[batch.indices].sum())
        result.executed_work, result.real_work = executed, samples_work(lengths)
        return result

    def skip(self, iteration: int) -> int:
        """Consume iteration ``iteration``'s global batch untrained (``--iterations-to-skip``);
        the consumed samples after it."""
        return self.batches.batch(iteration).consumed_samples

    def _validator(self) -> ResultValidator:
        if self.validator is None:
            self.validator = ResultValidator.of(self.cfg, self.stage.module, self.info.device)
        return self.validator

    def close(self) -> None:
        pass


def make_stepper(cfg: DynaPipeTrainingConfig, info: RankInfo, stage: Stage, optimizer, scheduler,
                 start_iteration: int, consumed_samples: int) -> Stepper:
    """The stepper of ``cfg.method``."""
    if cfg.method == "dynapipe":
        from megatron_integration.dynapipe_step import DynaPipeStepper

        return DynaPipeStepper.create(cfg, info, stage, optimizer, scheduler, start_iteration, consumed_samples)
    batches = GlobalBatches.create(cfg, consumed_samples, start_iteration)
    return MegatronStepper(cfg, info, stage, optimizer, scheduler, batches)


def make_evaluator(cfg: DynaPipeTrainingConfig, info: RankInfo, stage: Stage, stepper: Stepper):
    """The run's :class:`~megatron_integration.evaluation.Evaluator` (None without evaluation
    data or with ``--eval-iters 0``); ``--use-dynapipe`` evaluates through forward-only plans."""
    from megatron_integration.evaluation import Evaluator

    if cfg.evaluation.eval_iters <= 0:
        return None
    batch_fn = None
    if cfg.method == "dynapipe":
        from megatron_integration.dynapipe_eval import DynaPipeEvalRunner

        batch_fn = DynaPipeEvalRunner(cfg, info, stepper)
    evaluator = Evaluator(cfg, info, stage, batch_fn)
    return evaluator if evaluator.datasets else None


def vocab_padding_line(cfg: DynaPipeTrainingConfig) -> Optional[str]:
    """Megatron-LM's start-up line on the vocabulary padding (None when nothing was padded)."""
    m = cfg.model
    if not m.unpadded_vocab_size:
        return None
    return (f" > padded vocab (size: {m.unpadded_vocab_size}) with {m.vocab_size - m.unpadded_vocab_size} "
            f"dummy tokens (new size: {m.vocab_size})")


def result_validator(cfg: DynaPipeTrainingConfig, info: RankInfo, module, stream: TextIO,
                     start_iteration: int, split: Optional[dict] = None) -> ResultValidator:
    """The run's :class:`ResultValidator` (``--rerun-mode``), with the rerun record of the
    checkpoint it resumed from (``start_iteration`` > 0 under ``--load``), if any; collective.
    ``split``: how the model's layers sit on the stages (a record of another split is refused,
    as one of other parallel sizes, method or micro-batch size is)."""
    def log(line: str) -> None:
        print_rank_0(info, stream, [], line)
    layout = {"tp": info.tp_size, "pp": info.pp_size, "dp": info.dp_size, "method": cfg.method,
              "micro_batch_size": cfg.micro_batch_size, "split": split}
    if cfg.tracked_skips is not None:
        same_skips_everywhere(everyone((cfg.tracked_skips.path, cfg.iterations_to_skip)))
        for line in cfg.tracked_skips.lines():
            log(line)
    record = None
    if cfg.load and start_iteration > 0:
        record = load_record(cfg.load, start_iteration, cfg.rerun.rerun_mode, log,
                             check=cfg.check_for_nan_in_loss_and_grad, layout=layout,
                             skipped=start_iteration + 1 in cfg.iterations_to_skip)
    return ResultValidator(cfg.rerun, cfg.check_for_nan_in_loss_and_grad, module, info.device, resume=record,
                           log=log, layout=layout)


def check_split(chunks: int, layers: Optional[list], extra: dict, path: str) -> None:
    """Refuse a ``dynapipe``-format checkpoint saved with another number of model chunks a rank,
    or another uneven split (``layers``: transformer layers of every virtual stage, None: the even
    split); its tensors are stored by local names, while ``torch_dist`` ones load at any split."""
    saved = int(extra.get("virtual_stages_per_rank", 1))
    if saved != chunks:
        raise DynaPipeError(f"{path} was saved with {saved} model chunk(s) a rank, this run builds {chunks}; "
                            f"resume with --num-virtual-stages-per-pipeline-rank {saved}, or save in --ckpt-format "
                            f"torch_dist, which loads at any chunking.")
    saved_layers = extra.get("stage_layers")
    if saved_layers != layers:
        def name(v):
            return "the even split" if v is None else f"layers {v} a (virtual) stage"
        raise DynaPipeError(f"{path} was saved on {name(saved_layers)}, this run builds {name(layers)}; resume "
                            f"with the pipeline split flags it was saved with, or save in --ckpt-format torch_dist, "
                            f"which loads at any split.")


@megatron_spelled
def pretrain(cfg: DynaPipeTrainingConfig, stream: TextIO = sys.stdout,
             on_iteration: Optional[Callable[[int, StepResult], None]] = None) -> TrainingRun:
    """Train up to ``cfg.train_iters`` iterations (from the checkpoint in ``cfg.load`` when present),
    stopping early at ``--exit-interval`` as Megatron-LM does."""
    started_s = time.time()  # --exit-duration-in-mins counts from here, as Megatron-LM's from its start
    info = initialize_megatron(cfg.parallel, cfg.seed, cfg.model.deterministic_mode, cfg.logging_level)
    dynapipe, device_note = default_device_for(cfg.dynapipe, info.device)
    cfg = replace(cfg, dynapipe=dynapipe)
    start_planner_server_early(cfg, info)  # while the model is built and loaded
    for note in (untested_release_note(), device_note, analytic_on_gpu_note(cfg.dynapipe, info.device)):
        if info.rank == 0 and note is not None:
            write_line(stream, note)
    if info.rank == 0 and vocab_padding_line(cfg) is not None:
        write_line(stream, vocab_padding_line(cfg))
    # A CPU profile of other threads prices another machine; every rank checks its own threads.
    # The profile prices DynaPipe's plans, and every method's split under --dynapipe-placement auto.
    priced = cfg.dynapipe.enabled or cfg.parallel.auto_split
    same_error_everywhere(attempt(lambda: check_threads_at_start(cfg.dynapipe.cost_model, priced,
                                                                 info.device.type == "cpu"),
                                  "checking the cost profile")[1])
    if info.rank == 0:
        for line in extrapolation_lines(cfg.dynapipe.cost_model, priced,
                                        {"seqlen": ("--seq-length", cfg.model.seq_length)}):
            write_line(stream, line)
    # --non-persistent-ckpt-type: the newer of --load's checkpoint and the non-persistent one.
    cfg = newer_load(cfg, partial(print_rank_0, info, stream, []))
    # A resumed run trains on the weighted blend its checkpoint trained on: known before any data is read.
    cfg, kept_blend = keep_resumed_blend(cfg, checkpoint_formats.recorded_training_blend(cfg, info))
    # Rank 0 alone reads the data for the summary; a bad file stops every rank with its line.
    lines, error = attempt(lambda: data_summary_lines(cfg), "reading the data") if info.rank == 0 else ([], None)
    same_error_everywhere(error)
    for line in lines:
        write_line(stream, line)
    # --dynapipe-placement auto is chosen here, before any stage is built.
    cfg, split_line = resolve_gpt_split(cfg)
    if cfg.parallel.auto_split:
        check_uniform_recompute(cfg.recompute, block_layers(cfg.parallel, cfg.model.num_layers))
    if info.rank == 0 and split_line is not None:
        write_line(stream, split_line)
    with named_out_of_memory("building this rank's stage", MODEL_TOO_LARGE):
        stage = build_stage(cfg, info)
    count = sum(p.nelement() for p in stage.gpt.parameters())
    if info.dp_rank == 0:
        write_line(stream, parameter_count_line(info.tp_rank, info.pp_rank, count))
    optimizer, scheduler = build_optimizer(cfg, stage)
    attach_training_hooks(stage, optimizer)
    run = TrainingRun(spec_name=stage.spec_name, parameters=count)
    # The per-rank (dynapipe) format stores the chunks by local name: it resumes at its own chunking.
    chunks = cfg.parallel.virtual_pipeline_model_parallel_size or 1
    layers = None if cfg.parallel.stage_layers is None else list(cfg.parallel.stage_layers)
    record = {"virtual_stages_per_rank": chunks, "stage_layers": layers}
    log = partial(print_rank_0, info, stream, run.checkpoint_lines)
    if cfg.load:
        resumed = checkpoint_formats.load(cfg, stage.gpt, optimizer, scheduler, info, log,
                                          check_extra=partial(check_split, chunks, layers))
        if resumed is not None:
            run.start_iteration, run.consumed_samples = resumed.iteration, resumed.consumed_samples
            run.flops_so_far = resumed.flops_so_far
            if kept_blend:
                log(kept_blend)
    stepper = make_stepper(cfg, info, stage, optimizer, scheduler, run.start_iteration, run.consumed_samples)
    stepper.validator = result_validator(cfg, info, stage.module, stream, run.start_iteration, split=record)

    def save(iteration: int, consumed_samples: int, flops_so_far: float, persistent: bool = True) -> None:
        checkpoint_formats.save(cfg, iteration, consumed_samples, stage.gpt, optimizer, scheduler, info, log,
                                extra=record, training_blend=blend_record(cfg), flops_so_far=flops_so_far,
                                persistent=persistent)

    parts = LoopParts(cfg, info, optimizer, stepper, save, lambda: make_evaluator(cfg, info, stage, stepper),
                      started_s,
                      params_norm=partial(params_l2_norm, stage.modules, info.device) if cfg.log_params_norm else None,
                      weight_hashes=weight_hash_check(cfg, stage.modules, info.device),
                      model=cfg.model.to_model_config())
    return run_iterations(parts, run, stream, on_iteration)
