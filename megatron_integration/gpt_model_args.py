"""The model of a training run, as Megatron's model arguments give it: :class:`GPTModelArgs`.

A plain, validated dataclass (no torch, no megatron) in :class:`~megatron_integration.
train_config.DynaPipeTrainingConfig`; it turns into megatron-core's ``TransformerConfig``
(:func:`megatron_integration.model.transformer_config`) and into the planner's
:class:`~dynapipe.config.ModelConfig` (:meth:`GPTModelArgs.to_model_config`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


@dataclass(frozen=True)
class GPTModelArgs:
    """Shape of the GPT model and its numerics. Lengths in tokens."""

    num_layers: int
    hidden_size: int
    num_attention_heads: int
    ffn_hidden_size: int
    kv_channels: int
    seq_length: int
    max_position_embeddings: int
    vocab_size: int
    position_embedding_type: str = "learned_absolute"
    tie_embeddings: bool = True
    # The layers built: "transformer_engine" (--transformer-impl's default, on GPUs) or megatron-core's
    # "local" ones (--transformer-impl local, and every CPU run: Transformer Engine needs CUDA).
    transformer_impl: str = "local"
    normalization: str = "LayerNorm"
    hidden_dropout: float = 0.1
    attention_dropout: float = 0.1
    init_method_std: float = 0.02
    dtype: str = "fp32"  # fp32, bf16 or fp16
    # Megatron's vocabulary padding, recorded for the start-up log: the tokenizer's size
    # before padding (0: --vocab-size was given, nothing padded).
    unpadded_vocab_size: int = 0
    swiglu: bool = False  # --swiglu: gated SiLU MLP (FC1 twice ffn_hidden_size wide)
    # Megatron-LM's bias-GeLU fusion (on unless --no-bias-gelu-fusion) computes GeLU's tanh
    # approximation; its unfused path the exact (erf) GeLU. Only a biased, ungated MLP fuses.
    bias_gelu_fusion: bool = True
    add_bias_linear: bool = True  # cleared by --disable-bias-linear
    # --add-qkv-bias: the QKV projection keeps its bias under --disable-bias-linear (megatron-core
    # gives it one when either is set).
    add_qkv_bias: bool = False
    qk_layernorm: bool = False  # --qk-layernorm: per-head query and key norms
    num_query_groups: Optional[int] = None  # --group-query-attention's key/value heads (None: one per head)
    rotary_base: int = 10000  # --rotary-base, with RoPE
    # --use-rope-scaling / --rope-scaling-factor (Llama 3.x's frequency scaling) and
    # --rotary-seq-len-interpolation-factor (positions divided by it), with RoPE.
    rope_scaling: bool = False
    rope_scaling_factor: float = 8.0
    rotary_seq_len_interpolation_factor: Optional[int] = None
    norm_epsilon: float = 1e-5  # --norm-epsilon
    cross_entropy_loss_fusion: bool = False  # --cross-entropy-loss-fusion (GPU)
    deterministic_mode: bool = False  # --deterministic-mode (megatron_integration.determinism)
    disable_bf16_reduced_precision_matmul: bool = False  # --disable-bf16-reduced-precision-matmul (GPU, bf16)
    apply_query_key_layer_scaling: bool = False  # --apply-query-key-layer-scaling
    # --attention-softmax-in-fp32 (Megatron-LM's default: off, the softmax in the run's precision;
    # forced on by --apply-query-key-layer-scaling).
    attention_softmax_in_fp32: bool = False

    def to_model_config(self, name: str = "megatron-gpt"):
        """The planner's :class:`dynapipe.config.ModelConfig` for this model."""
        from dynapipe.config import ModelConfig

        return ModelConfig(name=name, arch="gpt", num_layers=self.num_layers, hidden_size=self.hidden_size,
                           num_attention_heads=self.num_attention_heads, ffn_hidden_size=self.ffn_hidden_size,
                           vocab_size=self.vocab_size, max_seq_length=self.seq_length, dtype=self.dtype,
                           max_position_embeddings=self.max_position_embeddings,
                           tie_embeddings=self.tie_embeddings, kv_channels=self.kv_channels,
                           num_query_groups=self.num_query_groups or 0, gated_linear_unit=self.swiglu,
                           add_bias_linear=self.add_bias_linear, add_qkv_bias=self.add_qkv_bias,
                           qk_layernorm=self.qk_layernorm, normalization=self.normalization,
                           hidden_dropout=self.hidden_dropout, attention_dropout=self.attention_dropout,
                           position_embedding_type=self.position_embedding_type,
                           fused_attention=self.fused_attention, torch_norms=self.transformer_impl == "local",
                           attention_softmax_in_fp32=self.softmax_in_fp32).validate(name)

    @property
    def gelu_approximation(self) -> str:
        """``"tanh"`` where Megatron-LM's fused bias-GeLU would run (its maths, computed unfused
        here), else ``"none"`` (the exact GeLU of its unfused path); SwiGLU MLPs have no GeLU."""
        return "tanh" if self.bias_gelu_fusion and self.add_bias_linear and not self.swiglu else "none"

    @property
    def softmax_in_fp32(self) -> bool:
        """The attention softmax runs in fp32: ``--attention-softmax-in-fp32``, which
        megatron-core's ``TransformerConfig`` forces on with ``--apply-query-key-layer-scaling``."""
        return self.attention_softmax_in_fp32 or self.apply_query_key_layer_scaling

    @property
    def fused_attention(self) -> bool:
        """Whether the attention core keeps no score matrix: Transformer Engine's layers pick flash
        or cuDNN fused attention (``--attention-backend auto``) in half precision for heads of
        at most 256 in multiples of 8. In fp32, for other heads, under ``--deterministic-mode``
        (where Transformer Engine may refuse its non-deterministic kernels) and in megatron-core's
        local layers, attention is counted unfused: more memory than a fused kernel keeps, never
        less. (Transformer Engine also needs an Ampere or newer GPU for them.)"""
        head = self.kv_channels or self.hidden_size // self.num_attention_heads
        return (self.transformer_impl == "transformer_engine" and self.dtype in ("bf16", "fp16")
                and head % 8 == 0 and head <= 256 and not self.deterministic_mode)
