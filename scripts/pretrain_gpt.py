"""Pretrain (or fine-tune) a GPT with megatron-core, with or without DynaPipe.

    torchrun --nproc-per-node 2 scripts/pretrain_gpt.py \
        --num-layers 4 --hidden-size 64 --num-attention-heads 4 --seq-length 1024 \
        --max-position-embeddings 1024 --micro-batch-size 4 --global-batch-size 64 \
        --pipeline-model-parallel-size 2 --lr 1e-3 --train-iters 20 --mock-data \
        --use-dynapipe --log-interval 1

Without ``--use-dynapipe`` megatron-core's fixed-shape 1F1B trains with padding
(``--dynapipe-batching packing`` for packed rows). ``--run-config FILE`` (for example
``configs/runs/gpt-7b-pp4-dp2-h100.yaml``) supplies the arguments of a named run;
arguments given after it override them. Run without torchrun, it is a one-rank job.
Arguments: ``--help``.
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
    from megatron_integration.arguments import build_parser, training_config_from_args
    from megatron_integration.run_config import add_run_config_argument, with_run_config

    started, failed = False, True
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser(prog="pretrain_gpt.py", description=__doc__.split("\n\n")[0])
    add_run_config_argument(parser)
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    # torchrun's ranks per node; --dynapipe-planner-nodes is checked against the node count.
    num_nodes = max(world_size // max(int(os.environ.get("LOCAL_WORLD_SIZE", world_size)), 1), 1)
    try:
        def checked():
            args = parser.parse_args(with_run_config(parser, argv, world_size))
            return args, training_config_from_args(args, world_size, num_nodes=num_nodes)

        # A rank whose checks fail (a file its node lacks) stops every rank with its line.
        args, cfg = agreed_start(checked, lambda value: value[1].parallel.timeout_minutes, timeout_in_argv(argv))
        if os.environ.get("RANK", "0") == "0":
            from megatron_integration.run_report import argument_dump, resolved_args, write_line

            write_line(sys.stdout, "\n".join(argument_dump(resolved_args(args, cfg))))
        # megatron-core is imported only now: a bad command line is reported before its notices.
        from megatron_integration.initialize import quiet_megatron_warnings

        quiet_megatron_warnings()
        from megatron_integration.training import pretrain

        started = True
        pretrain(cfg)
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
