"""This rank's pipeline stage of megatron-core's ``GPTModel``, its optimizer and schedule.

* Layer spec: Transformer Engine's when CUDA is up and megatron-core can build it
  (:func:`te_available`), megatron-core's local (pure torch) spec otherwise.
* ``TransformerConfig.pipeline_model_parallel_size`` is set, so each stage builds only
  its own layers; stage 0 holds the embedding, the last stage the output layer (a tied
  copy of the embedding when ``--untie-embeddings-and-output-weights`` is absent).
* Initialisation is deterministic by *global* parameter name (see
  :func:`megatron_integration.param_init.deterministic_init_`): every split of the model into stages, and every
  batching method, starts from the same weights for a given ``--seed``.
* Gradients are synchronised by megatron-core's ``DistributedDataParallel`` and
  finalised by ``finalize_model_grads`` (data-parallel all-reduce, tied-embedding
  all-reduce, division by the global batch's real-token count); megatron-core's
  optimizer wraps AdamW (torch's fallback on CPU).
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional

import torch

from megatron_integration.train_config import DynaPipeTrainingConfig, GPTModelArgs, ParallelArgs, RecomputeArgs
from megatron_integration.initialize import RankInfo
from megatron_integration.tensor_parallel import sequence_parallel_block_spec
from megatron_integration.masked_softmax import use_additive_masks
from megatron_integration.args_layout import megatron_layout, stage_layer_count
from megatron_integration.ddp import attach_grad_sync, count_parameters
from megatron_integration.param_init import deterministic_init_

TORCH_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def te_available() -> bool:
    """Whether Transformer Engine can be used: CUDA, and megatron-core's GPT specs found it. A
    bare ``import transformer_engine`` is not enough: its package imports its PyTorch half lazily,
    so a wheel that does not match torch imports, and megatron-core (which imports the half it
    uses) then has no Transformer Engine spec to build."""
    if not torch.cuda.is_available():
        return False
    from megatron_integration.initialize import quiet_megatron_warnings, select_local_gpu

    # Asked while the arguments are checked, before anything else imports megatron-core: its
    # notices about missing optional packages are silenced first, as at start-up, and the
    # rank's own GPU is made current first, so importing Transformer Engine (which may touch
    # CUDA) opens no context on GPU 0.
    select_local_gpu()
    quiet_megatron_warnings()
    try:
        from megatron.core.models.gpt import gpt_layer_specs
    except Exception:
        return False
    return bool(getattr(gpt_layer_specs, "HAVE_TE", False))


def tanh_gelu(x: torch.Tensor) -> torch.Tensor:
    """GeLU's tanh approximation: what Megatron-LM's fused bias-GeLU (its default) computes,
    ``0.5 x (1 + tanh(0.79788456 x (1 + 0.044715 x^2)))``."""
    return torch.nn.functional.gelu(x, approximate="tanh")


def transformer_config(model: GPTModelArgs, parallel: ParallelArgs, cuda: Optional[bool] = None,
                       recompute: Optional[RecomputeArgs] = None):
    """megatron-core ``TransformerConfig`` for this model and process layout; ``recompute``:
    Megatron's ``--recompute-*`` settings, applied as megatron-core applies them (baselines)."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    cuda = torch.cuda.is_available() if cuda is None else cuda
    dtype = TORCH_DTYPES[model.dtype]
    kwargs = dict(
        num_layers=model.num_layers, hidden_size=model.hidden_size, num_attention_heads=model.num_attention_heads,
        ffn_hidden_size=model.ffn_hidden_size, kv_channels=model.kv_channels,
        hidden_dropout=model.hidden_dropout, attention_dropout=model.attention_dropout,
        init_method_std=model.init_method_std, normalization=model.normalization,
        tensor_model_parallel_size=parallel.tensor_model_parallel_size,
        pipeline_model_parallel_size=parallel.pipeline_model_parallel_size,
        sequence_parallel=parallel.sequence_parallel,
        # Megatron's interleaved pipeline: each chunk builds its share of layers at its offset.
        virtual_pipeline_model_parallel_size=parallel.virtual_pipeline_model_parallel_size,
        overlap_p2p_comm=parallel.overlap_p2p_comm, batch_p2p_comm=not parallel.overlap_p2p_comm,
        params_dtype=dtype, pipeline_dtype=dtype, bf16=model.dtype == "bf16", fp16=model.dtype == "fp16",
        # The loss is a sum over real tokens; gradients are divided by the global batch's
        # real-token count in finalize_model_grads (comparable across batching methods).
        calculate_per_token_loss=True,
        use_cpu_initialization=not cuda,
        deallocate_pipeline_outputs=True,
        # Megatron-LM's --swiglu, --disable-bias-linear and --group-query-attention, as its
        # core_transformer_config_from_args maps them (None query groups: one per head).
        add_bias_linear=model.add_bias_linear, num_query_groups=model.num_query_groups,
        add_qkv_bias=model.add_qkv_bias, qk_layernorm=model.qk_layernorm,
        layernorm_epsilon=model.norm_epsilon, cross_entropy_loss_fusion=model.cross_entropy_loss_fusion,
        deterministic_mode=model.deterministic_mode,
        # Megatron-LM's --apply-query-key-layer-scaling (megatron-core then keeps the softmax in fp32).
        apply_query_key_layer_scaling=model.apply_query_key_layer_scaling,
        # Megatron-LM passes its flag (default off); megatron-core's own default is on.
        attention_softmax_in_fp32=model.attention_softmax_in_fp32,
    )
    if model.disable_bf16_reduced_precision_matmul:  # megatron-core applies it when it builds the config
        kwargs.update(disable_bf16_reduced_precision_matmul=True)
    if parallel.stage_layers is not None:
        kwargs.update(pipeline_model_parallel_layout=megatron_layout(parallel.stage_layers))
    # Transformer Engine's attention takes the scaling from this variable only (megatron-core
    # refuses a config and environment that disagree); megatron-core's local one from the config.
    # Set either way: a job that builds several models (the bench, a test job) must not carry one
    # run's setting into the next.
    os.environ["NVTE_APPLY_QK_LAYER_SCALING"] = "1" if model.apply_query_key_layer_scaling else "0"
    if model.swiglu:
        kwargs.update(gated_linear_unit=True, activation_func=torch.nn.functional.silu)
    elif model.gelu_approximation == "tanh":
        kwargs.update(activation_func=tanh_gelu)
    if recompute is not None and recompute.granularity is not None:
        kwargs.update(recompute_granularity=recompute.granularity, recompute_method=recompute.method,
                      recompute_num_layers=recompute.num_layers)
    if not cuda:
        # Fused kernels are CUDA-only (or need a compiler); the unfused paths are the same maths
        # (the bias-GeLU's tanh approximation is the activation above).
        kwargs.update(gradient_accumulation_fusion=False, masked_softmax_fusion=False, bias_activation_fusion=False,
                      bias_dropout_fusion=False, apply_rope_fusion=False, persist_layer_norm=False)
    return TransformerConfig(**kwargs)


