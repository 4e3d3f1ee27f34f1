"""The binary body of a plan (format versions 2 and 3 share it): fixed-width little-endian arrays, no parsing loop.

Body layout (before compression; every count is in the fixed part, so the body's exact
size follows from it and is checked before anything is read)::

    fixed      <qiiiiqq : iteration, stage, num_stages, replica, num_replicas,
                          loss_tokens, global_loss_tokens
    counts     <12I     : strings, string bytes, meta bytes, micro-batches, samples,
                          rows, row items, tensor lists, tensor items, dims,
                          instructions, (schedule string << 16 | recompute string)
    strings    u32[strings] lengths, then the UTF-8 bytes
    meta       JSON (UTF-8), the plan's ``meta``
    mbs        i64[micro-batches, 7] : mb, mbs, seqlen, dec_seqlen, loss_tokens,
                                        samples, rows
    samples    i32[samples]; row lengths i32[rows]; row items i32[row items]
    tensors    i32[tensor lists] items per list; i32[tensor items, 3] name string,
               dtype number, ndim; i64[dims]
    widths     u8[NCOLS] : bytes per value of each instruction column (1, 2 or 4)
    columns    each column of the instruction rows (see :mod:`dynapipe.plan.table`) as
               little-endian integers of its width: column by column and narrow,
               so a plan is small before compression and compresses quickly
"""
from __future__ import annotations

import json
import struct
import numpy as np

from dynapipe.errors import PlanError
from dynapipe.plan.instructions import DTYPES, ExecutionPlan, MicroBatchInfo, TensorSpec
from dynapipe.plan.table import NCOLS, InstructionTable, table_of
from dynapipe.plan.tensor_section import tensor_section

_FIXED = struct.Struct("<qiiiiqq")
_COUNTS = struct.Struct("<12I")
# Encoded micro-batch lists, keyed by the identity of the tuple (every stage of a
# replica shares one), holding the tuple so the identity stays valid.
_MB_CACHE: dict[int, tuple] = {}
# Decoded micro-batch sections by their bytes (the most recent few).
_DECODED_MBS: dict[tuple, tuple] = {}
#: Tensors one instruction may move or load, and dimensions a tensor may have.
MAX_TENSORS_PER_LIST = 64
MAX_TENSOR_RANK = 8


def _want(cond: bool, what: str) -> None:
    if not cond:
        raise PlanError(f"plan payload is malformed: {what}.")


def _encode_micro_batches(mbs: tuple) -> tuple[bytes, int, int, int]:
    hit = _MB_CACHE.get(id(mbs))
    if hit is not None and hit[0] is mbs:
        return hit[1]
    head, samples, row_lens, row_items = [], [], [], []
    for m in mbs:
        head.append((m.mb, m.mbs, m.seqlen, m.dec_seqlen, m.loss_tokens, len(m.samples), len(m.rows)))
        samples.extend(m.samples)
        for r in m.rows:
            row_lens.append(len(r))
            row_items.extend(r)
    try:
        parts = [np.array(head, dtype="<i8").reshape(-1)]
        for x in (samples, row_lens, row_items):
            a = np.array(x, dtype=np.int64)
            if a.size and not (0 <= a.min() and a.max() < 1 << 31):
                raise ValueError("sample positions and row lengths must lie in [0, 2**31)")
            parts.append(a.astype("<i4"))
    except (TypeError, ValueError, OverflowError) as e:
        raise PlanError(f"micro-batch list cannot be encoded ({e}); its fields must be integers.") from None
    out = (b"".join(p.tobytes() for p in parts), len(samples), len(row_lens), len(row_items))
    if len(_MB_CACHE) > 8:
        _MB_CACHE.clear()
    _MB_CACHE[id(mbs)] = (mbs, out)
    return out


