"""Model, device and cluster configurations, loaded from YAML files in ``configs/``
(the cluster's link and tensor-parallel types live in :mod:`dynapipe.topology`).

Each config is a frozen dataclass; ``load_*`` functions read a YAML file (or take a dict)
and reject unknown keys and bad values with an error that names the file and the key.
Pure Python: no torch, no megatron.
"""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Any, Mapping, Optional

from dynapipe.config_yaml import build_dataclass as _build, read_yaml
from dynapipe.errors import DynaPipeError, check_fields
# Re-exported: every layer imports its configs from here.
from dynapipe.topology import ClusterConfig, LinkConfig, TensorParallelConfig

__all__ = ["ModelConfig", "DeviceConfig", "LinkConfig", "ClusterConfig", "TensorParallelConfig", "DTYPE_BYTES",
           "load_model_config", "load_device_config", "load_cluster_config", "model_config_from_dict",
           "shipped_names", "resolve_config_path"]

DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
# Torch-style names, used in execution plans (shapes and dtypes of every tensor moved).
DTYPE_TORCH_NAME = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
POSITION_EMBEDDING_TYPES = ("learned_absolute", "rope", "relative", "none")


@dataclass(frozen=True)
class ModelConfig:
    """Transformer shape. ``arch`` is ``gpt`` (decoder-only) or ``t5`` (encoder-decoder).

    For ``gpt``, ``num_layers`` counts the decoder layers; for ``t5``, ``encoder_layers``
    and ``decoder_layers`` are used and ``num_layers`` is their sum.
    """

    name: str
    arch: str = "gpt"
    num_layers: int = 0
    hidden_size: int = 0
    num_attention_heads: int = 0
    ffn_hidden_size: int = 0
    vocab_size: int = 50304
    max_seq_length: int = 2048
    dtype: str = "bf16"
    encoder_layers: int = 0
    decoder_layers: int = 0
    # Megatron ties input embedding and output layer; with PP > 1 the last stage keeps a copy.
    tie_embeddings: bool = True
    # Per-head dimension; 0 means hidden_size / num_attention_heads (T5-11B uses 128 with 128 heads).
    kv_channels: int = 0
    # Grouped-query attention: key/value heads (Megatron's --num-query-groups); 0 means one per query head.
    num_query_groups: int = 0
    # Gated MLP (Megatron's --swiglu): FC1 produces gate and up projections, 2 x ffn_hidden_size wide.
    gated_linear_unit: bool = False
    # Biases on the linear layers (Megatron's --disable-bias-linear clears it).
    add_bias_linear: bool = True
    # The QKV projection's bias without the others (Megatron's --add-qkv-bias, Qwen2's layer).
    add_qkv_bias: bool = False
    # Per-head query and key norms over head_dim (Megatron's --qk-layernorm, Qwen3's layer).
    qk_layernorm: bool = False
    normalization: str = "LayerNorm"  # or RMSNorm (a weight, no bias)
    # Megatron's --hidden-dropout and --attention-dropout (default 0.1 each): at 0 the layers keep
    # no dropout masks and unfused attention keeps only its softmax output, which the analytic
    # memory model counts (dynapipe.cost.activation_bytes).
    hidden_dropout: float = 0.1
    attention_dropout: float = 0.1
    # Megatron's --position-embedding-type: learned_absolute (its default), rope (the rotated
    # query and key are kept), relative (T5) or none.
    position_embedding_type: str = "learned_absolute"
    # Megatron's --max-position-embeddings: rows of the learned position table every embedding
    # stage holds (0: max_seq_length).
    max_position_embeddings: int = 0
    # The attention core is a fused kernel (flash or cuDNN fused attention, which Transformer
    # Engine picks in half precision) that keeps no score matrix; False: megatron-core's local
    # (unfused) attention, which keeps it.
    fused_attention: bool = False
    # Megatron's --attention-softmax-in-fp32 (forced on by --apply-query-key-layer-scaling): the
    # unfused attention's torch softmax keeps fp32 probabilities and the cast copy.
    attention_softmax_in_fp32: bool = False
    # The layers' norms are torch's (megatron-core's local layers: --transformer-impl local, and
    # every CPU run), whose RMSNorm keeps more than its input and statistics
    # (dynapipe.cost.activation_bytes.torch_rms_norm_bytes); False: Transformer Engine's norms.
    torch_norms: bool = False

    @property
    def head_dim(self) -> int:
        """Per-head width (kv_channels)."""
        return self.kv_channels or self.hidden_size // self.num_attention_heads

    @property
    def attention_dim(self) -> int:
        """Width of the query projection and of the attention output: heads x kv_channels."""
        return self.num_attention_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        """Width of the key projection (and of the value projection): key/value heads x kv_channels."""
        return (self.num_query_groups or self.num_attention_heads) * self.head_dim

    @property
    def fc1_width(self) -> int:
        """Output width of the MLP's first linear layer: doubled for a gated (SwiGLU) MLP."""
        return self.ffn_hidden_size * (2 if self.gated_linear_unit else 1)

    @property
    def is_encoder_decoder(self) -> bool:
        return self.arch == "t5"

    @property
    def dtype_bytes(self) -> int:
        return DTYPE_BYTES[self.dtype]

    @property
    def torch_dtype_name(self) -> str:
        return DTYPE_TORCH_NAME[self.dtype]

    @property
    def total_layers(self) -> int:
        return self.encoder_layers + self.decoder_layers if self.is_encoder_decoder else self.num_layers

    def validate(self, source: str = "model config") -> "ModelConfig":
        check_fields(self, source)  # a config built in code gets the types YAML loading checks
        if self.arch not in ("gpt", "t5"):
            raise DynaPipeError(f"{source}: arch={self.arch!r} is not supported; use 'gpt' or 't5'.")
        if self.dtype not in DTYPE_BYTES:
            raise DynaPipeError(f"{source}: dtype={self.dtype!r}; use one of {sorted(DTYPE_BYTES)}.")
        for key in ("hidden_size", "num_attention_heads", "ffn_hidden_size", "vocab_size", "max_seq_length"):
            if getattr(self, key) <= 0:
                raise DynaPipeError(f"{source}: {key}={getattr(self, key)} must be a positive integer.")
        if self.hidden_size % self.num_attention_heads:
            raise DynaPipeError(
                f"{source}: hidden_size={self.hidden_size} is not divisible by "
                f"num_attention_heads={self.num_attention_heads}."
            )
        if self.is_encoder_decoder:
            if self.encoder_layers <= 0 or self.decoder_layers <= 0:
                raise DynaPipeError(f"{source}: a t5 model needs encoder_layers and decoder_layers > 0.")
        elif self.num_layers <= 0:
            raise DynaPipeError(f"{source}: num_layers={self.num_layers} must be a positive integer.")
        elif self.encoder_layers or self.decoder_layers:
            raise DynaPipeError(f"{source}: encoder_layers={self.encoder_layers} / decoder_layers="
                                f"{self.decoder_layers} describe a t5; a gpt counts its layers in num_layers "
                                f"(drop them, or set arch: t5).")
        if self.kv_channels < 0:
            raise DynaPipeError(f"{source}: kv_channels={self.kv_channels} must be >= 0 "
                                f"(0 means hidden_size / num_attention_heads).")
        if self.num_query_groups < 0 or (self.num_query_groups and self.num_attention_heads % self.num_query_groups):
            raise DynaPipeError(f"{source}: num_query_groups={self.num_query_groups} must divide "
                                f"num_attention_heads={self.num_attention_heads}.")
        if self.normalization not in ("LayerNorm", "RMSNorm"):
            raise DynaPipeError(f"{source}: normalization={self.normalization!r}; use 'LayerNorm' or 'RMSNorm'.")
        for key in ("hidden_dropout", "attention_dropout"):
            p = getattr(self, key)
            if not isinstance(p, (int, float)) or isinstance(p, bool) or not 0 <= p < 1:
                raise DynaPipeError(f"{source}: {key}={p!r} must be a probability in [0, 1).")
        if self.max_position_embeddings < 0:
            raise DynaPipeError(f"{source}: max_position_embeddings={self.max_position_embeddings} must be >= 0 "
                                f"(0 means max_seq_length).")
        if 0 < self.max_position_embeddings < self.max_seq_length:
            raise DynaPipeError(f"{source}: max_position_embeddings={self.max_position_embeddings} is below "
                                f"max_seq_length={self.max_seq_length} (Megatron-LM requires at least the sequence "
                                f"length); raise it, or give 0 for max_seq_length.")
        if self.position_embedding_type not in POSITION_EMBEDDING_TYPES:
            raise DynaPipeError(f"{source}: position_embedding_type={self.position_embedding_type!r}; use one of "
                                f"{', '.join(POSITION_EMBEDDING_TYPES)}.")
        return self


