"""``python -m dynapipe <command>``: the command line.

Each command lives in its own module exposing ``HELP`` (one line), ``add_arguments``
(argparse) and ``run(args) -> int``. Modules are imported only when their command runs,
so planning commands never import torch.
"""
from __future__ import annotations

import importlib
import importlib.util
import sys
from typing import Optional, Sequence

from dynapipe.cli.argtypes import StrictArgumentParser, print_error
from dynapipe.errors import DynaPipeError, error_lines, spelled_as

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
    parser = StrictArgumentParser(prog="python -m dynapipe",
                                  description="DynaPipe: dynamic micro-batching and pipeline planning.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    # Only the chosen command's module is imported (and so only it may pull in torch).
    chosen = next((a for a in argv if not a.startswith("-")), None)
    modules = {}
    for name, (module, help_) in commands.items():
        # Whole flags only, as Megatron-LM's parser takes them: bench and profile read Megatron
        # arguments, and a prefix must not silently become another flag (--warmup, --warmup-iters).
        p = sub.add_parser(name, help=help_, description=help_, allow_abbrev=False)
        if name == chosen:
            modules[name] = importlib.import_module(module)
            modules[name].add_arguments(p)
    try:
        args, extras = parser.parse_known_args(argv)
        if extras:
            # bench and profile take Megatron arguments: name the reason a refused one has there.
            if args.command in ("bench", "profile"):
                from megatron_integration.args_refusals import refused_flag_lines

                refused = refused_flag_lines(extras)
                for line in refused:
                    print_error(line)
                if refused:
                    return 2
            # Named against the command, whose --help lists its flags.
            own = sub.choices.get(args.command) if args.command else None
            (own or parser).error(f"unrecognized arguments: {' '.join(extras)}")
    except SystemExit as e:  # --help (0) or a bad command line (2, already printed on one line)
        return e.code if isinstance(e.code, int) else 2
    if args.command is None:
        parser.print_help()
        return 2
    try:
        from dynapipe.cli.spelling import spelling_of

        with spelled_as(spelling_of(args.command)):
            return int(modules[args.command].run(args) or 0)
    except DynaPipeError as e:
        for line in error_lines(e):  # one per refusal of a RefusedArguments
            print_error(line)
    except OSError as e:
        # A file the command reads or writes: name it and say what the system said.
        where = f"{e.filename!r}: " if e.filename else ""
        print_error(f"{where}{e.strerror or e}; check the path and its permissions.")
    except RecursionError:
        print_error("the input is nested too deeply to read; it is not a file this command writes.")
    except UnicodeError as e:
        print_error(f"the input is not valid UTF-8 text ({e.reason}).")
    except MemoryError:
        print_error("out of memory while reading the input; is it the file you meant?")
    except KeyboardInterrupt:
        return 130
    return 2
