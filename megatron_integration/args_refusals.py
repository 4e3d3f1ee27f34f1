"""What this build refuses instead of ignoring: Megatron-LM flags it does not take, and
non-default values of declared flags that the stages or checkpoints cannot honour.

Each refusal is one line naming the flag, why, and what to give instead
(:func:`~megatron_integration.args_checks._unsupported`). No torch or megatron import.
"""
from __future__ import annotations

import argparse

from dynapipe.errors import DynaPipeError, raise_refused
from megatron_integration.args_checks import _unsupported, _unsupported_value
from megatron_integration.flag_spelling import megatron_spelled
from megatron_integration.rerun_settings import RerunSettings

# Megatron-FSDP's flags (its own sharded data parallelism).
_FSDP = ("Megatron-FSDP is not built: each stage holds its parameters whole under megatron-core's DDP (or its "
         "distributed optimizer, --use-distributed-optimizer); drop it")

# Megatron-LM flags this build does not take, and why (or what to use instead). Anything
# not listed here and not declared by add_megatron_args / add_dynapipe_args is not a
# Megatron-LM flag and gets argparse's error.
UNSUPPORTED_MEGATRON_FLAGS = {
    "--wandb-project": "use --tensorboard-dir for metrics",
    "--wandb-exp-name": "use --tensorboard-dir for metrics",
    "--wandb-save-dir": "use --tensorboard-dir for metrics",
    "--eval-global-batch-size": "evaluation batches are --global-batch-size samples; drop it",
    "--full-validation": "evaluation reads --eval-iters global batches; drop it",
    # Megatron-LM's T5 flags for what the T5 stages here do not build.
    "--relative-attention-num-buckets": ("T5 stages use learned absolute positions (megatron-core's relative "
                                         "position embedding is not built); drop it"),
    "--relative-attention-max-distance": ("T5 stages use learned absolute positions (megatron-core's relative "
                                          "position embedding is not built); drop it"),
    # Megatron-LM's T5 flags, which pretrain_t5.py declares: refused by the GPT script, which
    # has nothing to apply them to (Megatron-LM's GPT parses and ignores them).
    "--decoder-num-layers": "a T5 flag (scripts/pretrain_t5.py reads it): a GPT has no decoder stack; drop it",
    "--decoder-seq-length": "a T5 flag (scripts/pretrain_t5.py reads it): a GPT's length is --seq-length; drop it",
    "--mask-prob": "a T5 span-corruption flag (scripts/pretrain_t5.py reads it): GPT data is not masked; drop it",
    "--short-seq-prob": ("a T5 span-corruption flag (scripts/pretrain_t5.py reads it): GPT samples are whole "
                         "documents; drop it"),
    "--vocab-extra-ids": ("a T5 span-corruption flag (scripts/pretrain_t5.py reads it): GPT data has no sentinel "
                          "tokens; drop it"),
    "--mid-level-dataset-surplus": ("GPT blends draw exact per-dataset counts (no surplus) and T5 span-corruption "
                                    "blends take megatron-core's default surplus (0.005); drop it"),
    "--fp16-lm-cross-entropy": "the loss is computed in fp32, as megatron-core does by default; drop it",
    "--skip-train": "training always runs (evaluation follows it); drop it",
    "--virtual-pipeline-model-parallel-size": ("not a Megatron-LM flag (Megatron derives the virtual pipeline size); "
                                               "give --num-virtual-stages-per-pipeline-rank or "
                                               "--num-layers-per-virtual-pipeline-stage"),
    # Megatron-LM's flag before its overlap became the default (and this build's own spelling
    # of it in one release): both now ask for what is already done.
    "--overlap-p2p-communication": ("the interleaved schedule overlaps its transfers by default, as in Megatron-LM; "
                                    "drop it (--no-overlap-p2p-communication turns it off)"),
    "--overlap-p2p-comm": ("not a Megatron-LM flag (this build's own spelling until 2026-12-02): the interleaved "
                           "schedule overlaps its transfers by default, as in Megatron-LM; drop it "
                           "(--no-overlap-p2p-communication turns it off)"),
    "--microbatch-group-size-per-virtual-pipeline-stage": ("the interleaved schedule groups "
                                                           "--pipeline-model-parallel-size micro-batches per chunk "
                                                           "(Megatron's default); drop it"),
    "--num-experts": "mixture-of-experts models are not built; drop it",
    "--overlap-param-gather": ("the distributed optimizer gathers its parameters within the optimizer step "
                               "(--overlap-grad-reduce overlaps the gradient reduction); drop it"),
    "--overlap-param-gather-with-optimizer-step": "see --overlap-param-gather; drop it",
    "--ddp-average-in-collective": ("the loss is per token of the global batch (--calculate-per-token-loss), so "
                                    "replicas' gradients are summed, not averaged (megatron-core refuses averaging "
                                    "in the collective then); drop it"),
    "--rampup-batch-size": "the global batch is fixed (or set by --dynapipe-tokens-per-global-batch)",
    "--dataloader-type": "global batches come from this project's sampler; drop it",
    "--sgd-momentum": "only --optimizer adam is built (SGD is refused); drop it",
    "--distribute-saved-activations": "full recompute keeps each layer's input whole on every TP rank; drop it",
    "--tp-comm-overlap": "tensor-parallel communication is not overlapped with GEMMs (Transformer Engine's "
                         "userbuffers); drop it",
    "--cp-comm-type": "context parallelism is not supported (--context-parallel-size 1); drop it",
    "--num-distributed-optimizer-instances": "one distributed-optimizer instance is built; drop it",
    "--ddp-reduce-scatter-with-fp32-accumulation": "gradients reduce as --accumulate-allreduce-grads-in-fp32 / "
                                                   "--grad-reduce-in-bf16 say; drop it",
    "--exit-signal-handler-for-dataloader": "no data-loader workers are started; drop it",
    "--log-throughput-to-tensorboard": "--log-throughput with --tensorboard-dir already writes TFLOP/s to "
                                       "TensorBoard; drop it",
    "--start-eval-at-iter": "evaluation runs every --eval-interval iterations from the start; drop it",
    "--eod-mask-loss": ("every sample here is one document (or a piece of one) and takes no loss past its "
                        "end-of-document token, which is what the flag keeps Megatron-LM's windows of "
                        "concatenated documents from training on; an end-of-document id inside a document "
                        "is not masked. Drop it"),
    "--fp8-format": "fp8 training is not supported; use --bf16",
    "--fp8-recipe": "fp8 training is not supported; use --bf16",
    "--fp8-amax-history-len": "fp8 training is not supported; use --bf16",
    "--fp8-amax-compute-algo": "fp8 training is not supported; use --bf16",
    "--fp8-param-gather": "fp8 training is not supported; use --bf16",
    "--profile": ("Nsight/PyTorch profiling hooks are not built; use --dynapipe-trace-dir for per-op traces of "
                  "DynaPipe's executor, or run the job under nsys"),
    "--profile-step-start": "profiling hooks are not built (see --profile); drop it",
    "--profile-step-end": "profiling hooks are not built (see --profile); drop it",
    "--use-pytorch-profiler": "profiling hooks are not built (see --profile); drop it",
    "--profile-ranks": "profiling hooks are not built (see --profile); drop it",
    "--log-progress": ("progress.txt is not written; the training summary line at the end has the tokens and "
                       "time (and --log-throughput the FLOP/s)"),
    "--log-memory-to-tensorboard": ("CUDA allocator statistics are not written to TensorBoard; on GPUs the log has "
                                    "Megatron-LM's memory report after the first interval, and the log line each "
                                    "stage's activation peak (MiB) against its plan's"),
    "--log-straggler": "straggler detection is not built; drop it",
    "--log-energy": "energy monitoring is not built; drop it",
    "--record-memory-history": "CUDA memory snapshots are not built; run under torch.cuda.memory._record_memory_history",
    "--use-torch-fsdp2": "parameters are held whole per stage with megatron-core's DDP (or its distributed optimizer)",
    "--use-legacy-models": "the stages are megatron-core's models; drop it",
    "--spec": ("the layer spec is megatron-core's own: GPT's (Transformer Engine's on GPUs, the local one on CPU), "
              "T5's local encoder and decoder specs"),
    "--step-batch-size-schedule": "the global batch is fixed (or set by --dynapipe-tokens-per-global-batch)",
    "--tiktoken-pattern": ("read by --tokenizer-type TikTokenizer only (Megatron-LM ignores it with any other "
                           "tokenizer), which is not a --tokenizer-type here; drop it (for a tiktoken vocabulary "
                           "use HuggingFaceTokenizer)"),
    "--use-megatron-fsdp": _FSDP,
    "--data-parallel-sharding-strategy": _FSDP,
    "--init-model-with-meta-device": _FSDP,
    "--use-nccl-ub": _FSDP,
    "--no-save-optim": "checkpoints always hold the optimizer state; drop it (load with --no-load-optim or "
                       "--finetune to leave it out)",
    "--no-save-rng": "checkpoints always hold the RNG states; drop it (load with --no-load-rng to leave them out)",
    "--async-save": "checkpoints are saved synchronously; drop it",
    "--use-persistent-ckpt-worker": "checkpoints are saved synchronously (no --async-save), so no worker; drop it",
    "--ckpt-assume-constant-structure": "the torch_dist save plan is built at every save; drop it",
    "--use-checkpoint-args": "the model is built from the command line, and a checkpoint of another shape is "
                             "refused; give the model arguments it was saved with",
    "--ckpt-step": "--load resumes from the iteration in latest_checkpointed_iteration.txt; drop it",
    "--pretrained-checkpoint": "give the checkpoint with --load (and --finetune to start from its weights)",
    # Layer variants and optimizer precisions megatron-core offers that the stages here do not build.
    "--openai-gelu": "the MLP is megatron-core's GeLU (a GPT's may be SwiGLU, --swiglu); drop it",
    "--squared-relu": "the MLP is megatron-core's GeLU (a GPT's may be SwiGLU, --swiglu); drop it",
    "--quick-geglu": "the MLP is megatron-core's GeLU (a GPT's may be SwiGLU, --swiglu); drop it",
    "--window-size": "sliding-window attention is not built; drop it",
    "--init-method-xavier-uniform": "weights are initialised from a normal distribution of --init-method-std "
                                    "(Megatron-LM's default); drop it",
    "--use-precision-aware-optimizer": "the optimizer keeps fp32 main parameters, gradients and Adam moments "
                                       "(megatron-core's default); drop it",
    "--main-params-dtype": "the optimizer keeps fp32 main parameters (megatron-core's default); drop it",
    "--main-grads-dtype": "the optimizer keeps fp32 main gradients (megatron-core's default); drop it",
    "--exp-avg-dtype": "the optimizer keeps fp32 Adam moments (megatron-core's default); drop it",
    "--exp-avg-sq-dtype": "the optimizer keeps fp32 Adam moments (megatron-core's default); drop it",
    "--num-dataset-builder-threads": "datasets are built with one thread a rank (Megatron-LM's default); drop it",
    "--yaml-cfg": "Megatron-LM's YAML config is not read; give the flags (the pretrain scripts also take this "
                  "project's run configs, --run-config)",
    "--sft": "Megatron-LM's SFT dataset is not built; give instruction data as JSONL records of \"input\" and "
             "\"target\" with --data-path",
    # Megatron-LM's deprecated spellings, which its argument check turns into errors.
    "--model-parallel-size": "Megatron-LM's deprecated name; use --tensor-model-parallel-size",
    # Checkpoint flags of Megatron-LM's that launch scripts pass.
    "--dist-ckpt-format": "deprecated in Megatron-LM, where it has no effect; choose the format with --ckpt-format",
    "--local-rank": ("torchrun sets LOCAL_RANK in every rank's environment, which is what this build reads; launch "
                     "with torchrun (torch.distributed.launch is deprecated)"),
    "--eval-micro-batch-size": ("evaluation runs at --micro-batch-size (DynaPipe plans its own evaluation "
                                "micro-batches); drop it"),
    "--exit-signal-handler-for-training": ("use --exit-signal-handler, which ends the run at the next iteration "
                                           "with a checkpoint on SIGTERM (or --exit-signal)"),
    "--warmup": "Megatron-LM's deprecated spelling of --lr-warmup-fraction; use that",
    "--multi-latent-attention": ("multi-latent attention is not built (GPT and T5 stages use megatron-core's "
                                 "standard attention); drop it"),
    # Declared by Megatron-LM only where NVIDIA's kitchen package is installed.
    "--kitchen-config-file": "NVIDIA's kitchen quantization recipes are not built; drop it",
    "--kitchen-recipe-number": "NVIDIA's kitchen quantization recipes are not built; drop it",
    "--checkpoint-activations": "Megatron-LM's deprecated name; use --recompute-activations",
    "--batch-size": "Megatron-LM's deprecated name; use --micro-batch-size",
}

