"""``python -m dynapipe trace``: the simulated pipeline timeline of one global batch.

Plans the batch like ``plan`` (micro-batches, schedule search) and writes the chosen
schedule's simulated timeline as a Chrome/Perfetto trace (``--output``), and optionally as
a PNG (``--png``). Lengths come from ``--lengths FILE`` or the synthetic mixture
(``--samples N [--seed K]``).
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import sys

from dynapipe.batching.lengths import read_lengths_for
from dynapipe.cli.batching_options import (add_batching_arguments, add_decoder_seq_length, check_batching_flags,
                                            cut_arguments)
from dynapipe.cli.cost import add_cost_model_arguments, add_memory_arguments, cost_setup_from_args
from dynapipe.output_paths import check_distinct, check_output_file, config_inputs, saved_whole, write_output
from dynapipe.cli.placement_options import (add_placement_argument, apply_placement, even_split_schedule,
                                             placement_json)
from dynapipe.cli.schedule_options import (add_recompute_default, add_split_backward_argument, check_schedule_flags,
                                           escalate_recompute,
                                           levels_from, recompute_label, resolve_cluster, split_backward)
from dynapipe.data.synthetic import sample_lengths
from dynapipe.errors import DynaPipeError
from dynapipe.pipeline_planner import schedule_batch_plan
from dynapipe.batching import plan_micro_batches
from dynapipe.schedule.search import SCHEDULE_CHOICES
from dynapipe.schedule.trace import chrome_trace, plot_timeline

HELP = "write the simulated pipeline timeline as a Chrome trace / PNG"
DEFAULT_SEED = 0


class _OneOutput(argparse.Action):
    """``--output`` or its first name ``--out``, given once: two paths would write only the last."""

    def __call__(self, parser, namespace, values, option_string=None):
        before = getattr(namespace, self.dest, None)
        if before is not None and before != values:
            parser.error(f"{option_string} {values!r}: the trace already goes to {before!r} (--output and --out "
                         f"are one flag); give one path")
        setattr(namespace, self.dest, values)


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Add the ``trace`` command's flags to ``p``."""
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--lengths", help="lengths file (as for plan); - reads stdin")
    src.add_argument("--samples", type=int, help="draw this many samples from the synthetic mixture instead")
    # None tells a --seed given from its default, which --lengths refuses (it draws nothing).
    p.add_argument("--seed", type=int, default=None, help=f"seed for --samples (default {DEFAULT_SEED})")
    add_cost_model_arguments(p)
    add_recompute_default(p)
    add_memory_arguments(p)
    p.add_argument("--dp", type=int, default=1, help="data-parallel replicas (default 1)")
    add_batching_arguments(p)
    p.add_argument("--seq-length", type=int, default=None, help="truncate samples to this many tokens")
    add_decoder_seq_length(p)
    p.add_argument("--schedule", choices=SCHEDULE_CHOICES, default="auto",
                   help="schedule, as for plan (zb-h1 draws each backward as BI and BW; default auto)")
    add_split_backward_argument(p)
    p.add_argument("--cluster", default=None, help="cluster config (default: chosen by device)")
    p.add_argument("--output", "--out", dest="out", required=True, metavar="FILE.json", action=_OneOutput,
                   help="write the Chrome/Perfetto trace here (--out: the same flag, its first name)")
    p.add_argument("--png", default=None, metavar="FILE.png", help="also draw the timeline (replica --replica)")
    p.add_argument("--replica", type=int, default=None, help="replica drawn by --png (default 0)")
    add_placement_argument(p)


def _check_replica(args: argparse.Namespace) -> int:
    """The replica ``--png`` draws; refused before any planning when out of range or given
    without ``--png`` (the trace file holds every replica)."""
    if args.replica is None:
        return 0
    if args.png is None:
        raise DynaPipeError(f"--replica {args.replica}: only --png reads it (the --output trace holds every replica); "
                            f"add --png FILE.png or drop --replica.")
    if args.dp >= 1 and not 0 <= args.replica < args.dp:  # a bad --dp has its own refusal
        raise DynaPipeError(f"--replica {args.replica} is not one of the {args.dp} replica(s); "
                            f"use 0 to {args.dp - 1} (--dp {args.dp}).")
    return args.replica


