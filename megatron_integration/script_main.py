"""What both training scripts (``scripts/pretrain_gpt.py``, ``scripts/pretrain_t5.py``) do around
a run: check the command line on every rank, print Megatron-LM's argument block, train, and turn
a failure into one ``error:`` line and exit status 2 (16 or 17, Megatron-LM's, for a result the
rerun state machine rejected).

Kept free of torch and megatron-core at import: a bad command line is reported before megatron-core
is imported and prints its notices.
"""
from __future__ import annotations

import argparse
import os
import sys
from typing import Callable, Sequence, TypeVar

from dynapipe.errors import DynaPipeError, RefusedArguments, error_lines

T = TypeVar("T")


def run_training_script(check: Callable[[], tuple[argparse.Namespace, T]], timeout_minutes: Callable[[T], float],
                        argv: Sequence[str], dumped: Callable[[argparse.Namespace, T], argparse.Namespace],
                        train: Callable[[T], object]) -> int:
    """Run one training job's rank; returns its exit status (0, or after an ``error:`` line 2, or
    Megatron-LM's 16 or 17 for a rejected result, :mod:`megatron_integration.rerun`).

    ``check``: parses and validates the command line, returning the parsed arguments and the run's
    config; every rank runs it and a rank whose checks fail stops every rank with its line.
    ``timeout_minutes``: the config's ``--distributed-timeout-minutes``, for that agreement.
    ``dumped``: the arguments rank 0 prints, with the values validation derived filled in.
    ``train``: imports megatron-core and trains; :func:`megatron_integration.initialize.destroy`
    runs after it, whatever happens.
    """
    from megatron_integration.agreement import agreed_start, exit_line, timeout_in_argv
    from megatron_integration.megatron_resolved import split_warning
    from megatron_integration.run_report import argument_dump, write_line

    started, failed = False, True
    try:
        # A rank whose checks fail (a file its node lacks) stops every rank with its line.
        args, cfg = agreed_start(check, lambda value: timeout_minutes(value[1]), timeout_in_argv(argv))
        if os.environ.get("RANK", "0") == "0":
            warning = split_warning(args)
            if warning is not None:
                write_line(sys.stderr, warning)
            write_line(sys.stdout, "\n".join(argument_dump(dumped(args, cfg))))
        # megatron-core is imported only now: a bad command line is reported before its notices.
        from megatron_integration.initialize import quiet_megatron_warnings

        quiet_megatron_warnings()
        started = True
        train(cfg)
        failed = False
    except (DynaPipeError, RuntimeError) as e:
        line = exit_line(e, started)
        if line is None:
            raise
        # Every rank prints its line (a line per refusal): each in one write, so two ranks' lines
        # never merge.
        lines = error_lines(e) if isinstance(e, RefusedArguments) else [line]
        write_line(sys.stderr, "\n".join("error: " + text for text in lines))
        # A rejected result ends with Megatron-LM's status (16: resume elsewhere, 17: diagnosed).
        return getattr(e, "exit_code", 2)
    finally:
        if started:
            from megatron_integration.initialize import destroy

            destroy(failed=failed)
    return 0
