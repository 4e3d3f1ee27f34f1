"""``--placement`` of ``plan`` and ``trace``: the layers every pipeline stage holds.

``even`` is Megatron's split; ``auto`` lets the planner choose from the cost model over
the command's own batch, cut as ``--batching`` cuts it
(:func:`dynapipe.schedule.placement.choose_placement`; for T5
:func:`~dynapipe.schedule.placement.choose_placement_kind`, which also tries interleaved
chunks, planned and even, and keeps the fastest in simulation); any other value is a split written out
(``12,12,8`` for GPT, ``ENC+DEC`` per stage for T5, chunks separated by ``|``).
"""
from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from typing import Optional

from dynapipe.cli.batching_options import length_limit, micro_batch_size
from dynapipe.cli.cost import CostSetup
from dynapipe.cost.placement import StagePlacement
from dynapipe.cli.schedule_options import resolve_cluster, split_backward
from dynapipe.schedule.placement import DYNAPIPE_CUT, Cut, PlacementPlan, choose_placement, choose_placement_kind


def add_placement_argument(p: argparse.ArgumentParser) -> None:
    """``--placement even|auto|SPEC`` (default even)."""
    p.add_argument("--placement", default="even", metavar="even|auto|interleaved|SPEC",
                   help="layers per pipeline stage: even (Megatron's split, default), auto (chosen from the cost "
                        "model over this batch so that no stage is the bottleneck; for T5 contiguous or interleaved, "
                        "whichever simulates faster), interleaved (T5: the encoder as chunk 0 and the decoder as "
                        "chunk 1 of every stage), or a split such as 12,12,8 (GPT) or 6+0,6+0,5+1,0+7 (T5: "
                        "encoder+decoder layers per stage), virtual-pipeline chunks separated by | (3+0,3+0|0+3,0+3)")


def apply_placement(args: argparse.Namespace, setup: CostSetup, lengths) -> tuple[CostSetup, Optional[PlacementPlan]]:
    """``setup`` with the cost model of ``--placement``, and the search's result for ``auto``."""
    choice = getattr(args, "placement", None)
    choice = "even" if choice is None else choice  # an empty --placement is refused by parse_placement
    cm = setup.cost_model
    if choice == "even":
        return setup, None
    if choice == "auto":
        # The search plans the batch on every candidate split, seconds for a large model: said on
        # stderr (stdout may carry the command's JSON), announced up front on a terminal, where
        # an error then starts on a line of its own; elsewhere the result line alone.
        live = sys.stderr.isatty()
        if live:
            print("choosing the stage placement (--placement auto) ...", end=" ", file=sys.stderr, flush=True)
        start = time.perf_counter()
        try:
            plan = _search_placement(args, setup, lengths)
        except BaseException:
            if live:
                print(file=sys.stderr, flush=True)
            raise
        took = f"{time.perf_counter() - start:.1f} s"
        print(f"{plan.cost_model.placement} ({took})" if live else
              f"placement {plan.cost_model.placement} chosen (--placement auto, {took})", file=sys.stderr)
        return dataclasses.replace(setup, cost_model=plan.cost_model), plan
    placement = StagePlacement.parse(choice, cm.model, cm.num_stages)
    return dataclasses.replace(setup, cost_model=cm.with_placement(placement)), None


def _search_placement(args: argparse.Namespace, setup: CostSetup, lengths) -> PlacementPlan:
    """``--placement auto``'s search on this batch (see :func:`apply_placement`)."""
    cm = setup.cost_model
    kw = dict(dp=getattr(args, "dp", 1), memory_limit_mib=setup.memory_limit_mib, reserved_mib=setup.reserved_mib,
              seq_length=length_limit(args, cm.model), recompute=getattr(args, "recompute", None), cut=_cut_of(args))
    if cm.model.is_encoder_decoder:  # contiguous or interleaved, by simulated time on this batch
        from dynapipe.schedule.types import CHUNKED_SCHEDULE_NAMES

        device = getattr(cm, "device", None)
        cluster = resolve_cluster(getattr(args, "cluster", None), device.name if device is not None else None)
        # A schedule given by name is tried on the kinds of placement it runs on: adaptive on
        # contiguous stages, the interleaved ones on chunks, 1f1b and zb-h1 on both.
        schedule = getattr(args, "schedule", None) or "auto"
        plan = choose_placement_kind([lengths], cm, cluster=cluster, split_backward=split_backward(args),
                                     chunks=1 if schedule == "adaptive" else 2,
                                     contiguous_allowed=schedule not in CHUNKED_SCHEDULE_NAMES,
                                     schedule=schedule, **kw)
    else:
        plan = choose_placement([lengths], cm, **kw)
    return plan


def _cut_of(args: argparse.Namespace) -> Cut:
    """The batching the command plans (``--batching`` and its sizes), which ``--placement auto``
    chooses the split on; DynaPipe's cut for commands without ``--batching``."""
    if not hasattr(args, "batching"):
        return DYNAPIPE_CUT
    return Cut(args.batching, micro_batch_size(args), args.max_tokens)


def even_split_schedule(schedule: str) -> str:
    """The ``--schedule`` to price Megatron's even split with beside a placement: a chunked
    schedule (``interleaved...``) has no chunks to run there, so the search's ``auto``."""
    from dynapipe.schedule.types import CHUNKED_SCHEDULE_NAMES

    return "auto" if schedule in CHUNKED_SCHEDULE_NAMES else schedule


def placement_json(setup: CostSetup, plan: Optional[PlacementPlan]) -> dict:
    """``placement`` (layers per stage) and, for ``auto``, ``placement_search`` (per-stage
    sample times and levels of the chosen split and of the even one)."""
    out = {"placement": setup.cost_model.placement.to_json()}
    if plan is not None:
        out["placement_search"] = {"chosen": plan.chosen.to_json(), "even": plan.before.to_json(),
                                   "rounds": plan.rounds, **({"compared": plan.compared} if plan.compared else {})}
    return out
