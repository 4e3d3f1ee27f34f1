"""Micro-batches and the plan of one global batch: the output of every batching method."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Union

from dynapipe.cost.attention_density import AttentionDensity

#: A length limit (tokens): one for every side of a sample, or an encoder-decoder model's
#: (input, target) pair, either side None for "no limit but the model's".
LengthLimit = Union[int, "tuple[Optional[int], Optional[int]]"]


@dataclass
class MicroBatch:
    """A micro-batch: which samples, padded to what shape, on which replica, at what cost.

    ``samples`` are indices into the global batch. For packing, ``rows`` lists the
    samples concatenated into each row and ``samples`` is their concatenation; a
    ``dynapipe-per-sample`` micro-batch lists one sample a row (its stages load per-row
    segment ids).
    ``seqlen`` (and ``dec_seqlen`` for encoder-decoder models) is the padded length in
    tokens; ``time_ms`` is forward + backward of the bottleneck stage;
    ``stored_mib``/``peak_mib`` its activation memory.

    ``real_tokens``: non-pad tokens of its samples, input + target (encoder + decoder
    tokens for encoder-decoder models); with :attr:`padded_tokens` it gives the padding
    efficiency. ``loss_tokens``: the tokens of its samples the loss counts when they
    differ from ``real_tokens``: target tokens of an encoder-decoder micro-batch, set
    when the planner knows the target lengths; ``None`` otherwise. Read
    :attr:`planned_loss_tokens`, which the execution plans record. ``attention``: for
    rows run with per-sample attention (packed, or DynaPipe's padded ones), the share of the rows' dense attention
    pairs computed (:class:`~dynapipe.cost.attention_density.AttentionDensity`); ``None``:
    dense attention over every row, as the cost models price by default.
    """

    samples: list[int]
    seqlen: int
    dec_seqlen: int = 0
    rows: Optional[list[list[int]]] = None
    replica: int = 0
    time_ms: float = 0.0
    stored_mib: float = 0.0
    peak_mib: float = 0.0
    real_tokens: int = 0
    loss_tokens: Optional[int] = None
    attention: Optional[AttentionDensity] = None

    @property
    def planned_loss_tokens(self) -> int:
        """Tokens the loss counts, as the planner knows them: ``loss_tokens`` when set, else
        every non-pad token (``real_tokens``; decoder-only lengths do not separate input
        from target)."""
        return self.real_tokens if self.loss_tokens is None else self.loss_tokens

    @property
    def mbs(self) -> int:
        """Number of rows (samples, or packed rows) in the micro-batch."""
        return len(self.rows) if self.rows is not None else len(self.samples)

    @property
    def padded_tokens(self) -> int:
        """Tokens computed, padding included."""
        return self.mbs * (self.seqlen + self.dec_seqlen)

    def to_json(self) -> dict:
        out = {
            "samples": self.rows if self.rows is not None else self.samples,
            "seqlen": self.seqlen,
            "replica": self.replica,
            "time_ms": self.time_ms,
            "stored_mib": self.stored_mib,
            "peak_mib": self.peak_mib,
            "real_tokens": self.real_tokens,
        }
        if self.dec_seqlen:
            out["dec_seqlen"] = self.dec_seqlen
        if self.loss_tokens is not None:
            out["loss_tokens"] = self.loss_tokens
        if self.attention is not None:
            out["attention_density"] = self.attention.to_json()
        return out


@dataclass
class BatchPlan:
    """The micro-batches of one global batch and the figures the planner reports.

    ``objective_ms`` is ``T = sum(time_ms) / dp + (stages - 1) * max(time_ms)``;
    ``replica_time_ms`` the summed ``time_ms`` of each replica; ``planning_ms`` the wall
    time of planning alone. ``extra`` holds method-specific figures (for packing,
    ``cross_sample_attention_pairs``).
    """

    batching: str
    micro_batches: list[MicroBatch]
    num_stages: int
    dp: int
    objective_ms: float
    padding_efficiency: float
    replica_time_ms: list[float]
    planning_ms: float = 0.0
    extra: dict = field(default_factory=dict)

    def replica(self, r: int) -> list[MicroBatch]:
        """The micro-batches assigned to replica ``r``, in their planned order."""
        return [mb for mb in self.micro_batches if mb.replica == r]

    def compute_objective_ms(self) -> float:
        """``T`` in ms, recomputed from the micro-batches' ``time_ms``."""
        times = [mb.time_ms for mb in self.micro_batches]
        return sum(times) / self.dp + (self.num_stages - 1) * max(times) if times else 0.0

    def compute_padding_efficiency(self) -> float:
        """Non-pad tokens (input + target) / padded tokens computed, over the whole batch."""
        padded = sum(mb.padded_tokens for mb in self.micro_batches)
        return sum(mb.real_tokens for mb in self.micro_batches) / padded if padded else 0.0

    @property
    def num_samples(self) -> int:
        return sum(len(mb.samples) for mb in self.micro_batches)

    def to_json(self) -> dict:
        """The plan as the ``plan`` command prints it (JSON-ready types only)."""
        return {
            "batching": self.batching,
            "num_stages": self.num_stages,
            "dp": self.dp,
            "micro_batches": [mb.to_json() for mb in self.micro_batches],
            "objective_ms": self.objective_ms,
            "padding_efficiency": self.padding_efficiency,
            "planning_ms": self.planning_ms,
            "replica_time_ms": self.replica_time_ms,
            "extra": {k: (v.item() if hasattr(v, "item") else v) for k, v in self.extra.items()},
        }
