"""The dataset and global-batch stream of a run, shared by every method.

DynaPipe's data loader and the fixed-shape baselines read the same
:class:`~dynapipe.data.config.DatasetConfig` through the same
:class:`~dynapipe.data.sampler.GlobalBatchSampler` (seeded by ``--seed``, resumable from
``consumed_samples``), so for a given seed every method trains on the same samples in
the same global batches.

``--mock-data`` is the synthetic multi-task mixture: ``--dynapipe-mock-samples``
samples (default 65,536), reshuffled every epoch. ``--data-path`` takes JSONL files
(``*.jsonl``, tokenised byte-level) or Megatron indexed-dataset prefixes
(``PREFIX.bin``/``PREFIX.idx``), split into train / validation / test by ``--split``;
``--train/valid/test-data-path`` give the splits separately.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional

import numpy as np

from dynapipe.data.config import DatasetConfig
from dynapipe.data.samples import Sample, SampleDataset
from dynapipe.data.sampler import GlobalBatch, GlobalBatchSampler, SamplerConfig
from dynapipe.data.splits import SPLITS, WHOLE, EmptySplitError, split_ranges
from dynapipe.errors import DynaPipeError
from megatron_integration.data_args import check_jsonl_tokenizer, is_jsonl
from megatron_integration.flag_spelling import megatron_spelled
from megatron_integration.train_config import DynaPipeTrainingConfig


def dataset_config(cfg: DynaPipeTrainingConfig, split: str = "train") -> Optional[DatasetConfig]:
    """The :class:`DatasetConfig` of one split (``train``, ``valid`` or ``test``) of a run's data
    arguments, or None when the run has no such split (see :mod:`megatron_integration.data_args`)."""
    d = cfg.data
    if split not in SPLITS:
        raise DynaPipeError(f"split {split!r} is not known; use one of {list(SPLITS)}.")
    # --dynapipe-overlong reject refuses long pretraining documents too, instead of cutting them.
    common = dict(seq_length=cfg.model.seq_length, overlong=d.overlong, seed=cfg.seed,
                  vocab_size=cfg.model.vocab_size, split_name=split, split_documents=d.overlong != "reject",
                  mmap_bin_files=d.mmap_bin_files)
    ranges = split_ranges(list(d.split)) if d.split else {"train": WHOLE, "valid": None, "test": None}
    if d.mock_data:
        if ranges[split] is None:
            return None
        # Each split is a mixture of its own: the same distribution, other samples.
        common["seed"] = cfg.seed + SPLITS.index(split)
        return DatasetConfig(kind="synthetic", num_samples=d.mock_samples, mixture=d.mixture, **common)
    # Token ids of files are checked against the tokenizer's vocabulary (or --vocab-size), not
    # the padded one: an id in the padding is no token of it. Mock data keeps drawing below the
    # padded size, as it always has.
    common["vocab_size"] = cfg.model.unpadded_vocab_size or cfg.model.vocab_size
    every_path = (*d.data_path, *d.train_data_path, *d.valid_data_path, *d.test_data_path)
    check_jsonl_tokenizer(every_path, d.tokenizer_type)
    if d.train_data_path:
        files, weights = getattr(d, f"{split}_data_path"), getattr(d, f"{split}_data_weights")
        if not files:
            return None
        flag = f"--{split}-data-path"
    else:
        if ranges[split] is None:
            return None
        files, weights, flag = d.data_path, d.data_weights, "--data-path"
        common["split_range"] = ranges[split]
    if split == "train":
        kind, count = training_blend_size(cfg)
        common[f"blend_{kind}"] = count
    return _files_config(files, weights, flag, common)


def training_blend_size(cfg: DynaPipeTrainingConfig) -> tuple[str, int]:
    """How many samples (``("samples", N)``) or tokens (``("tokens", T)``, token-budget
    batches) a weighted training blend holds: the run's, as Megatron sizes its blend, so a
    down-weighted path is drawn through all of it rather than one subset every epoch; a
    resumed run keeps its checkpoint's (:mod:`megatron_integration.blend_resume`)."""
    d = cfg.data
    if d.resumed_blend_size is not None:
        return d.resumed_blend_size
    if d.tokens_per_global_batch:
        return "tokens", cfg.train_iters * d.tokens_per_global_batch
    return "samples", cfg.train_iters * cfg.global_batch_size


