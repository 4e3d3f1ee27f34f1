"""A linear-time acceptance check for one replica's plans stored as instruction tables.

:func:`group_is_valid` decides, with numpy over the instruction columns and one linear
pass over the transfers, whether a replica's plans have the shape the compiler gives
them and satisfy every invariant :mod:`dynapipe.plan.validate` checks. It only ever
*accepts*: any plan outside that shape, or any doubt, returns ``False`` and the caller
runs the full object-by-object validator, which finds and names the error (or accepts
an unusual but valid plan). So it is sufficient, not necessary: it may send a valid plan
to the slow path, never pass an invalid one.

The shape accepted, per rank ``s`` of ``S`` and micro-batch ``i`` (``plan.micro_batches[i].mb
== i``, chunk 0, ungrouped posts, canonical buffer names): a forward, a backward, a load
on every micro-batch or on none (none only on middle ranks), the four transfers with
each neighbour and their finishes, and one free of every buffer the rank creates; a
rank that splits its backwards splits every one (a ``part="input"`` backward, then a
``part="weight"`` one, which touches no buffer), else every backward is ``full``. The
order constraints checked are those the validator's buffer state machine implies for
that shape; the deadlock check replays the in-order point-to-point model on the
transfers alone.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

from dynapipe.plan.instructions import BUFFER_KINDS, DTYPES, ExecutionPlan, sequence_shards
from dynapipe.plan.table import COL, OPCODE_INDEX, InstructionTable

_OP = OPCODE_INDEX
_K = {k: -1 - i for i, k in enumerate(BUFFER_KINDS)}
_STARTS = {"send_act_start": "send_act_finish", "recv_act_start": "recv_act_finish",
           "send_grad_start": "send_grad_finish", "recv_grad_start": "recv_grad_finish"}
_BUF_OF = {"send_act_start": "act_out", "send_act_finish": "act_out", "recv_act_start": "act_in",
           "recv_act_finish": "act_in", "send_grad_start": "grad_out", "send_grad_finish": "grad_out",
           "recv_grad_start": "grad_in", "recv_grad_finish": "grad_in"}


def _slots(s: int, S: int, loads: bool, split: bool) -> list[tuple[str, str, int]]:
    """The expected ``(opcode, buffer kind, peer)`` of every instruction of one micro-batch
    (for the weight part of a split backward: ``("bw", "weight", 0)``)."""
    out = [("fw", "", 0), ("bw", "", 0)] + ([("bw", "weight", 0)] if split else [])
    if loads:
        out += [("load", "", 0), ("free", "input", 0)]
    if s < S - 1:
        out += [(op, _BUF_OF[op], s + 1) for op in ("send_act_start", "send_act_finish", "recv_grad_start",
                                                     "recv_grad_finish")]
        out += [("free", "act_out", 0), ("free", "grad_in", 0)]
    if s > 0:
        out += [(op, _BUF_OF[op], s - 1) for op in ("recv_act_start", "recv_act_finish", "send_grad_start",
                                                     "send_grad_finish")]
        out += [("free", "act_in", 0), ("free", "grad_out", 0)]
    return out


def _rank(plan: ExecutionPlan, canon: dict):
    """One rank's transfers ``{start opcode: (start rows, finish rows, tensor ids)}``
    (arrays indexed by micro-batch), or ``None`` when the rank is outside the accepted shape."""
    t = plan.instructions
    s, S, M = plan.stage, plan.num_stages, len(plan.micro_batches)
    r = t.rows
    op, mb = r[:, COL["op"]], r[:, COL["mb"]].astype(np.int64)
    if len(r) and (mb.min() < 0 or mb.max() >= M or r[:, COL["chunk"]].any()):
        return None
    loads = bool((op == _OP["load"]).any())
    if not loads and s in (0, S - 1):
        return None
    strings = t.strings
    weight_sid = strings.index("weight") if "weight" in strings else -1
    weight = (op == _OP["bw"]) & (r[:, COL["part"]] == weight_sid)
    split = bool(weight.any())
    slots = _slots(s, S, loads, split)
    if len(r) != M * len(slots):
        return None
    # Slot of every row: its (opcode, buffer kind, peer) must be one of the expected ones.
    peer = r[:, COL["peer"]]
    slot = np.full(len(r), -1, np.int64)
    for j, (o, kind, p) in enumerate(slots):
        sel = (op == _OP[o])
        if o == "bw":
            sel &= weight if kind == "weight" else ~weight
        elif kind:
            sel &= r[:, COL["buffer"]] == _K[kind]
        if o.endswith(("start", "finish")):
            sel &= (peer == p) & (r[:, COL["group"]] == -1)
        slot[sel] = j
    if (slot < 0).any():
        return None
    code = mb * len(slots) + slot
    if not (np.bincount(code, minlength=M * len(slots)) == 1).all():
        return None
    pos = np.empty(M * len(slots), np.int64)
    pos[code] = np.arange(len(r))
    pos = pos.reshape(M, len(slots))
    P = {sl[:2]: pos[:, j] for j, sl in enumerate(slots)}
    F, B = P[("fw", "")], P[("bw", "")]
    before = [(F, B)] + ([(B, P[("bw", "weight")])] if split else [])
    if loads:
        before += [(P[("load", "")], F), (B, P[("free", "input")])]
    if s < S - 1:
        sas, saf = P[("send_act_start", "act_out")], P[("send_act_finish", "act_out")]
        rgs, rgf = P[("recv_grad_start", "grad_in")], P[("recv_grad_finish", "grad_in")]
        before += [(F, sas), (sas, saf), (saf, P[("free", "act_out")]), (B, P[("free", "act_out")]),
                   (rgs, rgf), (rgf, B), (B, P[("free", "grad_in")])]
    if s > 0:
        ras, raf = P[("recv_act_start", "act_in")], P[("recv_act_finish", "act_in")]
        sgs, sgf = P[("send_grad_start", "grad_out")], P[("send_grad_finish", "grad_out")]
        before += [(ras, raf), (raf, F), (B, P[("free", "act_in")]), (B, sgs), (sgs, sgf),
                   (sgf, P[("free", "grad_out")])]
    if any((a >= b).any() for a, b in before):
        return None
    # Shapes: compute rows against the micro-batch list; tensors against the shapes.
    info = np.array([(m.mb, m.mbs, m.seqlen, m.dec_seqlen) for m in plan.micro_batches], np.int64).reshape(M, 4)
    if M and not (info[:, 0] == np.arange(M)).all():
        return None
    # Messages carry [seqlen / shards, mbs, hidden] under sequence parallelism.
    shards = sequence_shards(plan)
    if shards < 1 or (info[:, 2:4] % shards).any():
        return None
    seq_msg, dec_msg = info[:, 2:3] // shards, info[:, 3:4] // shards
    for which in (F, B) + ((P[("bw", "weight")],) if split else ()):
        rows = r[which]
        if not ((rows[:, COL["mbs"]] == info[:, 1]).all() and (rows[:, COL["seqlen"]] == info[:, 2]).all()
                and (rows[:, COL["dec_seqlen"]] == info[:, 3]).all()):
            return None
        # Every pass at the rank's level (the slow path names one that is not).
        if any(strings[v] != plan.recompute for v in set(rows[:, COL["recompute"]].tolist())):
            return None
    if M and any(strings[v] != ("input" if split else "full") for v in set(r[B][:, COL["part"]].tolist())):
        return None
    lists = t.tensor_lists
    ids = np.array([canon.setdefault(ts, len(canon)) for ts in lists] + [-1], np.int64)
    # Per tensor list: whether every tensor has a known dtype, and its leading dims
    # (up to two tensors a message: hidden states, and the encoder output).
    width = max([len(ts) for ts in lists] + [1])
    ok = np.array([bool(ts) and all(x.dtype in DTYPES for x in ts) for ts in lists] + [False])
    nd = np.full((len(lists) + 1, width), -1, np.int64)
    d0 = np.full((len(lists) + 1, width), -1, np.int64)
    d1 = np.full((len(lists) + 1, width), -1, np.int64)
    for j, ts in enumerate(lists):
        for k, x in enumerate(ts):
            nd[j, k] = len(x.shape)
            d0[j, k] = x.shape[0] if x.shape else -1
            d1[j, k] = x.shape[1] if len(x.shape) > 1 else -1
    present = nd >= 0
    if loads:
        l = r[P[("load", "")]][:, COL["tensors"]].astype(np.int64)
        tokens = (d1[l] == info[:, 2:3]) | ((info[:, 3:4] > 0) & (d1[l] == info[:, 3:4]))
        good = ok[l] & ((~present[l]) | ((nd[l] == 2) & (d0[l] == info[:, 1:2]) & tokens)).all(axis=1)
        if not good.all():
            return None
    transfers = {}
    for o in _STARTS:
        if (o, _BUF_OF[o]) not in P:
            continue
        start, finish = P[(o, _BUF_OF[o])], P[(_STARTS[o], _BUF_OF[o])]
        tl, tf = r[start][:, COL["tensors"]].astype(np.int64), r[finish][:, COL["tensors"]]
        if (tl < 0).any() or not (tl == tf).all():
            return None
        shape_ok = (nd[tl] == 3) & (d1[tl] == info[:, 1:2]) & ((d0[tl] == seq_msg) | (d0[tl] == dec_msg))
        if not (ok[tl] & (~present[tl] | shape_ok).all(axis=1)).all():
            return None
        transfers[o] = (start, finish, ids[tl])
    return transfers


def group_is_valid(plans: Sequence[ExecutionPlan]) -> bool:
    """Whether one replica's plans (list index = stage) pass every check of
    :func:`dynapipe.plan.validate.validate_plans`; ``False`` also when undecided."""
    if not all(isinstance(p.instructions, InstructionTable) for p in plans):
        return False
    if any(type(c) is not int or c != 1 for c in ((p.meta or {}).get("chunks", 1) for p in plans)):
        return False  # interleaved plans (or a malformed count): the object-by-object check
    canon: dict = {}
    ranks = []
    for p in plans:
        tr = _rank(p, canon)
        if tr is None:
            return False
        ranks.append(tr)
    S = len(plans)
    M = len(plans[0].micro_batches)
    kinds = list(_STARTS)
    # Each rank's stream: its starts in posting order; pos[r][kind][mb] = stream position.
    pos, need, fin_op, n_ops = [], [], [], []
    for tr in ranks:
        mine = [k for k in kinds if k in tr]
        starts = np.concatenate([tr[k][0] for k in mine]) if mine else np.zeros(0, np.int64)
        finishes = np.concatenate([tr[k][1] for k in mine]) if mine else np.zeros(0, np.int64)
        order = np.argsort(starts, kind="stable")
        where = np.empty(len(starts), np.int64)
        where[order] = np.arange(len(starts))
        pos.append({k: where[i * M:(i + 1) * M] for i, k in enumerate(mine)})
        fo = np.argsort(finishes, kind="stable")
        fin_op.append(where[fo])
        need.append(np.searchsorted(finishes[fo], starts[order]))
        n_ops.append(len(starts))
    off = np.concatenate([[0], np.cumsum(n_ops)]).astype(np.int64)
    partner_rank = np.full(off[-1], -1, np.int64)
    partner_pos = np.full(off[-1], -1, np.int64)
    # Pairing: per boundary and direction, the n-th send pairs with the n-th receive in
    # posting order, which must be the same micro-batch with the same tensors.
    for s in range(S - 1):
        for send_op, recv_op, a, b in (("send_act_start", "recv_act_start", s, s + 1),
                                       ("send_grad_start", "recv_grad_start", s + 1, s)):
            sa, _, ta = ranks[a][send_op]
            rb, _, tb = ranks[b][recv_op]
            if not (np.argsort(sa, kind="stable") == np.argsort(rb, kind="stable")).all() or not (ta == tb).all():
                return False
            pa, pb = pos[a][send_op], pos[b][recv_op]
            partner_rank[off[a] + pa], partner_pos[off[a] + pa] = b, pb
            partner_rank[off[b] + pb], partner_pos[off[b] + pb] = a, pa
    if (partner_rank < 0).any():
        return False
    fin_off = np.concatenate([[0], np.cumsum([len(f) for f in fin_op])]).astype(np.int64)
    cat = lambda xs: np.concatenate(xs).astype(np.int64) if xs else np.zeros(0, np.int64)
    return bool(_replay(off, cat(need), fin_off, cat(fin_op), partner_rank, partner_pos))


def _jit(fn):
    try:
        import numba
    except ImportError:  # pragma: no cover - the same loop, interpreted
        return fn
    return numba.njit(cache=True, nogil=True)(fn)


def warm_up() -> None:
    """Load the compiled replay kernel (and with it numba's compiler) into this process: a replay
    of no rank, with the argument types :func:`group_is_valid` passes."""
    empty = np.zeros(0, np.int64)
    _replay(np.zeros(1, np.int64), empty, np.zeros(1, np.int64), empty, empty, empty)


@_jit
def _replay(off, need, fin_off, fin_op, partner_rank, partner_pos):
    """Replay the conservative in-order model (see :mod:`dynapipe.plan.deadlock`) on the
    transfers alone: each rank's ops complete in posting order, an op only together with
    its partner at the head of the partner's stream, and a rank passes a Finish only once
    its op has completed. Arrays are flat over the ranks (``off``/``fin_off`` delimit
    each rank's ops and finishes; ``need``: finishes a rank passes before posting the
    op; positions are rank-local). True when every rank gets through."""
    R = len(off) - 1
    head = np.zeros(R, np.int64)
    passed = np.zeros(R, np.int64)
    stack = np.empty(R + len(need) + 1, np.int64)
    top = 0
    for r in range(R):
        stack[top] = r
        top += 1
    while top > 0:
        top -= 1
        r = stack[top]
        while True:
            nf = fin_off[r + 1] - fin_off[r]
            while passed[r] < nf and fin_op[fin_off[r] + passed[r]] < head[r]:
                passed[r] += 1
            x = head[r]
            if x == off[r + 1] - off[r] or need[off[r] + x] > passed[r]:
                break
            p = partner_rank[off[r] + x]
            y = partner_pos[off[r] + x]
            if head[p] != y:
                break
            nfp = fin_off[p + 1] - fin_off[p]
            while passed[p] < nfp and fin_op[fin_off[p] + passed[p]] < head[p]:
                passed[p] += 1
            if need[off[p] + y] > passed[p]:
                break
            head[r] += 1
            head[p] += 1
            stack[top] = p
            top += 1
    for r in range(R):
        if head[r] != off[r + 1] - off[r] or passed[r] != fin_off[r + 1] - fin_off[r]:
            return False
    return True
