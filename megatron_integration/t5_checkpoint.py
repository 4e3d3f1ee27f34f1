"""T5 stages in both checkpoint formats, Megatron's ``torch_dist`` (the default) included.

Saving and loading go through :mod:`megatron_integration.checkpoint_formats` as for GPT
(``dist_checkpointing`` with per-file SHA-256 sidecars, one-line errors, Megatron-LM's log
lines); this module supplies what is T5's own:

* :func:`stage_sharded_state_dict`: a stage's sharded state dict under the keys megatron-core's
  ``T5Model`` gives the same parameters (``embedding.word_embeddings.weight``,
  ``encoder.layers.<name>`` stacked over the encoder's layers with each layer at its global
  index, the same for the decoder, ``encoder.final_layernorm``, ``decoder.final_layernorm``,
  ``lm_head.output_layer.bias``, and ``T5Model``'s two aliases ``position_embeddings.weight`` and
  ``output_layer.*``). Layer indices are global, so a checkpoint saved with one stage placement
  (``--dynapipe-placement``) or pipeline size loads at any other.
* The word and position embeddings exist on stage 0 and again on the first decoder stage, and
  the tied output layer repeats the word embedding on the last stage: the copies are marked as
  replicas of stage 0's tensors (Megatron's replica id ``(1, 0, dp)``, as ``LanguageModule`` marks
  a tied output layer), so each is written once and loaded into every copy, optimizer state too.
* :func:`t5_megatron_args`: the ``args`` record under Megatron-LM's T5 names (``num_layers`` is
  the encoder's, as in Megatron-LM), with the stage placement the checkpoint was saved at;
  :func:`t5_model_values`: what a checkpoint's ``args`` must match before any tensor is read.

The ``dynapipe`` format keeps per-stage files, so it records the placement and refuses a
resume at another one (:func:`~megatron_integration.t5_placement.check_checkpoint_placement`).
"""
from __future__ import annotations

from typing import Optional

# Entries megatron-core's T5Model has twice (its ``position_embeddings`` and ``output_layer``
# attributes alias submodules of ``embedding`` and ``lm_head``); a stage has each module once.
ALIAS_PREFIXES = ("position_embeddings.", "output_layer.")


def _copy_replica(sharded) -> None:
    """Mark ``sharded`` (a ShardedTensor or ShardedObject) as a copy of another stage's main replica."""
    rid = sharded.replica_id
    sharded.replica_id = (1,) + tuple(rid[1:]) if isinstance(rid, tuple) else 1


def _default(module, prefix: str, metadata: Optional[dict]) -> dict:
    """megatron-core's ``sharded_state_dict_default`` with the tensor-parallel group given: for a
    plain torch module it otherwise numbers every TP rank's copy as the main replica (its groups
    default only when neither group is given, and the data-parallel one always is), and
    ``dist_checkpointing`` refuses the save."""
    import inspect

    from megatron.core import parallel_state as ps
    from megatron.core.transformer.utils import sharded_state_dict_default

    kwargs = {}
    if "tp_group" in inspect.signature(sharded_state_dict_default).parameters:
        kwargs["tp_group"] = ps.get_tensor_model_parallel_group()
    return sharded_state_dict_default(module, prefix, (), metadata, **kwargs)


def _block_sharded_state_dict(block, prefix: str, start: int, total: int, per_layer: bool,
                              metadata: Optional[dict]) -> dict:
    """A ``TransformerBlock``'s entries with its layers at global indices ``start, start + 1, ...``
    of a block of ``total`` layers, as megatron-core's ``TransformerBlock`` writes an unsplit block:
    stacked tensors with the layer as the first axis, or one key per layer when ``per_layer``
    (``non_homogeneous_layers`` / ``singleton_local_shards``)."""
    from megatron.core.dist_checkpointing.utils import replace_prefix_for_sharding

    state = {}
    for index, layer in enumerate(block.layers):
        local = f"{prefix}layers.{index}."
        if per_layer:
            target, offsets = f"{prefix}layers.{start + index}.", ()
        else:
            target, offsets = f"{prefix}layers.", ((0, start + index, total),)
        part = layer.sharded_state_dict(local, offsets, metadata)
        replace_prefix_for_sharding(part, local, target)
        state.update(part)
    for name, module in block.named_children():
        if module is not block.layers:
            state.update(_default(module, f"{prefix}{name}.", metadata))
    return state