# Families of Megatron-LM flags refused as a whole, by prefix (Megatron-LM adds members
# release by release: --fp8-margin, --fp8-interval, --wandb-entity, ...).
UNSUPPORTED_MEGATRON_PREFIXES = {
    "--fp8-": "fp8 training is not supported; use --bf16",
    "--no-fp8-": "fp8 training is not supported; use --bf16",
    "--wandb-": "use --tensorboard-dir for metrics",
    "--moe-": "mixture-of-experts models are not built (see --num-experts); drop it",
    "--fsdp-": _FSDP,
}


# Refused names that look like Megatron-LM's but are not its flags (its arguments derive them).
NOT_MEGATRON_LM_FLAGS = frozenset({"--virtual-pipeline-model-parallel-size", "--overlap-p2p-comm"})


def unsupported_reason(flag: str):
    """Why this build does not take the Megatron-LM flag ``flag`` (``--name``), or None if
    it is not one it refuses: its own reason, its family's, or its Megatron-LM group's
    (:mod:`megatron_integration.megatron_lm_flags`)."""
    from megatron_integration.megatron_lm_flags import megatron_lm_reason

    if flag in UNSUPPORTED_MEGATRON_FLAGS:
        return UNSUPPORTED_MEGATRON_FLAGS[flag]
    family = next((why for prefix, why in UNSUPPORTED_MEGATRON_PREFIXES.items() if flag.startswith(prefix)), None)
    return family if family is not None else megatron_lm_reason(flag)


