"""Reading a cost profile file and refusing one that would misprice the run.

:func:`read_profile` parses the JSON; the checks refuse, in one line naming the key, a file
that is not a profile, a version or kind this build cannot read, a damaged grid, and a
profile measured on another layer shape, width, precision, run setting or tensor-parallel
size than the model's (:class:`~dynapipe.cost.profile.ProfileCostModel` runs them; the
format is described in :mod:`dynapipe.cost.profile`).
"""
from __future__ import annotations

import json
import math
import os
from typing import Any, Mapping

from dynapipe.config import ModelConfig
from dynapipe.cost.profile_t5 import (FIELDS, KIND_DECODER_ONLY, KIND_ENCODER_DECODER, MAX_PROFILE_NUMBER,
                                      check_grid, check_op_table, check_t5_tables, finite_number, is_number,
                                      profile_kind)
from dynapipe.errors import DynaPipeError, file_read_errors, is_whole

PROFILE_FORMAT = "dynapipe-profile"
PROFILE_VERSION = 2
# Version 1: decoder-only profiles written before ``kind`` existed.
READABLE_VERSIONS = (1, 2)
OPS = ("layer", "embedding", "output")
# Optional tables: the layer measured at a recompute level.
LEVEL_OPS = {"selective": "layer_selective", "full": "layer_full"}
# The transformer layer's tables, at every level measured.
LAYER_OPS = ("layer",) + tuple(LEVEL_OPS.values())
# The layers a profile may record measuring (megatron-core's local ones, Transformer Engine's).
LAYER_SPECS = ("local", "transformer_engine")
# WEIGHT_FIELD (from profile_t5, which T5 profiles share it with): the optional field of the
# layer's tables, the weight-gradient part of bw_ms (split backward).


# Layer-shape switches a measured table depends on, with the value a profile that does not
# record them was measured at (profiles written before these switches existed).
LAYER_SHAPE_KEYS = {"gated_linear_unit": False, "num_query_groups": 0, "add_bias_linear": True,
                    "add_qkv_bias": False, "qk_layernorm": False}


# Megatron arguments a measured layer depends on beyond its shape, recorded by the profilers
# under these names and compared when recorded: dropout roughly doubles a layer's stored
# activations and adds to its forward; rotary and learned positions differ in both.
RUN_KEYS = ("hidden_dropout", "attention_dropout", "position_embedding_type")

# Layer widths a measured table depends on, compared only when the profile records them
# (there is no width a profile could be assumed to have been measured at). kv_channels is
# recorded as the per-head width in effect, so it is compared with the model's head_dim.
LAYER_WIDTH_KEYS = ("hidden_size", "num_attention_heads", "ffn_hidden_size", "kv_channels", "normalization",
                    "vocab_size")
# The widths every profile records (both profilers always have): without them a profile could
# price any model.
REQUIRED_WIDTH_KEYS = ("hidden_size", "num_attention_heads", "ffn_hidden_size")
# Megatron pads the vocabulary to a multiple of this times TP: sizes within one padding price alike.
VOCAB_PADDING = 128


