"""``python -m dynapipe plan``: the micro-batches of one global batch, as JSON.

The plan goes to stdout (or ``--output``), a human-readable summary to stderr. Later
commands and options build on the same pieces: :func:`add_arguments` for the flags,
:func:`plan_from_args` for the :class:`BatchPlan`, :func:`build_plan_json` for the
output dict (extend it with more keys) and :func:`summary_lines` for stderr.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
import time

from dynapipe.batching import BatchPlan, plan_micro_batches
from dynapipe.batching.lengths import read_lengths_for
from dynapipe.cli.batching_options import (add_batching_arguments, add_decoder_seq_length, check_batching_flags,
                                            cut_arguments)
from dynapipe.cli.cost import (CostSetup, add_cost_model_arguments, add_memory_arguments, cost_setup_from_args,
                               extrapolation_notes)
from dynapipe.output_paths import check_distinct, check_output_file, config_inputs, write_output
from dynapipe.cli.placement_options import (add_placement_argument, apply_placement, even_split_schedule,
                                             placement_json)
from dynapipe.cli.schedule_options import (add_recompute_default, add_schedule_arguments, check_plan_out,
                                           check_schedule_flags, escalate_recompute, recompute_label,
                                           resolve_cluster, schedule_json, split_backward)
from dynapipe.errors import DynaPipeError
from dynapipe.schedule._kernels import compiled as compiled_kernels

HELP = "plan the micro-batches (and schedule) of one global batch"


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Add the ``plan`` command's flags to ``p``."""
    p.add_argument("--lengths", required=True,
                   help="lengths file: one integer a line, or 'input target' pairs for encoder-decoder; - reads stdin")
    add_cost_model_arguments(p)
    add_recompute_default(p)
    p.add_argument("--dp", type=int, default=1, help="data-parallel replicas (default 1)")
    add_memory_arguments(p)
    add_batching_arguments(p)
    p.add_argument("--seq-length", type=int, default=None,
                   help="truncate samples to this many tokens; row length of padding and packing "
                        "(default: the model's max_seq_length, and no truncation)")
    add_decoder_seq_length(p)
    p.add_argument("--output", default="-", help="write the JSON plan here (default: stdout)")
    add_schedule_arguments(p)
    add_placement_argument(p)


def plan_from_args(args: argparse.Namespace, setup: CostSetup | None = None,
                   lengths=None) -> tuple[BatchPlan, CostSetup]:
    """Read the lengths and plan them as the arguments say; returns the plan and its setup,
    whose ``recompute`` is the level the micro-batches were cut for (without ``--recompute``:
    the lightest of none, selective, full under which every sample fits)."""
    setup = setup or cost_setup_from_args(args)
    if lengths is None:
        lengths = read_lengths_for(args.lengths, setup.model.name, setup.model.is_encoder_decoder)
    plan, level = escalate_recompute(lambda level: plan_micro_batches(
        lengths, setup.cost_model, recompute=level, **cut_arguments(args, setup)), setup.recompute)
    return plan, dataclasses.replace(setup, recompute=level)


def build_plan_json(args: argparse.Namespace, batch_plan: BatchPlan, setup: CostSetup) -> dict:
    """The JSON object the command writes: the plan plus what it was planned for."""
    out = batch_plan.to_json()
    out.update(model=setup.model.name, device=setup.device.name, recompute=setup.recompute,
               batching_recompute=setup.recompute,
               memory_limit_mib=setup.memory_limit_mib, reserved_mib=setup.reserved_mib,
               tp=setup.tp.size, sequence_parallel=setup.tp.sequence_parallel,
               cost_model="analytic" if getattr(args, "profile", None) in (None, "", "analytic") else "profile")
    return out