def layer_spec(use_te: Optional[bool] = None, normalization: str = "LayerNorm", qk_layernorm: bool = False):
    """(spec, name): Transformer Engine's GPT layer spec when usable, else megatron-core's local one.
    ``normalization``: the local spec's norm class depends on it (TE's norm reads the config);
    ``qk_layernorm``: the spec builds the per-head query and key norms."""
    from megatron.core.models.gpt import gpt_layer_specs as specs

    use_te = te_available() if use_te is None else use_te
    if use_te:
        return specs.get_gpt_layer_with_transformer_engine_spec(qk_layernorm=qk_layernorm), "transformer_engine"
    return specs.get_gpt_layer_local_spec(normalization=normalization, qk_layernorm=qk_layernorm), "local"


@dataclass
class Stage:
    """This rank's model stage: the DDP-wrapped module and where it sits in the pipeline.

    Under Megatron's interleaved pipeline a rank holds several chunks, each wrapped in its own
    DDP as Megatron-LM wraps them: ``module`` is then a ``ModuleList`` of those DDPs and ``gpt``
    a :class:`~megatron_integration.gpt_chunks.GPTChunks` of the unwrapped chunks (both whole
    for parameters, ``train``/``eval`` and the NaN check); :attr:`modules` and :attr:`gpts` list
    the chunks in either case."""

    module: torch.nn.Module  # megatron DistributedDataParallel([Float16Module](GPTModel)), or a list of them
    gpt: torch.nn.Module  # the unwrapped GPTModel, or GPTChunks
    config: object  # TransformerConfig
    info: RankInfo  # where this rank sits in the pipeline and data-parallel groups
    spec_name: str

    @property
    def pre_process(self) -> bool:
        return self.info.is_first_stage

    @property
    def post_process(self) -> bool:
        return self.info.is_last_stage

    @property
    def chunked(self) -> bool:
        """Whether the rank holds several model chunks (interleaved pipeline)."""
        from megatron_integration.gpt_chunks import GPTChunks

        return isinstance(self.gpt, GPTChunks)

    @property
    def modules(self) -> list:
        """The DDP module of every chunk (one without interleaving), in chunk order."""
        return list(self.module) if self.chunked else [self.module]

    @property
    def gpts(self) -> list:
        """The unwrapped ``GPTModel`` of every chunk, in chunk order."""
        return list(self.gpt.chunks) if self.chunked else [self.gpt]


