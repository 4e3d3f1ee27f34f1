"""Plan and payload bytes under hostile input: bounded inflation, checksums, complete sets.

Every case must end in one :class:`DynaPipeError` line (no traceback, no newline), fast.
"""
import dataclasses
import json
import os
import struct
import time
import zlib

import numpy as np
import pytest

from dynapipe.cli import main
from dynapipe.config import load_model_config
from dynapipe.errors import DynaPipeError, PlanError
from dynapipe.plan import compile_plans, deserialize_plan, serialize_plan, validate_plans, write_plan_dir
from dynapipe.plan.binary import encode_body
from dynapipe.plan.serialize import MAX_BODY_BYTES, MAX_V1_JSON_BYTES, serialize_plan_v1
from dynapipe.plan.table import COL, InstructionTable, table_of
from dynapipe.runtime.plan_payload import decode_payload, encode_payload
from plan_helpers import chunked_micro_batches


@pytest.fixture(scope="module")
def grid():
    """Two replicas x three stages of the tiny model, compiled for one global batch."""
    tiny = load_model_config("gpt-tiny")
    rng = np.random.default_rng(3)
    lengths = rng.integers(1, 200, 24)
    mbs = chunked_micro_batches(lengths, 3)
    halves = [mbs[::2], mbs[1::2]]
    total = int(sum(m.real_tokens for m in mbs))
    return [compile_plans("1f1b", h, tiny, num_stages=3, replica=r, num_replicas=2, global_loss_tokens=total)
            for r, h in enumerate(halves)]


def _one_line(excinfo) -> str:
    msg = str(excinfo.value)
    assert "\n" not in msg and msg
    return msg


def _v2(body: bytes, *, declared=None, level=1) -> bytes:
    payload = zlib.compress(body, level)
    n = len(body) if declared is None else declared
    return struct.pack(">4sHHIII", b"DPPL", 2, 1, len(payload), zlib.crc32(payload), n) + payload


def test_binary_round_trip_is_exact_deterministic_and_lazy(grid):
    for plan in (p for row in grid for p in row):
        data = serialize_plan(plan)
        back = deserialize_plan(data)
        assert isinstance(back.instructions, InstructionTable)
        assert back.instructions._objects is None  # decoded as columns; objects only on demand
        assert back == plan and serialize_plan(back) == data
        assert list(back.instructions) == list(plan.instructions)
    # Version-1 files written by earlier releases still load.
    p = grid[1][2]
    assert deserialize_plan(serialize_plan_v1(p)) == p


def test_version1_token_keys_of_earlier_releases_read_as_loss_tokens(grid):
    """Earlier releases wrote the loss tokens under the keys ``real_tokens`` and
    ``global_real_tokens``; a document written by them reads into the renamed fields."""
    p = grid[1][2]
    doc = json.loads(zlib.decompress(serialize_plan_v1(p)[16:]))
    assert doc["real_tokens"] == p.loss_tokens > 0 and doc["global_real_tokens"] == p.global_loss_tokens
    assert "loss_tokens" not in doc and "global_loss_tokens" not in doc
    doc["real_tokens"], doc["global_real_tokens"] = 11, 22
    doc["micro_batches"][0][5] = 7
    payload = zlib.compress(json.dumps(doc, sort_keys=True, separators=(",", ":")).encode("ascii"))
    back = deserialize_plan(struct.pack(">4sHHII", b"DPPL", 1, 1, len(payload), zlib.crc32(payload)) + payload)
    assert (back.loss_tokens, back.global_loss_tokens, back.micro_batches[0].loss_tokens) == (11, 22, 7)


def test_inflation_is_bounded_by_the_header(grid):
    body = encode_body(grid[0][1])
    # A header that declares more than any plan: refused before inflating anything.
    huge = _v2(b"\0" * 1000, declared=MAX_BODY_BYTES + 1)
    with pytest.raises(PlanError, match="before inflating") as e:
        deserialize_plan(huge)
    _one_line(e)
    # A stream of zeros that would inflate to 64 MiB, under a modest declared size.
    bomb = zlib.compressobj(9)
    chunk = b"\0" * (1 << 20)
    stream = b"".join(bomb.compress(chunk) for _ in range(64)) + bomb.flush()
    t0 = time.perf_counter()
    with pytest.raises(PlanError, match="inflates past") as e:
        deserialize_plan(struct.pack(">4sHHIII", b"DPPL", 2, 1, len(stream), zlib.crc32(stream), len(body))
                         + stream)
    _one_line(e)
    assert time.perf_counter() - t0 < 2.0
    # A payload inflating to fewer bytes than declared.
    with pytest.raises(PlanError, match="declares"):
        deserialize_plan(_v2(body, declared=len(body) + 5))
    # Version 1 has no declared size: inflation stops at the version-1 limit.
    big = zlib.compress(b" " * (MAX_V1_JSON_BYTES + 10), 9)
    v1 = struct.pack(">4sHHII", b"DPPL", 1, 1, len(big), zlib.crc32(big)) + big
    with pytest.raises(PlanError, match="inflates past") as e:
        deserialize_plan(v1)
    _one_line(e)


