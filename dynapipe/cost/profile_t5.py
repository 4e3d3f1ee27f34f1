"""Encoder-decoder (T5) profiles: the tables, their checks and the stage cost they give.

A T5 profile is a ``dynapipe-profile`` of version 2 with ``"kind": "encoder-decoder"`` and
a third grid axis, ``dec_seqlen`` (decoder tokens); ``seqlen`` is the encoder's. Ops::

    "encoder_layer": mbs x seqlen               one encoder layer (bidirectional self-attention, MLP)
    "decoder_layer": mbs x dec_seqlen x seqlen  one decoder layer (causal self-attention,
                                                cross-attention to seqlen encoder tokens, MLP)
    "embedding":     mbs x seqlen               word + position embedding of seqlen tokens
    "output":        mbs x dec_seqlen           final norm, LM head and cross-entropy

each with ``fw_ms``, ``bw_ms``, ``stored_mib`` and ``peak_mib``. The decoder layer's
backward includes the gradient of the encoder output it attends to. A stage prices its
encoder layers at (mbs, seqlen), its decoder layers at (mbs, dec_seqlen, seqlen), the
embedding of stage 0 at the encoder tokens, the embedding of the stage holding the first
decoder layer at the decoder tokens, and the output layer at the decoder tokens. The decoder
table is interpolated as stacked (mbs, dec_seqlen) tables, one per encoder length, then
along the encoder length with the rules of the 2-D tables (linear inside, the power law of
the last two points above, the first point below). Recompute levels are derived as for GPT profiles: ``selective`` adds the
attention cores' share of the forward (self- and cross-attention, analytic FLOP split)
to the backward, drops the attention scores' share of the stored memory and adds to a
layer's peak what its recomputed cores save again (:func:`selective_rebuild_mib`); ``full``
adds a forward to the backward and stores each layer's input (and, on a decoder stage,
the encoder output).

``encoder_layer`` and ``decoder_layer`` may also hold ``bw_weight_ms`` (ms, same shape as
``bw_ms``, from 0 to it): the linear layers' weight-gradient GEMMs, timed with the backward
split as zero-bubble schedules run it (``python -m dynapipe profile --t5`` writes them).
:func:`t5_weight_ms` prices a stage's weight part from them; profiles without them leave it
to the FLOPs estimate of :mod:`dynapipe.cost.backward_split`.
"""
from __future__ import annotations

import math
from typing import Any, Mapping, Optional

import numpy as np

from dynapipe.config import ModelConfig
from dynapipe.cost.activation_bytes import cross_token_bytes, layer_token_bytes, score_bytes
from dynapipe.cost.attention_density import AttentionDensity, decoder_core_density, thin
from dynapipe.cost.base import MIB, StageCost, StageLayout
from dynapipe.cost.profile_tables import DecoderTable, OpTables, ProfileTable
from dynapipe.errors import DynaPipeError

KIND_DECODER_ONLY = "decoder-only"
KIND_ENCODER_DECODER = "encoder-decoder"
T5_OPS = ("encoder_layer", "decoder_layer", "embedding", "output")
FIELDS = ("fw_ms", "bw_ms", "stored_mib", "peak_mib")
# Optional field (GPT's layer tables and SPLIT_OPS): the weight-gradient part of bw_ms, ms.
WEIGHT_FIELD = "bw_weight_ms"
# The T5 ops whose backward is measured split (the transformer layers).
SPLIT_OPS = ("encoder_layer", "decoder_layer")
# Grid axes of each op's table, outermost first.
T5_AXES = {"encoder_layer": ("mbs", "seqlen"), "decoder_layer": ("mbs", "dec_seqlen", "seqlen"),
           "embedding": ("mbs", "seqlen"), "output": ("mbs", "dec_seqlen")}


# The largest magnitude a number of a profile (grid point, overhead, table entry) may have.
# Why: integers beyond it are not exact in float64, and past 2**63 numpy keeps them as Python
# objects, which np.isfinite refused with a TypeError instead of naming the field; no measured
# shape or time comes near it.
MAX_PROFILE_NUMBER = 2.0 ** 53


