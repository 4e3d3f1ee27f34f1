"""This rank's pipeline stage of a T5 (encoder-decoder) model, built from megatron-core blocks.

megatron-core's ``T5Model`` no longer pipelines (its schedules dropped encoder-decoder
models), so a stage is assembled here from the same building blocks:

* layers from megatron-core's T5 layer specs (``encoder_model_with_local_spec`` /
  ``decoder_model_with_local_spec``: pre-norm layers, bidirectional encoder self-attention,
  causal decoder self-attention, cross-attention to the encoder output), in
  ``TransformerBlock``s given an explicit block spec with a final ``LayerNorm``. The
  ``get_t5_*_with_local_block_spec`` helpers put Transformer Engine's ``TENorm`` there,
  which is ``None`` without Transformer Engine, so their blocks silently lose the final
  norms; the block spec is built here instead.
* the stage's layers come from the run's stage placement (``--dynapipe-placement``:
  Megatron's even split :func:`dynapipe.cost.base.stage_layouts` by default, or the
  planner's choice), the split the planner prices and the plan compiler ships messages
  for: encoder layers first, then decoder layers, a stage may hold the end of the
  encoder and the start of the decoder.
* one ``LanguageModelEmbedding`` (word + learned absolute positions, shared by encoder
  and decoder as in megatron-core's ``T5Model``) on stage 0 and on the first stage holding
  decoder layers; the output layer is megatron-core's ``T5LMHead`` (tied to the word
  embedding, with its bias; ``--untie-embeddings-and-output-weights`` is refused).
  :class:`EmbeddingSync` all-reduces the gradients of the copies, so they stay equal.
* initialisation is deterministic by global parameter name, as for GPT: every pipeline
  split starts from the same weights for a given ``--seed``.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Optional

import torch
import torch.distributed as dist

from megatron_integration.initialize import RankInfo
from megatron_integration.model import set_recompute_level, transformer_config
from megatron_integration.param_init import init_parameter_, tp_coordinates
from megatron_integration.t5_config import T5TrainingConfig
from megatron_integration.masked_softmax import use_additive_masks


@dataclass(frozen=True)
class T5StagePlace:
    """What one pipeline stage holds: encoder layers ``[enc_start, enc_start + enc_layers)``,
    decoder layers ``[dec_start, dec_start + dec_layers)`` (global indices), and its roles."""

    stage: int
    num_stages: int
    enc_start: int
    enc_layers: int
    dec_start: int
    dec_layers: int
    encoder_total: int
    decoder_total: int

    @property
    def embeds_encoder(self) -> bool:
        return self.stage == 0

    @property
    def embeds_decoder(self) -> bool:
        """The first stage holding decoder layers embeds the decoder tokens."""
        return self.dec_layers > 0 and self.dec_start == 0

    @property
    def ends_encoder(self) -> bool:
        return self.enc_layers > 0 and self.enc_start + self.enc_layers == self.encoder_total

    @property
    def is_last(self) -> bool:
        return self.stage == self.num_stages - 1


def stage_places(model_config, num_stages: int, placement=None) -> list[T5StagePlace]:
    """Every stage's place: the layers of ``placement`` (a
    :class:`~dynapipe.cost.placement.StagePlacement` of ``num_stages`` stages, validated
    against ``model_config``), by default the planner's even
    :func:`~dynapipe.cost.base.stage_layouts`. An interleaved placement gives one place per
    virtual stage (``chunks * num_stages`` of them; virtual stage ``k`` runs as chunk
    ``k // num_stages`` of rank ``k % num_stages``)."""
    from dynapipe.cost.base import stage_layouts
    from dynapipe.errors import DynaPipeError

    if placement is not None and placement.num_stages != num_stages:
        raise DynaPipeError(f"stage placement {placement} has {placement.num_stages} stages; the pipeline has "
                            f"{num_stages} (--pipeline-model-parallel-size).")
    if placement is None:
        layouts = stage_layouts(model_config, num_stages)
    else:
        placement = placement.validate(model_config)
        layouts = placement.virtual_layouts() if placement.chunks > 1 else placement.layouts()
    places, enc, dec = [], 0, 0
    for k, layout in enumerate(layouts):
        places.append(T5StagePlace(k, len(layouts), enc, layout.encoder_layers, dec, layout.decoder_layers,
                                   model_config.encoder_layers, model_config.decoder_layers))
        enc += layout.encoder_layers
        dec += layout.decoder_layers
    return places


def _block_spec(layer_spec, count: int, sequence_parallel: bool = False):
    """A block of ``count`` layers ending in a LayerNorm (the local spec's final norm). Under
    sequence parallelism its torch norms become ones whose parameters are marked
    ``sequence_parallel`` (see :mod:`megatron_integration.tensor_parallel`), so their gradients,
    computed on sequence shards, are summed over the TP group."""
    from megatron.core.transformer.torch_norm import WrappedTorchNorm
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

    if sequence_parallel:
        from megatron_integration.tensor_parallel import SequenceParallelTorchNorm, _replace_torch_norms

        return TransformerBlockSubmodules(layer_specs=[_replace_torch_norms(layer_spec)] * count,
                                          layer_norm=SequenceParallelTorchNorm)
    return TransformerBlockSubmodules(layer_specs=[layer_spec] * count, layer_norm=WrappedTorchNorm)


def _layer_specs():
    """megatron-core's local T5 encoder and decoder layer specs. Their attention takes the
    masks the handlers build (per-sample isolation: ``[mbs, 1, sq, sk]``, or on a CPU forms that
    broadcast to it); Transformer Engine's T5 specs take padding masks in another form and are
    not used."""
    from megatron.core.models.T5 import t5_spec

    return t5_spec.encoder_model_with_local_spec(), t5_spec.decoder_model_with_local_spec(), "local"


class T5Stage(torch.nn.Module):
    """One pipeline stage of a T5: embedding, encoder layers, decoder layers, LM head, as its
    :class:`T5StagePlace` says. ``forward`` maps this stage's inputs to its outgoing message
    (``hidden_states`` / ``encoder_output``) or, on the last stage, the per-token loss."""

    def __init__(self, config, place: T5StagePlace, vocab_size: int, max_positions: int, tie_embeddings: bool,
                 per_sample_attention: bool = False):
        super().__init__()
        from megatron.core.models.T5.t5_model import T5LMHead
        from megatron.core.models.common.embeddings.language_model_embedding import LanguageModelEmbedding
        from megatron.core.transformer.transformer_block import TransformerBlock

        self.config = config
        self.place = place
        self.share_embeddings_and_output_weights = tie_embeddings
        enc_spec, dec_spec, self.spec_name = _layer_specs()
        if per_sample_attention:  # packed samples' attention computed alone (segment_attention.py)
            from megatron_integration.segment_attention import with_segmented_attention

            enc_spec, dec_spec = with_segmented_attention(enc_spec), with_segmented_attention(dec_spec, cross=True)
        self.pre_process = place.embeds_encoder or place.embeds_decoder
        self.post_process = place.is_last
        self.embedding = None
        if self.pre_process:
            self.embedding = LanguageModelEmbedding(config=config, vocab_size=vocab_size,
                                                    max_sequence_length=max_positions,
                                                    position_embedding_type="learned_absolute")
        # pre_process=True: the block takes its input as an argument (not set_input_tensor).
        sp = bool(config.sequence_parallel)
        self.encoder = (TransformerBlock(config=config, spec=_block_spec(enc_spec, place.enc_layers, sp),
                                         pre_process=True, post_process=place.ends_encoder)
                        if place.enc_layers else None)
        self.decoder = (TransformerBlock(config=config, spec=_block_spec(dec_spec, place.dec_layers, sp),
                                         pre_process=True, post_process=place.is_last)
                        if place.dec_layers else None)
        self.lm_head = None
        if place.is_last:
            self.lm_head = T5LMHead(config, parallel_output=True, vocab_size=vocab_size,
                                    pre_process=self.embedding is not None, share_embeddings_and_output_weights=tie_embeddings)
        self._mark_copies()

    @property
    def output_layer(self):
        return None if self.lm_head is None else self.lm_head.output_layer

    def _mark_copies(self) -> None:
        """Flag the stage's duplicates of parameters stage 0 owns (the decoder stage's embedding,
        the tied output weight) as ``shared``, so megatron's gradient-norm counts them once."""
        copies = []
        if self.embedding is not None and self.place.stage != 0:
            copies += [self.embedding.word_embeddings.weight, self.embedding.position_embeddings.weight]
        if self.lm_head is not None and self.share_embeddings_and_output_weights and self.embedding is None:
            copies.append(self.output_layer.weight)
        for p in copies:
            p.shared = True

    def shared_embedding_or_output_weight(self) -> Optional[torch.Tensor]:
        """This stage's copy of the word embedding (None when it holds none)."""
        if self.embedding is not None:
            return self.embedding.word_embeddings.weight
        if self.lm_head is not None and self.share_embeddings_and_output_weights:
            return self.output_layer.weight
        return None

    def set_input_tensor(self, input_tensor) -> None:  # megatron's hook; inputs arrive as arguments here
        pass

    # torch_dist checkpoints: megatron-core T5Model's keys, global layer indices (t5_checkpoint).
    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: Optional[dict] = None):
        """This stage's sharded state dict, keyed as megatron-core's ``T5Model`` keys the same tensors."""
        from megatron_integration.t5_checkpoint import stage_sharded_state_dict

        assert not sharded_offsets, "a T5 stage is the top-level module"
        return stage_sharded_state_dict(self, prefix, metadata)

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        """``torch.nn.Module.load_state_dict``, skipping the alias entries of ``T5Model``'s keys."""
        from megatron_integration.t5_checkpoint import without_aliases

        return super().load_state_dict(without_aliases(state_dict), strict=strict, assign=assign)

    def forward(self, enc_tokens=None, enc_positions=None, dec_tokens=None, dec_positions=None,
                hidden_states=None, encoder_output=None, enc_attn_mask=None, dec_attn_mask=None,
                cross_attn_mask=None, labels=None):
        """Run this stage. Returns ``{"hidden_states": ...}`` inside the encoder, the encoder's
        output (``{"encoder_output": ...}``) at its end when no decoder layer follows here, or
        ``{"hidden_states": decoder states, "encoder_output": ...}`` on decoder stages; the
        last stage returns the per-token loss ``[mbs, dec_seqlen]`` (float32)."""
        place = self.place
        if self.encoder is not None:
            x = self.embedding(input_ids=enc_tokens, position_ids=enc_positions) if place.embeds_encoder \
                else hidden_states
            x = self.encoder(hidden_states=x, attention_mask=enc_attn_mask)
            if self.decoder is None:
                return {"encoder_output" if place.ends_encoder else "hidden_states": x}
            encoder_output = x
            # The local encoder output is also sent on: a copy, so that releasing the sent
            # data cannot touch what the cross-attention saved for its backward.
            sent_encoder_output = x.clone()
            y = None
        else:
            sent_encoder_output = encoder_output
            y = None if place.embeds_decoder else hidden_states
        if place.embeds_decoder:
            y = self.embedding(input_ids=dec_tokens, position_ids=dec_positions)
        y = self.decoder(hidden_states=y, attention_mask=dec_attn_mask, context=encoder_output,
                         context_mask=cross_attn_mask)
        if not place.is_last:
            return {"hidden_states": y, "encoder_output": sent_encoder_output}
        from megatron.core import tensor_parallel

        weight = self.shared_embedding_or_output_weight() if self.share_embeddings_and_output_weights else None
        logits = self.lm_head(y, word_embeddings_weight=weight)  # [s, b, vocab]
        loss = tensor_parallel.vocab_parallel_cross_entropy(logits.float(), labels.transpose(0, 1).contiguous())
        return loss.transpose(0, 1).contiguous()