def test_malformed_binary_bodies_are_refused(grid):
    plan = grid[0][1]
    body = bytearray(encode_body(plan))
    fixed = struct.calcsize("<qiiiiqq")
    cases = []
    bad = bytearray(body)
    struct.pack_into("<I", bad, fixed + 4 * 10, struct.unpack_from("<I", body, fixed + 40)[0] + 1)
    cases.append((bytes(bad), "counts describe"))
    cases.append((bytes(body[:-3]), "counts describe"))
    # Bad values in otherwise well-formed bodies, re-encoded with a valid CRC.
    rows = table_of(plan.instructions).rows
    for col, value, message in (("op", 99, "unknown opcode"), ("tensors", 10_000, "tensor-list index"),
                                ("recompute", 10_000, "string index")):
        t = table_of(plan.instructions)
        r = rows.copy()
        k = 1 if col != "recompute" else int(np.flatnonzero(r[:, 0] == 1)[0])
        r[k, COL[col]] = value
        doctored = InstructionTable(r, t.strings, t.tensor_lists)
        cases.append((encode_body(dataclasses.replace(plan, instructions=doctored)), message))
    for data, message in cases:
        with pytest.raises(PlanError, match=message) as e:
            deserialize_plan(_v2(data))
        _one_line(e)
    # Deeply nested JSON (meta of a version-2 body, or a version-1 document).
    deep = b"[" * 100_000 + b"]" * 100_000
    v1 = zlib.compress(deep)
    with pytest.raises(PlanError) as e:
        deserialize_plan(struct.pack(">4sHHII", b"DPPL", 1, 1, len(v1), zlib.crc32(v1)) + v1)
    _one_line(e)
    meta = json.dumps(plan.meta, sort_keys=True, separators=(",", ":")).encode()
    at = bytes(body).index(meta)
    swapped = bytes(body[:at]) + b"[" * (len(meta) // 2) + b"]" * (len(meta) - len(meta) // 2) + bytes(
        body[at + len(meta):])
    with pytest.raises(PlanError, match="meta") as e:
        deserialize_plan(_v2(swapped))
    _one_line(e)


def _payload(plan) -> bytes:
    tensors = {0: {"tokens": np.arange(12, dtype=np.int64).reshape(3, 4),
                   "loss_mask": np.ones((3, 4), np.float32)}}
    return encode_payload(plan.iteration, plan.replica, plan.stage, serialize_plan(plan), tensors, {"k": 1})