#: Megatron-LM's --make-vocab-size-divisible-by default.
VOCAB_DIVISIBLE_BY = 128


def padded_vocab_size(vocab_size: int, divisible_by: int = VOCAB_DIVISIBLE_BY, tensor_parallel: int = 1) -> int:
    """Megatron-LM's vocabulary padding: round ``vocab_size`` (ids) up to a multiple of
    ``divisible_by x tensor_parallel`` so every tensor-parallel shard of the embedding is equal
    and aligned (50257 -> 50304 with the defaults; 50304 -> 50432 at TP2)."""
    multiple = divisible_by * tensor_parallel
    return -(-vocab_size // multiple) * multiple


@dataclass(frozen=True)
class DeviceConfig:
    """One accelerator (or a CPU). Times in ms, memory in MiB, throughput in TFLOP/s."""

    name: str
    peak_tflops: float
    achievable_fraction: float = 0.5
    memory_mib: float = 0.0
    # Fixed launch/dispatch cost paid by every forward or backward op of a stage.
    op_overhead_ms: float = 0.0
    # Memory the framework keeps for itself (CUDA context, allocator fragmentation, buffers).
    reserved_mib: float = 0.0
    # Tokens per op at which the device reaches half of its achievable throughput: small
    # micro-batches leave GEMMs too thin to fill an accelerator. 0 disables the curve.
    half_efficiency_tokens: float = 0.0
    # Bytes a dropout mask keeps per element: 1 on CUDA (a bool mask); 0 means the activation's
    # dtype, as a CPU's dropout keeps it (input times a mask of its own dtype).
    dropout_mask_bytes: int = 1

    def dropout_mask_bytes_for(self, dtype_bytes: int) -> int:
        """Bytes a dropout mask keeps per element for activations of ``dtype_bytes``."""
        return self.dropout_mask_bytes or dtype_bytes

    def efficiency(self, tokens):
        """Fraction of the achievable throughput reached by an op over ``tokens`` tokens."""
        if self.half_efficiency_tokens <= 0:
            return 1.0
        return tokens / (tokens + self.half_efficiency_tokens)

    @property
    def effective_flops_per_ms(self) -> float:
        return self.peak_tflops * 1e12 * self.achievable_fraction / 1e3

    def validate(self, source: str = "device config") -> "DeviceConfig":
        check_fields(self, source)
        if self.peak_tflops <= 0:
            raise DynaPipeError(f"{source}: peak_tflops={self.peak_tflops} must be > 0.")
        if not 0 < self.achievable_fraction <= 1:
            raise DynaPipeError(f"{source}: achievable_fraction={self.achievable_fraction} must be in (0, 1].")
        if self.memory_mib <= 0:
            raise DynaPipeError(f"{source}: memory_mib={self.memory_mib} must be > 0.")
        if self.half_efficiency_tokens < 0:
            raise DynaPipeError(f"{source}: half_efficiency_tokens={self.half_efficiency_tokens} must be >= 0.")
        if self.dropout_mask_bytes not in (0, 1, 2, 4):
            raise DynaPipeError(f"{source}: dropout_mask_bytes={self.dropout_mask_bytes} must be 1 (a bool mask, as "
                                f"on CUDA), 2 or 4 (a mask of 16- or 32-bit values), or 0 (the activation's dtype, "
                                f"as on a CPU).")
        if self.op_overhead_ms < 0:
            raise DynaPipeError(f"{source}: op_overhead_ms={self.op_overhead_ms} must be >= 0.")
        if not 0 <= self.reserved_mib < self.memory_mib:
            raise DynaPipeError(f"{source}: reserved_mib={self.reserved_mib} must be >= 0 and below "
                                f"memory_mib={self.memory_mib}.")
        return self


CONFIG_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs")
# What a file of each folder of configs/ holds, as errors name it.
CONFIG_KINDS = {"models": "model", "devices": "device", "clusters": "cluster", "data": "mixture"}


def shipped_names(kind: str) -> list[str]:
    """Names of the configs shipped in ``configs/<kind>/`` (file names without ``.yaml``)."""
    folder = os.path.join(CONFIG_DIR, kind)
    if not os.path.isdir(folder):
        return []
    return sorted(n[:-len(".yaml")] for n in os.listdir(folder) if n.endswith(".yaml"))


def resolve_config_path(path_or_name: str, kind: str, flag: Optional[str] = None) -> str:
    """Accept a path, or a bare name of a config shipped in ``configs/<kind>/``; refuse
    anything else naming ``flag`` (when given), the shipped names of that kind and, for a
    name shipped as another kind (a device given as a cluster), which kind it is. A bare
    shipped name that is also a file in the working directory is refused as ambiguous."""
    if isinstance(path_or_name, os.PathLike):
        path_or_name = os.fspath(path_or_name)
    if not isinstance(path_or_name, str):
        raise DynaPipeError(f"{flag or CONFIG_KINDS.get(kind, kind) + ' config'} {path_or_name!r:.60}: give a YAML "
                            f"file's path or the name of a shipped config ({', '.join(shipped_names(kind)[:4])}, ...).")
    name = path_or_name.removesuffix(".yaml")
    shipped = os.path.join(CONFIG_DIR, kind, name + ".yaml")
    what = CONFIG_KINDS.get(kind, kind)
    bare = path_or_name == name and os.sep not in name
    if os.path.isdir(path_or_name):
        if bare and os.path.exists(shipped):
            return shipped  # a folder (an output folder, say) is no config: the shipped name is meant
        raise DynaPipeError(f"{flag + ': ' if flag else ''}{path_or_name!r} is a directory; give a {what} config "
                            f"YAML file or a shipped {what} name.")
    if os.path.exists(path_or_name):
        # A bare shipped name that is also a file here (a command's --output, say) would be read
        # in the shipped config's place without a word.
        if bare and os.path.exists(shipped):
            raise DynaPipeError(f"{flag + ': ' if flag else ''}{name!r} names both a file in the working directory "
                                f"and a shipped {what} config; give ./{name} for the file or {shipped} for the "
                                f"shipped one.")
        return path_or_name
    if os.path.exists(shipped):
        return shipped
    noun = "mixture file" if kind == "data" else "config file"
    others = [CONFIG_KINDS[k] for k in CONFIG_KINDS if k != kind and name in shipped_names(k)]
    hint = f" ({name!r} is a shipped {others[0]} config, not a {what} one)" if others else ""
    names = ", ".join(shipped_names(kind)) or "none"
    raise DynaPipeError(f"{flag + ': ' if flag else ''}{noun} {path_or_name!r} does not exist{hint}; give a YAML "
                        f"path or a shipped {what} name: {names}.")


def model_config_from_dict(data: Mapping[str, Any], source: str = "model config") -> ModelConfig:
    """Build and validate a :class:`ModelConfig` from a mapping."""
    if not isinstance(data, Mapping):
        raise DynaPipeError(f"{source}: {data!r:.80} is not a mapping of model fields (name, hidden_size, ...).")
    data = dict(data)
    layers = ("encoder_layers", "decoder_layers") if data.get("arch") == "t5" else ("num_layers",)
    missing = [k for k in ("hidden_size", "num_attention_heads") + layers if k not in data]
    if missing:
        # Their dataclass defaults (0) would be reported as given values ("hidden_size=0").
        raise DynaPipeError(f"{source}: {', '.join(missing)} missing; a model config gives the layer counts, "
                            f"hidden_size and num_attention_heads (see configs/models/).")
    cfg = _build(ModelConfig, data, source)
    if cfg.is_encoder_decoder and not cfg.num_layers:
        cfg = dataclasses.replace(cfg, num_layers=cfg.encoder_layers + cfg.decoder_layers)
    if not cfg.ffn_hidden_size and cfg.hidden_size:
        cfg = dataclasses.replace(cfg, ffn_hidden_size=4 * cfg.hidden_size)
    return cfg.validate(source)


def load_model_config(path: str, flag: Optional[str] = None) -> ModelConfig:
    """Load a model config from a YAML file path or a shipped name such as ``gpt-7b``;
    ``flag``: the option named when neither exists."""
    path = resolve_config_path(path, "models", flag)
    return model_config_from_dict(read_yaml(path), source=path)


def load_device_config(path: str, flag: Optional[str] = None) -> DeviceConfig:
    """Load a device config from a YAML file path or a shipped name such as ``a100-40gb``;
    ``flag``: the option named when neither exists."""
    path = resolve_config_path(path, "devices", flag)
    data = read_yaml(path)
    if isinstance(data, Mapping) and "memory_mib" not in data:
        # Its default (0, for devices built in code) would be reported as a value given.
        raise DynaPipeError(f"{path}: memory_mib missing; a device config gives its memory per device in MiB "
                            f"(see configs/devices/).")
    return _build(DeviceConfig, data, path).validate(path)


def load_cluster_config(path: str, flag: Optional[str] = None) -> ClusterConfig:
    """Load a cluster config (links in GB/s and ms) from a YAML file path or shipped name;
    ``flag``: the option named when neither exists."""
    path = resolve_config_path(path, "clusters", flag)
    data = read_yaml(path)
    for key in ("intra_node", "inter_node"):
        if key in data:
            data[key] = _build(LinkConfig, data[key], f"{path}: {key}")
    cluster = _build(ClusterConfig, data, path)  # the values given are named first
    missing = [k for k in ("intra_node", "inter_node") if k not in data]
    if missing:
        # The dataclass's defaults (made for clusters built in code) would price links nobody gave.
        raise DynaPipeError(f"{path}: {' and '.join(missing)} missing; a cluster config gives both links, "
                            f"{{bandwidth_gbps: GB/s, latency_ms: ms}} (see configs/clusters/).")
    return cluster.validate(path)