def _check_before_planning(args: argparse.Namespace) -> None:
    """Refuse, before any planning, a ``--seed`` that ``--lengths`` would ignore and output
    paths that cannot be written: ``--png`` must be a ``.png`` file, and neither output may
    name the lengths file or the other output."""
    if args.seed is not None and args.lengths is not None:
        raise DynaPipeError(f"--seed {args.seed}: only --samples reads it (--lengths {args.lengths} gives the "
                            f"lengths); drop --seed or draw the lengths with --samples N.")
    check_output_file(args.out, "--output", stdout=True)
    if args.png is not None:
        check_output_file(args.png, "--png", suffix=".png")
        if importlib.util.find_spec("matplotlib") is None:  # found now, not after the planning
            raise DynaPipeError("--png needs matplotlib: pip install matplotlib (or the 'plot' extra).")
    check_distinct(config_inputs(args) + [("--lengths", args.lengths), ("--output", args.out), ("--png", args.png)])


def run(args: argparse.Namespace) -> int:
    """Run ``trace`` with parsed ``args``; the process exit status (0: done)."""
    check_batching_flags(args)
    check_schedule_flags(args)
    replica = _check_replica(args)
    _check_before_planning(args)
    even_setup = cost_setup_from_args(args)
    if args.lengths is not None:
        lengths = read_lengths_for(args.lengths, even_setup.model.name, even_setup.model.is_encoder_decoder)
    else:
        if args.samples <= 0:
            raise DynaPipeError(f"--samples {args.samples} must be a positive integer.")
        seed = DEFAULT_SEED if args.seed is None else args.seed
        lengths = sample_lengths(args.samples, seed, args.seq_length or even_setup.model.max_seq_length,
                                 even_setup.model.is_encoder_decoder)
    setup, searched = apply_placement(args, even_setup, lengths)

    def simulate_on(cost_model, schedule=args.schedule):
        batch_plan, level = escalate_recompute(lambda level: plan_micro_batches(
            lengths, cost_model, recompute=level, **cut_arguments(args, setup)), setup.recompute)
        return schedule_batch_plan(batch_plan, cost_model, schedule=schedule,
                                   memory_limit_mib=setup.memory_limit_mib, reserved_mib=setup.reserved_mib,
                                   cluster=resolve_cluster(args.cluster, setup.device.name),
                                   recompute=levels_from(args.recompute), lengths=lengths,
                                   split_backward=split_backward(args)), level

    it, level = simulate_on(setup.cost_model)
    meta = {"model": setup.model.name, "device": setup.device.name, "stages": setup.cost_model.num_stages,
            **it.schedule_json(), **placement_json(setup, searched)}
    even_line = ""
    if setup.cost_model.placement != even_setup.cost_model.placement:
        even, _ = simulate_on(even_setup.cost_model, even_split_schedule(args.schedule))
        meta["even_split"] = {"simulated_ms": round(even.simulated_ms, 3),
                              "bubble_fraction": round(even.bubble_fraction, 4)}
        even_line = (f"; placement {setup.cost_model.placement} (even split {even_setup.cost_model.placement}: "
                     f"{even.simulated_ms:.1f} ms, bubble {100 * even.bubble_fraction:.1f}%)")
    trace = chrome_trace(it.timelines, it.search.micro_batches, meta)
    write_output(args.out, json.dumps(trace, separators=(",", ":")), "--output")
    levels = it.stage_recompute
    recompute = recompute_label(levels, setup.cost_model.num_stages)
    if args.png:
        tl = it.timelines[replica]
        title = (f"{setup.model.name}, {setup.cost_model.num_stages} stages, {len(it.search.micro_batches[replica])} "
                 f"micro-batches: {it.schedule} ({it.order} order, recompute {recompute}) "
                 f"{tl.makespan_ms:.1f} ms, bubble {100 * tl.bubble_fraction:.1f}%")
        saved_whole(args.png, lambda path: plot_timeline(tl, it.search.micro_batches[replica], path, title=title,
                                                         capacity_mib=setup.memory_limit_mib - setup.reserved_mib),
                    "--png")
    how = "as given" if args.recompute else f"chosen; micro-batches cut for {level}"
    print(f"{it.schedule} ({it.order} order, recompute {recompute}, {how}): simulated {it.simulated_ms:.1f} ms, "
          f"bubble {100 * it.bubble_fraction:.1f}%, peak " + ", ".join(f"{p:.0f}" for p in it.stage_peak_mib)
          + f" MiB{even_line}; trace written to {args.out}" + (f", picture to {args.png}" if args.png else ""),
          file=sys.stderr)
    return 0
