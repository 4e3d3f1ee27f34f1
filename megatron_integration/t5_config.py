"""The configuration of a T5 (encoder-decoder) training run: plain dataclasses, no torch.

A T5 run is a :class:`~megatron_integration.train_config.DynaPipeTrainingConfig` (``base``:
optimizer, data, parallel layout, DynaPipe settings, the shared model shape with
``seq_length`` = the encoder's and ``num_layers`` = encoder + decoder layers) plus what
only an encoder-decoder has. Built by :func:`megatron_integration.t5_arguments.t5_config_from_args`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from megatron_integration.t5_span_data import SpanCorruptionConfig
from megatron_integration.train_config import DynaPipeTrainingConfig


@dataclass(frozen=True)
class T5TrainingConfig:
    """A validated T5 run. Lengths in tokens.

    ``encoder_layers`` / ``decoder_layers``: Megatron's ``--encoder-num-layers`` /
    ``--decoder-num-layers``; ``decoder_seq_length``: ``--decoder-seq-length`` (the
    encoder's is ``base.model.seq_length``); ``span_corruption``: the indexed ``--data-path``
    datasets Megatron's T5 dataset span-corrupts (None: JSONL pairs or ``--mock-data``).
    """

    base: DynaPipeTrainingConfig
    encoder_layers: int
    decoder_layers: int
    decoder_seq_length: int
    span_corruption: Optional[SpanCorruptionConfig] = None
    # Layers per pipeline stage (--dynapipe-placement): the split itself, or None for
    # Megatron's even split when placement_flag is "even" and for "auto" until chosen.
    placement: Optional[object] = None
    placement_flag: str = "even"

    def stage_placement(self):
        """The :class:`~dynapipe.cost.placement.StagePlacement` the stages build."""
        from dynapipe.cost.placement import StagePlacement
        from dynapipe.errors import DynaPipeError

        if self.placement is not None:
            return self.placement
        if self.placement_flag == "auto":
            raise DynaPipeError("--dynapipe-placement auto is chosen at start-up "
                                "(megatron_integration.t5_placement.resolve_t5_placement); it was not chosen yet.")
        return StagePlacement.even(self.planner_model(), self.base.parallel.pipeline_model_parallel_size)

    @property
    def encoder_seq_length(self) -> int:
        return self.base.model.seq_length

    @property
    def planner_seq_length(self) -> tuple[int, int]:
        """The (input, target) length limits (tokens) DynaPipe's planner applies:
        ``--encoder-seq-length`` and ``--decoder-seq-length``, as the data cuts each side."""
        return self.encoder_seq_length, self.decoder_seq_length

    @property
    def method(self) -> str:
        """``dynapipe``, or the fixed-shape baseline ``padding`` / ``packing``."""
        return self.base.method

    def planner_model(self):
        """The planner's :class:`dynapipe.config.ModelConfig` (``arch: t5``) of this model."""
        from dynapipe.config import ModelConfig

        m = self.base.model
        return ModelConfig(name="megatron-t5", arch="t5", num_layers=self.encoder_layers + self.decoder_layers,
                           encoder_layers=self.encoder_layers, decoder_layers=self.decoder_layers,
                           hidden_size=m.hidden_size, num_attention_heads=m.num_attention_heads,
                           ffn_hidden_size=m.ffn_hidden_size, vocab_size=m.vocab_size,
                           max_seq_length=max(m.seq_length, self.decoder_seq_length), dtype=m.dtype,
                           max_position_embeddings=m.max_position_embeddings,
                           tie_embeddings=m.tie_embeddings, kv_channels=m.kv_channels,
                           hidden_dropout=m.hidden_dropout, attention_dropout=m.attention_dropout,
                           position_embedding_type=m.position_embedding_type,
                           attention_softmax_in_fp32=m.softmax_in_fp32,
                           fused_attention=False).validate("megatron-t5")  # local layers: unfused

    def dataset_config(self, split: str = "train"):
        """The :class:`~dynapipe.data.config.DatasetConfig` of one split (``train``, ``valid``,
        ``test``) as (input, target) pairs, None when the run has no such split; for
        span-corruption data (Megatron's splits of ``--split``) the opened
        :class:`~megatron_integration.t5_span_data.SpanCorruptionDataset` (megatron-core builds it
        collectively: call on every rank)."""
        if self.span_corruption is not None:
            from dataclasses import replace

            from megatron_integration.t5_data_args import span_split_samples
            from megatron_integration.t5_span_data import SpanCorruptionDataset

            index = ("train", "valid", "test").index(split)
            if index and (not self.span_corruption.has_split(index) or self.base.evaluation.eval_iters <= 0):
                return None
            # Training draws the config's own count (--train-samples itself where given).
            samples = span_split_samples(self.base, split) if index else self.span_corruption.num_samples
            return SpanCorruptionDataset(replace(self.span_corruption, split_index=index, num_samples=samples))
        from dataclasses import replace

        from megatron_integration.data import dataset_config

        config = dataset_config(self.base, split)
        return None if config is None else replace(config, encoder_decoder=True,
                                                   dec_seq_length=self.decoder_seq_length)