def refused_flag_lines(extras) -> list[str]:
    """One line for every Megatron-LM flag among ``extras`` (what the parser did not take) that
    this build refuses, with its reason: all of them at once, so a launch script brought over
    from Megatron-LM is mended in one pass, not one launch per flag."""
    lines = []
    for item in extras:
        flag = item.split("=", 1)[0]
        why = unsupported_reason(flag) if flag.startswith("--") else None
        if why is not None:
            # A name Megatron-LM never had is not called one of its flags.
            lines.append(f"{flag}: {why}" if flag in NOT_MEGATRON_LM_FLAGS else str(_unsupported(flag, why)))
    return lines


def refused_value_lines(args: argparse.Namespace) -> list[str]:
    """The first refusal of each flag-only check (checkpoint flags, the rerun state machine) on
    ``args``, one line each: printed with :func:`refused_flag_lines`' lines when there are any,
    so a launch script is mended in one pass (validation raises the same refusals otherwise)."""
    lines = []
    for check in (_checkpoint_args_honoured, _resilience_args_honoured):
        try:
            check(args)
        except DynaPipeError as e:
            lines.append(" ".join(str(e).split()))
    return lines


def _model_flags_honoured(args: argparse.Namespace, cuda: bool) -> None:
    """Refuse the Megatron model flags whose non-default values the stage builder cannot honour yet
    (the default of each, which is what is built, is accepted), and those this device cannot run:
    all of them together (:class:`~dynapipe.errors.RefusedArguments`), so a launch script brought
    over from Megatron-LM is mended in one pass."""
    refused = []
    if args.rotary_percent != 1.0:
        refused.append(_unsupported_value("--rotary-percent", args.rotary_percent,
                                          "rotary embeddings cover the whole head (1.0, the default); drop it"))
    if args.apply_layernorm_1p:
        refused.append(_unsupported("--apply-layernorm-1p", "zero-centred norm weights are not built (the "
                                    "deterministic initialisation sets norm weights to one); drop it"))
    if args.cross_entropy_loss_fusion and not cuda:
        refused.append(_unsupported("--cross-entropy-loss-fusion", "megatron-core's fused cross-entropy is a GPU "
                                    "kernel; drop it on CPU"))
    if args.transformer_impl == "inference_optimized":
        refused.append(_unsupported_value("--transformer-impl", args.transformer_impl,
                                          "megatron-core's inference-only layers do not train; use "
                                          "transformer_engine or local"))
    local_layers = args.transformer_impl == "local" or not cuda
    # local: megatron-core's own DotProductAttention, which local layers are built with; it is an
    # unfused one too (megatron-core's unfused backend only steers Transformer Engine's choice).
    if args.attention_backend != "auto" and not (args.attention_backend in ("local", "unfused") and local_layers):
        refused.append(_unsupported_value("--attention-backend", args.attention_backend,
                                          "megatron-core chooses the backend (auto), or local / unfused with local "
                                          "layers (--transformer-impl local, or on CPU); drop it"))
    if args.transformer_impl == "transformer_engine" and cuda:
        refused.extend(_transformer_engine_refusals(args))
    if args.use_distributed_optimizer and not cuda:
        refused.append(DynaPipeError("--use-distributed-optimizer needs GPUs (megatron-core's distributed optimizer "
                                     "wraps CUDA parameters only); on CPU drop it."))
    raise_refused(refused)