def t5_global_name(place: T5StagePlace, local_name: str, tied: bool) -> str:
    """Name of a parameter in the unsplit T5: layer indices made global, every copy of the
    word embedding (decoder stage's, tied output layer) named after stage 0's."""
    if local_name.startswith("lm_head."):
        local_name = local_name[len("lm_head."):]
    if tied and local_name == "output_layer.weight":
        return "embedding.word_embeddings.weight"
    for block, start in (("encoder", place.enc_start), ("decoder", place.dec_start)):
        prefix = f"{block}.layers."
        if local_name.startswith(prefix):
            index, rest = local_name[len(prefix):].split(".", 1)
            return f"{prefix}{start + int(index)}.{rest}"
    return local_name


@torch.no_grad()
def t5_deterministic_init_(stage: T5Stage, std: float, seed: int, tp: Optional[tuple[int, int]] = None) -> None:
    """Megatron's distributions (normal(0, std), output projections scaled by
    ``1/sqrt(2 x layers of their block)``, zero biases, unit norms), each parameter drawn from
    a generator seeded by (seed, global name): any pipeline split holds the same weights, and
    a tensor-parallel shard is the slice of the unsplit weight megatron-core gives its rank
    (:func:`~megatron_integration.param_init.init_parameter_`). ``tp``: (rank, size) of the
    tensor-parallel group; megatron's parallel state when omitted."""
    place, tied = stage.place, stage.share_embeddings_and_output_weights
    tp_rank, tp_size = tp_coordinates() if tp is None else tp
    for local_name, param in stage.named_parameters():
        name = t5_global_name(place, local_name, tied)
        layers = place.encoder_total if name.startswith("encoder.") else place.decoder_total
        init_parameter_(param, name, std, std / math.sqrt(2.0 * layers), seed, tp_rank, tp_size)


