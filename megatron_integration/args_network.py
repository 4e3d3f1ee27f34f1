"""Megatron-LM's network-size arguments: the model's shape, layer structure, rotary embeddings,
layer implementation, normalisation, dropout and initialisation.

Declarations only (names, meanings and defaults as Megatron-LM's), called by
:func:`~megatron_integration.args_megatron.add_megatron_args`; the values are validated where they
become config (:mod:`~megatron_integration.args_model`). No torch or megatron import.
"""
from __future__ import annotations

import argparse

from megatron_integration.args_megatron import ATTENTION_BACKENDS, POSITION_EMBEDDINGS, TRANSFORMER_IMPLS


def add_network_size_args(parser: argparse.ArgumentParser) -> None:
    """Declare the network size group (names and defaults as Megatron-LM's)."""
    g = parser.add_argument_group("network size")
    _add_shape_args(g)
    _add_layer_structure_args(g)
    _add_rotary_args(g)
    _add_implementation_args(g)
    _add_norm_dropout_init_args(g)


def _add_shape_args(g: argparse._ArgumentGroup) -> None:
    """Layers, widths, heads, position embeddings and the vocabulary."""
    g.add_argument("--num-layers", type=int, default=None, help="number of transformer layers")
    g.add_argument("--encoder-num-layers", type=int, default=None,
                   help="the same as --num-layers (Megatron-LM's other spelling; give one); T5: the encoder's layers")
    g.add_argument("--hidden-size", type=int, default=None, help="transformer hidden size")
    g.add_argument("--num-attention-heads", type=int, default=None, help="number of attention heads")
    g.add_argument("--ffn-hidden-size", type=int, default=None,
                   help="MLP width (default 4 x hidden size; with --swiglu Megatron-LM's 2/3 of it, rounded down to a "
                        "multiple of 64)")
    g.add_argument("--kv-channels", type=int, default=None, help="per-head width (default hidden / heads)")
    g.add_argument("--max-position-embeddings", type=int, default=None,
                   help="maximum sequence length the position embedding supports (Megatron-LM requires it; "
                        "default here: --seq-length; T5: the longer of the encoder and decoder lengths)")
    g.add_argument("--position-embedding-type", default="learned_absolute", choices=POSITION_EMBEDDINGS)
    g.add_argument("--vocab-size", type=int, default=None,
                   help="vocabulary size before padding (default: the byte-level tokenizer's)")
    g.add_argument("--make-vocab-size-divisible-by", type=int, default=128,
                   help="pad the vocabulary to a multiple of this x --tensor-model-parallel-size (Megatron's rule)")


def _add_layer_structure_args(g: argparse._ArgumentGroup) -> None:
    """The layer's MLP, biases, query/key norms and grouped-query attention."""
    g.add_argument("--swiglu", action="store_true", help="SwiGLU MLP instead of GeLU")
    g.add_argument("--disable-bias-linear", action="store_true", help="no biases in the linear layers")
    g.add_argument("--add-qkv-bias", action="store_true",
                   help="keep the query/key/value projection's bias under --disable-bias-linear (Qwen2's layer)")
    g.add_argument("--qk-layernorm", action="store_true",
                   help="normalise each head's queries and keys (--normalization's kind, over --kv-channels; "
                        "Qwen3's layer)")
    g.add_argument("--group-query-attention", action="store_true", help="grouped-query attention")
    g.add_argument("--num-query-groups", type=int, default=1, help="key/value groups with --group-query-attention")


def _add_rotary_args(g: argparse._ArgumentGroup) -> None:
    """Rotary embeddings (RoPE) and Megatron-LM's legacy RoPE spellings."""
    g.add_argument("--rotary-base", type=int, default=10000, help="RoPE base period")
    g.add_argument("--rope-type", default=None, choices=("rope", "yarn"),
                   help="rope: the standard rotary embedding (Megatron-LM's default with ordinary attention; "
                        "needs --position-embedding-type rope); yarn is refused (not built)")
    # Megatron-LM's deprecated spellings of --position-embedding-type rope (its legacy RoPE arguments).
    g.add_argument("--use-rotary-position-embeddings", action="store_true",
                   help="deprecated in Megatron-LM: --position-embedding-type rope")
    g.add_argument("--no-position-embedding", action="store_false", dest="add_position_embedding",
                   help="deprecated in Megatron-LM: accepted with rotary embeddings (which add none)")
    g.add_argument("--use-rope-scaling", action="store_true",
                   help="Llama 3.x's RoPE frequency scaling (with --position-embedding-type rope)")
    g.add_argument("--rope-scaling-factor", type=float, default=8.0, help="Llama 3.x's RoPE scaling factor")
    g.add_argument("--rotary-seq-len-interpolation-factor", type=int, default=None,
                   help="divide RoPE positions by this factor (position interpolation)")


def _add_implementation_args(g: argparse._ArgumentGroup) -> None:
    """Which attention and layer implementations build the stages."""
    g.add_argument("--use-flash-attn", action="store_true",
                   help="accepted: Megatron-LM declares it and its megatron-core models do not read it (Transformer "
                        "Engine's attention picks flash attention itself)")
    g.add_argument("--attention-backend", default="auto", choices=ATTENTION_BACKENDS,
                   help="attention implementation: auto (megatron-core chooses), or local where the stages are "
                        "built from local layers; the others are refused")
    g.add_argument("--transformer-impl", default="transformer_engine", choices=TRANSFORMER_IMPLS,
                   help="layer implementation; transformer_engine (Megatron-LM's default) needs Transformer "
                        "Engine on GPUs (refused where megatron-core cannot load it, and for T5, whose stages are "
                        "local); on CPUs every stage is local")


def _add_norm_dropout_init_args(g: argparse._ArgumentGroup) -> None:
    """Output-layer tying, normalisation, dropout, initialisation and the remaining layer flags."""
    g.add_argument("--untie-embeddings-and-output-weights", action="store_true",
                   help="separate output layer instead of the tied input embedding")
    g.add_argument("--normalization", default="LayerNorm", choices=("LayerNorm", "RMSNorm"))
    g.add_argument("--hidden-dropout", type=float, default=0.1)
    g.add_argument("--attention-dropout", type=float, default=0.1)
    g.add_argument("--init-method-std", type=float, default=0.02)
    g.add_argument("--use-cpu-initialization", action="store_true",
                   help="accepted, as what it asks for is done anyway: weights the same whatever the tensor-parallel "
                        "split (each parameter is drawn from a generator seeded by --seed and its unsplit name)")
    g.add_argument("--norm-epsilon", type=float, default=1e-5, help="epsilon of every LayerNorm / RMSNorm")
    g.add_argument("--apply-query-key-layer-scaling", action="store_true",
                   help="scale Q x K^T by 1 / layer number before the softmax and back inside it, in fp32 "
                        "(fp16 range headroom)")
    g.add_argument("--rotary-percent", type=float, default=1.0,
                   help="share of each head's channels rotary embeddings cover (only 1.0, the default, is built)")
    g.add_argument("--apply-layernorm-1p", action="store_true",
                   help="zero-centred norm weights (refused: not built)")
    g.add_argument("--use-mcore-models", action="store_true", dest="deprecated_use_mcore_models",
                   help="deprecated in Megatron-LM, which ignores it: the stages are megatron-core models")
