"""Pretrain (or fine-tune) a T5 (encoder-decoder) with megatron-core stages, with or without DynaPipe.

    torchrun --nproc-per-node 2 scripts/pretrain_t5.py \
        --encoder-num-layers 2 --decoder-num-layers 2 --hidden-size 64 --num-attention-heads 4 \
        --encoder-seq-length 512 --decoder-seq-length 128 --micro-batch-size 4 --global-batch-size 32 \
        --pipeline-model-parallel-size 2 --lr 1e-3 --train-iters 20 --mock-data --use-dynapipe --log-interval 1

Every method runs through the DynaPipe executor (megatron-core's schedules no longer
pipeline encoder-decoder models): ``--use-dynapipe`` plans variable-shape micro-batches;
without it the fixed-shape baselines run as 1F1B plans: ``--dynapipe-batching padding``
(the default) or ``packing`` (with ``--reset-position-ids --reset-attention-mask``). Run
without torchrun, it is a one-rank job. Arguments: ``--help``.
"""
from __future__ import annotations

import os
import sys

if __package__ in (None, ""):
    # Run as a file from a source checkout: make the repository importable.
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from dynapipe.errors import DynaPipeError  # noqa: E402


def main(argv=None) -> int:
    from megatron_integration.agreement import agreed_start, timeout_in_argv
    from megatron_integration.run_config import add_run_config_argument, with_run_config
    from megatron_integration.t5_arguments import build_t5_parser, t5_config_from_args

    started, failed = False, True
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_t5_parser(prog="pretrain_t5.py", description=__doc__.split("\n\n")[0])
    add_run_config_argument(parser)
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    try:
        # A rank whose checks fail (a file its node lacks) stops every rank with its line.
        cfg = agreed_start(lambda: t5_config_from_args(parser.parse_args(with_run_config(parser, argv, world_size)),
                                                       world_size),
                           lambda value: value.base.parallel.timeout_minutes, timeout_in_argv(argv))
        # megatron-core is imported only now: a bad command line is reported before its notices.
        from megatron_integration.initialize import quiet_megatron_warnings

        quiet_megatron_warnings()
        from megatron_integration.t5_training import pretrain_t5

        started = True
        pretrain_t5(cfg)
        failed = False
    except (DynaPipeError, RuntimeError) as e:
        from megatron_integration.agreement import exit_line
        from megatron_integration.run_report import write_line

        line = exit_line(e, started)
        if line is None:
            raise
        # Every rank prints its line: each in one write, so two ranks' lines never merge.
        write_line(sys.stderr, "error: " + line)
        return 2
    finally:
        if started:
            from megatron_integration.initialize import destroy

            destroy(failed=failed)
    return 0


if __name__ == "__main__":
    sys.exit(main())
