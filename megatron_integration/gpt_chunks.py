"""One pipeline rank's model chunks of megatron-core's ``GPTModel`` (interleaved pipeline).

With ``--num-virtual-stages-per-pipeline-rank V`` (or ``--num-layers-per-virtual-pipeline-stage``)
pipeline rank ``p`` of ``P`` builds ``V`` chunks: chunk ``c`` is virtual stage ``c * P + p``
and holds that stage's layers at their global indices (megatron-core's ``vp_stage``), so the
deterministic initialisation by global name gives the same weights as any other split. The
embedding is in chunk 0 of rank 0 and the output layer in chunk ``V - 1`` of the last rank;
megatron-core ties and all-reduces them as it does for plain pipelines.

Each chunk trains through its own DDP (:attr:`~megatron_integration.model.Stage.modules`), as
in Megatron-LM: megatron-core's interleaved 1F1B takes that list, the optimizer and
``finalize_model_grads`` too. :class:`GPTChunks` is the rank's chunks as one module, for what
treats a rank's model whole (parameter counts, the NaN check, train/eval switches) and for
checkpoints: ``torch_dist`` ones hold every chunk's tensors under megatron-core ``GPTModel``'s
global keys (layer ``i`` of the model is ``decoder.layers.i`` wherever it was built), so a
checkpoint saved interleaved loads on the plain pipeline and the other way round, as in
Megatron-LM; the per-rank ``dynapipe`` format holds the chunks by their local names and loads
at the same layout only.
"""
from __future__ import annotations

from typing import Optional

import torch


class GPTChunks(torch.nn.Module):
    """This rank's ``GPTModel`` chunks, in chunk order (``chunks[c]`` is virtual stage
    ``c * P + p``)."""

    def __init__(self, gpts: list):
        super().__init__()
        self.chunks = torch.nn.ModuleList(gpts)
        self.config = gpts[0].config  # the stage's TransformerConfig, which every chunk shares

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: Optional[dict] = None):
        """Every chunk's megatron-core sharded state dict under ``chunks.<c>.`` (the keys of this
        module's ``state_dict``); the sharded tensors keep megatron-core's global keys."""
        assert not sharded_offsets, "a rank's GPT chunks are the top-level module"
        state = {}
        for c, gpt in enumerate(self.chunks):
            for key, sharded in gpt.sharded_state_dict(prefix="", metadata=metadata).items():
                state[f"{prefix}chunks.{c}.{key}"] = sharded
        return state
