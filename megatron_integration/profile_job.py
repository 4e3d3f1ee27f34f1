"""Measure a cost profile from Python: the entry point the command line, the bench (and any
script) call.

:func:`write_profile` does, on one rank, what ``python -m dynapipe profile`` does after
parsing its command line: join the process group (a one-rank group when none is up),
measure the model's layers with :func:`megatron_integration.profiler.profile_model` over an
(mbs, seqlen) grid, check the result is a profile the cost model reads, and write it (rank 0).
With ``tp`` > 1 every rank of the job calls it: the job is one tensor-parallel group.
:func:`measure_profile` runs it in ``tp`` spawned ranks, so the caller's process keeps no
megatron state.
"""
from __future__ import annotations

import json
from typing import Optional, Sequence

from megatron_integration.train_config import GPTModelArgs


def write_profile(model: GPTModelArgs, output: str, mbs_grid: Sequence[int], seqlen_grid: Sequence[int], *,
                  repeats: int = 3, warmup: int = 1, threads: Optional[int] = None, seed: int = 1234,
                  use_te: Optional[bool] = None, levels: bool = True, tp: int = 1, sequence_parallel: bool = False,
                  progress: Optional[bool] = None, timeout_minutes: float = 10.0) -> dict:
    """Profile ``model`` on this process's device and write the JSON to ``output``; returns it.

    ``mbs_grid`` (samples) and ``seqlen_grid`` (tokens) are the measured points;
    ``repeats`` timed runs per point (the fastest kept) after ``warmup`` untimed ones;
    ``threads``: CPU threads (match what each training rank gets); ``levels``: also
    measure the layer at the recompute levels (otherwise the cost model derives them);
    ``tp``/``sequence_parallel``: the tensor-parallel group measured (the job's world size
    must be ``tp``; rank 0 writes); ``progress``: None prints nothing, else rank 0 prints a line
    per grid point, under a progress bar when True (on a terminal with tqdm);
    ``timeout_minutes``: the process group's (``--distributed-timeout-minutes``). The model's
    ``deterministic_mode`` applies ``--deterministic-mode`` as training does.
    """
    import torch

    from dynapipe.config import TensorParallelConfig
    from dynapipe.cost.profile import ProfileCostModel
    from dynapipe.progress import Progress
    from megatron_integration.cpu_affinity import use_profiler_threads
    from megatron_integration.initialize import initialize_megatron
    from megatron_integration.profiler import profile_model
    from megatron_integration.train_config import ParallelArgs

    cuda = torch.cuda.is_available()
    use_profiler_threads(threads, cuda)
    parallel = ParallelArgs(world_size=tp, tensor_model_parallel_size=tp, backend="nccl" if cuda else "gloo",
                            sequence_parallel=sequence_parallel, timeout_minutes=timeout_minutes)
    # --deterministic-mode: the kernels the deterministic training runs, timed.
    info = initialize_megatron(parallel, seed=seed, deterministic=model.deterministic_mode, private_store=True)
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    with Progress(len(mbs_grid) * len(seqlen_grid), "profiling", enabled=bool(progress)) as bar:
        profile = profile_model(model, list(mbs_grid), list(seqlen_grid), device, repeats=repeats, warmup=warmup,
                                use_te=use_te, levels=levels, sequence_parallel=sequence_parallel,
                                progress=None if progress is None else bar.step)
    # Refuse to write a profile the cost model would not read.
    ProfileCostModel(model.to_model_config("profiled"), profile, num_stages=1, source=output,
                     tp=TensorParallelConfig(tp, sequence_parallel))
    if info.rank == 0:
        from dynapipe.output_paths import write_output

        write_output(output, json.dumps(profile, indent=1), "--output")
    return profile


def _job(model: GPTModelArgs, output: str, mbs_grid, seqlen_grid, kwargs: dict) -> str:
    from megatron_integration.initialize import destroy

    try:
        write_profile(model, output, mbs_grid, seqlen_grid, **kwargs)
    finally:
        destroy()
    return output


def measure_profile(model: GPTModelArgs, output: str, mbs_grid: Sequence[int], seqlen_grid: Sequence[int], *,
                    repeats: int = 3, threads: int = 1, timeout_s: float = 1800.0, levels: bool = True,
                    tp: int = 1, sequence_parallel: bool = False, **kwargs) -> str:
    """:func:`write_profile` in ``tp`` spawned ranks (one tensor-parallel group) of ``threads``
    threads each; returns ``output``. A job past ``timeout_s`` seconds is killed and reported.
    ``kwargs``: the other arguments of :func:`write_profile`."""
    from megatron_integration.launch import spawn

    options = dict(repeats=repeats, threads=threads, levels=levels, tp=tp, sequence_parallel=sequence_parallel,
                   **kwargs)
    return spawn(_job, tp, (model, output, list(mbs_grid), list(seqlen_grid), options),
                 timeout_s=timeout_s, threads_per_rank=threads)[0]
