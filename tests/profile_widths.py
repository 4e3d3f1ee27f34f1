"""The widths a synthetic profile records of the model it stands for: every profile records
them (as both profilers write them), or the profile cost model refuses it."""
from __future__ import annotations

from dynapipe.config import ModelConfig, load_model_config
from dynapipe.cost.profile_checks import REQUIRED_WIDTH_KEYS


def widths(model: ModelConfig) -> dict:
    """``model``'s widths as a profile's ``model`` section records them (the ones every profile must)."""
    return {key: getattr(model, key) for key in REQUIRED_WIDTH_KEYS}


TINY_WIDTHS = widths(load_model_config("gpt-tiny"))  # hidden 64, 4 heads, FFN 256
