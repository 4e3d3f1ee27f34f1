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


def main(argv=None) -> int:
    from megatron_integration.run_config import add_run_config_argument, with_run_config
    from megatron_integration.run_report import t5_resolved_args
    from megatron_integration.script_main import run_training_script
    from megatron_integration.t5_arguments import build_t5_parser, t5_config_from_args

    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_t5_parser(prog="pretrain_t5.py", description=__doc__.split("\n\n")[0])
    add_run_config_argument(parser)
    world_size = int(os.environ.get("WORLD_SIZE", "1"))

    def check():
        args = parser.parse_args(with_run_config(parser, argv, world_size))
        return args, t5_config_from_args(args, world_size)

    def train(cfg):
        from megatron_integration.t5_training import pretrain_t5

        pretrain_t5(cfg)

    return run_training_script(check, lambda cfg: cfg.base.parallel.timeout_minutes, argv, t5_resolved_args, train)


if __name__ == "__main__":
    sys.exit(main())
