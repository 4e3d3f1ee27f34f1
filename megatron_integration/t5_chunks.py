"""One pipeline rank's chunks of a T5 under an interleaved stage placement.

With ``--dynapipe-placement interleaved`` (or a written-out chunked split such as
``1+0,1+0|0+1,0+1``) pipeline rank ``p`` of ``P`` runs virtual stages ``p, p + P, ...``:
chunk ``c`` is virtual stage ``c * P + p``, built as its own
:class:`~megatron_integration.t5_model.T5Stage` from that virtual stage's place. The executor
tells the handlers which chunk an op belongs to (``op.chunk``).

Copies of the embeddings held twice on one rank are one module: a rank that holds the encoder's
embedding stage and the first decoder stage (rank 0 of the T5 interleaved split) embeds both
with the same ``LanguageModelEmbedding``, and a tied output layer on a rank that holds an
embedding multiplies by that embedding's weight. Gradients of one tensor add up in the
backward, so :class:`~megatron_integration.t5_model.EmbeddingSync` only joins copies on other
ranks, and the optimizer sees every parameter once. Checkpoints (both formats) hold every
chunk's layers at their global indices, as a contiguous placement's stages do.
"""
from __future__ import annotations

from typing import Optional

import torch


class T5Chunks(torch.nn.Module):
    """This rank's :class:`~megatron_integration.t5_model.T5Stage` of every chunk, in chunk order.

    ``forward(chunk=c, **inputs)`` runs chunk ``c``. ``config``, ``spec_name`` and
    ``share_embeddings_and_output_weights`` are the stages' (all alike)."""

    def __init__(self, stages: list, pp_rank: int, pp_size: int):
        super().__init__()
        self.stages = torch.nn.ModuleList(stages)
        self.pp_rank, self.pp_size = pp_rank, pp_size
        first = stages[0]
        self.config, self.spec_name = first.config, first.spec_name
        self.share_embeddings_and_output_weights = first.share_embeddings_and_output_weights
        self._share_copies()

    @property
    def places(self) -> list:
        """Each chunk's :class:`~megatron_integration.t5_model.T5StagePlace` (virtual stages)."""
        return [s.place for s in self.stages]

    def chunk(self, c: int):
        """The stage of chunk ``c``."""
        return self.stages[c]

    def rank_embedding(self):
        """The embedding module this rank holds (shared by its chunks), or None."""
        return next((s.embedding for s in self.stages if s.embedding is not None), None)

    def _share_copies(self) -> None:
        """One embedding module per rank, a tied output layer multiplying by it, and the
        ``shared`` flags (copies of rank 0's tensors, counted once by the gradient norm) set
        as the rank's single tensors require."""
        embedding = self.rank_embedding()
        if embedding is not None:
            for s in self.stages:
                if s.embedding is not None:
                    s.embedding = embedding
                if s.lm_head is not None and s.share_embeddings_and_output_weights and \
                        getattr(s.output_layer, "weight", None) is not None:
                    s.output_layer.weight = embedding.word_embeddings.weight
        for p in self.parameters():
            if hasattr(p, "shared"):
                del p.shared
        if self.pp_rank == 0:
            return  # rank 0 holds virtual stage 0: its tensors are the main copies
        copies = []
        if embedding is not None:
            copies += [embedding.word_embeddings.weight, embedding.position_embeddings.weight]
        for s in self.stages:
            weight = getattr(s.output_layer, "weight", None) if s.lm_head is not None else None
            # A last stage that also embeds the decoder multiplies by its embedding (no own weight).
            if s.share_embeddings_and_output_weights and weight is not None:
                copies.append(weight)
        for p in {id(p): p for p in copies}.values():
            p.shared = True

    def shared_embedding_or_output_weight(self) -> Optional[torch.Tensor]:
        """This rank's copy of the word embedding (None when it holds none)."""
        return next((w for w in (s.shared_embedding_or_output_weight() for s in self.stages) if w is not None), None)

    def set_input_tensor(self, input_tensor) -> None:  # megatron's hook; inputs arrive as arguments here
        pass

    def forward(self, chunk: int = 0, **inputs):
        """Run chunk ``chunk`` (see :meth:`T5Stage.forward`)."""
        return self.stages[chunk](**inputs)

    # torch_dist checkpoints: every chunk's entries under megatron-core T5Model's global keys,
    # so a checkpoint saved interleaved loads at any placement and the other way round.
    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: Optional[dict] = None):
        """Each chunk's :func:`~megatron_integration.t5_checkpoint.stage_sharded_state_dict`
        under ``stages.<c>.``; an entry a previous chunk already lists (the same global key
        of the same tensor: a shared embedding) is left out, so the main copy (rank 0, chunk
        0) keeps its entry and the optimizer state of the tensor is written with it."""
        from megatron_integration.t5_checkpoint import stage_sharded_state_dict

        assert not sharded_offsets, "a rank's T5 chunks are the top-level module"
        state, seen = {}, set()
        for c, stage in enumerate(self.stages):
            for key, sharded in stage_sharded_state_dict(stage, "", metadata).items():
                tensor = getattr(sharded, "data", None)
                mark = (getattr(sharded, "key", key), id(tensor))
                if tensor is not None and mark in seen:
                    continue
                seen.add(mark)
                state[f"{prefix}stages.{c}.{key}"] = sharded
        return state

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        """``torch.nn.Module.load_state_dict`` of the chunks: ``T5Model``'s alias entries
        skipped, and an entry of a shared tensor left out of one chunk taken from the chunk
        that holds it (see :meth:`sharded_state_dict`)."""
        from megatron_integration.t5_checkpoint import without_aliases

        given = {}
        for c in range(len(self.stages)):
            head = f"stages.{c}."
            part = {k[len(head):]: v for k, v in state_dict.items() if k.startswith(head)}
            given.update({head + k: v for k, v in without_aliases(part).items()})
        own = self.state_dict(keep_vars=True)
        by_tensor = {id(own[k]): v for k, v in given.items() if k in own}
        merged = {k: given[k] if k in given else by_tensor.get(id(t), None) for k, t in own.items()}
        merged = {k: v for k, v in merged.items() if v is not None}
        merged.update({k: v for k, v in given.items() if k not in own})  # unexpected keys stay visible
        return super().load_state_dict(merged, strict=strict, assign=assign)