def stage_sharded_state_dict(stage, prefix: str = "", metadata: Optional[dict] = None) -> dict:
    """The sharded state dict of a :class:`~megatron_integration.t5_model.T5Stage`: local state-dict
    keys mapped to megatron-core ``T5Model``'s sharded keys, in ``T5Model``'s order (which also
    decides the keys of the optimizer state of aliased parameters)."""
    from megatron.core import parallel_state as ps
    from megatron.core.utils import make_tp_sharded_tensor_for_checkpoint

    metadata = metadata or {}
    place = stage.place
    per_layer = bool(metadata.get("non_homogeneous_layers") or metadata.get("singleton_local_shards"))
    state = {}
    if stage.embedding is not None:
        part = _default(stage.embedding, f"{prefix}embedding.", metadata)
        part.update(_default(stage.embedding.position_embeddings, f"{prefix}position_embeddings.", metadata))
        if not place.embeds_encoder:  # the first decoder stage's copy of stage 0's embeddings
            for sharded in part.values():
                _copy_replica(sharded)
        state.update(part)
    blocks = (("encoder", stage.encoder, place.enc_start, place.encoder_total),
              ("decoder", stage.decoder, place.dec_start, place.decoder_total))
    for name, block, start, total in blocks:
        if block is not None:
            state.update(_block_sharded_state_dict(block, f"{prefix}{name}.", start, total, per_layer, metadata))
    if stage.lm_head is not None:
        head = _default(stage.lm_head, f"{prefix}lm_head.", metadata)
        weight_key = f"{prefix}lm_head.output_layer.weight"
        if weight_key in head and stage.share_embeddings_and_output_weights:
            # The last stage's copy of the word embedding: stored once, under stage 0's key.
            dp_rank = ps.get_data_parallel_rank(with_context_parallel=True)
            head[weight_key] = make_tp_sharded_tensor_for_checkpoint(
                tensor=stage.output_layer.weight, key=f"{prefix}embedding.word_embeddings.weight",
                replica_id=(1, 0, dp_rank), allow_shape_mismatch=True)
        elif weight_key in head:
            head[weight_key].allow_shape_mismatch = True  # padded vocabulary, as LanguageModule allows
        state.update(head)
        alias = _default(stage.output_layer, f"{prefix}output_layer.", metadata)
        if stage.share_embeddings_and_output_weights:  # T5Model's output layer has no weight of its own
            alias.pop(f"{prefix}output_layer.weight", None)
        state.update(alias)
    return state


def without_aliases(state_dict: dict) -> dict:
    """``state_dict`` without the alias entries :func:`stage_sharded_state_dict` adds (loaded twice,
    held once by the stage)."""
    return {k: v for k, v in state_dict.items() if not k.startswith(ALIAS_PREFIXES)}


def t5_megatron_args(cfg) -> dict:
    """What a T5 checkpoint's ``args`` say beyond GPT's, under Megatron-LM's names (``cfg``: a
    :class:`~megatron_integration.t5_config.T5TrainingConfig`): ``num_layers`` is the encoder's and
    ``seq_length`` the encoder's, as in Megatron-LM; ``dynapipe_placement`` the stage split saved at."""
    return {"num_layers": cfg.encoder_layers, "encoder_num_layers": cfg.encoder_layers,
            "decoder_num_layers": cfg.decoder_layers, "seq_length": cfg.encoder_seq_length,
            "encoder_seq_length": cfg.encoder_seq_length, "decoder_seq_length": cfg.decoder_seq_length,
            "dynapipe_placement": str(cfg.stage_placement())}


def t5_model_values(cfg) -> dict:
    """Megatron-LM argument name -> this T5's value, compared with a checkpoint's ``args`` before
    any tensor is read (an argument the checkpoint lacks is not compared)."""
    m = cfg.base.model
    return {"encoder_num_layers": cfg.encoder_layers, "decoder_num_layers": cfg.decoder_layers,
            "num_layers": cfg.encoder_layers, "hidden_size": m.hidden_size,
            "num_attention_heads": m.num_attention_heads, "ffn_hidden_size": m.ffn_hidden_size,
            "kv_channels": m.kv_channels, "padded_vocab_size": m.vocab_size,
            "add_position_embedding": m.position_embedding_type == "learned_absolute",
            # The learned position table's rows (the longer of the two lengths by default).
            "max_position_embeddings": m.max_position_embeddings,
            "untie_embeddings_and_output_weights": not m.tie_embeddings}