def build_t5_stage(cfg: T5TrainingConfig, info: RankInfo) -> torch.nn.Module:
    """This rank's unwrapped :class:`T5Stage`, deterministically initialised; with an
    interleaved placement a :class:`~megatron_integration.t5_chunks.T5Chunks` holding one
    stage per chunk."""
    base = cfg.base
    placement = cfg.stage_placement()
    places = stage_places(cfg.planner_model(), info.pp_size, placement)
    mine = places[info.pp_rank::info.pp_size]  # virtual stages rank, rank + P, ... (one without chunks)
    # Each block gets the explicit list of its layers: the config describes one unsplit
    # block (no pipeline offsets), and DynaPipe sets the recompute level per micro-batch.
    fixed = None if base.dynapipe.enabled else base.recompute
    model = replace(base.model, num_layers=cfg.encoder_layers + cfg.decoder_layers)
    parallel = replace(base.parallel, pipeline_model_parallel_size=1)
    tconfig = transformer_config(model, parallel, cuda=info.device.type == "cuda", recompute=fixed)
    stages = []
    per_sample = base.per_sample_attention
    for place in mine:
        stage = T5Stage(tconfig, place, model.vocab_size, model.max_position_embeddings, model.tie_embeddings,
                        per_sample_attention=per_sample)
        stage.to(info.device)
        t5_deterministic_init_(stage, model.init_method_std, base.seed)
        use_additive_masks(stage, info.device)  # the same probabilities, at half the cost of the CPU's masked softmax
        stages.append(stage)
    if len(stages) == 1:
        return stages[0]
    from megatron_integration.t5_chunks import T5Chunks

    return T5Chunks(stages, info.pp_rank, info.pp_size)


