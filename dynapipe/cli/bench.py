"""``python -m dynapipe bench``: train with DynaPipe and megatron-core's baselines side by side.

    python -m dynapipe bench --output bench.json --png bench.png [--preset representative] [Megatron arguments]

Spawns its own ranks (gloo on CPU, NCCL on GPUs; no torchrun needed): by default as
many as ``--pipeline-model-parallel-size`` (2 in both presets). Every Megatron
argument not given takes the preset's value (``tiny``: the quick start's tiny GPT at
``--seq-length 1024``; ``representative``: GPT-7B's attention share, tuned baselines,
two rotated rounds). Unless ``--dynapipe-cost-model`` is given, a cost profile of this
machine is measured first and DynaPipe plans with it.
"""
from __future__ import annotations

import argparse
import sys

HELP = "train with dynapipe and megatron-core's padding / packing baselines side by side"


def add_arguments(p) -> None:
    """Add the ``bench`` command's flags to ``p``."""
    p.add_argument("--output", required=True,
                   help="JSON results file (a file path: the measured profile and the traces go next to it)")
    p.add_argument("--png", default=None, help="also draw the comparison as a PNG (a path ending in .png; GPT only)")
    p.add_argument("--preset", default="tiny", choices=("tiny", "representative", "long"),
                   help="default model, methods and protocol (default tiny: the quick start; long: --model t5 "
                        "only, inputs up to 4,096 tokens)")
    p.add_argument("--methods", default=None,
                   help="comma-separated methods to run, from dynapipe, dynapipe-1f1b, dynapipe-zb (the zb-h1 "
                        "schedule), dynapipe-per-sample (DynaPipe's rows skipping their padding's attention), "
                        "padding, padding-mb, packing, packing-per-sample (each sample's attention alone), "
                        "packing-search (per-sample packing given DynaPipe's schedule search) (default: the preset's)")
    p.add_argument("--rounds", type=int, default=None,
                   help="rounds over every method, in rotated order; medians are reported (default: the preset's)")
    p.add_argument("--sweep-top", type=int, default=None,
                   help="micro-batch sizes of each baseline run for real, best simulated first; 0 keeps "
                        "--micro-batch-size (default: the preset's)")
    p.add_argument("--nproc", type=int, default=None,
                   help="ranks to spawn (default: --pipeline-model-parallel-size x --tensor-model-parallel-size, i.e. "
                        "one replica)")
    p.add_argument("--warmup-iters", type=int, default=None,
                   help="first iterations left out of the figures (default: the preset's, 1)")
    p.add_argument("--calibrate-iters", type=int, default=None,
                   help="iterations of an untimed DynaPipe run that measures the profile's fixed cost per stage op "
                        "before the timed rounds; 0: none, else 2 or more (default: the preset's: 3 for "
                        "representative, 4 for --model t5 tiny, else 0)")
    p.add_argument("--threads-per-rank", type=int, default=None, help="CPU threads per rank (default cores / ranks)")
    p.add_argument("--timeout-s", type=float, default=1800.0, help="give up on a method after this long (s)")
    p.add_argument("--no-progress", action="store_true",
                   help="no progress bar over the training runs (one is drawn only on a terminal, with tqdm)")
    p.add_argument("--model", default="gpt", choices=("gpt", "t5"),
                   help="gpt (default) or t5: an encoder-decoder, every method through the DynaPipe executor")
    p.add_argument("--t5-sweep", default=None, help="--model t5: the baselines' micro-batch sizes to try, e.g. 1,2,4")
    # Every Megatron / DynaPipe training argument, passed through to the training jobs as given.
    from megatron_integration.arguments import add_dynapipe_args, add_megatron_args
    from megatron_integration.t5_arguments import add_t5_args

    before = len(p._actions)
    add_megatron_args(p)
    add_dynapipe_args(p)
    add_t5_args(p)
    p.set_defaults(_training_actions=p._actions[before:])
    for action in p._actions[before:]:
        action.default = argparse.SUPPRESS  # absent unless given: the bench's defaults apply


def training_argv(args) -> list[str]:
    """The training arguments given on the command line, as an argv list."""
    values = vars(args)
    out: list[str] = []
    for action in args._training_actions:
        if action.dest not in values:
            continue
        flag, value = action.option_strings[0], values[action.dest]
        if isinstance(action, argparse._StoreTrueAction):
            if value:
                out.append(flag)
        elif isinstance(action, argparse.BooleanOptionalAction):
            out.append(flag if value else action.option_strings[1])
        elif isinstance(value, list):
            out += [flag] + [str(v) for v in value]
        else:
            out += [flag, str(value)]
    return out


def _check_bench_numbers(args) -> None:
    """Refuse bench settings that would be replaced by a default or ignored, before any run."""
    from dynapipe.errors import DynaPipeError

    for flag, value in (("--nproc", args.nproc), ("--threads-per-rank", args.threads_per_rank)):
        if value is not None and value < 1:
            raise DynaPipeError(f"{flag} {value}: must be 1 or more (leave it out for the default).")
    if not args.timeout_s > 0:
        raise DynaPipeError(f"--timeout-s {args.timeout_s}: must be positive (seconds a method may take).")
    if args.t5_sweep is not None and args.model != "t5":
        raise DynaPipeError(f"--t5-sweep {args.t5_sweep} sets the T5 baselines' micro-batch sizes; add --model t5, "
                            f"or use --sweep-top for GPT.")


def run(args) -> int:
    """Run ``bench`` with parsed ``args``; the process exit status (0: done)."""
    from dynapipe.errors import spelled_as
    from megatron_integration.flag_spelling import MEGATRON_SPELLING, T5_SPELLING

    # bench reads Megatron's arguments, as training does.
    with spelled_as(T5_SPELLING if args.model == "t5" else MEGATRON_SPELLING):
        return _run(args)


def _run(args) -> int:
    from dynapipe.errors import DynaPipeError
    from megatron_integration.bench import PRESETS, check_request, run_bench
    from megatron_integration.bench_request import method_list
    from megatron_integration.bench_checks import check_bench_outputs, make_output_dir
    from megatron_integration.launch import RankFailed, RankUserError

    argv = training_argv(args)
    _check_bench_numbers(args)
    if args.model == "t5":
        from megatron_integration.bench_t5 import run_t5_cli

        return run_t5_cli(args, argv)
    if args.preset not in PRESETS:
        raise DynaPipeError(f"--preset {args.preset} is a T5 preset: add --model t5, or choose tiny or "
                            f"representative for GPT.")
    methods = list(PRESETS[args.preset].methods) if args.methods is None else method_list(args.methods)
    nproc = check_request(argv, methods, args.preset, rounds=args.rounds, sweep_top=args.sweep_top,
                          warmup_iters=args.warmup_iters, nproc=args.nproc, calibrate_iters=args.calibrate_iters)
    # The JSON and the picture are written after every run: what would fail then is refused now.
    check_bench_outputs(args.output, args.png, argv)
    for path in (args.output, args.png):
        if path is not None:
            make_output_dir(path)
    try:
        run_bench(argv, methods, nproc, args.output, png=args.png, warmup_iters=args.warmup_iters,
                  threads_per_rank=args.threads_per_rank, timeout_s=args.timeout_s, preset=args.preset,
                  rounds=args.rounds, sweep_top=args.sweep_top, calibrate_iters=args.calibrate_iters,
                  progress=not args.no_progress)
    except RankUserError as e:
        raise DynaPipeError(str(e)) from None  # bad input or a diverged run: one line, exit 2
    except RankFailed as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(f"wrote {args.output}" + (f" and {args.png}" if args.png else ""))
    return 0
