"""``--placement`` text as written on the command line, parsed into a :class:`StagePlacement`.

Errors quote the text as typed (not the normalised split) and name a chunk and a stage
within it, never a virtual-stage index the user did not write.
"""
from __future__ import annotations

import re
from typing import Optional

from dynapipe.config import ModelConfig
from dynapipe.cost.placement import StagePlacement
from dynapipe.errors import DynaPipeError, arg

_STAGE_SPEC = re.compile(r"\s*([0-9]{1,6})\s*(?:\+\s*([0-9]{1,6})\s*)?\Z")


def parse_placement(text: str, model: ModelConfig, num_stages: int, flag: Optional[str] = None) -> StagePlacement:
    """See :meth:`StagePlacement.parse`; ``flag`` names the option in errors (default: as the
    running program spells ``placement``)."""
    flag = flag or arg("placement")
    if text.strip() == "interleaved":
        return StagePlacement.interleaved(model, num_stages, flag)
    label = f"{flag} {text!r}"
    if not text.strip():
        raise DynaPipeError(f"{label}: empty; give even, auto, interleaved (T5) or layers per stage "
                            f"such as {StagePlacement.even(model, num_stages)}.")
    chunk_texts = text.split("|")
    parts = [p for c in chunk_texts for p in c.split(",")]
    enc, dec = [], []
    for part in parts:
        m = _STAGE_SPEC.match(part)
        if not m:
            raise DynaPipeError(f"{label}: {part!r} is not a layer count; write LAYERS per stage "
                                f"(GPT) or ENC+DEC per stage (T5), comma-separated (chunks separated by |).")
        if m.group(2) is None:
            enc.append(0)
            dec.append(int(m.group(1)))
        else:
            enc.append(int(m.group(1)))
            dec.append(int(m.group(2)))
    if model.is_encoder_decoder and any("+" not in p for p in parts):
        raise DynaPipeError(f"{label}: model {model.name!r} is encoder-decoder; write ENC+DEC "
                            f"for every stage.")
    if not model.is_encoder_decoder and any("+" in p for p in parts):
        part = next(p.strip() for p in parts if "+" in p)
        raise DynaPipeError(f"{label}: model {model.name!r} is decoder-only, so {part!r} (ENC+DEC, for T5) "
                            f"does not apply; write one layer count per stage, such as "
                            f"{StagePlacement.even(model, num_stages)}.")
    widths = [len(c.split(",")) for c in chunk_texts]
    bad = next((c for c, w in enumerate(widths) if w != num_stages), None)
    if bad is not None:
        where = f": chunk {bad} ({chunk_texts[bad].strip()!r})" if len(widths) > 1 else ""
        per = "stage per chunk" if len(widths) > 1 else "stage"
        raise DynaPipeError(f"{label}{where} names {widths[bad]} stage{'s' * (widths[bad] != 1)}; "
                            f"{arg('num_stages')} is {num_stages} (one layer count per {per}).")
    return StagePlacement(tuple(enc), tuple(dec), len(chunk_texts)).validate(model, label)