def _transformer_engine_refusals(args: argparse.Namespace) -> list[DynaPipeError]:
    """What ``--transformer-impl transformer_engine`` on GPUs cannot honour here."""
    from megatron_integration.model import te_available

    refused = []
    if not te_available():
        refused.append(DynaPipeError(
            "--transformer-impl transformer_engine (Megatron-LM's default) builds the GPU stages from Transformer "
            "Engine's layers, and megatron-core cannot load it here (not installed, or built for another torch); "
            "install a matching one (NVIDIA's PyTorch container ships one) or pass --transformer-impl local."))
    if args.reset_attention_mask:
        # megatron-core's Transformer Engine spec builds causal attention, which ignores an
        # explicit mask: packed samples would attend to each other without a word.
        refused.append(DynaPipeError(
            "--reset-attention-mask with --transformer-impl transformer_engine (Megatron-LM's default): Transformer "
            "Engine's causal attention ignores the per-sample mask of packed rows (it needs THD packed-sequence "
            "parameters, not built for training here); pass --transformer-impl local."))
    if getattr(args, "dynapipe_padded_attention", "mask") == "per-sample":
        # The per-sample kernel is the local attention's (segment tables); a Transformer
        # Engine layer would read the table as a mask, or ignore it.
        refused.append(DynaPipeError(
            "--dynapipe-padded-attention per-sample with --transformer-impl transformer_engine (Megatron-LM's "
            "default): the per-sample kernel is built for megatron-core's local attention (Transformer Engine's THD "
            "packed-sequence path is not built for training here); pass --transformer-impl local, or drop the flag "
            "(Transformer Engine's fused attention then computes the padded rows)."))
    return refused


