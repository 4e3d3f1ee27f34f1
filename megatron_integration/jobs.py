"""Training jobs started from Python: one spawned gloo/NCCL job per call.

``run_training(argv, world_size)`` launches ``world_size`` local ranks (see
:mod:`megatron_integration.launch`), each parsing the Megatron-style ``argv`` and
running :func:`megatron_integration.training.pretrain`; it returns the per-iteration
figures every rank agrees on. ``python -m dynapipe bench`` and the tests use it.
``run_trainings([argv, ...], world_size)`` runs several command lines one after the
other in one such job (the start-up of a job costs more than a tiny run).
"""
from __future__ import annotations

import io
import os
import sys
from typing import Optional, Sequence

from megatron_integration.cpu_allocator import pretouched_seconds
from megatron_integration.launch import spawn


def training_job(argv: Sequence[str], echo: bool = False) -> dict:
    """Rank body: train with ``argv``; returns a picklable summary of the run."""
    from megatron_integration.arguments import parse_training_args
    from megatron_integration.initialize import destroy

    world = int(os.environ.get("WORLD_SIZE", "1"))
    cfg = parse_training_args(list(argv), world)
    try:
        return _train(cfg, echo)
    finally:
        destroy()


def training_jobs(runs: Sequence[Sequence[str]], echo: bool = False) -> list[dict]:
    """Rank body: train each command line of ``runs`` in turn, in this job's process group;
    a picklable summary of each (as :func:`training_job`'s).

    Each command line is parsed just before its run (a run may load what an earlier one
    saved), and megatron's parallel state and every process group the run created are torn down after
    every run (:func:`~megatron_integration.initialize.end_run`; ``threads_after`` counts the
    rank's threads then), so each run sets up
    its own pipeline/data-parallel layout and seeds as a fresh job would."""
    from megatron_integration.arguments import parse_training_args
    from megatron_integration.initialize import destroy, end_run, thread_count

    world = int(os.environ.get("WORLD_SIZE", "1"))
    out = []
    try:
        for argv in runs:
            out.append(_train(parse_training_args(list(argv), world), echo))
            end_run()
            out[-1]["threads_after"] = thread_count()
    finally:
        destroy()
    return out


def _train(cfg, echo: bool) -> dict:
    """Train ``cfg`` on this rank (joining the process group if not joined); its summary."""
    from megatron.core import parallel_state

    from megatron_integration.cpu_time import IterationCpu
    from megatron_integration.training import pretrain

    stream = sys.stdout if echo else io.StringIO()
    cpu = IterationCpu()
    run = pretrain(cfg, stream=stream, on_iteration=cpu.record)
    pp_rank = parallel_state.get_pipeline_model_parallel_rank()
    return dict(iteration_summary(cfg.method, run, cpu, pp_rank), **{
        # Megatron-format validation/test lines (every rank computes them; the logging rank prints them).
        "eval_lines": run.eval_lines,
        "eval_path": run.eval_path,
        "printed": stream.getvalue() if isinstance(stream, io.StringIO) else "",
        "checkpoint_lines": run.checkpoint_lines,
        # Where each iteration's time went (megatron-core baselines: measured around its steps).
        "breakdown_ms": [r.breakdown_ms for r in run.results],
    })


def iteration_summary(method: str, run, cpu, pp_rank: int) -> dict:
    """The picklable per-iteration figures of a finished run (GPT or T5) on one rank:
    losses, times (ms), token counts, activation peaks (MiB), CPU ms of the rank and of the
    processes it started (planner workers)."""
    return {
        "method": method,
        "start_iteration": run.start_iteration,
        "losses": run.losses,
        "iteration_ms": [r.iteration_ms for r in run.results],
        "real_tokens": [r.real_tokens for r in run.results],
        "padded_tokens": [r.padded_tokens for r in run.results],
        # dynapipe.cost.model_flops.TokenWork of each global batch: executed shapes, samples' own.
        "executed_work": [r.executed_work for r in run.results],
        "real_work": [r.real_work for r in run.results],
        # Model FLOPs trained so far, a resumed checkpoint's included (checkpoints record it).
        "flops_so_far": run.flops_so_far,
        # --log-params-norm / --log-num-zeros-in-grad (None when not asked for).
        "params_norm": [r.params_norm for r in run.results],
        "num_zeros_in_grad": [r.num_zeros_in_grad for r in run.results],
        "loss_tokens": [r.loss_tokens for r in run.results],
        "grad_norms": [r.grad_norm for r in run.results],
        "plan_wait_ms": [r.plan_wait_ms for r in run.results],
        "schedules": [r.schedule for r in run.results],
        "activation_measured_mib": [r.activation_measured_mib for r in run.results],
        "activation_planned_mib": [r.activation_planned_mib for r in run.results],
        # GPUs: the caching allocator's memory at the end, maxima over the run (MiB); None on CPUs.
        "cuda_memory_mib": run.cuda_memory_mib,
        "pp_rank": pp_rank,
        "log_lines": run.log_lines,
        "layer_spec": run.spec_name,
        "cpu_ms": cpu.rank_ms,
        "children_cpu_ms": cpu.children_ms,
        "minor_faults": cpu.minor_faults,
        "system_ms": cpu.system_ms,
        # Seconds this rank spent writing --dynapipe-cpu-pretouch-mb of heap (0.0: none asked; None: a GPU rank).
        "pretouch_s": pretouched_seconds(),
    }


def run_training(argv: Sequence[str], world_size: int, timeout_s: float = 600.0, echo: bool = False,
                 threads_per_rank: Optional[int] = None) -> list[dict]:
    """Spawn ``world_size`` ranks training with ``argv``; their summaries in rank order."""
    return spawn(training_job, world_size, (list(argv), echo), timeout_s=timeout_s,
                 threads_per_rank=threads_per_rank)


def run_trainings(runs: Sequence[Sequence[str]], world_size: int, timeout_s: float = 600.0, echo: bool = False,
                  threads_per_rank: Optional[int] = None) -> list[list[dict]]:
    """Spawn ``world_size`` ranks training each command line of ``runs`` in turn, in one job;
    ``result[run][rank]`` is that rank's summary of that run (as :func:`run_training` gives it).
    A run that fails stops the job: the error is raised for all of them; ``timeout_s`` is for
    the whole job."""
    ranks = spawn(training_jobs, world_size, ([list(a) for a in runs], echo), timeout_s=timeout_s,
                  threads_per_rank=threads_per_rank)
    return [[ranks[r][i] for r in range(world_size)] for i in range(len(runs))]