def summary_lines(batch_plan: BatchPlan, setup: CostSetup) -> list[str]:
    """Human-readable summary of a plan (for stderr)."""
    p, x = batch_plan, batch_plan.extra
    mbs = p.micro_batches
    slowest = max(mb.time_ms for mb in mbs)
    heaviest = max(mb.stored_mib + mb.peak_mib for mb in mbs)
    lines = [
        f"{p.batching}: {p.num_samples} samples -> {len(mbs)} micro-batches for {setup.model.name} on "
        f"{p.num_stages} stages x {p.dp} replica(s) of {setup.device.name}"
        + (f", TP {setup.tp.size}{' with SP' if setup.tp.sequence_parallel else ''} per stage (figures per TP rank)"
           if setup.tp.size > 1 else ""),
        f"  objective {p.objective_ms:.1f} ms (sum/dp + (S-1) x slowest {slowest:.2f} ms), "
        f"padding efficiency {100 * p.padding_efficiency:.1f}%, planned in {p.planning_ms:.1f} ms",
        f"  activations: largest micro-batch {heaviest:.0f} MiB of a {x['activation_budget_mib']:.0f} MiB budget "
        f"(limit {setup.memory_limit_mib:.0f} - reserved {setup.reserved_mib:.0f} - model states "
        f"{x['model_state_mib']:.0f} MiB)",
    ]
    if p.dp > 1:
        lines.append("  replicas: " + ", ".join(f"{t:.1f}" for t in p.replica_time_ms)
                     + f" ms (spread {x['replica_spread_ms']:.2f} ms)")
    if x.get("truncated_samples"):
        limit = f"{x['seq_length']}"
        if x.get("dec_seq_length", x["seq_length"]) != x["seq_length"]:
            limit += f" input / {x['dec_seq_length']} target"
        lines.append(f"  {x['truncated_samples']} sample(s) truncated to {limit} tokens")
    if "cross_sample_attention_pairs" in x:
        done = "not computed: attention runs per sample" if p.batching == "packing-per-sample" else \
            "computed and masked"
        lines.append(f"  packing: {x['cross_sample_attention_pairs']:,} attention pairs cross sample boundaries "
                     f"({done})")
    if x.get("over_memory_micro_batches"):
        # Printed only once the schedule search found a fitting schedule (it refuses the batch otherwise).
        lines.append(f"  note: {x['over_memory_micro_batches']} micro-batch(es) exceed the activation budget at "
                     f"recompute {setup.recompute}; the schedule below keeps every stage within the memory limit")
    if x.get("empty_replicas"):
        lines.append(f"  warning: {x['empty_replicas']} replica(s) get no micro-batch")
    shapes = [(mb.mbs, mb.seqlen, mb.dec_seqlen) for mb in mbs]
    lines += [f"  note: {line}" for line in extrapolation_notes(setup.cost_model, shapes)]
    return lines