def _files_config(files, weights, flag: str, common: dict) -> DatasetConfig:
    jsonl = [p for p in files if is_jsonl(p)]
    if jsonl and len(jsonl) != len(files):
        raise DynaPipeError(f"{flag} mixes JSONL files and indexed-dataset prefixes; give one kind.")
    common["weights"] = tuple(weights)
    if jsonl:
        return DatasetConfig(kind="jsonl", paths=tuple(jsonl), **common)
    for p in files:
        if not (os.path.exists(p + ".idx") and os.path.exists(p + ".bin")):
            raise DynaPipeError(f"{flag} {p}: neither a .jsonl file nor an indexed dataset ({p}.bin/.idx).")
    return DatasetConfig(kind="indexed", paths=tuple(files), **common)


@megatron_spelled
def data_summary_lines(cfg: DynaPipeTrainingConfig, config_of=None) -> list[str]:
    """Start-up lines counting each split's documents, pieces (documents longer than
    ``--seq-length`` cut into samples), tokens and truncated samples. The training split is
    also checked against ``--dynapipe-tokens-per-global-batch`` here, before any stage is
    built, rather than when the planner workers first draw from it. ``config_of``: a split's
    name -> its dataset config or None (default: the run's GPT data; T5 passes its pairs')."""
    from dynapipe.data.summary import summarize

    lines = []
    for split in SPLITS:
        config = config_of(split) if config_of is not None else dataset_config(cfg, split)
        if config is None:
            continue
        try:
            dataset = config.open()
        except EmptySplitError as e:
            why = (f"its {e.empty_documents:,} document(s) are all empty, skipped" if e.empty_documents
                   else "no document falls in its --split range")
            lines.append(f" > {split} data: empty ({why})")
            continue
        # Span-corrupted T5 samples are not documents cut into pieces: they say what they are.
        line_of = getattr(dataset, "summary_line", None)
        if line_of is not None:
            lines.append(line_of(split))
        else:
            summary = summarize(dataset)
            lines.append(summary.line(split, cfg.model.seq_length))
            lines.extend(_truncation_note(split, summary, dataset.encoder_decoder))
        budget = cfg.data.tokens_per_global_batch
        if split == "train" and budget:
            # The sampler refuses a budget above the data's tokens (after truncation); one below a
            # sample would put that sample alone in a batch over the budget.
            tokens = dataset.sample_tokens()
            longest = int(tokens.max()) if len(tokens) else 0
            if budget < longest:
                raise DynaPipeError(f"--dynapipe-tokens-per-global-batch {budget}: below the longest training "
                                    f"sample ({longest:,} tokens), which would make a global batch over the budget "
                                    f"on its own; give at least {longest} (a budget holds several samples, "
                                    f"Megatron's global batches many).")
            GlobalBatchSampler(tokens, sampler_config(cfg, config))
        elif split == "train" and config_of is None and _pretraining_documents(dataset):
            note = _sample_size_note(cfg, dataset.sample_tokens())
            lines.extend([note] if note else [])
    return lines


# A split with more of its samples truncated than this gets a line of its own, not just a count.
TRUNCATION_NOTE_SHARE = 0.1


def _truncation_note(split: str, summary, encoder_decoder: bool) -> list[str]:
    """A start-up line when many samples of ``split`` were cut at the length limits (the
    default ``--dynapipe-overlong truncate``): a count in the summary line is easy to miss."""
    if not summary.samples or summary.truncated <= TRUNCATION_NOTE_SHARE * summary.samples:
        return []
    limits = "--encoder-seq-length / --decoder-seq-length" if encoder_decoder else "--seq-length"
    return [f" > note: {summary.truncated:,} of the {summary.samples:,} {split} samples "
            f"({summary.truncated / summary.samples:.0%}) are longer than {limits} and were cut to fit; raise "
            f"{limits}, or refuse such samples with --dynapipe-overlong reject"]


def _pretraining_documents(dataset) -> bool:
    """Whether every sample of ``dataset`` is a decoder-only pretraining document (or a piece of
    one): no input part, as Megatron-LM's ``GPTDataset`` would have read the same data."""
    inputs = getattr(dataset, "input_lengths", None)
    return inputs is not None and not dataset.encoder_decoder and len(inputs) > 0 and not inputs.any()


