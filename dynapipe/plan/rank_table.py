"""One rank's instructions, built as columns with numpy (no object per instruction).

The order is the one :mod:`dynapipe.plan.compile` documents. Every instruction gets a
sort key ``(major, minor, sub)``: ``major`` is the op it stands next to (its index in
the rank's op order; -1 before the first op), ``minor`` its place around that op
(0 load, 1 receive finish, 2 the op, 3 frees after a backward, 4 posted transfers,
5 send finish and its free), and ``sub`` the order among equals (the transfer's place
in the global post order, or the buffer kind). One lexsort then gives the list.

A split backward (``BI`` then ``BW``) compiles its ``BI`` exactly as a backward (the
gradient receive before it, the input-gradient send and every buffer free after it,
``part="input"``) and its ``BW`` alone (``part="weight"``, no transfer, no buffer): the
weight part's tensors are the executor's, not plan buffers.
"""
from __future__ import annotations

from typing import Optional, Sequence

import numpy as np

from dynapipe.errors import DynaPipeError
from dynapipe.plan.instructions import BUFFER_KINDS
from dynapipe.plan.table import COL, NCOLS, OPCODE_INDEX, InstructionTable

_BUF = {k: -1 - i for i, k in enumerate(BUFFER_KINDS)}
_OP = OPCODE_INDEX


def _op_codes(name: str, stage: int, ops: Sequence, code: dict, known: str) -> tuple[np.ndarray, np.ndarray]:
    """``(kind, mb)`` of ``ops``: each kind's ``code``, pushed past every code by its chunk (so
    an op of a chunk > 0 is out of range), and its micro-batch; ``known`` says which kinds."""
    stride = max(code.values()) + 1
    try:
        kind = np.fromiter((code[op.kind] + stride * op.chunk for op in ops), dtype=np.int64, count=len(ops))
    except KeyError as e:
        raise DynaPipeError(f"schedule {name!r}: stage {stage} has an op of kind {e.args[0]!r}; {known}.") from None
    return kind, np.fromiter((op.mb for op in ops), dtype=np.int64, count=len(ops))


def op_positions(name: str, stage: int, ops: Sequence, M: int) -> tuple[np.ndarray, np.ndarray]:
    """``(index of F(i), index of B(i))`` in stage ``stage``'s op list, per micro-batch
    ``i``; :class:`DynaPipeError` unless the stage runs every micro-batch's forward once,
    then its backward once (kinds F and B, chunk 0), as ``Schedule.check`` demands."""
    kind, mb = _op_codes(name, stage, ops, {"F": 0, "B": 1}, "only F and B are compiled so far")
    if ((kind > 1) | (mb < 0) | (mb >= M)).any() or len(ops) != 2 * M:
        raise DynaPipeError(f"schedule {name!r}: stage {stage} must run micro-batches 0..{M - 1} (chunk 0), "
                            f"each forward and backward once; it has {len(ops)} ops.")
    is_b = kind == 1
    pos = np.arange(len(ops))
    f, b = np.full(M, -1, np.int64), np.full(M, -1, np.int64)
    f[mb[~is_b]] = pos[~is_b]
    b[mb[is_b]] = pos[is_b]
    if (f < 0).any() or (b < 0).any() or (b < f).any():
        bad = int(np.flatnonzero((f < 0) | (b < 0) | (b < f))[0])
        raise DynaPipeError(f"schedule {name!r}: stage {stage} does not run F{bad} once and then B{bad} once.")
    return f, b


