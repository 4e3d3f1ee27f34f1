"""What one rank receives for one iteration: its plan, its tensors, metadata, as bytes.

Layout (little-endian)::

    b"DPIT" | u16 version | u16 reserved | u32 header length | u32 CRC32 of the rest
    | header (UTF-8 JSON) | plan bytes | tensor 0 bytes | tensor 1 bytes | ...

The CRC32 covers the header, the plan and every tensor byte, so a flipped bit anywhere
(token data included) is refused before anything is decoded; the header is at most
:data:`MAX_HEADER_BYTES`, and the plan bytes carry their
own inflation bound (see :mod:`dynapipe.plan.serialize`).

The JSON header gives the iteration, replica and stage, the plan's byte range, and for
every tensor its micro-batch, name, dtype, shape and byte range; plus metadata (numbers
and strings). Decoding checks every field and range and builds arrays with
``numpy.frombuffer``: no pickle, so a corrupted or hostile payload raises an error
instead of running code. Pure numpy (planner workers do not need torch for it).
"""
from __future__ import annotations

import json
import math
import struct
import zlib
from dataclasses import dataclass, field

import numpy as np

from dynapipe.errors import DynaPipeError

MAGIC = b"DPIT"
VERSION = 2
_PREFIX = struct.Struct("<4sHHII")
# The header lists one entry (about 100 bytes) per tensor: a few MiB at most.
MAX_HEADER_BYTES = 64 << 20
DTYPES = {"int64": np.int64, "int32": np.int32, "float32": np.float32, "float16": np.float16,
          "bool": np.bool_, "uint8": np.uint8}


@dataclass
class Payload:
    """A decoded payload. ``tensors`` maps micro-batch index -> tensor name -> array."""

    iteration: int
    replica: int
    stage: int
    plan_bytes: bytes
    tensors: dict[int, dict[str, np.ndarray]] = field(default_factory=dict)
    meta: dict = field(default_factory=dict)
    # CRC32 of header, plan and tensor bytes (what the transfer check covers).
    crc: int = 0
    # CRC32 of what the rank runs: the plan, the tensors' entries and bytes, not the metadata
    # (planning time, worker): the ranks that read one payload (a stage's tensor-parallel
    # ranks) compare it cheaply, and a payload planned again (after a store restart) has the
    # same one.
    content_crc: int = 0


def encode_payload(iteration: int, replica: int, stage: int, plan_bytes: bytes,
                   tensors: dict[int, dict[str, np.ndarray]], meta: dict) -> bytes:
    """Bytes for one rank; ``meta`` must be JSON-serialisable (numbers, strings, lists)."""
    entries, blobs = [], []
    offset = len(plan_bytes)
    for mb in sorted(tensors):
        for name, arr in sorted(tensors[mb].items()):  # bytes independent of insertion order
            dtype = next((k for k, v in DTYPES.items() if np.dtype(v) == arr.dtype), None)
            if dtype is None:
                raise DynaPipeError(f"tensor {name!r} of micro-batch {mb}: dtype {arr.dtype} cannot be sent; "
                                    f"use one of {sorted(DTYPES)}.")
            data = np.ascontiguousarray(arr).reshape(-1).view(np.uint8)  # joined below without a copy
            entries.append({"mb": int(mb), "name": name, "dtype": dtype, "shape": [int(d) for d in arr.shape],
                            "offset": offset, "nbytes": int(data.nbytes)})
            blobs.append(data)
            offset += int(data.nbytes)
    header = json.dumps({"iteration": int(iteration), "replica": int(replica), "stage": int(stage),
                         "plan_nbytes": len(plan_bytes), "tensors": entries, "meta": meta},
                        separators=(",", ":"), sort_keys=True).encode()
    crc = zlib.crc32(header)
    crc = zlib.crc32(plan_bytes, crc)
    for b in blobs:
        crc = zlib.crc32(b, crc)
    return b"".join([_PREFIX.pack(MAGIC, VERSION, 0, len(header), crc), header, plan_bytes, *blobs])


