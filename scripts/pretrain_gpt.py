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


def main(argv=None) -> int:
    from megatron_integration.arguments import build_parser, training_config_from_args
    from megatron_integration.run_config import add_run_config_argument, with_run_config
    from megatron_integration.run_report import resolved_args
    from megatron_integration.script_main import run_training_script

    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser(prog="pretrain_gpt.py", description=__doc__.split("\n\n")[0])
    add_run_config_argument(parser)
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    # torchrun's ranks per node; --dynapipe-planner-nodes is checked against the node count.
    num_nodes = max(world_size // max(int(os.environ.get("LOCAL_WORLD_SIZE", world_size)), 1), 1)

    def check():
        args = parser.parse_args(with_run_config(parser, argv, world_size))
        return args, training_config_from_args(args, world_size, num_nodes=num_nodes)

    def train(cfg):
        from megatron_integration.training import pretrain

        pretrain(cfg)

    return run_training_script(check, lambda cfg: cfg.parallel.timeout_minutes, argv, resolved_args, train)


if __name__ == "__main__":
    sys.exit(main())
