"""Simulated timelines as Chrome/Perfetto traces and as matplotlib pictures.

Trace layout (Chrome trace event format, times in microseconds): one process per
replica (``pid``), one thread per pipeline stage (``tid``); every op is a complete
event (``"ph": "X"``) named ``F<mb> <mbs>x<seqlen>``, ``B<mb> ...`` (or, for a split
backward, ``BI<mb> ...`` and ``BW<mb> ...``) with category ``forward``/``backward``
(``backward-input``/``backward-weight``) and its micro-batch shape in ``args``; each stage's memory is a
counter track ``memory stage <s>`` in MiB. :func:`op_event` is shared with traces of
executed plans, so simulated and measured timelines line up in one viewer.
"""
from __future__ import annotations

import textwrap
from typing import Optional, Sequence

from dynapipe.batching.types import MicroBatch
from dynapipe.errors import DynaPipeError
from dynapipe.schedule.simulator import Timeline

_CATEGORY = {"F": "forward", "B": "backward", "BI": "backward-input", "BW": "backward-weight"}
# Backwards hatched; a weight part dotted, so it stands apart from its input part.
_HATCH = {"F": None, "BW": ".."}


def op_name(kind: str, mb: int, mbs: int, seqlen: int, dec_seqlen: int = 0) -> str:
    """``F3 4x512`` (kind, micro-batch, samples x tokens[/decoder tokens])."""
    shape = f"{mbs}x{seqlen}" + (f"/{dec_seqlen}" if dec_seqlen else "")
    return f"{kind}{mb} {shape}"


def op_event(replica: int, stage: int, kind: str, mb: int, start_ms: float, end_ms: float, *, mbs: int,
             seqlen: int, dec_seqlen: int = 0, extra: Optional[dict] = None) -> dict:
    """One op as a complete trace event (times in ms in, microseconds out)."""
    args = {"mb": mb, "mbs": mbs, "seqlen": seqlen}
    if dec_seqlen:
        args["dec_seqlen"] = dec_seqlen
    if extra:
        args.update(extra)
    return {"name": op_name(kind, mb, mbs, seqlen, dec_seqlen), "cat": _CATEGORY.get(kind, kind), "ph": "X",
            "pid": replica, "tid": stage, "ts": round(start_ms * 1e3, 3),
            "dur": round((end_ms - start_ms) * 1e3, 3), "args": args}


def track_names(replica: int, num_stages: int, label: str = "replica") -> list[dict]:
    """Metadata events naming a replica's process and its stage threads."""
    out = [{"name": "process_name", "ph": "M", "pid": replica, "args": {"name": f"{label} {replica}"}}]
    for s in range(num_stages):
        out.append({"name": "thread_name", "ph": "M", "pid": replica, "tid": s, "args": {"name": f"stage {s}"}})
        out.append({"name": "thread_sort_index", "ph": "M", "pid": replica, "tid": s, "args": {"sort_index": s}})
    return out


def chrome_trace(timelines: Sequence[Timeline], micro_batches: Sequence[Sequence[MicroBatch]],
                 metadata: Optional[dict] = None) -> dict:
    """The trace of every replica's simulated timeline (``micro_batches[r]`` in the
    order the replica's schedule indexes them)."""
    if len(timelines) != len(micro_batches):
        raise DynaPipeError(f"{len(timelines)} timelines but {len(micro_batches)} micro-batch lists.")
    events: list[dict] = []
    for r, (tl, mbs) in enumerate(zip(timelines, micro_batches)):
        events.extend(track_names(r, tl.num_stages))
        for ev in tl.events():
            mb = mbs[ev.op.mb]
            events.append(op_event(r, ev.stage, ev.op.kind, ev.op.mb, ev.start_ms, ev.end_ms, mbs=mb.mbs,
                                   seqlen=mb.seqlen, dec_seqlen=mb.dec_seqlen,
                                   extra={"samples": len(mb.samples), "real_tokens": mb.real_tokens,
                                          **({"chunk": ev.op.chunk} if tl.schedule.num_chunks > 1 else {})}))
        for s, steps in enumerate(tl.memory):
            for t, mib in steps:
                events.append({"name": f"memory stage {s}", "ph": "C", "pid": r, "ts": round(t * 1e3, 3),
                               "args": {"MiB": round(mib, 3)}})
    return {"traceEvents": events, "displayTimeUnit": "ms", "metadata": dict(metadata or {})}


def plot_timeline(timeline: Timeline, micro_batches: Sequence[MicroBatch], path: str, *,
                  title: str = "", capacity_mib: Optional[float] = None) -> None:
    """Draw one replica's timeline (ops per stage, coloured by micro-batch, backwards
    hatched, weight parts dotted) above its memory per stage over time, and save it as a PNG."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise DynaPipeError("--png needs matplotlib: pip install matplotlib (or the 'plot' extra).") from None
    S = timeline.num_stages
    fig, (ax, mem) = plt.subplots(2, 1, figsize=(12, 1.0 + 0.55 * S + 2.6), sharex=True,
                                  gridspec_kw={"height_ratios": [0.55 * S + 0.4, 2.4]})
    cmap = plt.get_cmap("tab20")
    span = max(timeline.makespan_ms, 1e-9)
    for ev in timeline.events():
        y = S - 1 - ev.stage
        colour = cmap(ev.op.mb % 20)
        width = ev.end_ms - ev.start_ms
        ax.broken_barh([(ev.start_ms, width)], (y + 0.08, 0.84), facecolors=colour,
                       edgecolors="black", linewidth=0.3, hatch=_HATCH.get(ev.op.kind, "//"))
        if width > span / 60:
            ax.text(ev.start_ms + width / 2, y + 0.5, str(ev.op), ha="center", va="center",
                    fontsize=6)
    ax.set_yticks([S - 1 - s + 0.5 for s in range(S)], [f"stage {s}" for s in range(S)])
    ax.set_ylim(0, S)
    title = title or f"{timeline.schedule.name}: {timeline.makespan_ms:.1f} ms, bubble " \
                     f"{100 * timeline.bubble_fraction:.1f}%"
    # Wrapped to the figure's width (about 140 characters at this size): a long per-stage recompute
    # list would otherwise push the makespan and bubble off the right edge.
    ax.set_title(textwrap.fill(title, 140), fontsize=10)
    for s, steps in enumerate(timeline.memory):
        xs = [t for t, _ in steps] + [timeline.makespan_ms]
        ys = [m for _, m in steps] + [steps[-1][1]]
        mem.step(xs, ys, where="post", linewidth=0.8, label=f"stage {s}")
    if capacity_mib is not None:
        mem.axhline(capacity_mib, color="red", linestyle="--", linewidth=0.8, label="limit")
    mem.set_ylabel("memory (MiB)")
    mem.set_xlabel("time (ms)")
    mem.legend(fontsize=6, ncol=min(S + 1, 9), loc="lower right")
    fig.tight_layout()
    # The format is fixed, not guessed from the name: a name without .png would otherwise
    # get the suffix appended by matplotlib, or an unknown suffix fail after all the planning.
    fig.savefig(path, dpi=130, format="png")
    plt.close(fig)