def stage_config(cfg: DynaPipeTrainingConfig, info: RankInfo):
    """The ``TransformerConfig`` of this rank's stage (all its chunks share it, as in Megatron-LM:
    the recompute level and schedule hooks set on it reach every chunk)."""
    # The baselines run Megatron's --recompute-* as given; DynaPipe sets the level per micro-batch
    # (set_recompute_level), so its stage is built without a fixed one.
    fixed = None if cfg.dynapipe.enabled else cfg.recompute
    return transformer_config(cfg.model, cfg.parallel, cuda=info.device.type == "cuda", recompute=fixed)


def build_gpt_stage(cfg: DynaPipeTrainingConfig, info: RankInfo, use_te: Optional[bool] = None,
                    vp_stage: Optional[int] = None, tconfig=None) -> torch.nn.Module:
    """The unwrapped ``GPTModel`` of this rank's stage (``vp_stage``: of its chunk ``vp_stage``
    under the interleaved pipeline, built on the stage's shared ``tconfig``), deterministically
    initialised."""
    from megatron.core.models.gpt.gpt_model import GPTModel

    tconfig = tconfig or stage_config(cfg, info)
    m = cfg.model
    chunks = cfg.parallel.virtual_pipeline_model_parallel_size or 1
    first = info.is_first_stage and (vp_stage or 0) == 0
    last = info.is_last_stage and (vp_stage is None or vp_stage == chunks - 1)
    spec, name = layer_spec(use_te, m.normalization, m.qk_layernorm)
    if cfg.per_sample_attention and name == "local":
        from megatron_integration.segment_attention import with_segmented_attention

        spec = with_segmented_attention(spec)  # each sample's attention computed alone
    spec = sequence_parallel_block_spec(spec, tconfig, stage_layer_count(cfg.parallel, m.num_layers, info.pp_rank,
                                                                         vp_stage))
    kwargs = {} if vp_stage is None else {"vp_stage": vp_stage}
    gpt = GPTModel(config=tconfig, transformer_layer_spec=spec, vocab_size=m.vocab_size,
                   max_sequence_length=m.max_position_embeddings, pre_process=first,
                   post_process=last, share_embeddings_and_output_weights=m.tie_embeddings,
                   position_embedding_type=m.position_embedding_type, rotary_base=m.rotary_base,
                   rope_scaling=m.rope_scaling, rope_scaling_factor=m.rope_scaling_factor,
                   seq_len_interpolation_factor=m.rotary_seq_len_interpolation_factor, **kwargs)
    gpt.to(info.device)
    deterministic_init_(gpt, m, cfg.seed)
    use_additive_masks(gpt, info.device)  # the same probabilities, at half the cost of the CPU's masked softmax
    return gpt


def _wrap(cfg: DynaPipeTrainingConfig, gpt: torch.nn.Module, chunk: int = 0, num_parameters: int = 0) -> torch.nn.Module:
    """``gpt`` wrapped as Megatron-LM wraps a model chunk: Float16Module (bf16/fp16), then DDP
    (:mod:`megatron_integration.ddp`); ``num_parameters``: the rank's, over all its chunks."""
    from megatron_integration.ddp import wrap_chunk

    inner = gpt
    if cfg.model.dtype in ("bf16", "fp16"):
        from megatron.core.transformer.module import Float16Module

        # As Megatron-LM does: half-precision weights, fp32 loss on the last stage.
        inner = Float16Module(gpt.config, gpt)
    return wrap_chunk(cfg, gpt.config, inner, chunk, num_parameters)