def check_layer_widths(measured: Mapping[str, Any], model: ModelConfig, source: str, tp: int = 1) -> None:
    """Refuse a profile measured on a layer (or an output layer) of another width than
    ``model``'s; vocabularies are compared as Megatron pads them at tensor-parallel size ``tp``."""
    pad = VOCAB_PADDING * tp
    for key in LAYER_WIDTH_KEYS:
        have = measured.get(key)
        if have is None or (key == "kv_channels" and have == 0):
            continue
        want = model.head_dim if key == "kv_channels" else getattr(model, key)
        if key == "vocab_size" and isinstance(have, int) and -(-have // pad) == -(-want // pad):
            continue  # the output layer's cost: padded or not, the same
        if have != want:
            layer = "an output layer" if key == "vocab_size" else "a layer"
            raise DynaPipeError(f"{source}: the profile was measured on {layer} with {key}={have!r} but model "
                                f"{model.name!r} has {key}={want!r}; its times and memory price another model. "
                                f"Profile this model (`python -m dynapipe profile` with its config or its model "
                                f"flags) or use the analytic cost model.")


def check_layer_shape(data: Mapping[str, Any], model: ModelConfig, source: str) -> None:
    """Refuse a profile measured on a layer of another shape (hidden size, heads, FFN width,
    per-head width, norm) or kind (GeLU vs SwiGLU MLP, grouped-query attention, biases,
    query/key norms) or in another precision: its tables would misprice every micro-batch."""
    measured = data.get("model")
    if not isinstance(measured, Mapping):
        got = "no 'model'" if measured is None else f"'model' of type {type(measured).__name__}"
        raise DynaPipeError(f"{source}: has {got}; a profile records the shape it was measured on as a 'model' "
                            f"object (`python -m dynapipe profile` writes it), without which nothing shows that its "
                            f"times and memory price model {model.name!r}. Measure one for this model, or restore "
                            f"the section.")
    missing = [key for key in REQUIRED_WIDTH_KEYS if key not in measured]
    if missing:
        raise DynaPipeError(f"{source}: 'model' records no {', '.join(missing)}; without the measured layer's widths "
                            f"nothing shows that the profile prices model {model.name!r}. Measure one for this model "
                            f"(`python -m dynapipe profile`), or restore the keys.")
    check_layer_widths(measured, model, source, profile_tensor_parallel(data)[0])
    # Local layers never fuse attention: their tables time (and the derived recompute levels
    # count) a score matrix that a fused-attention model never builds.
    if data.get("layer_spec") == "local" and model.fused_attention:
        raise DynaPipeError(f"{source}: the profile was measured on megatron-core's local layers, whose attention "
                            f"keeps its score matrix, but model {model.name!r} has fused_attention: true; profile "
                            f"the layers it trains with (`python -m dynapipe profile --transformer-impl "
                            f"transformer_engine` on its GPU) or set fused_attention: false in its config.")
    dtype = data.get("dtype", "fp32")
    if dtype != model.dtype:
        raise DynaPipeError(f"{source}: the profile was measured in {dtype} but the model trains in {model.dtype}; "
                            f"profile in {model.dtype} (`python -m dynapipe profile` with the run's precision flag) "
                            f"or use the analytic cost model.")
    for key, default in LAYER_SHAPE_KEYS.items():
        have, want = measured.get(key, default), getattr(model, key)
        if have != want:
            raise DynaPipeError(f"{source}: the profile was measured with {key}={have!r} but the model has "
                                f"{key}={want!r}; profile this model (`python -m dynapipe profile` with the same "
                                f"model flags) or use the analytic cost model.")
    check_softmax_precision(measured, model, source)
    for key in RUN_KEYS:
        have, want = measured.get(key), getattr(model, key)
        if have is not None and have != want:
            flag = "--" + key.replace("_", "-")
            raise DynaPipeError(f"{source}: the profile was measured with {flag} {have}, this run trains with "
                                f"{flag} {want} (model {model.name!r}'s {key}: a model config's, or the training "
                                f"flag's); its times and memory price another layer. Profile with the run's model "
                                f"flags (`python -m dynapipe profile ... {flag} {want}`), give `plan`/`cost` a model "
                                f"config with {key}: {have}, or use the analytic cost model (--dynapipe-cost-model "
                                f"analytic; `plan` and `cost` without --profile).")


SOFTMAX_KEY = "attention_softmax_in_fp32"


def _softmax(on: bool, dtype: str) -> str:
    return "the attention softmax in fp32 (--attention-softmax-in-fp32)" if on else \
        f"the attention softmax in {dtype} (Megatron's default)"


def check_softmax_precision(measured: Mapping[str, Any], model: ModelConfig, source: str) -> None:
    """Refuse a profile measured with the attention softmax in another precision than the
    run's (``model.attention_softmax_in_fp32``; Megatron's ``--attention-softmax-in-fp32``,
    which ``--apply-query-key-layer-scaling`` forces on). Why: in bf16/fp16 unfused attention
    then keeps fp32 probabilities and their cast copy (a layer of 2 x 256 tokens of gpt-tiny
    stores 5.13 MiB against 4.13) and takes longer. Not compared where it changes nothing:
    fp32 runs (the softmax is fp32 either way) and fused attention (no score matrix). A
    profile that does not record it (written before it was recorded) was measured at
    Megatron's default, off, if at all: it prices only a run with the default."""
    if model.dtype == "fp32" or model.fused_attention:
        return
    have, want = measured.get(SOFTMAX_KEY), bool(model.attention_softmax_in_fp32)
    if have is not None and not isinstance(have, bool):
        raise DynaPipeError(f"{source}: model.{SOFTMAX_KEY} {have!r} must be true or false.")
    fix = (" --attention-softmax-in-fp32" if want
           else " without --attention-softmax-in-fp32 or --apply-query-key-layer-scaling")
    advice = (f"Measure a profile with the run's setting (`python -m dynapipe profile ...{fix}`) or use the "
              f"analytic cost model.")
    if have is None and want:
        raise DynaPipeError(f"{source}: the profile does not record the precision of its attention softmax (it "
                            f"was written before profiles did, at Megatron's default: {model.dtype}), this "
                            f"{model.dtype} run trains with {_softmax(True, model.dtype)}. {advice}")
    if have is not None and have != want:
        raise DynaPipeError(f"{source}: the profile was measured with {_softmax(have, model.dtype)}, this run "
                            f"trains with {_softmax(want, model.dtype)}; its stored activations and times price "
                            f"another layer. {advice}")


def profile_tensor_parallel(data: Mapping[str, Any]) -> tuple[int, bool]:
    """(tp, sequence_parallel) a profile was measured at; (1, False) when it does not say."""
    return int(data.get("tp", 1)), bool(data.get("sequence_parallel", False))


def _describe_tp(tp: int, sp: bool) -> str:
    return f"tensor-parallel size {tp} {'with' if sp else 'without'} sequence parallelism"


def check_profile_tensor_parallel(data: Mapping[str, Any], tp: int, sequence_parallel: bool, source: str) -> None:
    """Refuse a profile measured at another TP size or sequence-parallel setting than the run's:
    its times carry other collectives and its memory is another rank's share."""
    have = profile_tensor_parallel(data)
    flags = f"--tensor-model-parallel-size {tp}{' --sequence-parallel' if sequence_parallel else ''}"
    if have != (tp, bool(sequence_parallel)):
        raise DynaPipeError(f"{source}: the profile was measured at {_describe_tp(*have)}, but the run uses "
                            f"{_describe_tp(tp, bool(sequence_parallel))}; measure one with `python -m dynapipe "
                            f"profile {flags}` or use the analytic cost model.")


def read_profile(path: str) -> Any:
    """The parsed JSON of a profile file, or a one-line :class:`DynaPipeError` naming the problem."""
    if not isinstance(path, (str, os.PathLike)):
        # open() takes an int as a file descriptor, and closes it after: True would close stdout.
        raise DynaPipeError(f"profile {path!r:.60}: give the path of a profile JSON (`python -m dynapipe profile "
                            f"--output` writes one), or 'analytic' / None for the analytic cost model.")
    with file_read_errors("profile", path, missing="write one with `python -m dynapipe profile`.",
                          directory="give the JSON file `python -m dynapipe profile --output` wrote.",
                          not_text="is not UTF-8 JSON text (a binary file?)."):
        try:
            with open(path) as f:
                return json.load(f)
        except json.JSONDecodeError as e:
            raise DynaPipeError(f"profile {path!r} is not valid JSON: {e}") from None
        except RecursionError:
            raise DynaPipeError(f"profile {path!r} is nested too deeply to be a cost profile.") from None


def _short(value) -> str:
    """``repr(value)``, cut to 40 characters: a hand-edited number can run to hundreds of digits."""
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def check_profile(data: Mapping[str, Any], source: str) -> None:
    """Refuse ``data`` (read from ``source``) unless it is a profile of this format with every
    field of the right type; the error names the field and ``source``."""
    if not isinstance(data, Mapping):
        raise DynaPipeError(f"{source}: not a DynaPipe profile (a JSON object with \"format\": "
                            f"{PROFILE_FORMAT!r} is expected); write one with `python -m dynapipe profile`.")
    if data.get("format") != PROFILE_FORMAT:
        raise DynaPipeError(f"{source}: not a DynaPipe profile (format={data.get('format')!r}, "
                            f"expected {PROFILE_FORMAT!r}); write one with `python -m dynapipe profile`.")
    version = data.get("version")
    if isinstance(version, bool) or version not in READABLE_VERSIONS:
        raise DynaPipeError(f"{source}: profile version {version!r} is not supported "
                            f"(this DynaPipe reads versions {', '.join(map(str, READABLE_VERSIONS))}).")
    kind = profile_kind(data)
    if kind not in (KIND_DECODER_ONLY, KIND_ENCODER_DECODER) or (version == 1 and kind != KIND_DECODER_ONLY):
        raise DynaPipeError(f"{source}: profile kind {kind!r} is not one of {KIND_DECODER_ONLY!r}, "
                            f"{KIND_ENCODER_DECODER!r} (version 2; version 1 profiles are decoder-only).")
    for axis in ("mbs", "seqlen"):
        check_grid(data, axis, source)
    if len(data["seqlen"]) < 2:
        raise DynaPipeError(f"{source}: 'seqlen' {data['seqlen']} has one length; a profile needs at least two to "
                            f"price other lengths (measure with `--seqlens` of two or more).")
    overhead = data.get("stage_overhead_ms", 0.0)
    # An int is finite however large (math.isfinite would overflow on one beyond float64).
    if not is_number(overhead) or (isinstance(overhead, float) and not math.isfinite(overhead)) or overhead < 0:
        raise DynaPipeError(f"{source}: 'stage_overhead_ms' {_short(overhead)} must be a finite number of ms, "
                            f"0 or more.")
    if not finite_number(overhead):
        raise DynaPipeError(f"{source}: 'stage_overhead_ms' {_short(overhead)} is over 2**53 ms; give the fixed "
                            f"cost per stage op in ms.")
    calls = data.get("attention_call_ms", {})
    if not isinstance(calls, dict) or set(calls) - {"fw", "bw"} or not all(
            finite_number(v) and v >= 0 for v in calls.values()):
        raise DynaPipeError(f"{source}: 'attention_call_ms' {_short(calls)} must be {{\"fw\": ms, \"bw\": ms}}, "
                            f"finite and 0 or more: the fixed cost of one per-sample attention call.")
    if calls and set(calls) != {"fw", "bw"}:
        raise DynaPipeError(f"{source}: 'attention_call_ms' {_short(calls)} must give both \"fw\" and \"bw\" (ms).")
    spec = data.get("layer_spec")
    if spec is not None and spec not in LAYER_SPECS:
        raise DynaPipeError(f"{source}: 'layer_spec' {_short(spec)} is not one of {', '.join(LAYER_SPECS)} (the "
                            f"layers measured: megatron-core's local ones or Transformer Engine's).")
    threads = data.get("threads")
    if threads is not None and not is_whole(threads):
        raise DynaPipeError(f"{source}: 'threads' {_short(threads)} must be a whole number of CPU threads, 1 or "
                            f"more (profiles write the threads they measured with).")
    tp = data.get("tp", 1)
    if isinstance(tp, bool) or not isinstance(tp, int) or not 1 <= tp <= MAX_PROFILE_NUMBER:
        raise DynaPipeError(f"{source}: 'tp' {_short(tp)} must be a positive integer of at most 2**53 (the "
                            f"tensor-parallel size measured).")
    if not isinstance(data.get("sequence_parallel", False), bool):
        raise DynaPipeError(f"{source}: 'sequence_parallel' {data.get('sequence_parallel')!r} must be true or false.")
    if kind == KIND_ENCODER_DECODER:
        check_t5_tables(data, source)
        return
    shape = (len(data["mbs"]), len(data["seqlen"]))
    ops = data.get("ops")
    if not isinstance(ops, Mapping):
        raise DynaPipeError(f"{source}: 'ops' must be an object with tables for {list(OPS)}.")
    for op in OPS + tuple(k for k in LEVEL_OPS.values() if k in ops):
        table = ops.get(op)
        if table is None:
            raise DynaPipeError(f"{source}: ops.{op} is missing; a profile needs {list(OPS)}.")
        if not isinstance(table, Mapping):
            raise DynaPipeError(f"{source}: ops.{op} must be an object with tables {list(FIELDS)}.")
        check_op_table(table, op, shape, ("mbs", "seqlen"), source)
