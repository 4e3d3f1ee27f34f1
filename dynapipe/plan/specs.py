"""The tensors a plan names: what each pipeline boundary's messages carry and what each
stage loads, by micro-batch shape (:class:`~dynapipe.plan.instructions.TensorSpec` s).

Shared by the compilers (:mod:`dynapipe.plan.compile`, :mod:`dynapipe.plan.compile_chunked`),
which look specs up once per distinct shape (:func:`key_specs`).
"""
from __future__ import annotations

import functools
from typing import Optional, Sequence

from dynapipe.config import ModelConfig
from dynapipe.cost.base import StageLayout, stage_layouts
from dynapipe.plan.instructions import TensorSpec
from dynapipe.schedule.comm import message_shapes


@functools.lru_cache(maxsize=64)
def _layouts(model: ModelConfig, num_stages: int):
    return tuple(stage_layouts(model, num_stages))


def message_specs(model: ModelConfig, src_stage: int, num_stages: int, mbs: int, seqlen: int,
                  dec_seqlen: int = 0, layouts: Optional[Sequence[StageLayout]] = None,
                  shards: int = 1) -> tuple[TensorSpec, ...]:
    """Tensors of the activation message ``src_stage -> src_stage + 1`` (and of the
    gradient message back): ``[seqlen, mbs, hidden]`` in the model dtype; for
    encoder-decoder decoder stages also the encoder output. ``layouts``: the stages'
    layers (default: Megatron's even split). ``shards``: the TP size under sequence
    parallelism, where each TP rank sends its ``seqlen / shards`` slice to the same TP
    rank of the next stage."""
    layouts = layouts or _layouts(model, num_stages)
    return tuple(TensorSpec(name, (shape[0] // shards,) + tuple(shape[1:]), model.torch_dtype_name)
                 for name, shape in message_shapes(model, layouts, src_stage, mbs, seqlen, dec_seqlen))


def input_specs(model: ModelConfig, stage: int, num_stages: int, mbs: int, seqlen: int,
                dec_seqlen: int = 0, packed: bool = False,
                layouts: Optional[Sequence[StageLayout]] = None) -> tuple[TensorSpec, ...]:
    """What ``LoadInput`` brings in on ``stage`` (empty: the stage loads nothing).

    Decoder-only: the first stage loads ``tokens`` and ``position_ids`` ``[mbs, seqlen]``
    int64 (position ids restart per packed sample); the last stage ``labels`` int64 and
    ``loss_mask`` float32 ``[mbs, seqlen]``. Encoder-decoder: the first stage loads the
    encoder ``tokens``, the first stage holding decoder layers ``dec_tokens``
    ``[mbs, dec_seqlen]``, and labels and loss mask are ``[mbs, dec_seqlen]``. Every
    encoder-decoder stage also loads ``enc_mask`` ``[mbs, seqlen]`` int32 and every stage
    holding decoder layers ``dec_mask`` ``[mbs, dec_seqlen]`` int32: the sample number of
    each token within its row (1 for an unpacked row, 1-based per sample for a packed one;
    0 on padding). Bidirectional encoder attention and cross-attention must not see
    padding, so each stage builds its masks (and embedding stages their positions) from
    these on the device; the micro-batch's padded shape then never changes a sample's result.

    ``packed`` (decoder-only rows holding several samples): every stage also loads
    ``segment_ids`` ``[mbs, seqlen]`` int32 (1-based sample index within the row, 0 on
    padding), so each stage builds its block-diagonal causal mask on the device; an
    ``s x s`` mask would cost ``seqlen`` times more to ship. ``layouts``: the stages'
    layers (default: Megatron's even split).
    """
    layouts = layouts or _layouts(model, num_stages)
    last = num_stages - 1
    specs = []
    if model.is_encoder_decoder:
        if stage == 0:
            specs.append(TensorSpec("tokens", (mbs, seqlen), "int64"))
        first_dec = next(s for s, l in enumerate(layouts) if l.decoder_layers > 0)
        if stage == first_dec:
            specs.append(TensorSpec("dec_tokens", (mbs, dec_seqlen), "int64"))
        specs.append(TensorSpec("enc_mask", (mbs, seqlen), "int32"))
        if layouts[stage].decoder_layers > 0:
            specs.append(TensorSpec("dec_mask", (mbs, dec_seqlen), "int32"))
        target = dec_seqlen
    else:
        if stage == 0:
            specs += [TensorSpec("tokens", (mbs, seqlen), "int64"), TensorSpec("position_ids", (mbs, seqlen), "int64")]
        if packed:
            specs.append(TensorSpec("segment_ids", (mbs, seqlen), "int32"))
        target = seqlen
    if stage == last:
        specs += [TensorSpec("labels", (mbs, target), "int64"), TensorSpec("loss_mask", (mbs, target), "float32")]
    return tuple(specs)


# Specs by (model, stages, shape): a global batch repeats a few thousand shapes over
# tens of thousands of micro-batches, and every rank and replica shares the tuples (the
# encoder reads each distinct one once). The model is held with its key.
_SPEC_CACHE: dict = {}


def _cached(fn, model: ModelConfig, *key):
    k = (fn, id(model), key)
    hit = _SPEC_CACHE.get(k)
    if hit is None or hit[0] is not model:
        if len(_SPEC_CACHE) > 1 << 14:
            _SPEC_CACHE.clear()
        hit = _SPEC_CACHE[k] = (model, fn(model, *key))
    return hit[1]


def key_specs(model, S, key, layouts=None, shards=1) -> tuple[tuple, tuple]:
    """Every boundary's message and every stage's loads for micro-batches of one
    ``(mbs, seqlen, dec_seqlen, packed)`` shape: one cache lookup per shape. ``layouts``
    (a tuple, or None: the even split) and ``shards`` (sequence-parallel TP size) are part
    of the key."""
    return _cached(_specs_of_key, model, S, layouts, shards, *key)


def _specs_of_key(model, S, layouts, shards, mbs, seqlen, dec, packed):
    return (tuple(message_specs(model, b, S, mbs, seqlen, dec, layouts, shards) for b in range(S - 1)),
            tuple(input_specs(model, s, S, mbs, seqlen, dec, bool(packed), layouts) for s in range(S)))
