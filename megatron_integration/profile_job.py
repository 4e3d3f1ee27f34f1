"""Measure a cost profile from Python: the entry point the bench (and any script) calls.

:func:`write_profile` does in-process what ``python -m dynapipe profile`` does after
parsing its command line: join a one-rank process group when none is up, measure the
model's layers with :func:`megatron_integration.profiler.profile_model` over an
(mbs, seqlen) grid, check the result is a profile the cost model reads, and write it.
:func:`measure_profile` runs it in a spawned process, so the caller's process keeps no
megatron state.
"""
from __future__ import annotations

import json
import os
from typing import Optional, Sequence

from megatron_integration.train_config import GPTModelArgs


def write_profile(model: GPTModelArgs, output: str, mbs_grid: Sequence[int], seqlen_grid: Sequence[int], *,
                  repeats: int = 3, warmup: int = 1, threads: Optional[int] = None, seed: int = 1234,
                  use_te: Optional[bool] = None, levels: bool = True) -> dict:
    """Profile ``model`` on this process's device and write the JSON to ``output``; returns it.

    ``mbs_grid`` (samples) and ``seqlen_grid`` (tokens) are the measured points;
    ``repeats`` timed runs per point (the fastest kept) after ``warmup`` untimed ones;
    ``threads``: CPU threads (match what each training rank gets); ``levels``: also
    measure the layer at the recompute levels (otherwise the cost model derives them).
    """
    import torch

    from dynapipe.cost.profile import ProfileCostModel
    from megatron_integration.initialize import initialize_megatron
    from megatron_integration.launch import free_port
    from megatron_integration.profiler import profile_model
    from megatron_integration.train_config import ParallelArgs

    cuda = torch.cuda.is_available()
    if threads:
        torch.set_num_threads(threads)
    if "RANK" not in os.environ:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0", WORLD_SIZE="1")
    initialize_megatron(ParallelArgs(world_size=1, backend="nccl" if cuda else "gloo"), seed=seed)
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    profile = profile_model(model, list(mbs_grid), list(seqlen_grid), device, repeats=repeats, warmup=warmup,
                            use_te=use_te, levels=levels)
    # Refuse to write a profile the cost model would not read.
    ProfileCostModel(model.to_model_config("profiled"), profile, num_stages=1, source=output)
    with open(output, "w") as f:
        json.dump(profile, f, indent=1)
    return profile


def _job(model: GPTModelArgs, output: str, mbs_grid, seqlen_grid, repeats: int, threads: int,
         levels: bool = True) -> str:
    from megatron_integration.initialize import destroy

    try:
        write_profile(model, output, mbs_grid, seqlen_grid, repeats=repeats, threads=threads, levels=levels)
    finally:
        destroy()
    return output


def measure_profile(model: GPTModelArgs, output: str, mbs_grid: Sequence[int], seqlen_grid: Sequence[int], *,
                    repeats: int = 3, threads: int = 1, timeout_s: float = 1800.0, levels: bool = True) -> str:
    """:func:`write_profile` in one spawned rank with ``threads`` threads; returns ``output``."""
    from megatron_integration.launch import spawn

    return spawn(_job, 1, (model, output, list(mbs_grid), list(seqlen_grid), repeats, threads, levels),
                 timeout_s=timeout_s, threads_per_rank=threads)[0]
