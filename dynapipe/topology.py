"""Where the ranks sit and how they talk: links, clusters, tensor parallelism.

A :class:`LinkConfig` prices a transfer (GB/s and ms), a :class:`ClusterConfig` says which
link joins two global ranks, and a :class:`TensorParallelConfig` prices a stage's TP
collectives. Frozen dataclasses with ``validate`` methods; the YAML loaders are in
:mod:`dynapipe.config`, which re-exports these. Pure Python.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Optional

from dynapipe.errors import DynaPipeError, arg, check_fields, is_whole
from dynapipe.errors import flag as bool_flag

if TYPE_CHECKING:
    from dynapipe.config import ModelConfig


@dataclass(frozen=True)
class LinkConfig:
    """A link between two pipeline stages: bandwidth in GB/s (1e9 bytes/s), latency in ms."""

    bandwidth_gbps: float
    latency_ms: float = 0.0

    def transfer_ms(self, nbytes: float) -> float:
        """Time in ms to move ``nbytes`` bytes over this link."""
        return self.latency_ms + nbytes / (self.bandwidth_gbps * 1e9) * 1e3

    def validate(self, source: str = "link") -> "LinkConfig":
        """Refuse a bandwidth that is not positive or a negative latency: a zero bandwidth
        makes every transfer infinite, and negative figures would price transfers as gains."""
        check_fields(self, source)
        if not self.bandwidth_gbps > 0:
            raise DynaPipeError(f"{source}: bandwidth_gbps={self.bandwidth_gbps} must be > 0 "
                                f"(GB/s); give the link's measured or nominal bandwidth.")
        if not self.latency_ms >= 0:
            raise DynaPipeError(f"{source}: latency_ms={self.latency_ms} must be >= 0 (ms); "
                                f"use 0 for a link whose latency is negligible.")
        return self


@dataclass(frozen=True)
class ClusterConfig:
    """Devices per node and the links inside and between nodes."""

    name: str
    gpus_per_node: int = 8
    intra_node: LinkConfig = field(default_factory=lambda: LinkConfig(300.0, 0.005))
    inter_node: LinkConfig = field(default_factory=lambda: LinkConfig(25.0, 0.01))

    def link(self, rank_a: int, rank_b: int) -> LinkConfig:
        """The link between two global ranks (same node: intra-node link)."""
        same = rank_a // self.gpus_per_node == rank_b // self.gpus_per_node
        return self.intra_node if same else self.inter_node

    def validate(self, source: str = "cluster config") -> "ClusterConfig":
        """Refuse a node without GPUs and links with impossible bandwidth or latency."""
        check_fields(self, source)
        for key in ("intra_node", "inter_node"):
            if not isinstance(getattr(self, key), LinkConfig):
                raise DynaPipeError(f"{source}: {key}={getattr(self, key)!r:.60} must be a LinkConfig "
                                    f"(bandwidth_gbps, latency_ms).")
        if not is_whole(self.gpus_per_node):
            raise DynaPipeError(f"{source}: gpus_per_node={self.gpus_per_node!r} must be a whole number, at least 1 "
                                f"(the GPUs of one node).")
        self.intra_node.validate(f"{source}: intra_node")
        self.inter_node.validate(f"{source}: inter_node")
        return self


@dataclass(frozen=True)
class TensorParallelConfig:
    """Tensor parallelism of every stage (Megatron's ``--tensor-model-parallel-size`` and
    ``--sequence-parallel``); ``link``: the intra-node link its collectives run over."""

    size: int = 1
    sequence_parallel: bool = False
    link: LinkConfig = field(default_factory=lambda: LinkConfig(300.0, 0.005))

    def validate(self, model: "ModelConfig", gpus_per_node: Optional[int] = None,
                 flag: Optional[str] = None) -> "TensorParallelConfig":
        """Refuse a TP size the model cannot be split by (heads, FFN width) or that leaves the
        node (more ranks than a node has, or a size that does not divide it, so some TP group
        would straddle two nodes). ``flag``: the option named in the error (default: as the
        running program spells ``tp``)."""
        flag = flag or arg("tp")
        t = self.size
        if not is_whole(t):
            raise DynaPipeError(f"{flag} {t!r}: the tensor-parallel size must be a whole number, at least 1.")
        bool_flag("sequence_parallel", self.sequence_parallel)  # "yes" or "False" would count as on
        if not isinstance(self.link, LinkConfig):
            raise DynaPipeError(f"{flag} {t}: link {self.link!r:.60} must be a LinkConfig (bandwidth_gbps, latency_ms).")
        self.link.validate(f"{flag} {t}: link")
        if self.sequence_parallel and t == 1:
            raise DynaPipeError(f"{arg('sequence_parallel')} needs {flag} 2 or more (it shards the sequence over "
                                f"TP ranks).")
        for what, n in (("num_attention_heads", model.num_attention_heads), ("ffn_hidden_size", model.ffn_hidden_size),
                        ("num_query_groups", model.num_query_groups or model.num_attention_heads)):
            if n % t:
                raise DynaPipeError(f"{flag} {t} does not divide {what}={n} of model {model.name!r}; "
                                    f"use a divisor of {n}.")
        if gpus_per_node is not None and t > gpus_per_node:
            raise DynaPipeError(f"{flag} {t} exceeds the {gpus_per_node} GPUs of a node; tensor parallelism "
                                f"stays inside a node, so use at most {gpus_per_node}.")
        if gpus_per_node is not None and gpus_per_node % t:
            raise DynaPipeError(f"{flag} {t} does not divide the {gpus_per_node} GPUs of a node, so some TP group "
                                f"would span two nodes; use a divisor of {gpus_per_node}.")
        return self

    def allreduce_ms(self, nbytes):
        """Ring all-reduce of ``nbytes`` bytes over the TP group, ms (0 without TP)."""
        if self.size == 1:
            return 0.0 * nbytes
        return 2 * self.link.latency_ms + 2 * (self.size - 1) / self.size * nbytes / (self.link.bandwidth_gbps * 1e6)

    def gather_ms(self, nbytes):
        """Ring all-gather (or reduce-scatter) whose full result is ``nbytes`` bytes, ms."""
        if self.size == 1:
            return 0.0 * nbytes
        return self.link.latency_ms + (self.size - 1) / self.size * nbytes / (self.link.bandwidth_gbps * 1e6)