def _finite(v):
    """``v`` with every infinite or NaN float (a candidate that does not fit, say) as None: JSON
    has no such numbers, and strict readers refuse Python's ``Infinity``."""
    if isinstance(v, float):
        return v if math.isfinite(v) else None
    if isinstance(v, dict):
        return {k: _finite(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_finite(x) for x in v]
    return v


def dumps_plan(obj: dict) -> str:
    """JSON text of a plan dict: one line per top-level key, one line per micro-batch; an
    infinite time (a candidate that does not fit) is ``null``."""
    def value(key, v):
        if isinstance(v, list) and v and isinstance(v[0], dict):
            return "[\n" + ",\n".join("  " + json.dumps(item, allow_nan=False) for item in v) + "\n ]"
        return json.dumps(v, allow_nan=False)
    obj = _finite(obj)
    return "{\n" + ",\n".join(f" {json.dumps(k)}: {value(k, v)}" for k, v in obj.items()) + "\n}"


def write_json(obj: dict, path: str) -> None:
    """Write a plan dict as JSON to ``path`` (``-``: stdout)."""
    write_output(path, dumps_plan(obj) + "\n", "--output")


def check_not_in_plan_set(output, plan_out) -> None:
    """Refuse an ``--output`` that would land among the ``--plan-out`` plan files as one of them
    (a ``.plan`` name in that folder): the set would no longer read back."""
    if not output or output == "-" or not plan_out:
        return
    if os.path.dirname(os.path.abspath(output)) == os.path.abspath(plan_out) and output.endswith(".plan"):
        raise DynaPipeError(f"--output {output!r} would sit among the --plan-out {plan_out!r} plan files as one "
                            f"of them (every *.plan file there is read as a plan); write it elsewhere.")


def _with_room_in_flight(args: argparse.Namespace, batch_plan: BatchPlan, sched: dict, setup: CostSetup,
                         lengths) -> tuple[BatchPlan, dict]:
    """``(batch_plan, sched)``, or a cut :func:`~dynapipe.pipeline_planner.leave_room_in_flight`
    finds faster with its schedule; the time tried counts as micro-batching time."""
    from dynapipe.pipeline_planner import leave_room_in_flight

    start = time.perf_counter()
    stage_recompute = sched["recompute"] if isinstance(sched["recompute"], list) else (
        [sched["recompute"]] * setup.cost_model.num_stages)
    cut = cut_arguments(args, setup)
    search = dict(schedule=getattr(args, "schedule", "auto"), memory_limit_mib=setup.memory_limit_mib,
                  reserved_mib=setup.reserved_mib, cluster=resolve_cluster(args.cluster, setup.device.name),
                  tp=None, zero=False, split_backward=split_backward(args))
    roomier = leave_room_in_flight(lengths, setup.cost_model, planned=batch_plan, level=setup.recompute,
                                   simulated_ms=sched["simulated_ms"], stage_recompute=stage_recompute,
                                   cut=cut, search=search)
    tried_ms = (time.perf_counter() - start) * 1e3
    if roomier is None:
        batch_plan.planning_ms += tried_ms
        return batch_plan, sched
    # The first cut's search and compilation were spent too (its plan files, with --plan-out,
    # are overwritten by the roomier cut's: the same ranks).
    roomier.planning_ms = batch_plan.planning_ms + tried_ms + sched["schedule_planning_ms"]
    return roomier, schedule_json(args, roomier, setup.cost_model, memory_limit_mib=setup.memory_limit_mib,
                                  reserved_mib=setup.reserved_mib, lengths=lengths)


def run(args: argparse.Namespace) -> int:
    """Run ``plan`` with parsed ``args``; the process exit status (0: done)."""
    check_batching_flags(args)
    check_schedule_flags(args)
    check_plan_out(args.plan_out)
    check_output_file(args.output, "--output", stdout=True)
    check_distinct(config_inputs(args) + [("--lengths", args.lengths), ("--output", args.output),
                                          ("--plan-out", args.plan_out)])
    check_not_in_plan_set(args.output, args.plan_out)
    even_setup = cost_setup_from_args(args)
    lengths = read_lengths_for(args.lengths, even_setup.model.name, even_setup.model.is_encoder_decoder)
    setup, searched = apply_placement(args, even_setup, lengths)
    batch_plan, setup = plan_from_args(args, setup, lengths=lengths)
    sched = schedule_json(args, batch_plan, setup.cost_model, memory_limit_mib=setup.memory_limit_mib,
                          reserved_mib=setup.reserved_mib, lengths=lengths)
    if args.recompute is None:  # as plan_iteration: room for the micro-batches in flight when memory is tight
        batch_plan, sched = _with_room_in_flight(args, batch_plan, sched, setup, lengths)
    out = build_plan_json(args, batch_plan, setup)
    # planning_ms covers micro-batching, schedule search and plan compilation together.
    out["planning_ms"] = round(out["planning_ms"] + sched.pop("schedule_planning_ms"), 3)
    out.update(sched)
    out.update(placement_json(setup, searched))
    if setup.cost_model.placement != even_setup.cost_model.placement:
        # The same batch on Megatron's even split: the before of the placement's after.
        quiet = argparse.Namespace(**{**vars(args), "plan_out": None, "explain": False,
                                      "schedule": even_split_schedule(args.schedule)})
        even_plan, even_setup = plan_from_args(quiet, even_setup, lengths=lengths)
        even = schedule_json(quiet, even_plan, even_setup.cost_model, memory_limit_mib=even_setup.memory_limit_mib,
                             reserved_mib=even_setup.reserved_mib, lengths=lengths)
        if args.recompute is None:  # the even split gets the same tries as the placement
            even_plan, even = _with_room_in_flight(quiet, even_plan, even, even_setup, lengths)
        out["even_split"] = {k: even[k] for k in ("simulated_ms", "bubble_fraction", "recompute")}
    write_json(out, args.output)
    for line in summary_lines(batch_plan, setup):
        print(line, file=sys.stderr)
    chosen = recompute_label(out["recompute"], setup.cost_model.num_stages)
    how = "as given" if args.recompute else "chosen"
    print(f"  schedule {out['schedule']} (recompute {chosen}, {how}; micro-batches cut for "
          f"{setup.recompute}): simulated {out['simulated_ms']:.1f} ms, "
          f"bubble {100 * out['bubble_fraction']:.1f}%, stage peak "
          + ", ".join(f"{m:.0f}" for m in out["stage_peak_mib"]) + " MiB; "
          f"whole planning {out['planning_ms']:.1f} ms", file=sys.stderr)
    if compiled_kernels():
        # Measured: 0.3-0.4 s of a 1,024-sample plan at --dp 2 that takes 10 ms warm.
        print("  note: a process's first plan includes loading the planner's compiled (numba) kernels, a few "
              "hundred ms once; a training run's planner workers find them loaded by the process they fork from",
              file=sys.stderr)
    if "even_split" in out:
        e = out["even_split"]
        print(f"  placement {setup.cost_model.placement}: simulated {out['simulated_ms']:.1f} ms, bubble "
              f"{100 * out['bubble_fraction']:.1f}% (even split {even_setup.cost_model.placement}: "
              f"{e['simulated_ms']:.1f} ms, bubble {100 * e['bubble_fraction']:.1f}%)", file=sys.stderr)
    return 0
