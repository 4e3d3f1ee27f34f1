"""``python -m dynapipe bench``: train with dynapipe, padding and packing side by side.

    python -m dynapipe bench --output bench.json --png bench.png [Megatron arguments]

Spawns its own ranks (gloo on CPU, NCCL on GPUs; no torchrun needed): by default as
many as ``--pipeline-model-parallel-size`` (2 for the default tiny GPT). Every Megatron
argument not given takes the README's main-job value (tiny GPT, PP2, the synthetic
mixture at ``--seq-length 1024``). Unless ``--dynapipe-cost-model`` is given, a cost
profile of this machine is measured first and DynaPipe plans with it.
"""
from __future__ import annotations

import argparse
import os
import sys

HELP = "train with dynapipe, padding and packing side by side"


def add_arguments(p) -> None:
    p.add_argument("--output", required=True, help="JSON results file")
    p.add_argument("--png", default=None, help="also draw the comparison as a PNG")
    p.add_argument("--methods", default="dynapipe,padding,packing",
                   help="comma-separated methods to run (default dynapipe,padding,packing)")
    p.add_argument("--nproc", type=int, default=None,
                   help="ranks to spawn (default: --pipeline-model-parallel-size, i.e. one replica)")
    p.add_argument("--warmup-iters", type=int, default=1, help="first iterations left out of the figures (default 1)")
    p.add_argument("--threads-per-rank", type=int, default=None, help="CPU threads per rank (default cores / ranks)")
    p.add_argument("--timeout-s", type=float, default=1800.0, help="give up on a method after this long (s)")
    # Every Megatron / DynaPipe training argument, passed through to the training jobs as given.
    from megatron_integration.arguments import add_dynapipe_args, add_megatron_args

    before = len(p._actions)
    add_megatron_args(p)
    add_dynapipe_args(p)
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


def run(args) -> int:
    from dynapipe.errors import DynaPipeError
    from megatron_integration.arguments import parse_training_args
    from megatron_integration.bench import METHOD_FLAGS, run_bench, with_defaults
    from megatron_integration.launch import RankFailed, RankUserError

    argv = training_argv(args)
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    unknown = [m for m in methods if m not in METHOD_FLAGS]
    if unknown or not methods:
        raise DynaPipeError(f"--methods {args.methods!r}: choose from {', '.join(METHOD_FLAGS)}.")
    for flag in ("--use-dynapipe", "--dynapipe-batching"):
        if flag in argv:
            raise DynaPipeError(f"{flag}: the bench sets the method itself; choose methods with --methods.")
    full = with_defaults(argv)
    pp = int(full[full.index("--pipeline-model-parallel-size") + 1])
    nproc = args.nproc or pp
    if args.warmup_iters < 0:
        raise DynaPipeError(f"--warmup-iters {args.warmup_iters}: must be >= 0.")
    # Validate every method's command line before starting any process.
    for m in methods:
        cfg = parse_training_args(full + METHOD_FLAGS[m], nproc)
    if cfg.train_iters <= args.warmup_iters:
        raise DynaPipeError(f"--train-iters {cfg.train_iters} leaves no timed iteration after --warmup-iters "
                            f"{args.warmup_iters}; raise --train-iters.")
    for path in filter(None, (args.output, args.png)):
        out_dir = os.path.dirname(os.path.abspath(path))
        try:
            os.makedirs(out_dir, exist_ok=True)
        except OSError as e:
            raise DynaPipeError(f"{path}: cannot create its directory {out_dir}: {e.strerror}.") from None
    try:
        run_bench(argv, methods, nproc, args.output, png=args.png, warmup_iters=args.warmup_iters,
                  threads_per_rank=args.threads_per_rank, timeout_s=args.timeout_s)
    except RankUserError as e:
        raise DynaPipeError(str(e)) from None  # bad input or a diverged run: one line, exit 2
    except RankFailed as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(f"wrote {args.output}" + (f" and {args.png}" if args.png else ""))
    return 0
