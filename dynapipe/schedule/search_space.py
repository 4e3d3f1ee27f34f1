"""What a schedule search tries, resolved and checked from the arguments of
:func:`dynapipe.schedule.search.search_schedules`.

The schedules, micro-batch orders and recompute levels to try, each in search order (ties
between candidates are broken by that order), the recompute policies of one order, and the
checks of the replicas and run options. Each refusal is one :class:`DynaPipeError` line
naming the value; the search resolves schedules, then orders, then levels, then checks the
replicas and options, so an argument that is wrong in several ways is refused for the first.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence, Union

import numpy as np

from dynapipe.batching.types import MicroBatch
from dynapipe.config import ClusterConfig
from dynapipe.cost.base import RECOMPUTE_LEVELS, CostModel, check_recompute
from dynapipe.errors import DynaPipeError, arg, given, real_number, whole_number
from dynapipe.schedule.interleaved import INTERLEAVED, chunk_count
from dynapipe.schedule.interleaved_adaptive import INTERLEAVED_ADAPTIVE
from dynapipe.schedule.interleaved_zb import INTERLEAVED_ZB
from dynapipe.schedule.orders import ORDERS
from dynapipe.schedule.recompute_policy import per_stage_policies
from dynapipe.schedule.types import CHUNKED_SCHEDULE_NAMES, SCHEDULE_NAMES, SPLIT_BACKWARD_SCHEDULE_NAMES
from dynapipe.schedule.zero_bubble import ZB_H1

# Every --schedule value. ``auto`` tries SCHEDULE_NAMES and, where the run can split the
# backward, the split-backward schedules (on chunked placements: the chunked ones, of which
# interleaved-zb splits the backward).
SCHEDULE_CHOICES = SCHEDULE_NAMES + SPLIT_BACKWARD_SCHEDULE_NAMES + CHUNKED_SCHEDULE_NAMES + ("auto",)
_SHAPE_HINT = ("give one list of micro-batches per data-parallel replica ([[mb, ...], ...]; one replica: "
               "[micro_batches])")


@dataclass(frozen=True)
class SearchSpace:
    """What one search tries and under which limits: the schedule ``names``, micro-batch
    ``orders`` and uniform recompute ``levels`` (each in search order), the placement's
    ``chunks`` per stage, ``num_stages`` pipeline stages, the memory a stage may use
    (``cap_mib``, MiB, inf when unbounded; ``capacity``, the same per stage), whether to also
    try per-stage recompute mixes (``per_stage``, only when ``bounded``), and ``explain``."""

    names: list[str]
    orders: list[str]
    levels: list[str]
    chunks: int
    num_stages: int
    cap_mib: float
    capacity: np.ndarray
    per_stage: bool
    bounded: bool
    explain: bool


def check_schedule(schedule: str) -> None:
    """Refuse a ``schedule`` that is not one of :data:`SCHEDULE_CHOICES`."""
    if schedule not in SCHEDULE_CHOICES:
        raise DynaPipeError(f"{given('schedule', schedule)} is not known; use one of {', '.join(SCHEDULE_CHOICES)}.")


def schedule_names(schedule: str, split_backward: bool, cost_model: CostModel) -> tuple[list[str], int]:
    """The schedules to try, in search order, and the placement's chunks per stage. Refuses an
    unknown ``schedule``, one that splits the backward when the stages cannot, and a chunked
    one on a placement without chunks; on a chunked placement each name maps to its chunked
    counterpart (``1f1b`` to ``interleaved``, ``adaptive`` to ``interleaved-adaptive``,
    ``zb-h1`` to ``interleaved-zb``)."""
    check_schedule(schedule)
    unsplit = getattr(cost_model, "unsplit_backward", None)
    if unsplit is not None:
        if schedule in (ZB_H1, INTERLEAVED_ZB):
            raise DynaPipeError(f"{given('schedule', schedule)} splits every backward, but {unsplit}; use auto "
                                f"(which then leaves the split schedules out) or another schedule.")
        split_backward = False
    if not split_backward and schedule in (ZB_H1, INTERLEAVED_ZB):
        off = arg("split_backward", "split_backward=False")  # the command line's flag turns the switch off
        raise DynaPipeError(f"{given('schedule', schedule)} splits every backward, and the stages cannot split "
                            f"theirs ({off}); drop one of them (auto then searches "
                            f"the other schedules).")
    chunks = chunk_count(cost_model)
    # On a chunked placement 1F1B is Megatron's interleaved 1F1B, adaptive the adaptive
    # interleaved order and zb-h1 interleaved-zb, as training's --dynapipe-schedule reads them.
    if chunks == 1 and schedule in CHUNKED_SCHEDULE_NAMES:
        use = ", ".join(CHUNKED_SCHEDULE_NAMES) if chunks > 1 else "1f1b, adaptive or zb-h1"
        raise DynaPipeError(f"{given('schedule', schedule)}: placement {cost_model.placement} has {chunks} chunk(s) "
                            f"per stage; use {arg('schedule')} {use} or auto.")
    if chunks > 1:
        auto = [INTERLEAVED, INTERLEAVED_ADAPTIVE] + ([INTERLEAVED_ZB] if split_backward else [])
        names = {"auto": auto, INTERLEAVED_ADAPTIVE: [INTERLEAVED_ADAPTIVE], "adaptive": [INTERLEAVED_ADAPTIVE],
                 INTERLEAVED_ZB: [INTERLEAVED_ZB], ZB_H1: [INTERLEAVED_ZB]}.get(schedule, [INTERLEAVED])
    elif schedule == "auto":
        names = list(SCHEDULE_NAMES) + (list(SPLIT_BACKWARD_SCHEDULE_NAMES) if split_backward else [])
    else:
        names = [schedule]
    return names, chunks


def order_names(schedule: str, orders: Optional[Sequence[str]]) -> list[str]:
    """The micro-batch orders to try, in search order: ``orders``, else every order for
    ``auto`` and the planned one for a named schedule; refuses an unknown order."""
    names = list(orders) if orders else (list(ORDERS) if schedule == "auto" else ["planned"])
    for o in names:
        if o not in ORDERS:
            raise DynaPipeError(f"micro-batch order {o!r} is not known; use one of {sorted(ORDERS)}.")
    return names


def recompute_levels(recompute: Optional[Union[str, Sequence[str]]]) -> list[str]:
    """The uniform recompute levels to try, in search order: every level for ``None``, else
    the one level or the list given (refused when empty or naming an unknown level)."""
    if recompute is None:
        return list(RECOMPUTE_LEVELS)
    if isinstance(recompute, str):
        return [check_recompute(recompute)]
    levels = [check_recompute(r) for r in recompute]
    if not levels:
        raise DynaPipeError("no recompute level to try; give at least one of none, selective, full.")
    return levels


def checked_replicas(replicas) -> list[list[MicroBatch]]:
    """``replicas`` as a list of lists of micro-batches, one list per data-parallel replica;
    refuses anything else (a flat list of micro-batches, a string, a number, an element that
    is not a :class:`MicroBatch`) and replicas without any micro-batch."""
    try:
        if isinstance(replicas, (str, bytes)):
            raise TypeError
        # Materialised before any check: one that iterates an iterator of replicas consumes it.
        replicas = list(replicas)
        if any(isinstance(r, (MicroBatch, str, bytes)) for r in replicas):
            raise TypeError
        replicas = [list(r) for r in replicas]
    except TypeError:  # not a list of lists (a flat list of micro-batches, a number)
        raise DynaPipeError(f"replicas: {_SHAPE_HINT}.") from None
    odd = next((x for r in replicas for x in r if not isinstance(x, MicroBatch)), None)
    if odd is not None:
        raise DynaPipeError(f"replicas: {type(odd).__name__} {odd!r:.40} is not a MicroBatch; {_SHAPE_HINT}.")
    if not any(replicas):
        raise DynaPipeError("there are no micro-batches to schedule.")
    return replicas


def checked_options(replicas: list[list[MicroBatch]], *, dp: Optional[int], tp: int,
                    cluster: Optional[ClusterConfig], capacity_mib: Optional[float],
                    must_beat_ms: Optional[float]) -> int:
    """The data-parallel size (``dp``, else the number of replica lists), after checking that
    ``dp`` matches the replica lists, ``tp`` is a whole number, ``cluster`` is a valid
    :class:`ClusterConfig`, and ``capacity_mib`` (MiB) and ``must_beat_ms`` (ms) are numbers
    of at least 0 (or unlimited)."""
    if dp is not None and whole_number("dp", dp) != len(replicas):
        raise DynaPipeError(f"dp {dp}: {len(replicas)} replica list(s) were given; give one list per replica.")
    whole_number("tp", tp)
    if cluster is not None:
        if not isinstance(cluster, ClusterConfig):
            raise DynaPipeError(f"cluster {cluster!r}: give a ClusterConfig "
                                f"(dynapipe.config.load_cluster_config(name)).")
        cluster.validate(f"cluster {cluster.name!r}")
    if capacity_mib is not None:
        real_number("capacity_mib", capacity_mib, unlimited=True)
    if must_beat_ms is not None:
        real_number("must_beat_ms", must_beat_ms, unlimited=True)
    return dp or len(replicas)


def recompute_policies(space: SearchSpace, level_times: dict, perms: list[tuple], num_replicas: int) -> list[tuple]:
    """The recompute policies to try on one micro-batch order (``perms``, one permutation per
    replica), in search order, as ``(label, per-stage levels, permuted times, schedule names)``:
    each uniform level of ``level_times`` (every replica's stage times by level, ms and MiB),
    with the per-stage mixes for the capacity (MiB) after the first when the search tries them.
    Levels are one per virtual stage (chunk-major, ``k = c * P + s``)."""
    by_level = {lv: [t.permuted(p) for t, p in zip(level_times[lv], perms)] for lv in space.levels}
    policies = [(lv, (lv,) * (space.num_stages * space.chunks), by_level[lv], space.names) for lv in space.levels]
    if space.per_stage and len(space.levels) > 1 and space.bounded:
        policies[1:1] = per_stage_policies(by_level, space.levels, space.cap_mib, space.names, space.chunks,
                                           num_replicas)
    return policies