def backward_positions(name: str, stage: int, ops: Sequence, M: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(f, b, w)``: per micro-batch ``i`` the index of ``F(i)``, of its backward (``B(i)``
    or ``BI(i)``) and of ``BW(i)`` (-1 where the backward is whole) in stage ``stage``'s op
    list; :class:`DynaPipeError` unless the stage runs every micro-batch's forward once,
    then either ``B`` once or ``BI`` then ``BW`` once each (chunk 0), as ``Schedule.check``
    demands."""
    kind, mb = _op_codes(name, stage, ops, {"F": 0, "B": 1, "BI": 1, "BW": 2}, "only F, B, BI and BW are compiled")
    inputs = np.fromiter((op.kind == "BI" for op in ops), dtype=bool, count=len(ops))
    if ((kind > 2) | (mb < 0) | (mb >= M)).any():
        raise DynaPipeError(f"schedule {name!r}: stage {stage} must run micro-batches 0..{M - 1} (chunk 0); it has "
                            f"{len(ops)} ops.")
    pos = np.arange(len(ops))
    out = []
    for k in range(3):
        sel = kind == k
        at = np.full(M, -1, np.int64)
        at[mb[sel]] = pos[sel]
        if np.bincount(mb[sel], minlength=M).max(initial=0) > 1:
            dup = int(np.argmax(np.bincount(mb[sel], minlength=M)))
            raise DynaPipeError(f"schedule {name!r}: stage {stage} runs the {('forward', 'backward', 'weight part')[k]}"
                                f" of micro-batch {dup} more than once.")
        out.append(at)
    f, b, w = out
    split = np.zeros(M, bool)
    split[mb[inputs]] = True
    bad = (f < 0) | (b < 0) | (b < f) | (split != (w >= 0)) | ((w >= 0) & (w < b))
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        raise DynaPipeError(f"schedule {name!r}: stage {stage} does not run F{i} once and then B{i} once (or BI{i} "
                            f"then BW{i}).")
    return f, b, w


def split_positions_from_arrays(kind: np.ndarray, mb: np.ndarray, nops: np.ndarray,
                                M: int) -> Optional[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """``(f, b, w)``: ``[S, M]`` op positions of every forward, input part and weight part,
    from a simulated split-backward schedule's ``[S, L]`` arrays (kind 0 = F, 2 = BI,
    3 = BW); ``None`` unless every stage runs each micro-batch's F, BI and BW once in that
    order (the caller then reads the ops, which names what is wrong)."""
    S = kind.shape[0]
    if S == 0 or (np.asarray(nops) != 3 * M).any() or kind.shape[1] < 3 * M:
        return None
    kind, mb = kind[:, :3 * M], mb[:, :3 * M]
    if ((kind != 0) & (kind != 2) & (kind != 3)).any() or ((mb < 0) | (mb >= M)).any():
        return None
    part = np.where(kind == 0, 0, kind - 1)
    slot = (np.arange(S)[:, None] * M + mb) * 3 + part
    if M and (np.bincount(slot.ravel(), minlength=3 * S * M) != 1).any():
        return None
    pos = np.empty(3 * S * M, np.int64)
    pos[slot.ravel()] = np.tile(np.arange(3 * M), S)
    pos = pos.reshape(S, M, 3)
    f, b, w = pos[:, :, 0], pos[:, :, 1], pos[:, :, 2]
    if (b < f).any() or (w < b).any():
        return None
    return f, b, w


def positions_from_arrays(kind: np.ndarray, mb: np.ndarray, nops: np.ndarray,
                          M: int) -> Optional[tuple[np.ndarray, np.ndarray]]:
    """``(f, b)``: ``[S, M]`` op positions of every forward and backward, from a simulated
    schedule's ``[S, L]`` kind/micro-batch arrays (kind 0 = F, 1 = B); ``None`` unless every
    stage runs each micro-batch's forward once and then its backward once (the caller
    then reads the ops, which names what is wrong)."""
    S = kind.shape[0]
    if S == 0 or (np.asarray(nops) != 2 * M).any() or kind.shape[1] < 2 * M:
        return None
    kind, mb = kind[:, :2 * M], mb[:, :2 * M]
    if ((kind != 0) & (kind != 1)).any() or ((mb < 0) | (mb >= M)).any():
        return None
    # Flat slot of every op: (stage, micro-batch, kind); each must be hit exactly once.
    slot = (np.arange(S)[:, None] * M + mb) * 2 + kind
    if M and (np.bincount(slot.ravel(), minlength=2 * S * M) != 1).any():
        return None
    pos = np.empty(2 * S * M, np.int64)
    pos[slot.ravel()] = np.tile(np.arange(2 * M), S)
    pos = pos.reshape(S, M, 2)
    f, b = pos[:, :, 0], pos[:, :, 1]
    if (b < f).any():
        return None
    return f, b


def rank_table(s: int, S: int, M: int, f_idx: Sequence[np.ndarray], b_idx: Sequence[np.ndarray],
               ends: Sequence[np.ndarray], mb_shape: np.ndarray, msg_ids: list, load_ids: np.ndarray,
               strings: tuple, tensor_lists: tuple, recompute_sid: int, full_sid: int,
               w_idx: Optional[np.ndarray] = None, input_sid: int = -1, weight_sid: int = -1) -> InstructionTable:
    """The instruction table of pipeline rank ``s`` of ``S`` running ``M`` micro-batches.

    ``f_idx[r]``/``b_idx[r]``: op positions of every micro-batch's forward/backward (or
    input part of a split backward) on rank ``r``; ``ends[r]``: simulated end (ms) of rank
    ``r``'s ops, in op order (an array); ``mb_shape``: ``[M, 3]`` mbs, seqlen, dec_seqlen;
    ``msg_ids[b]``: per micro-batch, the tensor-list index of boundary ``b``'s message;
    ``load_ids``: per micro-batch the tensor-list index of what this rank loads (-1:
    nothing). ``w_idx``: op positions of this rank's weight parts when it splits every
    backward (``None``: it splits none); ``input_sid``/``weight_sid`` then index the part
    names ``"input"``/``"weight"`` in ``strings``.
    """
    i = np.arange(M, dtype=np.int64)
    fi, bi = f_idx[s], b_idx[s]
    loads = bool(M) and load_ids[0] >= 0
    # Every part has one row per micro-batch: (major, minor, sub, op, buffer kind code,
    # tensors, peer); major and the array-valued fields are [M] arrays.
    parts = []

    def add(major, minor, sub, op, buf=0, tensors=-1, peer=0):
        parts.append((major, minor, sub, _OP[op], buf, tensors, peer))

    if loads:
        add(fi, 0, 0, "load", tensors=load_ids)
    add(fi, 2, 0, "fw")
    add(bi, 2, 0, "bw")
    if w_idx is not None:
        weight_part = len(parts)
        add(w_idx, 2, 0, "bw")
    free_kinds = [k for k, present in (("input", loads), ("act_in", s > 0), ("act_out", s < S - 1),
                                       ("grad_in", s < S - 1)) if present]
    for j, k in enumerate(free_kinds):
        add(bi, 3, j, "free", buf=_BUF[k])
    # Posts: (gap, ready time, kind, micro-batch, boundary) orders them globally.
    post_gap, post_t, post_kind, post_b, post_rows = [], [], [], [], []
    e_s = ends[s]

    def recv_gap(t, consumer):
        return np.minimum(np.searchsorted(e_s, t, side="right") - 1, consumer - 1)

    if s < S - 1:
        ids = msg_ids[s]
        add(fi, 5, 0, "send_act_finish", buf=_BUF["act_out"], tensors=ids, peer=s + 1)
        add(bi, 1, 0, "recv_grad_finish", buf=_BUF["grad_in"], tensors=ids, peer=s + 1)
        t = e_s[fi]
        post_gap.append(fi), post_t.append(t), post_kind.append(0), post_b.append(s)
        post_rows.append(("send_act_start", _BUF["act_out"], ids, s + 1))
        t = ends[s + 1][b_idx[s + 1]]
        post_gap.append(recv_gap(t, bi)), post_t.append(t), post_kind.append(1), post_b.append(s)
        post_rows.append(("recv_grad_start", _BUF["grad_in"], ids, s + 1))
    if s > 0:
        ids = msg_ids[s - 1]
        add(fi, 1, 0, "recv_act_finish", buf=_BUF["act_in"], tensors=ids, peer=s - 1)
        add(bi, 5, 0, "send_grad_finish", buf=_BUF["grad_out"], tensors=ids, peer=s - 1)
        add(bi, 5, 1, "free", buf=_BUF["grad_out"])
        t = ends[s - 1][f_idx[s - 1]]
        post_gap.append(recv_gap(t, fi)), post_t.append(t), post_kind.append(0), post_b.append(s - 1)
        post_rows.append(("recv_act_start", _BUF["act_in"], ids, s - 1))
        t = e_s[bi]
        post_gap.append(bi), post_t.append(t), post_kind.append(1), post_b.append(s - 1)
        post_rows.append(("send_grad_start", _BUF["grad_out"], ids, s - 1))
    if post_gap:
        n = len(post_gap)
        gap = np.concatenate(post_gap)
        tt = np.concatenate(post_t)
        kk = np.repeat(np.array(post_kind), M)
        bb = np.repeat(np.array(post_b), M)
        mm = np.tile(i, n)
        rank = np.empty(n * M, np.int64)
        rank[np.lexsort((bb, mm, kk, tt, gap))] = np.arange(n * M)
        for j, (op, buf, ids, peer) in enumerate(post_rows):
            sl = slice(j * M, (j + 1) * M)
            add(gap[sl], 4, rank[sl], op, buf=buf, tensors=ids, peer=peer)
    P = len(parts)
    # One sort key: (major, minor, sub) with major >= -1, minor < 6 and sub < 4M, as one
    # integer; the stable sort keeps the order of the parts for equal keys, as a
    # lexsort on the three columns would.
    major = np.empty((P, M), np.int64)
    sub = np.empty((P, M), np.int64)
    tensors = np.empty((P, M), np.int64)
    for k, p in enumerate(parts):
        major[k], sub[k], tensors[k] = p[0], p[2], p[5]
    scalars = np.array([(p[1], p[3], p[4], p[6]) for p in parts], dtype=np.int64).reshape(P, 4)
    minor = np.repeat(scalars[:, 0], M)
    width = 4 * M + 8
    key = ((major.ravel() + 1) * 6 + minor) * width + sub.ravel()
    order = np.argsort(key, kind="stable")
    part = order // M if M else order
    op, buf, peer = (scalars[:, c][part] for c in (1, 2, 3))
    mb = order % M if M else order
    rows = np.zeros((len(order), NCOLS), dtype=np.int32)
    rows[:, COL["op"]] = op
    rows[:, COL["mb"]] = mb
    comm = (op >= _OP["send_act_start"]) & (op <= _OP["recv_grad_finish"])
    rows[:, COL["peer"]] = np.where(comm, peer, 0)
    rows[:, COL["group"]] = np.where(comm, -1, 0)
    rows[:, COL["buffer"]] = buf
    rows[:, COL["tensors"]] = np.where(comm | (op == _OP["load"]), tensors.ravel()[order], 0)
    compute = (op == _OP["fw"]) | (op == _OP["bw"])
    shape = mb_shape[mb]
    for c, name in enumerate(("mbs", "seqlen", "dec_seqlen")):
        rows[:, COL[name]] = np.where(compute, shape[:, c], 0)
    rows[:, COL["recompute"]] = np.where(compute, recompute_sid, 0)
    if w_idx is None:
        rows[:, COL["part"]] = np.where(op == _OP["bw"], full_sid, 0)
    else:
        rows[:, COL["part"]] = np.where(op == _OP["bw"], np.where(part == weight_part, weight_sid, input_sid), 0)
    return InstructionTable(rows, strings, tensor_lists)