def encode_body(plan: ExecutionPlan) -> bytes:
    """The uncompressed binary body of ``plan`` (versions 2 and 3)."""
    table = table_of(plan.instructions)
    strings = list(table.strings)
    index = {s: i for i, s in enumerate(strings)}

    def sid(s: str) -> int:
        if type(s) is not str:
            raise PlanError(f"plan of stage {plan.stage}: expected a string, got {s!r}.")
        i = index.get(s)
        if i is None:
            i = index[s] = len(strings)
            strings.append(s)
        return i

    # The reader's bounds, kept here too: a plan that serializes reads back.
    for specs in table.tensor_lists:
        if len(specs) > MAX_TENSORS_PER_LIST or any(len(t.shape) > MAX_TENSOR_RANK for t in specs):
            raise PlanError(f"plan of stage {plan.stage} moves or loads {len(specs)} tensor(s) of up to "
                            f"{max((len(t.shape) for t in specs), default=0)} dimensions in one instruction; a plan "
                            f"holds at most {MAX_TENSORS_PER_LIST} of at most {MAX_TENSOR_RANK}.")
    list_lens, items, dims = tensor_section(table.tensor_lists, sid, plan.stage)
    sched, rec = sid(plan.schedule), sid(plan.recompute)
    try:
        meta = json.dumps(plan.meta, sort_keys=True, separators=(",", ":"), ensure_ascii=True,
                          allow_nan=False).encode("ascii")
    except (TypeError, ValueError) as e:
        raise PlanError(f"plan of stage {plan.stage} cannot be serialized: {e} "
                        f"(plan.meta may hold only JSON values).") from None
    if len(strings) >= 1 << 16 and (sched >= 1 << 16 or rec >= 1 << 16):
        raise PlanError("plan holds too many distinct strings to encode.")
    encoded = [s.encode("utf-8", "surrogatepass") for s in strings]
    mb_bytes, n_samples, n_rows, n_row_items = _encode_micro_batches(plan.micro_batches)
    try:
        fixed = _FIXED.pack(plan.iteration, plan.stage, plan.num_stages, plan.replica, plan.num_replicas,
                            plan.loss_tokens, plan.global_loss_tokens)
    except struct.error as e:
        raise PlanError(f"plan of stage {plan.stage} has a field out of range: {e}.") from None
    counts = _COUNTS.pack(len(strings), sum(map(len, encoded)), len(meta), len(plan.micro_batches), n_samples,
                          n_rows, n_row_items, len(list_lens), len(items), len(dims), len(table),
                          sched << 16 | rec)
    return b"".join([fixed, counts, np.array([len(e) for e in encoded], "<u4").tobytes(), *encoded, meta, mb_bytes,
                     list_lens.astype("<i4").tobytes(), items.astype("<i4").tobytes(),
                     dims.astype("<i8").tobytes(), *_encode_columns(table.rows)])


_WIDTH_TYPES = {1: "<i1", 2: "<i2", 4: "<i4"}


def _encode_columns(rows: np.ndarray) -> list[bytes]:
    # Column-major once: each column is then contiguous, for its range and its bytes.
    cols = np.ascontiguousarray(rows.T)
    if cols.shape[1]:
        lo, hi = cols.min(axis=1), cols.max(axis=1)
    else:
        lo = hi = np.zeros(NCOLS, np.int64)
    widths = np.where((lo >= -128) & (hi < 128), 1, np.where((lo >= -32768) & (hi < 32768), 2, 4)).tolist()
    out = [bytes(widths)]
    # Neighbouring columns of one width are written together: their rows of ``cols``
    # are exactly the bytes of each column in turn.
    c = 0
    while c < NCOLS:
        e = c + 1
        while e < NCOLS and widths[e] == widths[c]:
            e += 1
        out.append(cols[c:e].astype(_WIDTH_TYPES[widths[c]]).tobytes())
        c = e
    return out


class _Reader:
    def __init__(self, data: bytes):
        self.data, self.pos = data, 0

    def take(self, dtype: str, count: int, shape=None) -> np.ndarray:
        arr = np.frombuffer(self.data, dtype=dtype, count=count, offset=self.pos)
        self.pos += arr.nbytes
        return arr.reshape(shape) if shape is not None else arr

    def raw(self, n: int) -> bytes:
        out = self.data[self.pos:self.pos + n]
        self.pos += n
        return out


def decode_body(body: bytes) -> ExecutionPlan:
    """Rebuild a plan from a version-2 or -3 body; :class:`PlanError` naming what is wrong."""
    head = _FIXED.size + _COUNTS.size
    _want(len(body) >= head, f"body of {len(body)} bytes is shorter than its {head}-byte fixed part")
    fixed = _FIXED.unpack_from(body)
    (n_str, str_bytes, meta_bytes, n_mb, n_samples, n_rows, n_row_items, n_lists, n_items, n_dims, n_insts,
     names) = _COUNTS.unpack_from(body, _FIXED.size)
    expect = (head + 4 * n_str + str_bytes + meta_bytes + 56 * n_mb + 4 * (n_samples + n_rows + n_row_items)
              + 4 * n_lists + 12 * n_items + 8 * n_dims + NCOLS)
    _want(expect <= len(body), f"its counts describe at least {expect} bytes but the body has {len(body)}")
    widths = list(body[expect - NCOLS:expect])
    _want(all(w in _WIDTH_TYPES for w in widths), f"instruction column widths {widths} are not 1, 2 or 4")
    expect += sum(widths) * n_insts
    _want(expect == len(body), f"its counts describe {expect} bytes but the body has {len(body)}")
    rd = _Reader(body)
    rd.pos = head
    lens = rd.take("<u4", n_str).astype(np.int64)
    _want(int(lens.sum()) == str_bytes, "string lengths do not add up to the string bytes")
    blob = rd.raw(str_bytes)
    ends = np.cumsum(lens).tolist()
    try:
        # surrogatepass as the writer encodes: a string Python holds round-trips.
        strings = [blob[a:b].decode("utf-8", "surrogatepass") for a, b in zip([0] + ends[:-1], ends)]
    except UnicodeDecodeError as e:
        raise PlanError(f"plan payload is malformed: a string is not UTF-8 ({e}).") from None
    meta_text = rd.raw(meta_bytes)
    try:
        meta = json.loads(meta_text.decode("ascii"))
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise PlanError(f"plan payload is malformed: meta is not JSON ({e}).") from None
    _want(isinstance(meta, dict), "meta must be an object")
    sched, rec = names >> 16, names & 0xFFFF
    _want(sched < n_str and rec < n_str, "schedule or recompute names a string that is not there")
    # Every stage of a replica carries the same micro-batch list: decode each distinct
    # section once (the result is immutable, so sharing it is safe).
    size = 56 * n_mb + 4 * (n_samples + n_rows + n_row_items)
    # Keyed by the counts too: the same bytes split by other counts decode differently (or not).
    section = (body[rd.pos:rd.pos + size], n_mb, n_samples, n_rows, n_row_items)
    micro_batches = _DECODED_MBS.get(section)
    if micro_batches is None:
        micro_batches = _decode_micro_batches(rd, n_mb, n_samples, n_rows, n_row_items)
        if len(_DECODED_MBS) >= 16:
            _DECODED_MBS.pop(next(iter(_DECODED_MBS)))
        _DECODED_MBS[section] = micro_batches
    else:
        rd.pos += size
    tensor_lists = _decode_tensor_lists(rd, strings, n_lists, n_items, n_dims)
    rd.pos += NCOLS
    rows = np.empty((n_insts, NCOLS), dtype=np.int32)
    for c, w in enumerate(widths):
        rows[:, c] = rd.take(_WIDTH_TYPES[w], n_insts)
    table = InstructionTable(rows, strings, tensor_lists)
    table.check("plan payload")
    iteration, stage, num_stages, replica, num_replicas, loss, global_loss = fixed
    return ExecutionPlan(iteration=iteration, stage=stage, num_stages=num_stages, replica=replica,
                         num_replicas=num_replicas, schedule=strings[sched], recompute=strings[rec],
                         micro_batches=micro_batches, instructions=table, loss_tokens=loss,
                         global_loss_tokens=global_loss, meta=meta)