def _int(obj: dict, key: str, where: str) -> int:
    v = obj.get(key)
    if not isinstance(v, int) or isinstance(v, bool) or v < 0:
        raise DynaPipeError(f"{where}: field {key!r} must be a non-negative integer, got {v!r}.")
    return v


def decode_payload(data: bytes) -> Payload:
    """Parse and check a payload; :class:`DynaPipeError` naming what is wrong otherwise."""
    where = "plan payload"
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise DynaPipeError(f"{where}: expected bytes, got {type(data).__name__}.")
    if len(data) < _PREFIX.size:
        raise DynaPipeError(f"{where}: {len(data)} bytes is too short.")
    if data[:4] != MAGIC:
        raise DynaPipeError(f"{where}: bad magic {bytes(data[:4])!r}; not a plan payload.")
    version = struct.unpack_from("<H", data, 4)[0]
    if version != VERSION:
        raise DynaPipeError(f"{where}: version {version}, this reader understands {VERSION}; "
                            f"run the same dynapipe version on every node.")
    magic, version, _, hlen, crc = _PREFIX.unpack_from(data)
    if hlen > MAX_HEADER_BYTES:
        raise DynaPipeError(f"{where}: header claims {hlen} bytes, more than the {MAX_HEADER_BYTES}-byte limit; "
                            f"corrupted.")
    body = _PREFIX.size + hlen
    if body > len(data):
        raise DynaPipeError(f"{where}: header of {hlen} bytes runs past the end ({len(data)} bytes); truncated?")
    if zlib.crc32(memoryview(data)[_PREFIX.size:]) != crc:
        raise DynaPipeError(f"{where}: CRC32 mismatch over header, plan and tensor bytes; the payload is "
                            f"corrupted (or truncated).")
    try:
        header = json.loads(bytes(data[_PREFIX.size:body]))
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as e:
        raise DynaPipeError(f"{where}: corrupted header ({e}).") from None
    if not isinstance(header, dict):
        raise DynaPipeError(f"{where}: header is not a JSON object.")
    plan_n = _int(header, "plan_nbytes", where)
    rest = memoryview(data)[body:]
    if plan_n > len(rest):
        raise DynaPipeError(f"{where}: plan of {plan_n} bytes runs past the end; truncated?")
    out = Payload(_int(header, "iteration", where), _int(header, "replica", where),
                  _int(header, "stage", where), bytes(rest[:plan_n]), meta=header.get("meta") or {}, crc=crc)
    if not isinstance(out.meta, dict):
        raise DynaPipeError(f"{where}: 'meta' must be an object.")
    entries = header.get("tensors") or []
    if not isinstance(entries, list):
        raise DynaPipeError(f"{where}: 'tensors' must be a list.")
    for i, t in enumerate(entries):
        tw = f"{where}: tensor {i}"
        if not isinstance(t, dict):
            raise DynaPipeError(f"{tw}: entry is not an object.")
        dtype, shape, name = t.get("dtype"), t.get("shape"), t.get("name")
        if not isinstance(dtype, str) or dtype not in DTYPES:
            raise DynaPipeError(f"{tw}: dtype {dtype!r} is not one of {sorted(DTYPES)}.")
        if not isinstance(name, str) or not isinstance(shape, list) or not all(
                isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape):
            raise DynaPipeError(f"{tw}: needs a string name and a list of non-negative integer dims.")
        off, nbytes, mb = _int(t, "offset", tw), _int(t, "nbytes", tw), _int(t, "mb", tw)
        itemsize = np.dtype(DTYPES[dtype]).itemsize
        if nbytes != math.prod(shape) * itemsize:
            raise DynaPipeError(f"{tw} ({name!r}): {nbytes} bytes do not hold shape {shape} of {dtype}.")
        if off + nbytes > len(rest):
            raise DynaPipeError(f"{tw} ({name!r}): bytes {off}..{off + nbytes} run past the end; truncated?")
        arr = np.frombuffer(rest, dtype=DTYPES[dtype], count=math.prod(shape), offset=off).reshape(shape)
        out.tensors.setdefault(mb, {})[name] = arr
    listed = json.dumps(entries, separators=(",", ":"), sort_keys=True).encode()
    out.content_crc = zlib.crc32(rest, zlib.crc32(listed))
    return out
