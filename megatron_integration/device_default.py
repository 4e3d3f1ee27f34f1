"""The planner's device config on a GPU the command line did not name.

Without ``--dynapipe-device`` a CUDA run planned with ``h100-80gb``'s figures, its memory
limit included, whatever GPU it ran on: on an A100 of 40 GB the plans would have used twice the
memory there is. At start-up, once the device exists, the default becomes the shipped config of
the GPU found (:func:`dynapipe.cost.profile_device.shipped_config_for_gpu`), and the cluster
config that GPU's shipped one unless ``--dynapipe-cluster`` was given; for a GPU no shipped
config describes, ``h100-80gb``'s figures stay but the plans may use at most the memory the GPU
has. A device config or a memory limit the user gave is kept as given.
"""
from __future__ import annotations

from dataclasses import replace
import torch

from dynapipe.cost.profile_device import shipped_config_for_gpu
from megatron_integration.args_dynapipe import default_cluster

MIB = float(1 << 20)


def default_device_for(dynapipe, device: torch.device):
    """``(dynapipe, note)``: ``dynapipe`` (the run's :class:`DynaPipeArgs`) with the default device
    config resolved for the CUDA ``device`` this rank runs on, and a start-up line saying what
    was chosen (None where nothing changes: a CPU, or a device config given)."""
    if device.type != "cuda" or dynapipe.device_given:
        return dynapipe, None
    name = torch.cuda.get_device_name(device)
    total_mib = torch.cuda.get_device_properties(device).total_memory / MIB
    return resolve_default_device(dynapipe, name, total_mib)


def resolve_default_device(dynapipe, gpu_name: str, total_mib: float):
    """:func:`default_device_for` given the GPU's name and memory (MiB)."""
    chosen = shipped_config_for_gpu(gpu_name, total_mib)
    if chosen is not None:
        if chosen == dynapipe.device:
            return dynapipe, None
        resolved = replace(dynapipe, device=chosen)
        cluster = ""
        if not dynapipe.cluster_given:
            resolved = replace(resolved, cluster=default_cluster(chosen, cuda=True))
            cluster = f" and the cluster config {resolved.cluster}"
        return (resolved,
                f" > planning with the device config {chosen}{cluster} for this GPU ({gpu_name}); "
                f"--dynapipe-device{' / --dynapipe-cluster' if cluster else ''} names another")
    if dynapipe.memory_limit_mb is not None:  # the user's limit stands
        return dynapipe, None
    return (replace(dynapipe, memory_limit_mb=float(total_mib)),
            f" > no shipped device config describes this GPU ({gpu_name}, {total_mib:,.0f} MiB): planning with "
            f"{dynapipe.device}'s figures within its memory; give --dynapipe-device a config of this GPU "
            f"(a YAML path) to price it")


def analytic_on_gpu_note(dynapipe, device: torch.device):
    """A start-up line for a CUDA run whose DynaPipe plans are priced by the analytic cost model
    (None otherwise): on the one GPU measured so far it priced forwards at 0.1-0.4x their time,
    since it knows nothing of kernel launches, and a profile of the run's own layers fixes that."""
    if device.type != "cuda" or not dynapipe.enabled or dynapipe.cost_model != "analytic":
        return None
    return (" > warning: planning with the analytic cost model on a GPU; on the one GPU measured it priced "
            "forwards at 0.1-0.4x their time (it does not count kernel launches). Measure this model's "
            "layers with `python -m dynapipe profile --output PROFILE.json ...` and pass "
            "--dynapipe-cost-model PROFILE.json")