def is_number(value: Any) -> bool:
    """Whether ``value`` is a JSON number: an int or a float, not ``true``/``false`` (a bool,
    which numpy would read as 1 or 0) nor a string."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def finite_number(value) -> bool:
    """Whether ``value`` is an int or a float (not a bool) that float64 holds finite and at
    most :data:`MAX_PROFILE_NUMBER` in magnitude (an int too large for a float is not)."""
    if not is_number(value):
        return False
    try:
        f = float(value)
    except OverflowError:  # an int beyond float64's range (about 1.8e308)
        return False
    return math.isfinite(f) and abs(f) <= MAX_PROFILE_NUMBER


def profile_kind(data: Mapping[str, Any]) -> str:
    """``decoder-only`` or ``encoder-decoder``; version 1 profiles (no ``kind``) are decoder-only."""
    return str(data.get("kind", KIND_DECODER_ONLY))


def check_grid(data: Mapping[str, Any], axis: str, source: str, what: str = "") -> None:
    """Refuse a grid axis of a profile (``mbs``, ``seqlen``, ``dec_seqlen``) that is not a
    non-empty, strictly ascending list of finite positive numbers (NaN passed every comparison
    and priced NaN); ``what`` is appended to the first error (e.g. what the axis counts)."""
    grid = data.get(axis)
    if not isinstance(grid, list) or not grid or any(not finite_number(v) or v <= 0 for v in grid):
        raise DynaPipeError(f"{source}: {axis!r} must be a non-empty list of positive numbers of at most "
                            f"2**53{what}.")
    if any(b <= a for a, b in zip(grid, grid[1:])):
        raise DynaPipeError(f"{source}: {axis!r} grid {grid} must be strictly ascending.")
    if axis == "mbs" and any(float(v) != int(v) for v in grid):
        # A fractional size would be priced by interpolating between measured ones.
        raise DynaPipeError(f"{source}: 'mbs' {grid} must hold whole numbers of samples (the micro-batch sizes "
                            f"measured).")


def plain_numbers(value: Any) -> bool:
    """Whether ``value`` is a JSON number, or nested lists of them: not ``true``/``false`` nor a
    string, which numpy would read as 1, 0 or a number without complaint."""
    if isinstance(value, list):
        return all(plain_numbers(v) for v in value)
    return is_number(value)


def check_op_table(table: Mapping[str, Any], op: str, shape: tuple[int, ...], axes: tuple[str, ...],
                   source: str) -> None:
    """Refuse an op's tables (every field of :data:`FIELDS`) that are not ``shape`` (one
    entry per point of the grid ``axes``) or hold negative, non-finite or non-numeric values."""
    for field in FIELDS:
        huge = f"{source}: ops.{op}.{field} holds values over 2**53 (ms or MiB); measure the profile again."
        if field in table and not plain_numbers(table[field]):
            raise DynaPipeError(f"{source}: ops.{op}.{field} holds a value that is not a number (true, false or a "
                                f"string); measure the profile again.")
        try:
            arr = np.asarray(table[field], dtype=np.float64) if field in table else None
        except OverflowError:  # an int beyond float64's range
            raise DynaPipeError(huge) from None
        except (TypeError, ValueError):
            arr = None
        if arr is None or arr.shape != shape:
            dims = "x".join(str(n) for n in shape)
            raise DynaPipeError(f"{source}: ops.{op}.{field} must be a {dims} table ({' x '.join(axes)}).")
        if not np.all(np.isfinite(arr)) or np.any(arr < 0):
            raise DynaPipeError(f"{source}: ops.{op}.{field} holds negative or non-finite values.")
        if np.any(arr > MAX_PROFILE_NUMBER):
            raise DynaPipeError(huge)
        if field.endswith("_ms") and np.any(arr == 0):
            raise DynaPipeError(f"{source}: ops.{op}.{field} holds a time of 0 ms; a measured time is positive "
                                f"(measure the profile again).")


def check_t5_tables(data: Mapping[str, Any], source: str) -> None:
    """Refuse an encoder-decoder profile whose ``dec_seqlen`` axis or op tables are malformed
    (one line naming the table and the shape it must have)."""
    check_grid(data, "dec_seqlen", source, " (decoder tokens) in an encoder-decoder profile")
    if len(data["dec_seqlen"]) < 2:
        raise DynaPipeError(f"{source}: 'dec_seqlen' {data['dec_seqlen']} has one length; a profile needs at least "
                            f"two to price other lengths (measure with `--dec-seqlens` of two or more).")
    ops = data.get("ops")
    if not isinstance(ops, Mapping):
        raise DynaPipeError(f"{source}: 'ops' must be an object with tables for {list(T5_OPS)}.")
    for op in T5_OPS:
        table = ops.get(op)
        if not isinstance(table, Mapping):
            raise DynaPipeError(f"{source}: ops.{op} is missing or not an object; an encoder-decoder profile needs "
                                f"{list(T5_OPS)}, each with {list(FIELDS)}.")
        check_op_table(table, op, tuple(len(data[a]) for a in T5_AXES[op]), T5_AXES[op], source)
    for op in SPLIT_OPS:
        if WEIGHT_FIELD in ops[op]:
            check_weight_table(ops[op], op, source)


def check_weight_table(table: Mapping[str, Any], op: str, source: str) -> None:
    """Refuse ``ops.<op>.bw_weight_ms`` unless it has the shape of the op's (checked) ``bw_ms``
    and finite values from 0 to that backward's ms: the weight part is a part of it."""
    try:
        w = np.asarray(table[WEIGHT_FIELD], dtype=np.float64) if plain_numbers(table[WEIGHT_FIELD]) else None
    except (TypeError, ValueError, OverflowError):  # OverflowError: an int beyond float64's range
        w = None
    bw = np.asarray(table["bw_ms"], dtype=np.float64)
    if w is None or w.shape != bw.shape or not np.all(np.isfinite(w)) or np.any(w < 0) or np.any(w > bw + 1e-9):
        dims = "x".join(str(n) for n in bw.shape)
        raise DynaPipeError(f"{source}: ops.{op}.{WEIGHT_FIELD} must be a {dims} table, the shape of ops.{op}.bw_ms, "
                            f"with values from 0 to that backward's ms.")


