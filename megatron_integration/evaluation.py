"""Megatron-LM's evaluation: ``--eval-iters`` global batches of the validation set every
``--eval-interval`` iterations, and of the validation and test sets after training.

Forward only: the model is put in eval mode (no dropout) and runs under ``torch.no_grad``;
no gradient buffer, optimizer state, learning rate or training data position changes, so
a run's training losses are the same with and without evaluation. The loss is the
validation batches' summed token loss over their loss tokens (every replica), and the log
line is Megatron-LM's::

     validation loss at iteration 10 | lm loss value: 5.123456E+00 | lm loss PPL: 1.678161E+02 |

between two rules of dashes (``... at iteration N on validation set`` / ``on test set`` after
training). Each evaluation reads the next ``--eval-iters`` global batches of the split's own
stream (seeded by ``--seed``), as Megatron-LM's validation iterator continues across
evaluations; the position follows from the iteration, so a resumed run reads the same ones.

The fixed-shape baselines evaluate through megatron-core's ``forward_backward_func(...,
forward_only=True)`` with the run's batching; ``--use-dynapipe`` evaluates through DynaPipe
plans (:mod:`megatron_integration.dynapipe_eval`).

Under ``--exit-duration-in-mins`` every rank checks the limit after each evaluation batch, as
Megatron-LM's ``evaluate()`` does: once it has passed, the evaluation stops with
"exiting during evaluation" and no result, and the training loop saves and stops, so a long
evaluation cannot carry a job past the scheduler's limit before its checkpoint.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Optional, TextIO

import torch

from dynapipe.data.samples import SampleDataset
from dynapipe.data.sampler import GlobalBatchSampler
from dynapipe.data.splits import EmptySplitError
from dynapipe.errors import DynaPipeError
from megatron_integration.data import dataset_config, eval_sampler_config
from megatron_integration.initialize import RankInfo
from megatron_integration.baseline_step import (build_micro_batches, forward_step, holds_loss, reduce_loss,
                                                schedule_group, schedule_inputs, sp_shards)
from megatron_integration.model import Stage
from megatron_integration.train_config import DynaPipeTrainingConfig
from megatron_integration.training_limits import empty_unused_memory
from megatron_integration.run_report import write_line

SPLIT_NAMES = {"valid": "validation set", "test": "test set"}


def _fix(error: EmptySplitError, split: str) -> str:
    """What fills an empty ``split``: other data where its documents are all empty (a larger
    share would only hold more of them, or none), else a larger share of ``--split``."""
    if error.empty_documents:
        return f"drop the empty documents from the data or give --{split}-data-path"
    return f"raise the {SPLIT_NAMES[split].split()[0]} share of --split or give --{split}-data-path"


@dataclass
class EvalResult:
    """One evaluation: mean loss per loss token over ``loss_tokens`` tokens (whole eval batches)."""

    loss: float
    loss_tokens: int

    @property
    def ppl(self) -> float:
        """Perplexity as Megatron-LM reports it (``exp`` of the loss capped at 20)."""
        return math.exp(min(20.0, self.loss))


def validation_lines(prefix: str, result: EvalResult) -> list[str]:
    """Megatron-LM's three validation lines for ``prefix`` (``iteration N`` or ``iteration N on
    validation set``)."""
    text = (f" validation loss at {prefix} | lm loss value: {result.loss:.6E} | "
            f"lm loss PPL: {result.ppl:.6E} | ")
    rule = "-" * (len(text) + 1)
    return [rule, text, rule]


def megatron_eval_batch(stage: Stage, info: RankInfo, cfg: DynaPipeTrainingConfig, samples, lengths,
                        method: str) -> tuple[float, int]:
    """Forward-only megatron-core schedule over one global batch: (loss sum, loss tokens), global."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    micro_batches, _ = build_micro_batches(method, samples, lengths, cfg.model.seq_length, cfg.micro_batch_size,
                                           info, cfg.reset_position_ids, cfg.reset_attention_mask,
                                           schedule_group(stage), sp_shards(cfg), packed_attention=cfg.packed_attention)
    seq_lengths = {int(m.tokens.shape[1]) for m in micro_batches}
    saved = stage.config.variable_seq_lengths
    stage.config.variable_seq_lengths = saved or len(seq_lengths) > 1
    try:
        model, data = schedule_inputs(stage, micro_batches)
        reports = get_forward_backward_func()(
            forward_step_func=forward_step, data_iterator=data, model=model,
            num_microbatches=len(micro_batches), seq_length=max(seq_lengths), micro_batch_size=cfg.micro_batch_size,
            forward_only=True)
    finally:
        stage.config.variable_seq_lengths = saved
    loss_sum = sum(float(r["lm loss"][0]) for r in reports) if info.is_last_stage else 0.0
    tokens = sum(int(r["lm loss"][1]) for r in reports) if info.is_last_stage else 0
    return reduce_loss(loss_sum, tokens, holds_loss(info), info.device)


