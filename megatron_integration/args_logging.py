"""Megatron-LM's logging arguments: the log line's optional fields and TensorBoard's settings.

Honoured: ``--log-interval``, ``--log-throughput``, ``--log-params-norm``,
``--log-num-zeros-in-grad`` (log line and TensorBoard), ``--tensorboard-dir``,
``--tensorboard-log-interval``, ``--tensorboard-queue-size``, ``--log-timers-to-tensorboard``
(the iteration's measured time split), ``--log-validation-ppl-to-tensorboard``,
``--no-log-loss-scale-to-tensorboard``, ``--log-world-size-to-tensorboard``;
``--logging-level`` (Python's root logger); ``--timing-log-level 0`` and ``--timing-log-option``
(Megatron-LM's defaults: the iteration time only) are accepted, higher levels refused. No torch
or megatron import.
"""
from __future__ import annotations

import argparse

from dynapipe.errors import DynaPipeError
from megatron_integration.args_checks import _positive, _unsupported_value
from megatron_integration.train_config import TensorBoardArgs


def add_logging_args(parser: argparse.ArgumentParser) -> None:
    """Declare the logging group (names and defaults as Megatron-LM's)."""
    g = parser.add_argument_group("logging")
    g.add_argument("--log-interval", type=int, default=100, help="iterations between log lines")
    g.add_argument("--tensorboard-dir", default=None, help="write TensorBoard scalars here")
    g.add_argument("--log-throughput", action="store_true",
                   help="add the model TFLOP/s per GPU (rank, on CPU) to the log line: of the shapes executed, "
                        "as Megatron-LM counts them, and of the real tokens")
    g.add_argument("--log-params-norm", action="store_true",
                   help="add the L2 norm of all parameters (every stage, each once) to the log line")
    g.add_argument("--log-num-zeros-in-grad", action="store_true",
                   help="add the number of zero gradient elements (every stage, each once) to the log line")
    g.add_argument("--tensorboard-log-interval", type=int, default=1,
                   help="iterations between TensorBoard scalars")
    g.add_argument("--tensorboard-queue-size", type=int, default=1000,
                   help="TensorBoard events held before a write to disk")
    g.add_argument("--log-timers-to-tensorboard", action="store_true",
                   help="write the iteration's measured time split (ms) to TensorBoard")
    g.add_argument("--log-validation-ppl-to-tensorboard", action="store_true",
                   help="write the validation perplexity to TensorBoard")
    g.add_argument("--no-log-loss-scale-to-tensorboard", "--disable-log-loss-scale-to-tensorboard",
                   action="store_false", dest="log_loss_scale_to_tensorboard",
                   help="do not write the loss scale to TensorBoard")
    g.add_argument("--log-world-size-to-tensorboard", action="store_true",
                   help="write the world size to TensorBoard")
    g.add_argument("--logging-level", type=int, default=None,
                   help="level of Python's root logger (10 DEBUG, 20 INFO, 30 WARNING, ...), with a handler, so "
                        "megatron-core's log records at that level and above are printed (default: none set; "
                        "warnings and errors only)")
    g.add_argument("--timing-log-level", type=int, default=0, choices=(0, 1, 2),
                   help="0 (default): the iteration time only; 1 and 2 are refused (use --dynapipe-trace-dir)")
    g.add_argument("--timing-log-option", default="minmax", choices=("max", "minmax", "all"),
                   help="accepted: applies to --timing-log-level 1 and 2")


def tensorboard_args_from_args(args: argparse.Namespace) -> TensorBoardArgs:
    """TensorBoard's settings, validated; refuses the per-operation timers of timing levels 1
    and 2 (this build's per-op times are the executor traces)."""
    if args.timing_log_level:
        raise _unsupported_value("--timing-log-level", args.timing_log_level,
                                 "Megatron-LM's per-operation timers are not built; the log line has the iteration "
                                 "time (level 0), and --dynapipe-trace-dir writes every op's time")
    for flag in ("tensorboard-log-interval", "tensorboard-queue-size"):
        _positive(flag, getattr(args, flag.replace("-", "_")))
    _positive("logging-level", args.logging_level, allow_zero=True)
    # Megatron-LM ignores these without a directory; here a flag that would change nothing is refused.
    wants = [f"--{f}" for f in ("log-timers-to-tensorboard", "log-validation-ppl-to-tensorboard",
                                "log-world-size-to-tensorboard") if getattr(args, f.replace("-", "_"))]
    wants += [f"--tensorboard-{f} {v}" for f, v, default in (
        ("log-interval", args.tensorboard_log_interval, 1), ("queue-size", args.tensorboard_queue_size, 1000))
        if v != default]
    if not args.log_loss_scale_to_tensorboard:
        wants.append("--no-log-loss-scale-to-tensorboard")
    if wants and not args.tensorboard_dir:
        raise DynaPipeError(f"{wants[0]} applies to TensorBoard's scalars; add --tensorboard-dir DIR or drop it.")
    return TensorBoardArgs(log_interval=args.tensorboard_log_interval, queue_size=args.tensorboard_queue_size,
                           log_timers=args.log_timers_to_tensorboard,
                           log_validation_ppl=args.log_validation_ppl_to_tensorboard,
                           log_loss_scale=args.log_loss_scale_to_tensorboard,
                           log_world_size=args.log_world_size_to_tensorboard)
