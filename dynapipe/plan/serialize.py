"""Execution plans as bytes: compact, versioned, checksummed, deterministic, never pickle.

Version 3 (written), big-endian header::

    magic  b"DPPL"        4 bytes
    version               uint16   (FORMAT_VERSION = 3)
    flags                 uint16   (bit 0: body is zlib-compressed)
    payload length        uint32   (bytes after the header)
    payload CRC32         uint32
    body length           uint32   (bytes once inflated)
    payload               zlib(binary body, see :mod:`dynapipe.plan.binary`)

The body length bounds the inflation: a reader refuses a header that declares more
than :data:`MAX_BODY_BYTES`, inflates at most the declared length, and refuses a
payload that would inflate further (a compression bomb costs nothing). A plan always
gives the same bytes; an equal plan built another way (instruction objects rather than the
compiler's table) may order its string table differently, so compare plans, not bytes.

Version 3 has version 2's header and body; its ``BackwardPass.part`` may be ``"input"``
or ``"weight"`` (split backwards of zero-bubble schedules). The version changed so that
a release that reads at most version 2, whose executor runs every backward in full,
refuses these plans instead of running a weight part as a second backward. Version-2
payloads (written by earlier releases) still read.

Version 1 (read only): a 16-byte header without the body length and zlib-compressed
canonical JSON, inflated at most to :data:`MAX_V1_JSON_BYTES`. Anything malformed
raises :class:`PlanError` saying what is wrong.
"""
from __future__ import annotations

import dataclasses
import functools
import json
import struct
import zlib
from typing import Any, Optional

from dynapipe.errors import PlanError
from dynapipe.plan._fast import gc_paused, maker
from dynapipe.plan.binary import decode_body, encode_body
from dynapipe.plan.instructions import DTYPES, INSTRUCTION_TYPES, ExecutionPlan, MicroBatchInfo, TensorSpec

MAGIC = b"DPPL"
FORMAT_VERSION = 3
READABLE_VERSIONS = (1, 2, 3)
_HEADER_V1 = struct.Struct(">4sHHII")
_HEADER = struct.Struct(">4sHHIII")
HEADER_BYTES = _HEADER.size
_FLAG_ZLIB = 1
# A rank's plan is a few KiB to a few MiB (about 40 bytes an instruction inflated);
# a header declaring more than this is corrupted or hostile.
MAX_BODY_BYTES = 256 << 20
# Version-1 JSON is parsed into Python objects (about 20x its size in memory).
MAX_V1_JSON_BYTES = 16 << 20

_PLAN_FIELDS = ("iteration", "stage", "num_stages", "replica", "num_replicas", "schedule",
                "recompute", "real_tokens", "global_real_tokens")
# Version 1 is the frozen format of earlier releases: its keys "real_tokens" and
# "global_real_tokens" (and each micro-batch's sixth field) hold what the plan now calls
# loss_tokens and global_loss_tokens. The keys stay, so that plans written by those
# releases still read and a version-1 document means one thing.
_V1_ATTRS = {"real_tokens": "loss_tokens", "global_real_tokens": "global_loss_tokens"}
_DTYPES = frozenset(DTYPES)


@functools.lru_cache(maxsize=None)
def _fields(cls) -> tuple[tuple[str, str, Any], ...]:
    """``(name, kind, default)`` of an instruction class's fields; kind is ``int``,
    ``str`` or ``tensors``."""
    out = []
    for f in dataclasses.fields(cls):
        if not f.init:
            continue
        t = str(f.type)
        kind = "tensors" if "TensorSpec" in t else t
        if kind not in ("int", "str", "tensors"):
            raise PlanError(f"instruction field {cls.__name__}.{f.name} has unsupported type {t}.")
        out.append((f.name, kind, f.default))
    return tuple(out)


def _plan_document(plan: ExecutionPlan) -> dict:
    table: list = []
    by_id: dict[int, int] = {}
    by_value: dict[tuple, int] = {}

    def tensors_index(ts: tuple) -> int:
        i = by_id.get(id(ts))
        if i is None:
            i = by_value.get(ts)
            if i is None:
                i = by_value[ts] = len(table)
                table.append([[t.name, list(t.shape), t.dtype] for t in ts])
            by_id[id(ts)] = i
        return i

    insts = []
    for inst in plan.instructions:
        row = [inst.OPCODE]
        for name, kind, _ in _fields(type(inst)):
            v = getattr(inst, name)
            row.append(tensors_index(v) if kind == "tensors" else v)
        insts.append(row)
    doc = {k: getattr(plan, _V1_ATTRS.get(k, k)) for k in _PLAN_FIELDS}
    doc["micro_batches"] = [[m.mb, list(m.samples), m.mbs, m.seqlen, m.dec_seqlen, m.loss_tokens,
                             [list(r) for r in m.rows]] for m in plan.micro_batches]
    doc["instructions"] = insts
    doc["tensors"] = table
    doc["meta"] = plan.meta
    return doc