def _sample_size_note(cfg: DynaPipeTrainingConfig, tokens: np.ndarray) -> Optional[str]:
    """A start-up line for a user porting a Megatron-LM run: a GPT sample here is a document (or
    a piece of a longer one), where Megatron-LM's ``GPTDataset`` packs documents into samples of
    ``--seq-length`` tokens, so the same ``--global-batch-size`` trains fewer tokens a step.
    None where samples average at least 90% of ``--seq-length`` (the two then differ little)."""
    seq_length, gbs = cfg.model.seq_length, cfg.global_batch_size
    mean = float(tokens.mean()) if len(tokens) else 0.0
    if not len(tokens) or mean >= 0.9 * seq_length:
        return None
    fix = (" (or --dynapipe-tokens-per-global-batch to batch by tokens)" if cfg.method == "dynapipe" else "")
    return (f" > a train sample here is one document (or a piece of a longer one), {mean:,.0f} tokens on average: a "
            f"global batch of {gbs:,} samples holds about {mean * gbs:,.0f} tokens, where Megatron-LM's GPTDataset "
            f"packs documents into samples of --seq-length {seq_length:,} ({gbs * seq_length:,} tokens a batch); "
            f"raise --global-batch-size{fix} to train as many tokens a step")


def reshuffles(dataset_config) -> bool:
    """Whether the sampler shuffles the samples of ``dataset_config`` (a dataset config of any
    kind): not those megatron-core's own dataset already shuffled, which Megatron-LM's sampler
    reads in order (``ordered_by_megatron``: T5 span corruption), so that global batch ``k``
    holds the samples Megatron-LM's does."""
    return not getattr(dataset_config, "ordered_by_megatron", False)


def eval_sampler_config(cfg: DynaPipeTrainingConfig, dataset_config) -> SamplerConfig:
    """Evaluation batches of ``--global-batch-size`` samples of ``dataset_config`` (see
    :func:`reshuffles`)."""
    return SamplerConfig(global_batch_size=cfg.global_batch_size, seed=cfg.seed, shuffle=reshuffles(dataset_config),
                         min_samples=cfg.parallel.data_parallel_size)


def sampler_config(cfg: DynaPipeTrainingConfig, dataset_config=None) -> SamplerConfig:
    """Global batches by ``--global-batch-size`` samples or by token budget, of the samples of
    ``dataset_config`` (None: the run's GPT data; see :func:`reshuffles`)."""
    tokens = cfg.data.tokens_per_global_batch or 0
    return SamplerConfig(global_batch_size=0 if tokens else cfg.global_batch_size, tokens_per_global_batch=tokens,
                         seed=cfg.seed, shuffle=reshuffles(dataset_config),
                         min_samples=cfg.parallel.data_parallel_size)


@dataclass
class GlobalBatches:
    """Random access to the global batches of a run started at ``start_iteration``."""

    dataset: SampleDataset
    sampler: GlobalBatchSampler
    start_iteration: int

    @classmethod
    def create(cls, cfg: DynaPipeTrainingConfig, consumed_samples: int, start_iteration: int) -> "GlobalBatches":
        dataset = dataset_config(cfg).build()
        vocab = getattr(dataset, "vocab_size", 0)
        if vocab and vocab > cfg.model.vocab_size:
            raise DynaPipeError(f"the data's vocabulary has {vocab} ids but --vocab-size is {cfg.model.vocab_size}; "
                                f"raise --vocab-size to at least {vocab}.")
        sampler = GlobalBatchSampler(dataset.sample_tokens(), sampler_config(cfg), consumed_samples)
        return cls(dataset, sampler, start_iteration)

    def batch(self, iteration: int) -> GlobalBatch:
        """Dataset indices of global batch ``iteration`` (and its consumed-samples bounds)."""
        return self.sampler.batch(iteration - self.start_iteration)

    def samples(self, batch: GlobalBatch) -> list[Sample]:
        """The samples (token ids) of a global batch, in stream order."""
        return [self.dataset[int(i)] for i in batch.indices]

    def lengths(self, batch: GlobalBatch) -> np.ndarray:
        """Tokens of every sample of a global batch (input + target)."""
        return self.dataset.planner_lengths(batch.indices)

    @property
    def num_truncated(self) -> int:
        return self.dataset.num_truncated
