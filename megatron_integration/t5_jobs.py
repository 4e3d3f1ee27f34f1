"""T5 training jobs started from Python: several runs in one spawned gloo job.

``run_t5_training([argv, ...], world_size)`` launches ``world_size`` local ranks that run
:func:`megatron_integration.t5_training.pretrain_t5` once per command line, one after the
other in the same process group (the start-up of a job costs more than a tiny run), and
returns the per-iteration figures of every run on every rank. Used by ``bench --model t5``
and the tests.
"""
from __future__ import annotations

import io
import os
import sys
from typing import Optional, Sequence

from megatron_integration.jobs import iteration_summary
from megatron_integration.launch import spawn


def t5_training_job(runs: Sequence[Sequence[str]], echo: bool = False) -> list[dict]:
    """Rank body: train each command line of ``runs`` in turn; a picklable summary of each.
    megatron's parallel state and every process group the run created are torn down after
    every run (:func:`~megatron_integration.initialize.end_run`; ``threads_after`` counts the
    rank's threads then), so each run sets up its own
    tensor/pipeline/data-parallel layout as a fresh job would."""
    from megatron_integration.cpu_time import IterationCpu
    from megatron_integration.initialize import destroy, end_run, thread_count
    from megatron_integration.t5_arguments import parse_t5_args
    from megatron_integration.t5_training import pretrain_t5

    world = int(os.environ.get("WORLD_SIZE", "1"))
    configs = [parse_t5_args(list(argv), world) for argv in runs]  # every command line checked first
    out = []
    try:
        for cfg in configs:
            cpu = IterationCpu()
            text = io.StringIO()
            run = pretrain_t5(cfg, stream=sys.stdout if echo else text, on_iteration=cpu.record)
            from megatron.core import parallel_state

            out.append(dict(iteration_summary(cfg.method, run, cpu, parallel_state.get_pipeline_model_parallel_rank()),
                            eval_lines=run.eval_lines, eval_path=run.eval_path, checkpoint_lines=run.checkpoint_lines,
                            parameters=run.parameters,
                            data_lines=[line for line in text.getvalue().splitlines()
                                        if line.startswith(" > ") and " data: " in line],
                            # --rerun-mode report_stats: the determinism statistics, rank 0's.
                            stats_lines=[line for line in text.getvalue().splitlines()
                                         if line.startswith(("  loss: ", "  gradient norm: "))],
                            # --check-weight-hash-across-dp-replicas-interval: rank 0's lines.
                            hash_lines=[line for line in text.getvalue().splitlines()
                                        if line.startswith(">>> Weight hashes match")],
                            tp_size=parallel_state.get_tensor_model_parallel_world_size()))
            end_run()
            out[-1]["threads_after"] = thread_count()
    finally:
        destroy()
    return out


def run_t5_training(runs: Sequence[Sequence[str]], world_size: int, timeout_s: float = 600.0, echo: bool = False,
                    threads_per_rank: Optional[int] = None) -> list[list[dict]]:
    """Spawn ``world_size`` ranks training each command line of ``runs`` in turn;
    ``result[rank][run]`` is that rank's summary of that run."""
    return spawn(t5_training_job, world_size, ([list(a) for a in runs], echo), timeout_s=timeout_s,
                 threads_per_rank=threads_per_rank)