def set_t5_recompute_level(stage: T5Stage, config, level: str) -> None:
    """:func:`~megatron_integration.model.set_recompute_level` for both blocks of a T5 stage
    (``selective`` checkpoints self- and cross-attention cores)."""
    set_recompute_level(stage, config, level)
    for block in (stage.encoder, stage.decoder):
        for layer in getattr(block, "layers", ()):
            for name in ("self_attention", "cross_attention"):
                attention = getattr(layer, name, None)
                if attention is not None and hasattr(attention, "checkpoint_core_attention"):
                    attention.checkpoint_core_attention = level == "selective"


# -- keeping the embedding copies equal -------------------------------------------------------

def _main_grad(param: torch.Tensor) -> torch.Tensor:
    """The gradient the optimizer reads: DDP's ``main_grad`` buffer view, else ``.grad``."""
    grad = getattr(param, "main_grad", None)
    return param.grad if grad is None else grad


def sum_sequence_parallel_grads(stage) -> None:
    """Sum over the tensor-parallel group the gradients computed on sequence shards: the norms'
    and the row-parallel biases' (parameters megatron-core marks ``sequence_parallel``), as
    megatron-core's ``finalize_model_grads`` does for GPT stages. ``stage``: this rank's
    :class:`T5Stage` or ``T5Chunks``; nothing to do without sequence parallelism."""
    from megatron.core import parallel_state as ps
    from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

    grads = [_main_grad(p) for p in stage.parameters() if p.requires_grad and getattr(p, "sequence_parallel", False)]
    grads = [g for g in grads if g is not None]
    if not grads or ps.get_tensor_model_parallel_world_size() == 1:
        return
    coalesced = _flatten_dense_tensors(grads)
    dist.all_reduce(coalesced, group=ps.get_tensor_model_parallel_group())
    for grad, summed in zip(grads, _unflatten_dense_tensors(coalesced, grads)):
        grad.copy_(summed)


