"""The widths a synthetic profile records of the model it stands for: every profile records
them (as both profilers write them), or the profile cost model refuses it."""
from __future__ import annotations

from dynapipe.config import ModelConfig

# gpt-tiny's: hidden 64, 4 heads, FFN 256.
TINY_WIDTHS = {"hidden_size": 64, "num_attention_heads": 4, "ffn_hidden_size": 256}


def widths(model: ModelConfig) -> dict:
    """``model``'s widths as a profile's ``model`` section records them."""
    return {"hidden_size": model.hidden_size, "num_attention_heads": model.num_attention_heads,
            "ffn_hidden_size": model.ffn_hidden_size}