def load_t5_tables(profile: Mapping[str, Any]) -> dict:
    """``{op: OpTables}`` of a checked encoder-decoder profile; 2-D ops take ``(mbs, tokens)``,
    the decoder layer ``(mbs, dec_seqlen, seqlen)``. The layers' ``bw_weight_ms`` is loaded
    where the profile has it."""
    axes = {a: np.asarray(profile[a], dtype=np.float64) for a in ("mbs", "seqlen", "dec_seqlen")}
    out = {}
    for op in T5_OPS:
        names = T5_AXES[op]
        present = FIELDS + ((WEIGHT_FIELD,) if op in SPLIT_OPS and WEIGHT_FIELD in profile["ops"][op] else ())
        values = np.stack([np.asarray(profile["ops"][op][f], dtype=np.float64) for f in present])
        # Times and memory extrapolate differently beyond the grid (see ProfileTable).
        timed = np.array([f.endswith("_ms") for f in present])
        if op == "decoder_layer":
            table = DecoderTable(axes["mbs"], axes["dec_seqlen"], axes["seqlen"], values, timed)
        else:
            table = ProfileTable(axes[names[0]], axes[names[1]], values, timed=timed)
        out[op] = OpTables(present, table)
    return out


def _core_shares(model: ModelConfig, s_enc, s_dec, mask_bytes: float = 1.0, tp: int = 1, seq_shard: int = 1) -> tuple:
    """Analytic shares of one layer's forward FLOPs in its attention cores (encoder, decoder)
    and of its stored activations in attention scores (encoder, decoder), on one of ``tp``
    tensor-parallel ranks (``seq_shard``: ``tp`` with sequence parallelism, else 1): the
    scores split over the ranks, the norms' and residuals' share over the sequence shards."""
    h, ad, f = model.hidden_size, model.attention_dim, model.ffn_hidden_size
    lin = 2 * h * (ad + 2 * model.kv_dim) + 2 * ad * h + 2 * h * (model.fc1_width + f)  # per token
    enc_core = 4 * s_enc * ad
    # Decoder per decoder token: self-attention + cross-attention (query, output, and the
    # key/value projections of the encoder tokens spread over the decoder tokens).
    cross_lin = 4 * h * ad + 4 * h * ad * s_enc / np.maximum(s_dec, 1)
    dec_core = 4 * s_dec * ad + 4 * s_enc * ad
    enc_share = enc_core / (lin + enc_core)
    dec_share = dec_core / (lin + cross_lin + dec_core)
    n, per_score = model.num_attention_heads / tp, score_bytes(model, mask_bytes)
    act = layer_token_bytes(model, tp, seq_shard, mask_bytes=mask_bytes)
    cross_dec, cross_enc = cross_token_bytes(model, tp, seq_shard, mask_bytes=mask_bytes)
    cross = cross_dec + cross_enc * s_enc / np.maximum(s_dec, 1)  # per decoder token
    enc_scores = per_score * n * s_enc
    dec_scores = per_score * n * (s_dec + s_enc)
    return (enc_share, dec_share, enc_scores / (act + enc_scores),
            dec_scores / np.maximum(act + cross + dec_scores, 1e-30))