def _resilience_args_honoured(args: argparse.Namespace) -> None:
    """Megatron-LM's rerun state machine: ``--rerun-mode`` and its error injection
    (:mod:`megatron_integration.rerun`); an injection no mode diagnoses is refused."""
    rerun_settings_from_args(args)


@megatron_spelled
def rerun_settings_from_args(args: argparse.Namespace) -> RerunSettings:
    """The run's :class:`RerunSettings` (Megatron-LM's defaults for what ``args`` lacks). Refused:
    an error injection with the NaN check off (it injects into that check's validation), and the
    spike checks under ``report_stats`` (which computes every iteration twice and rejects nothing)."""
    settings = _rerun_settings(args)
    check_off = (getattr(args, "check_for_nan_in_loss_and_grad", None) is False
                 or (getattr(args, "fp16", False) and getattr(args, "loss_scale", None) is None))
    if settings.error_injection_rate and check_off:
        raise DynaPipeError(f"--error-injection-rate {settings.error_injection_rate}: errors are injected into the "
                            f"NaN/Inf check of the loss and gradient norm, which is off here "
                            f"(--no-check-for-nan-in-loss-and-grad, or --fp16 without a static --loss-scale); turn "
                            f"the check on or drop the flag.")
    spikes = [f for f, on in (("--check-for-spiky-loss", settings.check_for_spiky_loss),
                              ("--check-for-large-grads", settings.check_for_large_grads)) if on]
    if spikes and settings.rerun_mode == "report_stats":
        raise DynaPipeError(f"{spikes[0]} with --rerun-mode report_stats: report_stats computes every iteration "
                            f"twice to measure its non-determinism and rejects nothing; use --rerun-mode "
                            f"validate_results (computed again, training goes on) or disabled (warned about), or "
                            f"drop {' and '.join(spikes)}.")
    return settings


