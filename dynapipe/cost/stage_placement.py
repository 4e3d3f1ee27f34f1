"""The split of a model's layers over pipeline stages: :class:`StagePlacement`.

One data structure for GPT and T5, shared by the cost model, the plan JSON and the model
stages that build it; :mod:`dynapipe.cost.placement` chooses one from the cost model.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np

from dynapipe.config import ModelConfig
from dynapipe.cost.base import StageLayout, layout_of_layers, stage_layouts
from dynapipe.errors import DynaPipeError, arg, whole_number


@dataclass(frozen=True)
class StagePlacement:
    """Layers of every pipeline stage, in model order.

    ``encoder_layers[k]``/``decoder_layers[k]``: layers virtual stage ``k`` holds. With
    ``chunks == 1`` (the default) virtual stages are the pipeline ranks. With ``chunks = v``
    there are ``v * P`` virtual stages and virtual stage ``k`` is chunk ``k // P`` of rank
    ``k % P`` (Megatron's virtual pipeline): a micro-batch runs through ranks ``0..P-1``
    once per chunk. Layers are contiguous in virtual-stage order: the encoder's come
    first, so at most one virtual stage holds both. Decoder-only (GPT) models put all their
    layers in ``decoder_layers``. Virtual stage 0 holds the embedding, the last one the
    output layer. The interleaved T5 placement puts the encoder in chunk 0 and the decoder
    in chunk 1, so every rank holds encoder and decoder layers.
    """

    encoder_layers: tuple[int, ...]
    decoder_layers: tuple[int, ...]
    chunks: int = 1

    @property
    def num_stages(self) -> int:
        """Pipeline ranks (virtual stages / chunks)."""
        return len(self.decoder_layers) // max(self.chunks, 1)

    @property
    def num_virtual_stages(self) -> int:
        return len(self.decoder_layers)

    @staticmethod
    def even(model: ModelConfig, num_stages: int, chunks: int = 1) -> "StagePlacement":
        """Megatron's split: layers as evenly as possible over the ``chunks * num_stages``
        virtual stages, earlier ones taking the remainder (``chunks`` > 1: its interleaved split)."""
        layouts = stage_layouts(model, whole_number("chunks", chunks) * whole_number("num_stages", num_stages))
        return StagePlacement(tuple(l.encoder_layers for l in layouts), tuple(l.decoder_layers for l in layouts),
                              chunks)

    @staticmethod
    def interleaved(model: ModelConfig, num_stages: int, flag: Optional[str] = None) -> "StagePlacement":
        """Encoder-decoder models, two chunks per rank: the encoder split evenly over the
        ranks as chunk 0, the decoder as chunk 1 (earlier ranks take the remainders), so
        every rank holds about the same encoder and decoder work. ``flag`` names the option
        in errors (default: as the running program spells ``placement``)."""
        flag = flag or arg("placement")
        if not model.is_encoder_decoder:
            raise DynaPipeError(f"{flag} interleaved: model {model.name!r} is not encoder-decoder; give a "
                                f"chunked split such as 4,4|4,4 instead.")
        P = int(num_stages)
        fewest = min(model.encoder_layers, model.decoder_layers)
        if P < 2:
            raise DynaPipeError(f"{flag} interleaved spreads the encoder and the decoder over the pipeline's ranks "
                                f"and needs at least 2 stages; {arg('num_stages')} is {P}.")
        if P > fewest:
            raise DynaPipeError(f"{flag} interleaved puts an encoder and a decoder layer on every rank, but model "
                                f"{model.name!r} has {model.encoder_layers} encoder and {model.decoder_layers} "
                                f"decoder layer(s) for {P} stages; {arg('num_stages')} is {P}.")
        split = lambda n: [n // P + (1 if s < n % P else 0) for s in range(P)]  # noqa: E731
        return StagePlacement(tuple(split(model.encoder_layers) + [0] * P),
                              tuple([0] * P + split(model.decoder_layers)), 2).validate(model)

    def layouts(self) -> list[StageLayout]:
        """The :class:`StageLayout` of every rank (all its chunks' layers together: what the
        rank computes and stores per micro-batch, priced as one stage)."""
        S, v = self.num_stages, max(self.chunks, 1)
        enc = [sum(self.encoder_layers[c * S + s] for c in range(v)) for s in range(S)]
        dec = [sum(self.decoder_layers[c * S + s] for c in range(v)) for s in range(S)]
        chunks = self.virtual_layouts()
        # A rank takes the roles of its chunks (virtual stage k runs on rank k % S).
        roles = [(any(l.embeds_decoder for l in chunks[s::S]), any(l.ends_encoder for l in chunks[s::S]))
                 for s in range(S)]
        return [StageLayout(s, e, d, s == 0, s == S - 1, embeds_decoder=r[0], ends_encoder=r[1])
                for s, (e, d, r) in enumerate(zip(enc, dec, roles))]

    def virtual_layouts(self) -> list[StageLayout]:
        """The :class:`StageLayout` of every virtual stage (``stage`` = virtual index; the
        embedding on the first, the output layer on the last)."""
        V, enc_total = self.num_virtual_stages, sum(self.encoder_layers)
        bounds = np.cumsum((0,) + tuple(e + d for e, d in zip(self.encoder_layers, self.decoder_layers)))
        return [layout_of_layers(k, V, int(bounds[k]), int(bounds[k + 1]), enc_total) for k in range(V)]

    def validate(self, model: ModelConfig, label: Optional[str] = None) -> "StagePlacement":
        """Raise :class:`DynaPipeError` unless this placement holds exactly ``model``'s
        layers, contiguously, with at least one layer on every (virtual) stage. ``label``
        names the placement in the errors (default ``stage placement <split>``)."""
        what = label or f"stage placement {self}"
        enc, dec = list(self.encoder_layers), list(self.decoder_layers)
        want_e = model.encoder_layers if model.is_encoder_decoder else 0
        want_d = model.total_layers - want_e
        if len(enc) != len(dec) or not dec:
            raise DynaPipeError(f"{what}: {len(enc)} encoder and {len(dec)} decoder counts; "
                                f"give one of each per stage.")
        if self.chunks < 1 or len(dec) % self.chunks:
            raise DynaPipeError(f"{what}: {len(dec)} virtual stages do not split into "
                                f"{self.chunks} chunks of equal rank count.")
        if self.chunks > 1 and len(dec) // self.chunks < 2:
            # Chunks interleave over pipeline ranks; one rank would hold the whole model in pieces.
            raise DynaPipeError(f"{what}: {self.chunks} chunks on one pipeline rank; an interleaved placement "
                                f"needs at least 2 pipeline ranks: give one chunk, or more pipeline ranks.")
        if any(v < 0 for v in enc + dec):
            raise DynaPipeError(f"{what}: layer counts must not be negative.")
        if not model.is_encoder_decoder and sum(enc) + sum(dec) != want_d:
            raise DynaPipeError(f"{what} holds {sum(enc) + sum(dec)} layers; model {model.name!r} has {want_d}.")
        if sum(enc) != want_e or sum(dec) != want_d:
            raise DynaPipeError(f"{what} holds {sum(enc)} encoder + {sum(dec)} decoder layers; "
                                f"model {model.name!r} has {want_e} + {want_d}.")
        empty = [s for s in range(len(dec)) if enc[s] + dec[s] == 0]
        if empty:
            # A virtual stage's index means nothing to whoever wrote the chunks out: name
            # the chunk and the rank within it.
            S, k = len(dec) // self.chunks, empty[0]
            where = f"stage {k % S} of chunk {k // S}" if self.chunks > 1 else f"stage {k}"
            raise DynaPipeError(f"{what}: {where} holds no layer; every stage"
                                f"{' of every chunk' if self.chunks > 1 else ''} needs one.")
        first_dec = next((s for s, d in enumerate(dec) if d), len(dec))
        if any(enc[first_dec + 1:]) or (first_dec < len(dec) and sum(enc[:first_dec + 1]) != want_e):
            raise DynaPipeError(f"{what}: encoder layers must all come before the first "
                                f"decoder layer (contiguous stages).")
        return self

    def __str__(self) -> str:
        if not any(self.encoder_layers):
            items = [str(d) for d in self.decoder_layers]
        else:
            items = [f"{e}+{d}" for e, d in zip(self.encoder_layers, self.decoder_layers)]
        S = self.num_stages or 1
        return "|".join(",".join(items[c * S:(c + 1) * S]) for c in range(max(len(items) // S, 1)))

    def to_json(self) -> dict:
        """``{"encoder_layers": [...], "decoder_layers": [...]}`` per stage (GPT: ``{"layers": [...]}``);
        chunked placements list every virtual stage and add ``"chunks"``."""
        extra = {"chunks": self.chunks} if self.chunks > 1 else {}
        if not any(self.encoder_layers):
            return {"layers": list(self.decoder_layers), **extra}
        return {"encoder_layers": list(self.encoder_layers), "decoder_layers": list(self.decoder_layers), **extra}

    @staticmethod
    def from_json(obj: dict, model: ModelConfig) -> "StagePlacement":
        """Inverse of :meth:`to_json`, validated against ``model``; anything else (a key it does
        not write, a count that is not a whole number) is refused naming it."""
        keys = {"layers"} if model.arch == "gpt" else {"encoder_layers", "decoder_layers"}
        if not isinstance(obj, dict) or not keys <= set(obj) or set(obj) - keys - {"chunks"}:
            raise DynaPipeError(f"stage placement {obj!r:.120}: give {{{', '.join(map(repr, sorted(keys)))}"
                                f"[, 'chunks']}} for {model.arch} model {model.name!r}, as StagePlacement.to_json "
                                f"writes it.")

        def counts(key: str) -> tuple[int, ...]:
            values = obj[key]
            if not isinstance(values, (list, tuple)) or not all(
                    isinstance(v, int) and not isinstance(v, bool) for v in values):
                raise DynaPipeError(f"stage placement {key}={values!r:.80}: give a list of whole layer counts, one "
                                    f"per (virtual) stage.")
            return tuple(values)

        chunks = obj.get("chunks", 1)
        if isinstance(chunks, bool) or not isinstance(chunks, int) or chunks < 1:
            raise DynaPipeError(f"stage placement chunks={chunks!r}: give a whole number of chunks a rank, 1 or more.")
        if "layers" in keys:
            dec = counts("layers")
            return StagePlacement((0,) * len(dec), dec, chunks).validate(model)
        return StagePlacement(counts("encoder_layers"), counts("decoder_layers"), chunks).validate(model)

    @staticmethod
    def parse(text: str, model: ModelConfig, num_stages: int, flag: Optional[str] = None) -> "StagePlacement":
        """``--placement`` text: comma-separated layers per stage (``12,12,8``), or
        ``ENC+DEC`` per stage for encoder-decoder models (``6+0,5+1,0+6``); virtual-pipeline
        chunks separated by ``|``, each listing every rank (``3+0,3+0|0+3,0+3``: the
        encoder as chunk 0, the decoder as chunk 1); ``interleaved``: that split for T5
        with the layers of each chunk spread evenly. ``flag`` names the option in errors."""
        from dynapipe.cost.placement_spec import parse_placement  # its own module: it imports this one

        return parse_placement(text, model, num_stages, flag)