def selective_rebuild_mib(model: ModelConfig, layer_stored_mib, score_share, mbs, tokens, tp: int = 1,
                         mask_bytes=0.0) -> np.ndarray:
    """MiB the backward of one layer at selective recompute holds above the layer's
    no-recompute ``peak_mib``, for a level the profile has no table for: what the recomputed
    attention core saves again (the layer's no-recompute ``layer_stored_mib`` x
    ``score_share``, the scores, softmax and dropout mask the level does not store), the
    core's output it computes again (``mbs`` x ``tokens`` x attention_dim, split over the
    ``tp`` ranks), and the ``mask_bytes`` of attention mask it builds again (unfused attention
    only): megatron-core's default causal mask of a stage given none with its additive bias
    (:mod:`megatron_integration.masked_softmax`), tokens² x (1 + dtype bytes) on every TP
    rank, or the bias of a mask the stage passed, ``[mbs, 1, sq, sk]`` in the dtype, where
    the bias cache no longer holds it.

    Why: the no-recompute peak never held them beside the stored activations, so a stage
    priced without them fits micro-batches the level does not fit. On GPT profiles measured
    at every level (hidden 64, 4 heads, mbs 1-4, unpacked rows, CPU), the derived peak is the
    measured one at 256 and 512 tokens to 0.1% at mbs 1 and up to 5% above it at mbs 2-4
    (packed rows' mask bias counted); without dropout 2-5% below it at mbs 1 (one more
    token-sized tensor); at 64-128 tokens, where the no-recompute peak is elsewhere in the
    layer, up to 2.2 times it (high, not low)."""
    b, q = np.asarray(mbs, dtype=np.float64), np.asarray(tokens, dtype=np.float64)
    core_out = b * q * model.attention_dim * model.dtype_bytes / tp
    mask = 0.0 if model.fused_attention else np.asarray(mask_bytes, dtype=np.float64)
    return np.asarray(layer_stored_mib) * score_share + (core_out + mask) / MIB