# Printed instead of an evaluation's result when --exit-duration-in-mins passed during it.
TIME_UP_LINE = "exiting during evaluation: --exit-duration-in-mins reached"


class Evaluator:
    """Evaluates the run's validation and test splits (see the module docstring).

    ``batch_fn(samples, lengths, eval_index, dataset)`` runs one global batch forward only and returns
    the global (loss sum, loss tokens); the default is megatron-core's schedule with the
    run's fixed-shape batching. ``dataset_fn(split)``: the split's dataset config or None
    (default: :func:`~megatron_integration.data.dataset_config` of ``cfg``; a T5 run passes its
    encoder-decoder one). ``time_up`` (set by the training loop under ``--exit-duration-in-mins``;
    collective, so every rank calls it after the same batch): whether to stop evaluating.
    """

    time_up: Optional[Callable[[], bool]] = None

    def __init__(self, cfg: DynaPipeTrainingConfig, info: RankInfo, stage: Stage,
                 batch_fn: Optional[Callable] = None, dataset_fn: Optional[Callable] = None):
        self.cfg, self.info, self.stage = cfg, info, stage
        self.datasets: dict[str, SampleDataset] = {}
        self.samplers: dict[str, GlobalBatchSampler] = {}
        dataset_fn = dataset_fn or (lambda split: dataset_config(cfg, split))
        empty = []
        for split in SPLIT_NAMES:
            config = dataset_fn(split) if cfg.evaluation.eval_iters > 0 else None
            if config is None:
                continue
            try:
                dataset = config.build()
            except EmptySplitError as e:
                if split == "valid" and cfg.evaluation.eval_interval is not None:
                    # Asked for, so not skipped unsaid (every rank sees the same data and raises).
                    raise DynaPipeError(f"--eval-interval {cfg.evaluation.eval_interval}: the validation split "
                                        f"holds no document ({e.reason()}); {_fix(e, 'valid')}, or drop "
                                        f"--eval-interval.") from None
                empty.append((split, e))
                continue
            sampler = GlobalBatchSampler(dataset.sample_tokens(), eval_sampler_config(cfg, config))
            self._check_loss_tokens(split, dataset, sampler)
            self.datasets[split], self.samplers[split] = dataset, sampler
        e = cfg.evaluation
        if empty and not self.datasets and e.eval_iters_given:
            # Typed, so not dropped unsaid (every rank sees the same data and raises).
            if any(err.empty_documents for _, err in empty):
                why = "; ".join(f"the {SPLIT_NAMES[x].split()[0]} split holds no document ({err.reason()})"
                                for x, err in empty)
                fixes = "drop the empty documents from the data, raise the other shares of --split"
            else:
                names = " and ".join(SPLIT_NAMES[x].split()[0] for x, _ in empty)
                why = (f"the {names} splits hold no document (their --split shares of the data round to none)"
                       if len(empty) > 1 else f"the {names} split holds no document ({empty[0][1].reason()})")
                fixes = "raise that share of --split"
            raise DynaPipeError(f"--eval-iters {e.eval_iters}: {why}, so nothing would be evaluated; {fixes}, give "
                                f"--valid-data-path or --test-data-path, or drop --eval-iters.")
        method = "padding" if cfg.method == "dynapipe" else cfg.method
        self.batch_fn = batch_fn or (lambda samples, lengths, k, dataset: megatron_eval_batch(
            stage, info, cfg, samples, lengths, method))
        self.batches_run = 0  # evaluation batches so far (also numbers their plans)

    # Evaluations of at most this many global batches are checked whole at start-up.
    CHECKED_BATCHES = 256

    def _check_loss_tokens(self, split: str, dataset: SampleDataset, sampler: GlobalBatchSampler) -> None:
        """Refuse, at start-up, a split whose evaluation would stop the run after the training
        before it: no sample with a token to predict (documents of one token), or none in the
        first evaluation's global batches (a blend drawing almost only such samples). Every
        rank sees the same data and raises."""
        e = self.cfg.evaluation
        flag = (f"--eval-interval {e.eval_interval}" if split == "valid" and e.eval_interval is not None
                else f"--eval-iters {e.eval_iters}")
        own_path = bool(getattr(self.cfg.data, f"{split}_data_path", ()))
        fix = ("drop such documents from the data" + ("" if own_path else
                                                        f", raise that share of --split, or give --{split}-data-path"))
        why = ("documents of one token, such as an end-of-document token alone, have no next token to predict, so "
               "the loss could not be averaged")
        from dynapipe.data.collate import loss_token_counts

        # From the lengths alone (nothing is read); the whole split's, then the first evaluation's.
        predicts = loss_token_counts(dataset.input_lengths, dataset.target_lengths, dataset.encoder_decoder) > 0
        if not predicts.any():
            raise DynaPipeError(f"{flag}: the {SPLIT_NAMES[split]}'s {len(dataset):,} sample(s) hold no loss tokens "
                                f"({why}); {fix}.")
        if e.eval_iters <= self.CHECKED_BATCHES and not any(
                predicts[sampler.batch(k).indices].any() for k in range(e.eval_iters)):
            share = float(predicts.mean())
            raise DynaPipeError(f"{flag}: the first evaluation of the {SPLIT_NAMES[split]} (its first {e.eval_iters} "
                                f"global batch(es)) holds no loss tokens: {share:.1%} of its samples have a token to "
                                f"predict ({why}); {fix}, or raise --eval-iters so an evaluation reaches them.")

    def has(self, split: str) -> bool:
        """Whether ``split`` (``valid``/``test``) has data to evaluate."""
        return split in self.datasets

    def evaluate(self, split: str, first_batch: int) -> Optional[EvalResult]:
        """``--eval-iters`` global batches of ``split`` from its ``first_batch``, forward only;
        ``None`` if :attr:`time_up` said to stop after some batch."""
        dataset, sampler = self.datasets[split], self.samplers[split]
        module = self.stage.module
        was_training = module.training
        module.eval()
        total, tokens = 0.0, 0
        try:
            with torch.no_grad():
                for k in range(first_batch, first_batch + self.cfg.evaluation.eval_iters):
                    batch = sampler.batch(k)
                    samples = [dataset[int(i)] for i in batch.indices]
                    lengths = dataset.planner_lengths(batch.indices)
                    s, t = self.batch_fn(samples, lengths, self.batches_run, dataset)
                    self.batches_run += 1
                    # Megatron-LM's evaluate() empties the cache after each step from level 1.
                    empty_unused_memory(self.cfg.empty_unused_memory_level, self.info.device, after_optimizer=False)
                    total, tokens = total + s, tokens + t
                    if self.time_up is not None and self.time_up():
                        return None
        finally:
            module.train(was_training)
        if tokens == 0:  # the count is every rank's together, so every rank stops here
            raise DynaPipeError(f"evaluating the {SPLIT_NAMES[split]}: its {self.cfg.evaluation.eval_iters} global "
                                f"batch(es) from batch {first_batch} hold no loss tokens (documents of one token, "
                                f"such as an end-of-document token alone, have no next token to predict), so there "
                                f"is no loss to average (it was logged as 0); drop such documents from the data.")
        return EvalResult(total / tokens, tokens)

    def after_iteration(self, done: int, stream: TextIO, logging_rank: bool, sink: list[str], writer=None,
                        consumed_samples: int = 0) -> None:
        """Megatron-LM's periodic evaluation after iteration ``done`` (1-based), when due: logged
        on the logging rank, kept in ``sink``, and written to TensorBoard's ``writer``."""
        if not self.periodic_due(done):
            return
        with self.cfg.manual_gc.evaluation():
            result = self.evaluate("valid", self.first_batch(done))
        if result is None:
            log_eval([TIME_UP_LINE], stream, logging_rank, sink)
            return
        log_eval(validation_lines(f"iteration {done}", result), stream, logging_rank, sink)
        self._write(writer, result, done, consumed_samples)

    def after_training(self, last: int, stream: TextIO, logging_rank: bool, sink: list[str], writer=None,
                       consumed_samples: int = 0) -> None:
        """Megatron-LM's evaluation of the validation and test sets once training is done,
        written to TensorBoard too (Megatron-LM writes both under its validation tags)."""
        for split in ("valid", "test"):
            if self.has(split):
                result = self.evaluate(split, self.first_batch(last, final=True) if split == "valid" else 0)
                if result is None:
                    log_eval([TIME_UP_LINE], stream, logging_rank, sink)
                    return
                log_eval(validation_lines(f"iteration {last} on {SPLIT_NAMES[split]}", result), stream,
                         logging_rank, sink)
                self._write(writer, result, last, consumed_samples)

    def _write(self, writer, result: EvalResult, iteration: int, consumed_samples: int) -> None:
        """Megatron-LM's validation scalars, by iteration and by consumed samples."""
        if writer is None:
            return
        values = [("lm loss validation", result.loss)]
        if self.cfg.tensorboard.log_validation_ppl:  # Megatron's --log-validation-ppl-to-tensorboard
            values.append(("lm loss validation ppl", result.ppl))
        for tag, value in values:
            writer.add_scalar(tag, value, iteration)
            writer.add_scalar(f"{tag} vs samples", value, consumed_samples)

    def periodic_due(self, iteration: int) -> bool:
        """Whether Megatron-LM evaluates after ``iteration`` (1-based) during training."""
        interval = self.cfg.evaluation.eval_interval
        return bool(interval) and iteration % interval == 0 and self.has("valid")

    def first_batch(self, iteration: int, final: bool = False) -> int:
        """Where the validation stream stands at ``iteration`` (:func:`valid_first_batch`)."""
        e = self.cfg.evaluation
        return valid_first_batch(iteration, e.eval_interval, e.eval_iters, final)


def valid_first_batch(iteration: int, eval_interval, eval_iters: int, final: bool = False) -> int:
    """First validation batch of the evaluation at ``iteration``: ``eval_iters`` batches per
    evaluation already run (Megatron-LM's ``consumed_valid_samples``). A periodic one at a
    multiple of ``eval_interval`` follows the earlier ones; the final one (after training)
    follows every periodic one up to ``iteration``."""
    done = iteration // eval_interval if eval_interval else 0
    return (done if final else done - 1) * eval_iters


def log_eval(lines: list[str], stream: TextIO, is_logging_rank: bool, sink: list[str]) -> None:
    """Print the lines on the logging rank and keep them in ``sink``."""
    sink.extend(lines)
    if is_logging_rank:
        for line in lines:
            write_line(stream, line)