def _decode_micro_batches(rd: _Reader, n_mb: int, n_samples: int, n_rows: int, n_row_items: int) -> tuple:
    head = rd.take("<i8", 7 * n_mb, (n_mb, 7))
    samples = rd.take("<i4", n_samples)
    row_lens = rd.take("<i4", n_rows).astype(np.int64)
    row_items = rd.take("<i4", n_row_items)
    _want(bool((head[:, 5:] >= 0).all()), "a micro-batch has a negative sample or row count")
    _want(int(head[:, 5].sum()) == n_samples and int(head[:, 6].sum()) == n_rows,
          "micro-batch sample or row counts do not add up")
    _want(bool((row_lens >= 0).all()) and int(row_lens.sum()) == n_row_items, "row lengths do not add up")
    s_list, r_lens, r_items = samples.tolist(), row_lens.tolist(), row_items.tolist()
    out, si, ri, ii = [], 0, 0, 0
    for mb, mbs, seqlen, dec, loss, ns, nr in head.tolist():
        rows = []
        for n in r_lens[ri:ri + nr]:
            rows.append(tuple(r_items[ii:ii + n]))
            ii += n
        out.append(MicroBatchInfo(mb=mb, samples=tuple(s_list[si:si + ns]), mbs=mbs, seqlen=seqlen,
                                  dec_seqlen=dec, loss_tokens=loss, rows=tuple(rows)))
        si += ns
        ri += nr
    return tuple(out)


def _decode_tensor_lists(rd: _Reader, strings: list, n_lists: int, n_items: int, n_dims: int) -> tuple:
    lens = rd.take("<i4", n_lists)
    items = rd.take("<i4", 3 * n_items, (n_items, 3))
    dims = rd.take("<i8", n_dims)
    _want(bool((lens >= 0).all()) and int(lens.astype(np.int64).sum()) == n_items,
          "tensor-list lengths do not add up")
    # A message or a load moves a handful of tensors of a few dims; without these bounds a
    # few hundred KiB of zeros inflate to millions of tensor objects (GiBs) within the body limit.
    _want(not n_lists or int(lens.max()) <= MAX_TENSORS_PER_LIST,
          f"a tensor list holds {int(lens.max()) if n_lists else 0} tensors, more than {MAX_TENSORS_PER_LIST}")
    if n_items:
        _want(bool(((items[:, 0] >= 0) & (items[:, 0] < len(strings))).all()), "a tensor name is not in the strings")
        _want(bool(((items[:, 1] >= 0) & (items[:, 1] < len(DTYPES))).all()), "a tensor dtype number is unknown")
        _want(bool((items[:, 2] >= 0).all()) and int(items[:, 2].astype(np.int64).sum()) == n_dims,
              "tensor ranks do not add up to the dims")
        _want(int(items[:, 2].max()) <= MAX_TENSOR_RANK, f"a tensor has more than {MAX_TENSOR_RANK} dimensions")
    _want(bool((dims >= 0).all()), "a tensor dimension is negative")
    d_list, out, k, di = dims.tolist(), [], 0, 0
    all_items = items.tolist()
    for n in lens.tolist():
        specs = []
        for name, dt, nd in all_items[k:k + n]:
            specs.append(TensorSpec(strings[name], tuple(d_list[di:di + nd]), DTYPES[dt]))
            di += nd
        out.append(tuple(specs))
        k += n
    return tuple(out)