def test_store_payloads_are_checksummed_over_every_byte(grid):
    plan = grid[1][0]
    data = _payload(plan)
    p = decode_payload(data)
    assert deserialize_plan(p.plan_bytes) == plan
    assert p.tensors[0]["tokens"].tolist() == np.arange(12).reshape(3, 4).tolist()
    # A single flipped bit anywhere after the prefix: header, plan, token data.
    for pos in (20, 40, len(data) - 60, len(data) - 1):
        bad = bytearray(data)
        bad[pos] ^= 0x01
        with pytest.raises(DynaPipeError, match="CRC32") as e:
            decode_payload(bytes(bad))
        _one_line(e)
    for cut in (3, 17, len(data) // 2, len(data) - 1):
        with pytest.raises(DynaPipeError) as e:
            decode_payload(data[:cut])
        _one_line(e)
    # A header length beyond the limit is refused without reading it.
    bad = bytearray(data)
    struct.pack_into("<I", bad, 8, 1 << 31)
    with pytest.raises(DynaPipeError, match="limit") as e:
        decode_payload(bytes(bad))
    _one_line(e)
    # A previous version's payload is refused by version, clearly.
    old = bytearray(data)
    struct.pack_into("<H", old, 4, 1)
    with pytest.raises(DynaPipeError, match="version 1") as e:
        decode_payload(bytes(old))
    _one_line(e)
    # A compression bomb inside a well-formed payload: refused by the plan's bound.
    stream = zlib.compress(b"\0" * (8 << 20), 9)
    bomb = struct.pack(">4sHHIII", b"DPPL", 2, 1, len(stream), zlib.crc32(stream), 1000) + stream
    wrapped = decode_payload(encode_payload(0, 0, 0, bomb, {}, {}))
    with pytest.raises(PlanError, match="inflates past"):
        deserialize_plan(wrapped.plan_bytes)


def test_validate_requires_every_replica_and_agreeing_token_totals(grid, tmp_path, capsys):
    flat = [p for row in grid for p in row]
    assert validate_plans(flat).replicas == 2
    with pytest.raises(PlanError, match=r"incomplete.*replica\(s\) 1 have no plans") as e:
        validate_plans(grid[0])
    _one_line(e)
    assert validate_plans(grid[0], complete=False).replicas == 1
    off = [dataclasses.replace(p, global_loss_tokens=p.global_loss_tokens + 1) for p in flat]
    with pytest.raises(PlanError, match="add up to") as e:
        validate_plans(off)
    _one_line(e)
    # Through the command line: a whole replica missing, a renamed file, a directory.
    d = tmp_path / "plans"
    write_plan_dir(flat, str(d))
    assert main(["validate", str(d)]) == 0
    assert "valid: 6 plans" in capsys.readouterr().out
    for name in sorted(os.listdir(d))[3:]:
        os.remove(d / name)
    assert main(["validate", str(d)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "incomplete" in err
    write_plan_dir(flat, str(d))
    os.rename(d / "replica001-stage000.plan", d / "replica001-stage009.plan")
    assert main(["validate", str(d)]) == 2
    assert "belongs in replica001-stage000.plan" in capsys.readouterr().err
    os.remove(d / "replica001-stage009.plan")
    os.mkdir(d / "replica001-stage000.plan")
    assert main(["validate", str(d)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "not a regular file" in err


def test_decoded_instruction_tables_behave_like_tuples(grid):
    plan = grid[0][0]
    back = deserialize_plan(serialize_plan(plan)).instructions
    objs = tuple(plan.instructions)
    assert back + objs[:1] == objs + objs[:1] and objs[:1] + back == objs[:1] + objs
    assert back[-1] == objs[-1] and back[1:3] == objs[1:3] and len(back) == len(objs)
    assert objs[2] in back and back.index(objs[2]) == objs.index(objs[2])
    assert hash(back) == hash(objs) and back == objs


def test_damaged_fields_are_refused_by_name_not_by_a_crash(grid):
    from dynapipe.plan.validate_fast import group_is_valid

    flat = [p for row in grid for p in row]
    # A layout field declaring billions of ranks: listed to the first few, not built in full.
    huge = [dataclasses.replace(p, num_stages=2**31 - 1) for p in grid[0]]
    with pytest.raises(PlanError, match=r"no plan for rank\(s\) \[3, 4, 5, 6, 7, 8, 9, 10\] and 2147483636 more") \
            as e:
        validate_plans(huge, complete=False)
    _one_line(e)
    wide = [dataclasses.replace(p, num_replicas=2**31 - 1) for p in flat]
    with pytest.raises(PlanError, match=r"replica\(s\) 2, 3, 4, 5, 6, 7, 8, 9 and 2147483637 more") as e:
        validate_plans(wide)
    # One plan of a set declaring another layout (stage 4 of 5 among 3-stage plans) was a KeyError.
    odd = list(grid[0][:2]) + [dataclasses.replace(grid[0][2], num_stages=5, stage=4)]
    with pytest.raises(PlanError, match="declares a 2 x 5 layout, plan of replica 0 rank 0 a 2 x 3 one") as e:
        validate_plans(odd, complete=False)
    _one_line(e)
    # A micro-batch order that is not a list of indices.
    for order in (1, [0, "x"], [0.5, 1]):
        bad = [dataclasses.replace(p, meta=dict(p.meta, mb_order=order)) for p in grid[0]]
        with pytest.raises(PlanError, match="meta mb_order=.* is not an order of the plan's") as e:
            validate_plans(bad, complete=False)
        _one_line(e)
    # A chunk count that only compares equal to 1 goes to the checker that refuses it.
    for chunks in (True, 1.0):
        bad = [dataclasses.replace(p, meta=dict(p.meta, chunks=chunks)) for p in grid[0]]
        assert not group_is_valid(bad)
        with pytest.raises(PlanError, match="is not a positive number of chunks"):
            validate_plans(bad, complete=False)
    # A version-1 tensor whose dtype is not a string.
    doc = json.loads(zlib.decompress(serialize_plan_v1(grid[0][0])[struct.calcsize(">4sHHII"):]))
    doc["tensors"][0][0][2] = ["float32"]  # tensor lists of [name, shape, dtype]
    body = zlib.compress(json.dumps(doc).encode())
    with pytest.raises(PlanError, match=r"dtype \['float32'\] is not one of") as e:
        deserialize_plan(struct.pack(">4sHHII", b"DPPL", 1, 1, len(body), zlib.crc32(body)) + body)
    _one_line(e)


def test_strings_round_trip_and_micro_batch_sections_decode_by_their_counts(grid):
    import dynapipe.plan.binary as binary

    odd = dataclasses.replace(grid[0][0], schedule="1f1b-\udcff")
    assert deserialize_plan(serialize_plan(odd)).schedule == "1f1b-\udcff"
    # One sample count moved to the rows: the section is as long, but its counts do not add
    # up; the decoder's cache of sections once accepted it after the genuine plan.
    body = encode_body(grid[0][1])
    at = struct.calcsize("<qiiiiqq")
    counts = list(struct.unpack_from("<12I", body, at))
    counts[4] -= 1
    counts[5] += 1
    moved = body[:at] + struct.pack("<12I", *counts) + body[at + 48:]
    deserialize_plan(_v2(body))
    with pytest.raises(PlanError, match="malformed") as e:
        deserialize_plan(_v2(moved))
    _one_line(e)
    binary._DECODED_MBS.clear()


def test_a_payload_tensor_whose_dtype_is_not_a_string_is_refused_by_name():
    from dynapipe.runtime.plan_payload import _PREFIX, MAGIC, VERSION

    blob = encode_payload(0, 0, 0, b"PLAN", {0: {"tokens": np.zeros((2, 3), np.int64)}}, {})
    size = struct.unpack_from("<I", blob, 8)[0]
    header, rest = json.loads(blob[_PREFIX.size:_PREFIX.size + size]), blob[_PREFIX.size + size:]
    header["tensors"][0]["dtype"] = ["int64"]
    h = json.dumps(header).encode()
    with pytest.raises(DynaPipeError, match=r"dtype \['int64'\] is not one of") as e:
        decode_payload(_PREFIX.pack(MAGIC, VERSION, 0, len(h), zlib.crc32(rest, zlib.crc32(h))) + h + rest)
    _one_line(e)


@pytest.mark.parametrize("items,rank,needle", [(65, 0, "a tensor list holds 65 tensors, more than 64"),
                                               (1, 9, "a tensor has more than 8 dimensions")])
def test_tensor_lists_are_bounded_before_they_are_built(items, rank, needle):
    # A few hundred KiB of zeros once inflated into 22 million tensor objects (5 GiB).
    from dynapipe.plan.table import NCOLS

    strings, meta = [b"none"], b"{}"
    counts = struct.pack("<12I", 1, 4, len(meta), 0, 0, 0, 0, 1, items, rank * items, 0, 0)
    body = b"".join([struct.pack("<qiiiiqq", 0, 0, 1, 0, 1, 0, 0), counts, struct.pack("<I", 4), *strings, meta,
                     struct.pack("<i", items), struct.pack("<3i", 0, 0, rank) * items, bytes(8 * rank * items),
                     bytes([1] * NCOLS)])
    with pytest.raises(PlanError, match=needle) as e:
        deserialize_plan(_v2(body))
    _one_line(e)


def test_the_writer_keeps_the_readers_bounds(grid):
    # A 65-tensor message validated and serialized, and its bytes were then refused on reading.
    from dynapipe.plan.instructions import SendActivationStart, TensorSpec

    plan = grid[0][0]
    k, inst = next((k, i) for k, i in enumerate(plan.instructions) if isinstance(i, SendActivationStart))
    many = dataclasses.replace(inst, tensors=inst.tensors * 65)
    rows = list(plan.instructions)
    rows[k] = many
    with pytest.raises(PlanError, match="moves or loads 65 tensor.* at most 64") as e:
        serialize_plan(dataclasses.replace(plan, instructions=tuple(rows)))
    _one_line(e)
    deep = dataclasses.replace(inst, tensors=(TensorSpec("x", (1,) * 9, "float32"),))
    rows[k] = deep
    with pytest.raises(PlanError, match="of up to 9 dimensions"):
        serialize_plan(dataclasses.replace(plan, instructions=tuple(rows)))
