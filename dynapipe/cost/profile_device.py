"""The device a cost profile was measured on, against the device config it is used with.

A profile records the device it timed (``"device"``: ``"cpu"``, or the CUDA device name such
as ``NVIDIA A100-SXM4-40GB``); its times price that device only. The device config given
with it still sets the memory the plans may use. Device config names are free-form (a YAML
path may name any device), so only what can be told reliably is compared: CPU against GPU
wherever the config's name says which it is, and, for a device config the user named, the
GPU model (``a100``, ``h100``, ``h200``, ...) where both names carry one.
"""
from __future__ import annotations

import re
from typing import Any, Mapping, Optional

from dynapipe.config import DeviceConfig
from dynapipe.errors import DynaPipeError

# One or two letters and one to four digits, optionally a letter: a100, h100, h200, v100, l40s,
# a10g, b200, gh200, t4, l4, a6000, mi300x (not sxm4, hbm3 or 80gb).
_GPU_MODEL = re.compile(r"[a-z]{1,2}\d{1,4}[a-z]?")


def _words(name: str) -> list[str]:
    return [w for w in re.split(r"[^a-z0-9]+", name.lower()) if w]


def gpu_model(name: str) -> Optional[str]:
    """The GPU model a device name carries (``NVIDIA H100 80GB HBM3`` -> ``h100``), or None."""
    return next((w for w in _words(name) if _GPU_MODEL.fullmatch(w)), None)


def shipped_cluster_for_device(device: str) -> Optional[str]:
    """The shipped cluster config (``configs/clusters``) of the device config name ``device``:
    ``cpu-local`` for a CPU, else the one of the GPU model it carries (``a100-40gb`` ->
    ``a100-8x``), the first by name if several; None where the name tells neither or no
    shipped cluster has it."""
    from dynapipe.config import shipped_names

    shipped = shipped_names("clusters")
    if config_kind(device) == "cpu":
        return "cpu-local" if "cpu-local" in shipped else None
    model = gpu_model(device)
    if model is None:
        return None
    return next((name for name in shipped if gpu_model(name) == model), None)


def config_kind(name: str) -> Optional[str]:
    """``cpu`` or ``gpu`` as a device config's name says, or None where it does not tell."""
    words = _words(name)
    if "cpu" in words:
        return "cpu"
    if "gpu" in words or gpu_model(name) is not None:
        return "gpu"
    return None


def check_profile_device(profile: Mapping[str, Any], device: Optional[DeviceConfig], source: str,
                         device_flag: Optional[str] = None, compare_model: Optional[bool] = None) -> None:
    """Refuse pricing ``device`` with a profile measured on another kind of device (CPU vs GPU)
    and, with ``compare_model`` (default: when ``device_flag``, the flag the user named the
    device config with, is given), on another GPU model. A profile that does not record its
    device, or no device config, is not compared."""
    measured = profile.get("device")
    if device is None or not isinstance(measured, str) or not measured.strip():
        return
    # The profilers write "cpu" on a CPU and the CUDA device name otherwise.
    have = "cpu" if measured.strip().lower() == "cpu" else "gpu"
    want = config_kind(device.name)
    named = f"{device_flag} {device.name}" if device_flag else f"the device config {device.name!r}"
    if want is not None and want != have:
        raise DynaPipeError(f"{source}: the profile was measured on {measured!r}, a {have.upper()}, but {named} is a "
                            f"{want.upper()}: its times would price the wrong device. Give the device config it was "
                            f"measured on, profile the {want.upper()} (`python -m dynapipe profile`), or use the "
                            f"analytic cost model.")
    if (bool(device_flag) if compare_model is None else compare_model) and have == "gpu":
        mine, theirs = gpu_model(measured), gpu_model(device.name)
        if mine and theirs and mine != theirs:
            raise DynaPipeError(f"{source}: the profile was measured on {measured!r} (GPU model {mine}) but {named} "
                                f"is GPU model {theirs}: its times would price another GPU. Give the device config "
                                f"of the {mine}, profile the {theirs} (`python -m dynapipe profile`), or use the "
                                f"analytic cost model.")


def shipped_config_for_gpu(gpu_name: str, total_mib: float, tolerance: float = 0.1) -> Optional[str]:
    """The shipped device config (``configs/devices``) of the GPU a run found: the one whose name
    carries the GPU's model (``NVIDIA A100-SXM4-40GB`` -> ``a100``) and whose memory lies within
    ``tolerance`` of the GPU's ``total_mib`` (MiB; an A100 of 80 GB is not ``a100-40gb``), the
    closest if several; None when none does."""
    from dynapipe.config import load_device_config, shipped_names

    model = gpu_model(gpu_name)
    if model is None or not total_mib > 0:
        return None
    fits = []
    for name in shipped_names("devices"):
        if gpu_model(name) != model:
            continue
        memory = load_device_config(name).memory_mib
        if abs(memory - total_mib) <= tolerance * total_mib:
            fits.append((abs(memory - total_mib), name))
    return min(fits)[1] if fits else None