def t5_layout_cost(model: ModelConfig, tables: dict, layout: StageLayout, mbs, seqlen, dec_seqlen,
                   recompute: str, overhead_ms: float, mask_bytes: float = 1.0, tp: int = 1,
                   sequence_parallel: bool = False, attention: Optional[AttentionDensity] = None) -> StageCost:
    """Cost of one micro-batch of ``mbs`` samples (``seqlen`` encoder, ``dec_seqlen`` decoder
    tokens) on a stage of ``layout`` from the tables of :func:`load_t5_tables` (ms, MiB), on one
    of ``tp`` tensor-parallel ranks (the tables' TP size; the derived recompute levels' shares
    and full recompute's stored inputs are worked out per rank); ``mask_bytes``: a dropout
    mask's bytes per element in the measured layers (the derived levels' score shares).
    ``attention``: per-sample attention over packed rows (see
    :class:`~dynapipe.cost.attention_density.AttentionDensity`): each layer's attention-core
    share of the time and score share of the stored bytes scale by its density (a decoder
    layer's self- and cross-attention weighted together)."""
    b = np.asarray(mbs, dtype=np.float64)
    s_enc, s_dec = np.asarray(seqlen, dtype=np.float64), np.asarray(dec_seqlen, dtype=np.float64)
    shape = np.broadcast(b, s_enc, s_dec).shape
    zero = np.zeros(shape)
    fw, bw, stored, peak = zero.copy(), zero.copy(), zero.copy(), zero.copy()
    shard = tp if sequence_parallel else 1
    enc_share, dec_share, enc_scores, dec_scores = _core_shares(model, s_enc, s_dec, mask_bytes, tp, shard)
    one_layer = zero.copy()
    # What full recompute keeps: each layer's input (+ the encoder output), sequence-sharded
    # over the TP ranks with sequence parallelism.
    inputs = zero.copy()
    row = b * model.hidden_size * model.dtype_bytes / shard / MIB
    for n, op, args, share, scores, tokens in (
            (layout.encoder_layers, "encoder_layer", (b, s_enc), enc_share, enc_scores, s_enc),
            (layout.decoder_layers, "decoder_layer", (b, s_dec, s_enc), dec_share, dec_scores, s_dec)):
        if not n:
            continue
        t = tables[op](*args)
        if attention is not None:
            dens = attention.input if op == "encoder_layer" else \
                decoder_core_density(attention.target, attention.cross, s_dec, s_enc)
            dense_share = share
            t["fw_ms"], share = thin(t["fw_ms"], dense_share, dens)
            t["bw_ms"], _ = thin(t["bw_ms"], dense_share, dens)
            t["stored_mib"], scores = thin(t["stored_mib"], scores, dens)
        l_fw, l_bw, l_st = t["fw_ms"], t["bw_ms"], t["stored_mib"]
        l_peak = t["peak_mib"]
        if recompute == "selective":
            l_bw, l_st = l_bw + l_fw * share, l_st * (1 - scores)
            # One core at a time is recomputed (a decoder layer's cross- and self-attention
            # each): one core output; the scores of both are counted (high, not low). The
            # stages pass every mask they need (the causal one too), so the core builds
            # again at most the additive bias of one, [mbs, 1, sq, sk] in the activations'
            # dtype, when the bias cache no longer holds it.
            keys = s_enc if op == "encoder_layer" else np.maximum(s_dec, s_enc)
            l_peak = l_peak + selective_rebuild_mib(model, t["stored_mib"], scores, b, tokens, tp,
                                                    b * tokens * keys * model.dtype_bytes)
        elif recompute == "full":
            l_bw = l_bw + l_fw
        fw, bw = fw + n * l_fw, bw + n * l_bw
        stored = stored + n * l_st
        if op == "decoder_layer" and n > 1:
            # Each measured decoder layer kept the encoder output its cross-attention reads (its
            # input); a stage's decoder layers all read the one copy the stage received.
            stored = stored - (n - 1) * row * s_enc
        peak = np.maximum(peak, l_peak)
        one_layer = np.maximum(one_layer, t["stored_mib"])
        inputs = inputs + n * row * tokens
        if op == "decoder_layer":
            inputs = inputs + row * s_enc
    if recompute == "full":
        stored, peak = inputs, 2 * peak + one_layer
    # The stage holding the first decoder layer embeds the decoder's tokens too (stage 0 with the
    # same embedding); the encoder block's final norm is not measured apart (a layer's norms are).
    for op, present, tokens in (("embedding", layout.has_embedding, s_enc),
                                ("embedding", layout.embeds_decoder, s_dec), ("output", layout.has_output, s_dec)):
        if present:
            e = tables[op](b, tokens)
            fw, bw = fw + e["fw_ms"], bw + e["bw_ms"]
            stored = stored + e["stored_mib"]
            peak = np.maximum(peak, e["peak_mib"])
    return StageCost(fw_ms=fw + overhead_ms, bw_ms=bw + overhead_ms, stored_mib=stored, peak_mib=peak)


def t5_weight_ms(tables: dict, layout: StageLayout, mbs, seqlen, dec_seqlen) -> Optional[np.ndarray]:
    """The measured weight part (ms) of one micro-batch's split backward on a stage of
    ``layout``: its encoder layers' ``bw_weight_ms`` at (mbs, seqlen) plus its decoder layers'
    at (mbs, dec_seqlen, seqlen), from the tables of :func:`load_t5_tables`. None where the
    stage has no layers or the profile did not time a split backward of a kind it holds.

    The same at every recompute level: recomputation runs in the input part and does not
    change the weight GEMMs. Each layer's weight part is capped at its interpolated ``bw_ms``
    (extrapolated tables could cross), so the sum stays within the stage's backward ms,
    which adds recomputation, embedding, output layer and overhead to the layers' ``bw_ms``."""
    b = np.asarray(mbs, dtype=np.float64)
    s_enc, s_dec = np.asarray(seqlen, dtype=np.float64), np.asarray(dec_seqlen, dtype=np.float64)
    layers = [(n, op, args) for n, op, args in ((layout.encoder_layers, "encoder_layer", (b, s_enc)),
                                                (layout.decoder_layers, "decoder_layer", (b, s_dec, s_enc))) if n]
    if not layers or any(WEIGHT_FIELD not in tables[op] for _, op, _ in layers):
        return None
    total = np.zeros(np.broadcast(b, s_enc, s_dec).shape)
    for n, op, args in layers:
        t = tables[op](*args)
        total = total + n * np.minimum(t[WEIGHT_FIELD], t["bw_ms"])
    return total