def build_stage(cfg: DynaPipeTrainingConfig, info: RankInfo, use_te: Optional[bool] = None) -> Stage:
    """Build, initialise and wrap this rank's stage (every chunk of it) in megatron-core DDP."""
    use_te = cfg.model.transformer_impl == "transformer_engine" if use_te is None else use_te
    name = "transformer_engine" if use_te else "local"
    chunks = cfg.parallel.virtual_pipeline_model_parallel_size
    if chunks:
        from megatron_integration.gpt_chunks import GPTChunks

        tconfig = stage_config(cfg, info)
        gpts = [build_gpt_stage(cfg, info, use_te, vp_stage=c, tconfig=tconfig) for c in range(chunks)]
        n = count_parameters(gpts)
        module = torch.nn.ModuleList([_wrap(cfg, g, c, n) for c, g in enumerate(gpts)])
        return Stage(module=module, gpt=GPTChunks(gpts), config=gpts[0].config, info=info, spec_name=name)
    gpt = build_gpt_stage(cfg, info, use_te)
    return Stage(module=_wrap(cfg, gpt, 0, count_parameters([gpt])), gpt=gpt, config=gpt.config, info=info,
                 spec_name=name)


# -- recompute level per forward ----------------------------------------------------------

RECOMPUTE_LEVELS = ("none", "selective", "full")


def set_recompute_level(gpt: torch.nn.Module, config, level: str) -> None:
    """Make the stage's next forward, and the recomputation in its backward, run at ``level``.

    ``selective`` checkpoints each layer's core attention (megatron-core's
    ``_checkpointed_attention_forward``), ``full`` each transformer layer on its own
    (``recompute_method="uniform"``, ``recompute_num_layers=1``: the stage keeps only every
    layer's input, and the backward rematerialises one layer at a time). Both go through
    megatron-core's ``tensor_parallel.checkpoint``, which saves and restores the CPU, CUDA and
    model-parallel tracker RNG states, so dropout masks are redrawn identically.

    megatron-core (0.16 to 0.19) reads ``config.recompute_granularity == "full"`` and
    ``recompute_method``/``recompute_num_layers`` in ``TransformerBlock.forward``, but
    decides core-attention checkpointing once, in ``Attention.__init__``
    (``checkpoint_core_attention``); that attribute is set here on every layer.
    """
    if level not in RECOMPUTE_LEVELS:
        raise ValueError(f"recompute level {level!r} is not one of {RECOMPUTE_LEVELS}")
    if level == "full":
        config.recompute_granularity, config.recompute_method, config.recompute_num_layers = "full", "uniform", 1
    else:
        config.recompute_granularity = "selective" if level == "selective" else None
        config.recompute_method = config.recompute_num_layers = None
    decoder = getattr(gpt, "decoder", None)
    for layer in getattr(decoder, "layers", ()):
        attention = getattr(layer, "self_attention", None)
        if attention is not None and hasattr(attention, "checkpoint_core_attention"):
            attention.checkpoint_core_attention = level == "selective"


def finalize_grads_func():
    """megatron-core's ``finalize_model_grads`` (DP and tied-embedding all-reduce, per-token scaling)."""
    from megatron.core.distributed import finalize_model_grads

    return finalize_model_grads


def attach_training_hooks(stage: Stage, optimizer) -> None:
    """Point the TransformerConfig at DDP's no-sync, the grad finaliser and (fp16) the
    optimizer's loss scaling, as Megatron-LM's training does."""
    # One no-sync (and with --overlap-grad-reduce one grad-sync) per chunk under the interleaved
    # pipeline, as Megatron-LM sets them.
    attach_grad_sync(stage.config, stage.modules)
    stage.config.finalize_model_grads_func = finalize_grads_func()
    stage.config.grad_scale_func = grad_scale_func(stage.config, optimizer)


def grad_scale_func(config, optimizer):
    """The optimizer's ``scale_loss`` when it scales the loss (fp16; bf16 with a static
    ``--loss-scale``), else None: the optimizer divides the gradients by its scale before
    stepping, so the loss must be multiplied by it before the backward (the schedules call
    ``config.grad_scale_func``)."""
    scaled = config.fp16 or (config.bf16 and float(optimizer.get_loss_scale()) != 1.0)
    return optimizer.scale_loss if scaled else None