def serialize_plan(plan: ExecutionPlan) -> bytes:
    """The plan as deterministic version-3 bytes: a 20-byte header (magic, version,
    flags, payload length, CRC32, body length) and the zlib-compressed binary body.
    ``plan.meta`` must hold only JSON values (str keys, numbers, strings, lists, dicts)."""
    if not isinstance(plan, ExecutionPlan):
        raise PlanError(f"serialize_plan takes an ExecutionPlan, got {type(plan).__name__}.")
    body = encode_body(plan)
    if len(body) > MAX_BODY_BYTES:
        raise PlanError(f"plan of stage {plan.stage} encodes to {len(body)} bytes, more than the "
                        f"{MAX_BODY_BYTES}-byte limit a reader accepts; plan fewer micro-batches per iteration.")
    payload = zlib.compress(body, 1)
    return _HEADER.pack(MAGIC, FORMAT_VERSION, _FLAG_ZLIB, len(payload), zlib.crc32(payload), len(body)) + payload


def serialize_plan_v1(plan: ExecutionPlan) -> bytes:
    """The plan in the version-1 format (JSON), which this release still reads."""
    try:
        with gc_paused():
            doc = _plan_document(plan)
        text = json.dumps(doc, sort_keys=True, separators=(",", ":"),
                          ensure_ascii=True, allow_nan=False)
    except (TypeError, ValueError) as e:
        raise PlanError(f"plan of stage {plan.stage} cannot be serialized: {e} "
                        f"(plan.meta may hold only JSON values).") from None
    payload = zlib.compress(text.encode("ascii"), 6)
    return _HEADER_V1.pack(MAGIC, 1, _FLAG_ZLIB, len(payload), zlib.crc32(payload)) + payload


# -- reading ---------------------------------------------------------------------------------

def _want(cond: bool, what: str) -> None:
    if not cond:
        raise PlanError(f"plan payload is malformed: {what}.")


def _int(v: Any, what: str) -> int:
    if type(v) is not int:
        _want(False, f"{what} must be an integer, got {v!r}")
    return v


def _str(v: Any, what: str) -> str:
    if type(v) is not str:
        _want(False, f"{what} must be a string, got {v!r}")
    return v


def _tensor_list(i: int, v: Any) -> tuple[TensorSpec, ...]:
    what = f"tensors[{i}]"
    if type(v) is not list:
        _want(False, f"{what} must be a list of tensors")
    out = []
    for j, t in enumerate(v):
        if not (type(t) is list and len(t) == 3 and type(t[1]) is list):
            _want(False, f"{what}[{j}] must be [name, shape, dtype]")
        shape = tuple(t[1])
        if not all(type(d) is int and d >= 0 for d in shape):
            _want(False, f"{what}[{j}] shape {t[1]!r} must hold non-negative integers")
        if type(t[2]) is not str or t[2] not in _DTYPES:
            _want(False, f"{what}[{j}] dtype {t[2]!r} is not one of {DTYPES}")
        out.append(TensorSpec(_str(t[0], f"{what}[{j}] name"), shape, t[2]))
    return tuple(out)


_DECODERS = {op: (maker(cls), _fields(cls)) for op, cls in INSTRUCTION_TYPES.items()}


def _decode_instruction(i: int, v: Any, tables: list) -> Any:
    if type(v) is not list or not v:
        _want(False, f"instruction {i} must be a non-empty array")
    dec = _DECODERS.get(v[0]) if type(v[0]) is str else None
    if dec is None:
        _want(False, f"instruction {i} has unknown opcode {v[0]!r}")
    make, fields = dec
    if not 2 <= len(v) <= len(fields) + 1:
        _want(False, f"instruction {i} ({v[0]}) has {len(v) - 1} fields, 1 to {len(fields)} expected")
    kwargs = {}
    for (name, kind, _), x in zip(fields, v[1:]):
        if kind == "tensors":
            if type(x) is not int or not 0 <= x < len(tables):
                _want(False, f"instruction {i} ({v[0]}) field {name!r} must index the tensor table, got {x!r}")
            x = tables[x]
        elif type(x) is not (int if kind == "int" else str):
            _want(False, f"instruction {i} ({v[0]}) field {name!r} must be {'an integer' if kind == 'int' else 'a string'}, "
                         f"got {x!r}")
        kwargs[name] = x
    return make(**kwargs)


def _decode_micro_batch(i: int, v: Any) -> MicroBatchInfo:
    what = f"micro_batches[{i}]"
    if not (type(v) is list and len(v) == 7 and type(v[1]) is list and type(v[6]) is list):
        _want(False, f"{what} must be an array of 7 fields with sample and row arrays")
    ints = [v[0], v[2], v[3], v[4], v[5], *v[1]]
    rows = []
    for r in v[6]:
        if type(r) is not list:
            _want(False, f"{what} rows must be arrays")
        ints.extend(r)
        rows.append(tuple(r))
    if not all(type(x) is int for x in ints):
        _want(False, f"{what} must hold integers only")
    return MicroBatchInfo(mb=v[0], samples=tuple(v[1]), mbs=v[2], seqlen=v[3], dec_seqlen=v[4], loss_tokens=v[5],
                          rows=tuple(rows))