def _rerun_settings(args: argparse.Namespace) -> RerunSettings:
    return RerunSettings(rerun_mode=getattr(args, "rerun_mode", None) or "validate_results",
                         error_injection_rate=getattr(args, "error_injection_rate", 0),
                         error_injection_type=getattr(args, "error_injection_type", None) or "transient_error",
                         check_for_spiky_loss=bool(getattr(args, "check_for_spiky_loss", False)),
                         check_for_large_grads=bool(getattr(args, "check_for_large_grads", False)),
                         result_rejected_tracker_filename=getattr(args, "result_rejected_tracker_filename", None))


def _checkpoint_args_honoured(args: argparse.Namespace) -> None:
    """Refuse the checkpoint flags this build cannot honour."""
    if args.override_opt_param_scheduler and args.use_checkpoint_opt_param_scheduler:
        raise DynaPipeError("--override-opt_param-scheduler and --use-checkpoint-opt_param-scheduler contradict "
                            "each other (this run's schedule vs the checkpoint's); give one of them.")
    if args.ckpt_format == "torch":
        raise _unsupported_value("--ckpt-format", "torch", "Megatron's legacy per-rank files are not written; use "
                                                          "torch_dist (the default, which Megatron-LM loads) or "
                                                          "dynapipe")
    if args.ckpt_format in ("torch_dcp", "fsdp_dtensor"):
        raise _unsupported_value("--ckpt-format", args.ckpt_format,
                                 "torch.distributed.checkpoint's own layout and Megatron-FSDP's are not written; "
                                 "use torch_dist (the default, which Megatron-LM loads) or dynapipe")
    if not args.load:
        # Each acts on a loaded checkpoint only; without one it would be a no-op the command line claims.
        for flag, given in (("--no-load-optim", args.no_load_optim), ("--no-load-rng", args.no_load_rng),
                            ("--override-opt_param-scheduler", args.override_opt_param_scheduler),
                            ("--use-checkpoint-opt_param-scheduler", args.use_checkpoint_opt_param_scheduler),
                            ("--exit-on-missing-checkpoint", args.exit_on_missing_checkpoint)):
            if given:
                raise DynaPipeError(f"{flag} applies to a checkpoint loaded with --load DIR, and none is given; "
                                    f"add --load or drop {flag}.")
    if args.finetune and not args.load:
        raise DynaPipeError("--finetune needs --load DIR (the checkpoint whose weights to start from).")
    # --finetune and --no-load-optim load no optimizer state, so no schedule either.
    for flag, given in (("--override-opt_param-scheduler", args.override_opt_param_scheduler),
                        ("--use-checkpoint-opt_param-scheduler", args.use_checkpoint_opt_param_scheduler)):
        skipped = "--finetune" if args.finetune else "--no-load-optim" if args.no_load_optim else None
        if given and skipped:
            raise DynaPipeError(f"{flag} picks between this run's and the checkpoint's learning-rate schedule, but "
                                f"{skipped} loads no schedule (this run's is used); drop {flag}.")
