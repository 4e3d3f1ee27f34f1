"""The plan compiler's instruction order as first written (one Python object at a time).

Kept as the reference the vectorised compiler (:mod:`dynapipe.plan.rank_table`) must
reproduce instruction for instruction.
"""
from __future__ import annotations

import bisect

from dynapipe.config import ModelConfig
from dynapipe.plan._fast import gc_paused, maker as _maker
from dynapipe.plan.specs import input_specs, message_specs
from dynapipe.plan.instructions import (BackwardPass, ForwardPass, FreeBuffer, LoadInput, RecvActivationFinish,
                                        RecvActivationStart, RecvGradFinish, RecvGradStart, SendActivationFinish,
                                        SendActivationStart, SendGradFinish, SendGradStart)
from dynapipe.schedule.simulator import Timeline
from dynapipe.schedule.types import Schedule

_SendActStart, _SendActFinish = _maker(SendActivationStart), _maker(SendActivationFinish)
_RecvActStart, _RecvActFinish = _maker(RecvActivationStart), _maker(RecvActivationFinish)
_SendGradStart, _SendGradFinish = _maker(SendGradStart), _maker(SendGradFinish)
_RecvGradStart, _RecvGradFinish = _maker(RecvGradStart), _maker(RecvGradFinish)
_Free, _Load, _Forward, _Backward = _maker(FreeBuffer), _maker(LoadInput), _maker(ForwardPass), _maker(BackwardPass)


def reference_instructions(schedule, timeline, infos, model, levels) -> list[tuple]:
    """Every rank's instruction tuple, built the original way."""
    S = schedule.num_stages
    msgs = [[message_specs(model, b, S, i.mbs, i.seqlen, i.dec_seqlen) for i in infos] for b in range(S - 1)]
    ends_of = [{(op.kind, op.mb): timeline.ends[s][i] for i, op in enumerate(schedule.stage_ops[s])}
               for s in range(S)]
    with gc_paused():
        return [tuple(_rank_instructions(s, S, schedule, timeline, ends_of, msgs, infos, model, levels[s]))
                for s in range(S)]


def _rank_instructions(s: int, S: int, schedule: Schedule, timeline: Timeline, ends_of: list[dict],
                       msgs: list, infos: tuple, model: ModelConfig, level: str) -> list:
    ops = schedule.stage_ops[s]
    ends = timeline.ends[s]
    index = {(op.kind, op.mb): i for i, op in enumerate(ops)}
    # Posts as (gap, key, instruction): gap g = after op g (-1: before the first op); key
    # = the transfer's place in the global order (ready time, kind, micro-batch, boundary).
    posts: list = []
    after: dict[int, list] = {}       # op index -> send finishes (and frees) before the next op
    before: dict[int, list] = {}      # op index -> receive finishes the op waits for

    def recv_gap(ready_ms: float, consumer: int) -> int:
        return min(bisect.bisect_right(ends, ready_ms) - 1, consumer - 1)

    for info in infos:
        i = info.mb
        if s < S - 1:
            specs = msgs[s][i]
            t = ends_of[s][("F", i)]
            g = index[("F", i)]
            buf = f"act_out:{i}:0"
            posts.append((g, t, 0, i, s, _SendActStart(mb=i, peer=s + 1, buffer=buf, tensors=specs)))
            after.setdefault(g, []).append(_SendActFinish(mb=i, peer=s + 1, buffer=buf, tensors=specs))
            t = ends_of[s + 1][("B", i)]
            c = index[("B", i)]
            buf = f"grad_in:{i}:0"
            posts.append((recv_gap(t, c), t, 1, i, s, _RecvGradStart(mb=i, peer=s + 1, buffer=buf, tensors=specs)))
            before.setdefault(c, []).append(_RecvGradFinish(mb=i, peer=s + 1, buffer=buf, tensors=specs))
        if s > 0:
            specs = msgs[s - 1][i]
            t = ends_of[s - 1][("F", i)]
            c = index[("F", i)]
            buf = f"act_in:{i}:0"
            posts.append((recv_gap(t, c), t, 0, i, s - 1,
                          _RecvActStart(mb=i, peer=s - 1, buffer=buf, tensors=specs)))
            before.setdefault(c, []).append(_RecvActFinish(mb=i, peer=s - 1, buffer=buf, tensors=specs))
            t = ends_of[s][("B", i)]
            g = index[("B", i)]
            buf = f"grad_out:{i}:0"
            posts.append((g, t, 1, i, s - 1, _SendGradStart(mb=i, peer=s - 1, buffer=buf, tensors=specs)))
            after.setdefault(g, []).extend((_SendGradFinish(mb=i, peer=s - 1, buffer=buf, tensors=specs),
                                            _Free(mb=i, buffer=buf)))
    posts.sort(key=lambda p: p[:5])
    by_gap: dict[int, list] = {}
    for p in posts:
        by_gap.setdefault(p[0], []).append(p[5])

    loads = {info.mb: input_specs(model, s, S, info.mbs, info.seqlen, info.dec_seqlen) for info in infos}
    frees = [kind for kind, present in (("input", None), ("act_in", s > 0), ("act_out", s < S - 1),
                                        ("grad_in", s < S - 1)) if present is not False]
    out: list = list(by_gap.get(-1, ()))
    for g, op in enumerate(ops):
        mb = op.mb
        info = infos[mb]
        if op.kind == "F" and loads[mb]:
            out.append(_Load(mb=mb, tensors=loads[mb]))
        out.extend(before.get(g, ()))
        if op.kind == "F":
            out.append(_Forward(mb=mb, mbs=info.mbs, seqlen=info.seqlen, dec_seqlen=info.dec_seqlen,
                                   recompute=level))
        else:
            out.append(_Backward(mb=mb, mbs=info.mbs, seqlen=info.seqlen, dec_seqlen=info.dec_seqlen,
                                    recompute=level))
            out.extend(_Free(mb=mb, buffer=f"{kind}:{mb}:0") for kind in frees
                       if kind != "input" or loads[mb])
        out.extend(by_gap.get(g, ()))
        out.extend(after.get(g, ()))
    return out