def _inflate(payload: bytes, flags: int, limit: int, exact: Optional[int]) -> bytes:
    """Inflate at most ``limit`` bytes; refuse a payload that would give more (or, with
    ``exact``, a different length)."""
    if not flags & _FLAG_ZLIB:
        out = payload
    else:
        d = zlib.decompressobj()
        try:
            out = d.decompress(payload, limit + 1)
        except zlib.error as e:
            raise PlanError(f"plan payload is corrupted: {e}.") from None
        if len(out) > limit or d.unconsumed_tail:
            raise PlanError(f"plan payload inflates past {exact if exact is not None else limit} bytes, more than "
                            f"its header allows: refused before inflating it (corrupted or hostile).")
        if not d.eof:
            raise PlanError("plan payload is corrupted: the compressed stream ends early.")
    if exact is not None and len(out) != exact:
        raise PlanError(f"plan payload inflates to {len(out)} bytes, its header declares {exact}.")
    if len(out) > limit:
        raise PlanError(f"plan payload of {len(out)} bytes is larger than the {limit}-byte limit.")
    return out


def deserialize_plan(data: bytes) -> ExecutionPlan:
    """Rebuild an :class:`ExecutionPlan` from :func:`serialize_plan` bytes (version 3, or
    version 2 or 1 written by earlier releases).

    Raises :class:`PlanError` for a wrong magic or an unknown version, a truncated
    payload, a CRC mismatch (corruption), a body larger than its header declares or
    than the limits allow (checked before inflating), and any malformed field.
    """
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise PlanError(f"a serialized plan must be bytes, got {type(data).__name__}.")
    data = bytes(data)
    if len(data) < _HEADER_V1.size:
        raise PlanError(f"plan payload is truncated: {len(data)} bytes, shorter than any plan header "
                        f"({_HEADER_V1.size} bytes in version 1, {HEADER_BYTES} in versions 2 and 3).")
    magic, version = data[:4], struct.unpack_from(">H", data, 4)[0]
    if magic != MAGIC:
        raise PlanError(f"not a DynaPipe execution plan (magic {magic!r}, expected {MAGIC!r}).")
    if version not in READABLE_VERSIONS:
        raise PlanError(f"execution plan format version {version} is not supported "
                        f"(this DynaPipe reads versions {list(READABLE_VERSIONS)}); plan and run with the same "
                        f"release.")
    if version == 1:
        _, _, flags, length, crc = _HEADER_V1.unpack_from(data)
        body_len, head = None, _HEADER_V1.size
    else:
        if len(data) < HEADER_BYTES:
            raise PlanError(f"plan payload is truncated: {len(data)} bytes, shorter than the "
                            f"{HEADER_BYTES}-byte header.")
        _, _, flags, length, crc, body_len = _HEADER.unpack_from(data)
        head = HEADER_BYTES
        if body_len > MAX_BODY_BYTES:
            raise PlanError(f"plan header declares a body of {body_len} bytes, more than the {MAX_BODY_BYTES}-byte "
                            f"limit: refused before inflating it (corrupted or hostile).")
    payload = data[head:]
    if len(payload) < length:
        raise PlanError(f"plan payload is truncated: {len(payload)} of {length} bytes.")
    if len(payload) > length:
        raise PlanError(f"plan payload has {len(payload) - length} unexpected trailing bytes.")
    if zlib.crc32(payload) != crc:
        raise PlanError("plan payload is corrupted: CRC32 mismatch.")
    if version >= 2:
        return decode_body(_inflate(payload, flags, body_len, body_len))
    text = _inflate(payload, flags, MAX_V1_JSON_BYTES, None)
    try:
        doc = json.loads(text.decode("ascii"))
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise PlanError(f"plan payload is corrupted: {e}.") from None
    _want(isinstance(doc, dict), "the document must be an object")
    missing = [k for k in _PLAN_FIELDS + ("micro_batches", "instructions", "tensors", "meta") if k not in doc]
    _want(not missing, f"missing field(s) {missing}")
    kwargs = {_V1_ATTRS.get(k, k): (_str if k in ("schedule", "recompute") else _int)(doc[k], k) for k in _PLAN_FIELDS}
    for k in ("micro_batches", "instructions", "tensors"):
        _want(isinstance(doc[k], list), f"{k} must be an array")
    _want(isinstance(doc["meta"], dict), "meta must be an object")
    with gc_paused():
        tables = [_tensor_list(i, t) for i, t in enumerate(doc["tensors"])]
        return ExecutionPlan(
            micro_batches=tuple(_decode_micro_batch(i, m) for i, m in enumerate(doc["micro_batches"])),
            instructions=tuple(_decode_instruction(i, x, tables) for i, x in enumerate(doc["instructions"])),
            meta=doc["meta"], **kwargs)
