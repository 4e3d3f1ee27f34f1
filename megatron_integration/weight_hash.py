"""Megatron-LM's ``--check-weight-hash-across-dp-replicas-interval``: are the data-parallel
replicas still the same model?

Data-parallel replicas start from the same seed and apply the same reduced gradients, so their
weights stay bit-identical; a replica whose weights differ was hit by a silent fault (a bit flip,
a device that computes wrongly, an optimizer step lost on one rank), and every later step trains
replicas that no longer agree. As Megatron-LM does, every rank hashes each of its parameters
(SHA-1 of its fp32 values on the CPU, so bit-exact) at the start of training and after every
``interval``-th iteration, and the hashes are all-gathered over the data-parallel group.

Where Megatron-LM's ranks of a differing group fail an assertion and the other ranks wait in a
barrier until the process-group timeout, the outcome here is agreed by every rank of the job: all
stop with the same line, naming the parameters and the ranks off the majority's weights.
"""
from __future__ import annotations

import hashlib
from functools import partial
from typing import Callable, Optional, Sequence

import torch
import torch.distributed as dist

from megatron_integration.agreement import attempt, same_error_everywhere

FLAG = "--check-weight-hash-across-dp-replicas-interval"


def parameter_hashes(modules: Sequence[torch.nn.Module]) -> tuple[list[str], torch.Tensor]:
    """This rank's parameters (``chunk N: name``, over its model chunks) and their SHA-1 digests,
    ``[parameters, 20]`` uint8 on the CPU (of each parameter's values in fp32, as Megatron-LM
    hashes them)."""
    names, digests = [], []
    for chunk, module in enumerate(modules):
        for name, param in module.named_parameters():
            values = param.detach().to("cpu", torch.float32).contiguous().numpy()
            names.append(f"chunk {chunk}: {name}")
            digests.append(torch.frombuffer(bytearray(hashlib.sha1(values).digest()), dtype=torch.uint8))
    return names, torch.stack(digests) if digests else torch.zeros((0, 20), dtype=torch.uint8)


def differing(names: list[str], every: list[torch.Tensor], ranks: list[int]) -> list[str]:
    """What differs among one data-parallel group's hashes (``every``: each member's, in group
    order; ``ranks``: their global ranks), one text a parameter whose hash is not the same on every
    member: the ranks off the hash most members hold, or, when no hash is held by more than half
    (two replicas that disagree), every rank, as no majority tells which is wrong. Empty when all
    agree."""
    out = []
    for i, name in enumerate(names):
        keys = [bytes(t[i].tolist()) for t in every]
        if len(set(keys)) == 1:
            continue
        common = max(set(keys), key=keys.count)
        if keys.count(common) * 2 > len(keys):
            odd = [ranks[m] for m, k in enumerate(keys) if k != common]
            out.append(f"{name} on rank{'s' if len(odd) > 1 else ''} {', '.join(map(str, odd))}")
        else:
            out.append(f"{name} disagrees between ranks {', '.join(map(str, ranks))} (no majority tells which is "
                       f"wrong)")
    return out


def weight_hash_check(cfg, modules: Sequence[torch.nn.Module], device: torch.device) -> Optional[Callable]:
    """The training loop's check (``cfg``: a DynaPipeTrainingConfig): :func:`check_weight_hashes`
    of ``modules`` (this rank's model chunks), or None without the flag."""
    if cfg.weight_hash_interval is None:
        return None
    return partial(check_weight_hashes, modules, device)


def check_weight_hashes(modules: Sequence[torch.nn.Module], device: torch.device, iteration: int,
                        log: Callable[[str], None]) -> None:
    """Compare this rank's parameter hashes with its data-parallel replicas' after ``iteration``
    iterations; collective over the job. Rank 0 logs Megatron-LM's line when every group agrees;
    otherwise every rank raises the same :class:`DynaPipeError`, naming the first differing group's
    parameters and ranks."""
    from megatron.core import parallel_state as ps

    # A rank that cannot hash (out of host memory) must not leave its replicas in the all-gather.
    hashed, error = attempt(lambda: parameter_hashes(modules), "hashing the parameters")
    same_error_everywhere(error)
    names, mine = hashed
    group = ps.get_data_parallel_group()
    size = dist.get_world_size(group)
    if size > 1:
        local = mine.to(device)
        every = [torch.zeros_like(local) for _ in range(size)]
        dist.all_gather(every, local, group=group)
        ranks = dist.get_process_group_ranks(group)
        odd = differing(names, [t.cpu() for t in every], ranks)
        if odd:
            shown = "; ".join(odd[:3]) + (f"; and {len(odd) - 3} more" if len(odd) > 3 else "")
            error = (f"after {iteration} iterations the weights of data-parallel replicas differ ({FLAG}): "
                     f"{shown}. Replicas that should be identical are not: a device fault or a rank that stepped "
                     f"differently; resume from the last checkpoint, leaving out the nodes of the ranks named.")
    same_error_everywhere(error)
    log(f">>> Weight hashes match after {iteration} iterations...")