@dataclass
class EmbeddingSync:
    """All-reduces (sums) the gradients of the word-embedding copies (stage 0, the first
    decoder stage, a tied output layer) and of the position-embedding copies (stage 0, the
    first decoder stage) within each pipeline, after the data-parallel reduction, as
    Megatron-LM's embedding groups do; identical weights and identical updates keep them equal."""

    word_group: Optional[object]
    position_group: Optional[object]

    @classmethod
    def create(cls, places: list[T5StagePlace], tied: bool, num_ranks: int) -> "EmbeddingSync":
        """Collective: every rank creates every pipeline's groups, in the same order.
        ``places``: every (virtual) stage's place; ``num_ranks``: pipeline ranks (virtual
        stage ``k`` runs on rank ``k % num_ranks``). Copies on one rank are one tensor (see
        ``T5Chunks``), so the groups join the ranks holding copies."""
        from megatron.core import parallel_state

        mine = dist.get_process_group_ranks(parallel_state.get_pipeline_model_parallel_group())
        gathered = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, list(mine))
        pipelines = sorted({tuple(r) for r in gathered})
        first_dec = next(p.stage for p in places if p.embeds_decoder)
        word_stages = sorted({s % num_ranks for s in {0, first_dec} | ({len(places) - 1} if tied else set())})
        pos_stages = sorted({s % num_ranks for s in (0, first_dec)})
        word = pos = None
        for ranks in pipelines:
            for stages, kind in ((word_stages, "word"), (pos_stages, "pos")):
                if len(stages) < 2:
                    continue
                group = dist.new_group([ranks[s] for s in stages])
                if tuple(mine) == ranks and dist.get_rank() in [ranks[s] for s in stages]:
                    if kind == "word":
                        word = group
                    else:
                        pos = group
        return cls(word, pos)

    def __call__(self, stage) -> None:
        """Sum the copies' gradients (``stage``: this rank's :class:`T5Stage` or ``T5Chunks``)."""
        if self.word_group is not None:
            weight = stage.shared_embedding_or_output_weight()
            dist.all_reduce(_main_grad(weight), group=self.word_group)
        if self.position_group is not None:
            embedding = stage.embedding if isinstance(stage, T5Stage) else stage.rank_embedding()
            dist.all_reduce(_main_grad(embedding.position_embeddings.weight), group=self.position_group)
