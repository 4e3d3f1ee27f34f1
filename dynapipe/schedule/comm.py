"""What crosses a pipeline-stage boundary, and how long it takes.

The activation message from stage ``s`` to ``s + 1`` (and the gradient message back,
which has the same tensors) follows Megatron's layout ``[seqlen, mbs, hidden]`` in the
model dtype. Encoder-decoder models: encoder stages pass the hidden states; from the
first stage that holds decoder layers on, the message carries the decoder hidden
states ``[dec_seqlen, mbs, hidden]`` and the encoder output ``[seqlen, mbs, hidden]``
that every decoder layer attends to.
"""
from __future__ import annotations

from typing import Optional, Sequence

from dynapipe.config import ClusterConfig, LinkConfig, ModelConfig
from dynapipe.cost.base import StageLayout


def message_shapes(model: ModelConfig, layouts: Sequence[StageLayout], src_stage: int, mbs: int,
                   seqlen: int, dec_seqlen: int = 0) -> list[tuple[str, tuple[int, ...]]]:
    """``(name, shape)`` of every tensor stage ``src_stage`` sends to ``src_stage + 1``
    for one micro-batch, in message order. The gradient message back has the same list."""
    h = model.hidden_size
    if not model.is_encoder_decoder:
        return [("hidden_states", (seqlen, mbs, h))]
    if layouts[src_stage].decoder_layers == 0:
        # Still inside the encoder: the next stage either continues it or starts the decoder.
        next_is_decoder = layouts[src_stage + 1].encoder_layers == 0
        return [("encoder_output" if next_is_decoder else "hidden_states", (seqlen, mbs, h))]
    return [("hidden_states", (dec_seqlen, mbs, h)), ("encoder_output", (seqlen, mbs, h))]


def message_bytes(model: ModelConfig, layouts: Sequence[StageLayout], src_stage: int, mbs,
                  seqlen, dec_seqlen=0, shards: int = 1):
    """Bytes one TP rank sends across boundary ``src_stage`` as the activation (or gradient)
    message (``mbs``/``seqlen``/``dec_seqlen`` may be numpy arrays: one value per micro-batch).
    ``shards``: the TP size under sequence parallelism, where each TP rank sends its
    ``seqlen / shards`` slice of every tensor (see :func:`sequence_shards_of`)."""
    total = 0
    for _, shape in message_shapes(model, layouts, src_stage, mbs, seqlen, dec_seqlen):
        n = 1
        for d in shape:
            n *= d
        total += n
    return total * model.dtype_bytes / shards


def sequence_shards_of(cost_model) -> int:
    """How many slices a message's sequence dimension is split into over a stage's TP ranks:
    the TP size under sequence parallelism, else 1 (every TP rank sends the whole tensor)."""
    tp = getattr(cost_model, "tp", None)
    return tp.size if tp is not None and tp.sequence_parallel else 1


def stage_global_rank(stage: int, *, dp: int = 1, tp: int = 1, replica: int = 0) -> int:
    """Global rank of a stage's first device in Megatron's default layout (tensor
    parallel innermost, then data parallel, then pipeline)."""
    return stage * dp * tp + replica * tp


def boundary_links(cluster: Optional[ClusterConfig], num_stages: int, *, dp: int = 1,
                   tp: int = 1, replica: int = 0) -> list[Optional[LinkConfig]]:
    """The link each boundary ``s -> s + 1`` of data-parallel replica ``replica`` uses (``None``
    everywhere without a cluster). Replicas differ where ``dp x tp`` ranks do not fill whole
    nodes: one replica's boundary can stay inside a node while another's crosses."""
    if cluster is None:
        return [None] * max(num_stages - 1, 0)
    return [cluster.link(stage_global_rank(s, dp=dp, tp=tp, replica=replica),
                         stage_global_rank(s + 1, dp=dp, tp=tp, replica=replica)) for s in range(num_stages - 1)]
