"""``python -m dynapipe <command>``: the command line.

Each command lives in its own module exposing ``HELP`` (one line), ``add_arguments``
(argparse) and ``run(args) -> int``. Modules are imported only when their command runs,
so planning commands never import torch.
"""
from __future__ import annotations

import argparse
import importlib
import importlib.util
import sys
from typing import Optional, Sequence

from dynapipe.errors import DynaPipeError

# command -> (module, one-line help). Order is the order ``--help`` lists them.
COMMANDS = {
    "plan": ("dynapipe.cli.plan", "plan the micro-batches (and schedule) of one global batch"),
    "cost": ("dynapipe.cli.cost", "print the cost model's time and memory for given shapes"),
    "synth": ("dynapipe.cli.synth", "write a lengths file drawn from the synthetic multi-task mixture"),
    "validate": ("dynapipe.cli.validate", "validate a directory of serialized execution plans"),
    "trace": ("dynapipe.cli.trace", "write the simulated pipeline timeline as a Chrome trace / PNG"),
    "bench": ("dynapipe.cli.bench", "train with dynapipe, padding and packing side by side"),
    "profile": ("dynapipe.cli.profile", "measure megatron-core layers and write a cost profile"),
    "advise": ("dynapipe.cli.advise", "rank parallel layouts for a model and cluster by simulation"),
}


def _available() -> dict:
    found = {}
    for name, (module, help_) in COMMANDS.items():
        if importlib.util.find_spec(module) is not None:
            found[name] = (module, help_)
    return found


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Parse ``argv`` and run one command; user errors print one line and return 2."""
    argv = list(sys.argv[1:] if argv is None else argv)
    commands = _available()
    parser = argparse.ArgumentParser(prog="python -m dynapipe",
                                     description="DynaPipe: dynamic micro-batching and pipeline planning.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    # Only the chosen command's module is imported (and so only it may pull in torch).
    chosen = next((a for a in argv if not a.startswith("-")), None)
    modules = {}
    for name, (module, help_) in commands.items():
        p = sub.add_parser(name, help=help_, description=help_)
        if name == chosen:
            modules[name] = importlib.import_module(module)
            modules[name].add_arguments(p)
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    try:
        return int(modules[args.command].run(args) or 0)
    except DynaPipeError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
