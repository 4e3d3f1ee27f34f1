"""Time and memory of a micro-batch on a pipeline stage (pure numpy).

``build_cost_model`` is the one entry point the planner and the command line use:
``analytic`` (from the model and device configs) or a path to a measured profile.
"""
from __future__ import annotations

from typing import Optional

from dynapipe.config import DeviceConfig, ModelConfig, TensorParallelConfig
from dynapipe.cost.analytic import AnalyticCostModel
from dynapipe.cost.backward_split import backward_split
from dynapipe.cost.base import RECOMPUTE_LEVELS, CostModel, StageCost, StageLayout, stage_layouts
from dynapipe.cost.placement import PlacementChoice, PlacementSample, StagePlacement, plan_placement
from dynapipe.cost.profile import ProfileCostModel
from dynapipe.cost.profile_device import check_profile_device
from dynapipe.errors import DynaPipeError, shown, whole_number

__all__ = ["AnalyticCostModel", "ProfileCostModel", "CostModel", "StageCost", "StageLayout",
           "RECOMPUTE_LEVELS", "stage_layouts", "build_cost_model", "StagePlacement", "PlacementChoice",
           "PlacementSample", "plan_placement", "backward_split"]


def build_cost_model(model: ModelConfig, device: DeviceConfig, num_stages: int,
                     profile: Optional[str] = None, tp: Optional[TensorParallelConfig] = None,
                     placement: Optional[StagePlacement] = None, device_flag: Optional[str] = None) -> CostModel:
    """An analytic cost model, or a profile-based one when ``profile`` names a JSON file.
    ``tp``: tensor parallelism of every stage (figures are then per TP rank).
    ``placement``: layers per stage (default: Megatron's even split).
    A profile measured on a CPU is refused for a GPU device config and the other way round;
    ``device_flag``: the flag the user named ``device`` with, which also compares the GPU model
    (a default device config, chosen without knowing the GPU, is not)."""
    cm = _build(model, device, num_stages, profile, tp, device_flag)
    return cm if placement is None else cm.with_placement(placement)


def _build(model: ModelConfig, device: DeviceConfig, num_stages: int, profile: Optional[str],
           tp: Optional[TensorParallelConfig], device_flag: Optional[str]) -> CostModel:
    # Configs built by hand get the checks the YAML loaders run (a T5 priced as a GPT, heads
    # that do not divide the width, a device given by name).
    if not isinstance(model, ModelConfig):
        raise DynaPipeError(f"model {shown(model)}: give a ModelConfig (dynapipe.config.load_model_config(name)).")
    analytic = profile in (None, "", "analytic")
    # A measured profile carries its own device; the analytic model is priced from this one.
    if not isinstance(device, DeviceConfig) and (analytic or device is not None):
        raise DynaPipeError(f"device {shown(device)}: give a DeviceConfig (dynapipe.config.load_device_config(name)).")
    model.validate(f"model {model.name!r}")
    if device is not None:
        device.validate(f"device {device.name!r}")
    whole_number("num_stages", num_stages)
    if tp is not None and not isinstance(tp, TensorParallelConfig):
        raise DynaPipeError(f"tp {tp!r}: give a TensorParallelConfig (or None for no tensor parallelism).")
    if tp is not None:
        tp.validate(model)
    if analytic:
        return AnalyticCostModel(model, device, num_stages, tp)
    cm = ProfileCostModel.from_file(model, profile, num_stages, tp)
    check_profile_device(cm.profile, device, profile, device_flag)
    return cm
