"""Command-line arguments in Megatron's style, and the training config built from them.

``add_megatron_args`` declares the standard Megatron-LM arguments this project reads
(same names, same meaning, same defaults where Megatron has one), so an existing
Megatron command line carries over; ``add_dynapipe_args`` adds DynaPipe's own group.
``build_parser`` gives a parser usable on its own (the project does not depend on
Megatron-LM's training scripts). ``training_config_from_args`` turns parsed arguments
into a :class:`DynaPipeTrainingConfig` and rejects invalid combinations with a
:class:`~dynapipe.errors.DynaPipeError` that names the flag and the fix.

No torch or megatron import here: the config is plain data.
"""
from __future__ import annotations

import argparse
import os
import sys
from typing import Optional, Sequence

from dynapipe.errors import DynaPipeError
from megatron_integration.model_flags import add_loss_scale_args, loss_scale_from_args, model_shape_from_args
from megatron_integration.run_config import RunConfig, load_run_config  # noqa: F401  (re-exported)
from megatron_integration.tensor_parallel import check_tensor_parallel_args
from megatron_integration.tokenizer import add_tokenizer_args, tokenizer_info
from megatron_integration.train_config import (DataArgs, DynaPipeArgs, DynaPipeTrainingConfig,  # noqa: F401
                                               GPTModelArgs, OptimizerArgs, ParallelArgs, RecomputeArgs)

BATCHINGS = ("dynapipe", "padding", "padding-mb", "packing", "token-budget")
# Batchings megatron-core's own 1F1B runs (without --use-dynapipe); padding-mb with variable_seq_lengths.
MEGATRON_BATCHINGS = ("padding", "padding-mb", "packing")
SCHEDULES = ("auto", "adaptive", "1f1b")
RECOMPUTE_CHOICES = ("auto", "none", "selective", "full")
KV_BACKENDS = ("store", "redis")
POSITION_EMBEDDINGS = ("learned_absolute", "rope")
LR_DECAY_STYLES = ("constant", "linear", "cosine")
ATTENTION_BACKENDS = ("auto", "flash", "fused", "unfused", "local")


def add_megatron_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Declare the Megatron-LM arguments the project reads (names and defaults as Megatron's)."""
    g = parser.add_argument_group("network size")
    g.add_argument("--num-layers", type=int, default=None, help="number of transformer layers")
    g.add_argument("--hidden-size", type=int, default=None, help="transformer hidden size")
    g.add_argument("--num-attention-heads", type=int, default=None, help="number of attention heads")
    g.add_argument("--ffn-hidden-size", type=int, default=None, help="MLP width (default 4 x hidden size)")
    g.add_argument("--kv-channels", type=int, default=None, help="per-head width (default hidden / heads)")
    g.add_argument("--max-position-embeddings", type=int, default=None,
                   help="maximum sequence length the position embedding supports (default: --seq-length)")
    g.add_argument("--position-embedding-type", default="learned_absolute", choices=POSITION_EMBEDDINGS)
    g.add_argument("--vocab-size", type=int, default=None,
                   help="vocabulary size before padding (default: the byte-level tokenizer's)")
    g.add_argument("--make-vocab-size-divisible-by", type=int, default=128,
                   help="pad the vocabulary to a multiple of this x --tensor-model-parallel-size (Megatron's rule)")
    g.add_argument("--swiglu", action="store_true", help="SwiGLU MLP instead of GeLU")
    g.add_argument("--disable-bias-linear", action="store_true", help="no biases in the linear layers")
    g.add_argument("--group-query-attention", action="store_true", help="grouped-query attention")
    g.add_argument("--num-query-groups", type=int, default=1, help="key/value groups with --group-query-attention")
    g.add_argument("--rotary-base", type=int, default=10000, help="RoPE base period")
    g.add_argument("--use-flash-attn", action="store_true", help="flash attention (GPU)")
    g.add_argument("--attention-backend", default="auto", choices=ATTENTION_BACKENDS,
                   help="attention implementation (auto: megatron-core chooses)")
    g.add_argument("--transformer-impl", default="transformer_engine", choices=("local", "transformer_engine"),
                   help="layer implementation; Transformer Engine's spec where it is installed, else local")
    g.add_argument("--untie-embeddings-and-output-weights", action="store_true",
                   help="separate output layer instead of the tied input embedding")
    g.add_argument("--normalization", default="LayerNorm", choices=("LayerNorm", "RMSNorm"))
    g.add_argument("--hidden-dropout", type=float, default=0.1)
    g.add_argument("--attention-dropout", type=float, default=0.1)
    g.add_argument("--init-method-std", type=float, default=0.02)

    g = parser.add_argument_group("training")
    g.add_argument("--seq-length", type=int, default=None, help="maximum sequence length in tokens")
    g.add_argument("--micro-batch-size", type=int, default=None,
                   help="samples (or packed rows) per micro-batch of the fixed-shape baselines")
    g.add_argument("--global-batch-size", type=int, default=None, help="samples per iteration over all replicas")
    g.add_argument("--train-iters", type=int, default=None, help="iterations to train")
    g.add_argument("--train-samples", type=int, default=None,
                   help="samples to train (instead of --train-iters): iterations = samples / --global-batch-size")
    g.add_argument("--exit-interval", type=int, default=None,
                   help="stop (after saving, with --save) at the first iteration divisible by this")
    g.add_argument("--seed", type=int, default=1234, help="random seed (initialisation, data, dropout)")
    g.add_argument("--bf16", action="store_true", help="bfloat16 parameters and activations (GPU)")
    g.add_argument("--fp16", action="store_true", help="float16 parameters and activations (GPU)")
    g.add_argument("--reset-position-ids", action="store_true",
                   help="packing: restart position ids at every sample of a packed row")
    g.add_argument("--reset-attention-mask", action="store_true",
                   help="packing: samples of a packed row do not attend to each other")
    g.add_argument("--check-for-nan-in-loss-and-grad", action=argparse.BooleanOptionalAction, default=True,
                   help="stop the job when the loss or the gradient norm is NaN or infinite, before the optimizer "
                        "step (default on; --no-check-for-nan-in-loss-and-grad disables)")
    g.add_argument("--recompute-granularity", default=None, choices=("full", "selective"),
                   help="activation recomputation: selective (core attention) or full (whole layers)")
    g.add_argument("--recompute-method", default=None, choices=("uniform", "block"),
                   help="full recompute: uniform (chunks of --recompute-num-layers layers) or block "
                        "(the first --recompute-num-layers layers of each stage)")
    g.add_argument("--recompute-num-layers", type=int, default=None,
                   help="full recompute: layers per chunk (uniform) or layers recomputed per stage (block)")

    g = parser.add_argument_group("learning rate and optimizer")
    g.add_argument("--lr", type=float, default=None, help="peak learning rate")
    g.add_argument("--min-lr", type=float, default=0.0)
    g.add_argument("--lr-decay-style", default="linear", choices=LR_DECAY_STYLES)
    g.add_argument("--lr-warmup-iters", type=int, default=0)
    g.add_argument("--lr-warmup-fraction", type=float, default=None,
                   help="warm-up as a fraction of the decay iterations (instead of --lr-warmup-iters)")
    g.add_argument("--optimizer", default="adam", choices=("adam", "sgd"))
    g.add_argument("--loss-scale", type=float, default=None, help="fp16: static loss scale (default: dynamic)")
    g.add_argument("--initial-loss-scale", type=float, default=2.0 ** 32, help="fp16: initial dynamic loss scale")
    add_loss_scale_args(g)
    g.add_argument("--lr-decay-iters", type=int, default=None, help="default: --train-iters")
    g.add_argument("--weight-decay", type=float, default=0.01)
    g.add_argument("--adam-beta1", type=float, default=0.9)
    g.add_argument("--adam-beta2", type=float, default=0.999)
    g.add_argument("--adam-eps", type=float, default=1e-8)
    g.add_argument("--clip-grad", type=float, default=1.0, help="gradient norm clip (0 disables)")
    g.add_argument("--use-distributed-optimizer", action="store_true",
                   help="shard optimizer state over data-parallel ranks (megatron-core's distributed optimizer)")

    g = parser.add_argument_group("distributed")
    g.add_argument("--tensor-model-parallel-size", type=int, default=1)
    g.add_argument("--sequence-parallel", action="store_true",
                   help="split norms, dropout and the activations between stages along the sequence over the "
                        "tensor-parallel ranks (needs --tensor-model-parallel-size 2 or more)")
    g.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    g.add_argument("--distributed-backend", default=None, choices=("nccl", "gloo"),
                   help="default: nccl with CUDA, gloo without")
    g.add_argument("--distributed-timeout-minutes", type=float, default=10.0)

    g = parser.add_argument_group("data")
    g.add_argument("--data-path", nargs="*", default=None,
                   help="JSONL files or Megatron indexed-dataset prefixes (optionally weighted: W1 P1 W2 P2)")
    g.add_argument("--mock-data", action="store_true", help="train on the synthetic multi-task mixture")
    g.add_argument("--tokenizer-type", default="ByteLevel", help="ByteLevel (default), NullTokenizer, GPT2BPETokenizer or HuggingFaceTokenizer: the vocabulary size "
                        "and end of document; JSONL text is tokenised byte-level")
    g.add_argument("--tokenizer-model", default=None, help="tokenizer model file or name, when the type needs one")
    add_tokenizer_args(g)
    g.add_argument("--num-workers", type=int, default=2,
                   help="data-loader workers (accepted; samples are read in-process from memory-mapped files)")

    g = parser.add_argument_group("checkpointing")
    g.add_argument("--save", default=None, help="directory to save checkpoints to")
    g.add_argument("--load", default=None, help="directory to resume from (its latest checkpoint)")
    g.add_argument("--save-interval", type=int, default=None, help="iterations between checkpoints")
    g.add_argument("--no-load-optim", action="store_true", help="do not restore the optimizer state")
    g.add_argument("--no-load-rng", action="store_true", help="do not restore the RNG states")
    g.add_argument("--ckpt-format", default="torch_dist", choices=("torch_dist", "torch", "dynapipe"),
                   help="torch_dist: megatron-core's distributed checkpoint, as Megatron-LM writes it (default); "
                        "dynapipe: this project's per-rank files (torch: Megatron's legacy format, not written)")
    g.add_argument("--override-opt_param-scheduler", action="store_true",
                   help="on --load, take the learning-rate schedule from this run's arguments, not the checkpoint's")
    g.add_argument("--use-checkpoint-opt_param-scheduler", action="store_true",
                   help="on --load, keep the checkpoint's learning-rate schedule whatever this run's arguments say "
                        "(without either flag a schedule that differs from the checkpoint's is refused)")
    g.add_argument("--finetune", action="store_true",
                   help="load the model weights only (no optimizer, scheduler or RNG) and start at iteration 0")
    g.add_argument("--auto-detect-ckpt-format", action="store_true",
                   help="accepted: --load always reads the format the checkpoint is in")
    g.add_argument("--use-dist-ckpt", action="store_true", help="deprecated in Megatron-LM (see --ckpt-format); no effect")

    g = parser.add_argument_group("logging")
    g.add_argument("--log-interval", type=int, default=100, help="iterations between log lines")
    g.add_argument("--tensorboard-dir", default=None, help="write TensorBoard scalars here")
    from megatron_integration.data_args import add_eval_args, add_split_args

    add_split_args(parser)
    add_eval_args(parser)
    return parser


def add_dynapipe_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Declare DynaPipe's arguments (Megatron style: one group, ``--dynapipe-*`` names)."""
    g = parser.add_argument_group("dynapipe")
    g.add_argument("--use-dynapipe", action="store_true",
                   help="plan variable-shape micro-batches and run them through the DynaPipe executor; "
                        "without it, megatron-core's fixed-shape 1F1B runs padding or packing")
    g.add_argument("--dynapipe-batching", default=None, choices=BATCHINGS,
                   help="micro-batching method (default: dynapipe with --use-dynapipe, padding without)")
    g.add_argument("--dynapipe-schedule", default="auto", choices=SCHEDULES,
                   help="pipeline schedule (auto: the fastest candidate that fits in memory)")
    g.add_argument("--dynapipe-memory-limit-mb", type=float, default=None,
                   help="device memory the plans may use, MiB (default: the device config's)")
    g.add_argument("--dynapipe-cost-model", default="analytic",
                   help="'analytic', or the path of a profile written by `python -m dynapipe profile`")
    g.add_argument("--dynapipe-device", default=None,
                   help="device config for the analytic cost model (default: cpu without CUDA, else h100-80gb)")
    g.add_argument("--dynapipe-cluster", default=None, help="cluster config for link costs (default cpu-local / h100-8x)")
    g.add_argument("--dynapipe-planner-workers", type=int, default=1, help="planner worker processes per node")
    g.add_argument("--dynapipe-prefetch", type=int, default=4, help="iterations planned ahead")
    g.add_argument("--dynapipe-kv-backend", default="store", choices=KV_BACKENDS,
                   help="plan delivery: the job's torch.distributed store, or Redis")
    g.add_argument("--dynapipe-redis-host", default="127.0.0.1")
    g.add_argument("--dynapipe-redis-port", type=int, default=6379)
    g.add_argument("--dynapipe-store-retry-s", type=float, default=30.0,
                   help="seconds a lost Redis connection is retried with backoff before the job stops; what a "
                        "restarted server lost is planned again (default 30)")
    g.add_argument("--dynapipe-max-tokens", type=int, default=None,
                   help="token-budget batching: padded tokens per micro-batch")
    g.add_argument("--dynapipe-tokens-per-global-batch", type=int, default=None,
                   help="form global batches by real-token budget instead of --global-batch-size samples")
    g.add_argument("--dynapipe-overlong", default="truncate", choices=("truncate", "reject"),
                   help="samples longer than --seq-length: truncate (counted, logged) or reject")
    g.add_argument("--dynapipe-mixture", default=None,
                   help="mixture YAML for --mock-data (default configs/data/flan-mixture.yaml)")
    g.add_argument("--dynapipe-mock-samples", type=int, default=65536,
                   help="samples in the --mock-data dataset (reshuffled every epoch; default 65536)")
    g.add_argument("--dynapipe-timeout-s", type=float, default=300.0,
                   help="seconds a rank waits for a peer or a plan before failing")
    g.add_argument("--dynapipe-trace-dir", default=None, help="write per-rank Chrome traces of what ran")
    g.add_argument("--dynapipe-recompute", default="auto", choices=RECOMPUTE_CHOICES,
                   help="recompute level the planner uses on every stage (auto: the schedule search chooses "
                        "per stage, lightest first)")
    return parser


def build_parser(prog: Optional[str] = None, description: Optional[str] = None) -> argparse.ArgumentParser:
    """A standalone parser with the Megatron and DynaPipe arguments (one-line errors; a
    Megatron-LM flag this build does not take is named with the reason)."""
    from dynapipe.argparsing import StrictArgumentParser

    class MegatronArgumentParser(StrictArgumentParser):
        def parse_known_args(self, args=None, namespace=None):
            parsed, extras = super().parse_known_args(args, namespace)
            for item in extras:
                flag = item.split("=", 1)[0]
                if flag in UNSUPPORTED_MEGATRON_FLAGS:
                    # torchrun runs this on every rank; one copy of the line is enough.
                    if os.environ.get("RANK", "0") == "0":
                        print("error: " + str(_unsupported(flag, UNSUPPORTED_MEGATRON_FLAGS[flag])), file=sys.stderr)
                    self.exit(2)
            return parsed, extras

        def error(self, message):
            if os.environ.get("RANK", "0") != "0":
                self.exit(2)
            super().error(message)

    parser = MegatronArgumentParser(prog=prog, description=description, allow_abbrev=False)
    add_megatron_args(parser)
    add_dynapipe_args(parser)
    return parser


def _need(args, flag: str, value):
    if value is None:
        raise DynaPipeError(f"--{flag} is required.")
    return value


def _positive(flag: str, value, allow_zero: bool = False):
    if value is None:
        return value
    if value < 0 or (value == 0 and not allow_zero):
        raise DynaPipeError(f"--{flag} {value}: must be {'non-negative' if allow_zero else 'positive'}.")
    return value


# The byte-level tokenizer's ids (256 bytes and its specials), before padding.
BYTE_LEVEL_VOCAB = 384


def padded_vocab_size(vocab_size: int, divisible_by: int, tensor_parallel: int) -> int:
    """Megatron-LM's vocabulary padding: round ``vocab_size`` (ids) up to a multiple of
    ``divisible_by x tensor_parallel`` so every tensor-parallel shard of the embedding is equal
    and aligned (50257 -> 50304 with the defaults)."""
    multiple = divisible_by * tensor_parallel
    return -(-vocab_size // multiple) * multiple


def _unsupported(flag: str, reason: str) -> DynaPipeError:
    return DynaPipeError(f"{flag} is a Megatron-LM flag that dynapipe-megatron does not support: {reason}")


# Megatron-LM flags this build does not take, and why (or what to use instead). Anything
# not listed here and not declared above is not a Megatron-LM flag and gets argparse's error.
UNSUPPORTED_MEGATRON_FLAGS = {
    "--wandb-project": "use --tensorboard-dir for metrics",
    "--wandb-exp-name": "use --tensorboard-dir for metrics",
    "--wandb-save-dir": "use --tensorboard-dir for metrics",
    "--eval-global-batch-size": "evaluation batches are --global-batch-size samples; drop it",
    "--full-validation": "evaluation reads --eval-iters global batches; drop it",
    "--skip-train": "training always runs (evaluation follows it); drop it",
    "--context-parallel-size": "no context parallelism; split long sequences over fewer tokens per sample",
    "--virtual-pipeline-model-parallel-size": "interleaved pipeline stages are not run; drop it",
    "--num-layers-per-virtual-pipeline-stage": "interleaved pipeline stages are not run; drop it",
    "--num-experts": "mixture-of-experts models are not built; drop it",
    "--expert-model-parallel-size": "mixture-of-experts models are not built; drop it",
    "--overlap-grad-reduce": "gradients are all-reduced once after the last micro-batch of an iteration; drop it",
    "--overlap-param-gather": "parameters are gathered after the optimizer step; drop it",
    "--rampup-batch-size": "the global batch is fixed (or set by --dynapipe-tokens-per-global-batch)",
    "--lr-decay-samples": "give the decay in iterations (--lr-decay-iters)",
    "--lr-warmup-samples": "give the warm-up in iterations (--lr-warmup-iters) or --lr-warmup-fraction",
    "--dataloader-type": "global batches come from this project's sampler; drop it",
    "--eod-mask-loss": "samples are whole documents without separators; drop it",
    "--fp8-format": "fp8 training is not supported; use --bf16",
    "--rotary-percent": "rotary embeddings cover the whole head; drop it",
    "--no-save-optim": "checkpoints always hold the optimizer state; drop it (load with --no-load-optim or "
                       "--finetune to leave it out)",
    "--no-save-rng": "checkpoints always hold the RNG states; drop it (load with --no-load-rng to leave them out)",
    "--async-save": "checkpoints are saved synchronously; drop it",
    "--use-checkpoint-args": "the model is built from the command line, and a checkpoint of another shape is "
                             "refused; give the model arguments it was saved with",
    "--ckpt-step": "--load resumes from the iteration in latest_checkpointed_iteration.txt; drop it",
    "--pretrained-checkpoint": "give the checkpoint with --load (and --finetune to start from its weights)",
}


def _model_flags_honoured(args: argparse.Namespace, cuda: bool) -> None:
    """Refuse the Megatron model flags whose non-default values the stage builder cannot honour yet
    (the default of each, which is what is built, is accepted)."""
    if args.use_flash_attn:
        raise _unsupported("--use-flash-attn", "attention runs through Transformer Engine's spec where installed "
                                               "(it picks flash attention itself) or megatron-core's local one; "
                                               "drop it")
    if args.attention_backend != "auto":
        raise _unsupported("--attention-backend", f"{args.attention_backend}: megatron-core chooses the backend "
                                                  f"(auto); drop it")
    if args.transformer_impl == "local" and cuda:
        raise _unsupported("--transformer-impl", "local: on GPUs the stages use Transformer Engine's spec where "
                                                 "it is installed; drop it")


def model_args_from_args(args: argparse.Namespace, cuda: bool) -> GPTModelArgs:
    """The model part of the arguments, validated (shared by training and profiling)."""
    for flag in ("num-layers", "hidden-size", "num-attention-heads", "seq-length"):
        _need(args, flag, getattr(args, flag.replace("-", "_")))
    for flag in ("num-layers", "hidden-size", "num-attention-heads", "seq-length", "ffn-hidden-size",
                 "kv-channels", "max-position-embeddings", "vocab-size"):
        _positive(flag, getattr(args, flag.replace("-", "_")))
    for flag in ("hidden-dropout", "attention-dropout"):
        value = getattr(args, flag.replace("-", "_"))
        if not 0.0 <= value < 1.0:
            raise DynaPipeError(f"--{flag} {value}: must be in [0, 1).")
    if args.fp16 and args.bf16:
        raise DynaPipeError("--fp16 and --bf16 were both given; choose one (or neither for fp32).")
    dtype = "bf16" if args.bf16 else "fp16" if args.fp16 else "fp32"
    if dtype != "fp32" and not cuda:
        raise DynaPipeError(f"--{dtype} needs a GPU; on CPU drop --{dtype} and train in fp32.")
    if args.hidden_size % args.num_attention_heads:
        raise DynaPipeError(f"--hidden-size {args.hidden_size} is not divisible by "
                            f"--num-attention-heads {args.num_attention_heads}.")
    _model_flags_honoured(args, cuda)
    shape = model_shape_from_args(args)
    _positive("make-vocab-size-divisible-by", args.make_vocab_size_divisible_by)
    unpadded = tokenizer_info(args).vocab_size
    vocab = padded_vocab_size(unpadded, args.make_vocab_size_divisible_by, args.tensor_model_parallel_size)
    max_pos = args.max_position_embeddings or args.seq_length
    if args.position_embedding_type == "learned_absolute" and args.seq_length > max_pos:
        raise DynaPipeError(f"--seq-length {args.seq_length} exceeds --max-position-embeddings {max_pos}; "
                            f"raise --max-position-embeddings to at least {args.seq_length} or shorten --seq-length.")
    return GPTModelArgs(
        num_layers=args.num_layers, hidden_size=args.hidden_size, num_attention_heads=args.num_attention_heads,
        ffn_hidden_size=shape.pop("ffn_hidden_size"),
        kv_channels=args.kv_channels or args.hidden_size // args.num_attention_heads,
        seq_length=args.seq_length, max_position_embeddings=max_pos, vocab_size=vocab,
        unpadded_vocab_size=unpadded,
        position_embedding_type=args.position_embedding_type,
        tie_embeddings=not args.untie_embeddings_and_output_weights, normalization=args.normalization,
        hidden_dropout=args.hidden_dropout, attention_dropout=args.attention_dropout,
        init_method_std=args.init_method_std, dtype=dtype, **shape)


def training_config_from_args(args: argparse.Namespace, world_size: int,
                              cuda: Optional[bool] = None) -> DynaPipeTrainingConfig:
    """Validate parsed arguments for a job of ``world_size`` ranks and build the config.

    ``cuda`` says whether the job runs on GPUs (default: ask torch). Raises
    :class:`DynaPipeError` naming the offending flag for every invalid combination.
    """
    if cuda is None:
        import torch

        cuda = torch.cuda.is_available()
    _schedule_from_samples(args)
    for flag in ("global-batch-size", "train-iters", "lr"):
        _need(args, flag, getattr(args, flag.replace("-", "_")))
    for flag in ("global-batch-size", "train-iters", "micro-batch-size", "tensor-model-parallel-size",
                 "pipeline-model-parallel-size", "log-interval", "save-interval", "dynapipe-planner-workers",
                 "dynapipe-max-tokens", "dynapipe-tokens-per-global-batch", "dynapipe-memory-limit-mb",
                 "dynapipe-timeout-s", "dynapipe-mock-samples"):
        _positive(flag, getattr(args, flag.replace("-", "_")))
    _positive("lr", args.lr, allow_zero=True)
    _positive("dynapipe-prefetch", args.dynapipe_prefetch, allow_zero=True)
    _positive("dynapipe-store-retry-s", args.dynapipe_store_retry_s, allow_zero=True)
    if not 0 < args.dynapipe_redis_port < 65536:
        raise DynaPipeError(f"--dynapipe-redis-port {args.dynapipe_redis_port}: a TCP port is 1 to 65535.")
    model = model_args_from_args(args, cuda)

    tp, pp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size
    if world_size % (tp * pp):
        raise DynaPipeError(f"world size {world_size} is not divisible by --tensor-model-parallel-size {tp} x "
                            f"--pipeline-model-parallel-size {pp}; launch a multiple of {tp * pp} ranks.")
    if args.use_distributed_optimizer and not cuda:
        raise DynaPipeError("--use-distributed-optimizer needs GPUs (megatron-core's distributed optimizer wraps "
                            "CUDA parameters only); on CPU drop it.")
    check_tensor_parallel_args(args, cuda)
    if pp > args.num_layers or args.num_layers % pp:
        raise DynaPipeError(f"--num-layers {args.num_layers} cannot be split evenly over "
                            f"--pipeline-model-parallel-size {pp}; use a divisor of the layer count.")
    backend = args.distributed_backend or ("nccl" if cuda else "gloo")
    if backend == "nccl" and not cuda:
        raise DynaPipeError("--distributed-backend nccl needs GPUs; use gloo on CPU.")
    parallel = ParallelArgs(world_size=world_size, tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                            backend=backend, timeout_minutes=args.distributed_timeout_minutes,
                            sequence_parallel=args.sequence_parallel)
    dp = parallel.data_parallel_size

    batching = args.dynapipe_batching or ("dynapipe" if args.use_dynapipe else "padding")
    if not args.use_dynapipe and batching not in MEGATRON_BATCHINGS:
        raise DynaPipeError(f"--dynapipe-batching {batching} runs through the DynaPipe executor: add --use-dynapipe "
                            f"(without it megatron-core's fixed-shape 1F1B runs {' or '.join(MEGATRON_BATCHINGS)}).")
    mbs = args.micro_batch_size
    gbs = args.global_batch_size
    if not args.use_dynapipe or batching in MEGATRON_BATCHINGS:
        mbs = _need(args, "micro-batch-size", mbs)
        if gbs % (mbs * dp):
            raise DynaPipeError(f"--global-batch-size {gbs} is not divisible by --micro-batch-size {mbs} x "
                                f"data-parallel size {dp}; use a multiple of {mbs * dp}.")
    elif gbs < dp:
        raise DynaPipeError(f"--global-batch-size {gbs} is smaller than the data-parallel size {dp}: "
                            f"every replica needs at least one sample.")
    if batching == "token-budget" and args.dynapipe_max_tokens is None:
        raise DynaPipeError("--dynapipe-batching token-budget needs --dynapipe-max-tokens (padded tokens per micro-batch).")
    if args.dynapipe_max_tokens is not None and args.dynapipe_max_tokens < args.seq_length:
        raise DynaPipeError(f"--dynapipe-max-tokens {args.dynapipe_max_tokens} is below --seq-length "
                            f"{args.seq_length}: a full-length sample would not fit in any micro-batch.")
    if args.use_dynapipe and batching == "packing" and not (args.reset_position_ids and args.reset_attention_mask):
        # The executor's packing always isolates samples (every stage masks attention per
        # sample, positions restart); Megatron's packing without these flags would not.
        missing = [f for f, on in (("--reset-position-ids", args.reset_position_ids),
                                   ("--reset-attention-mask", args.reset_attention_mask)) if not on]
        raise DynaPipeError(f"--use-dynapipe --dynapipe-batching packing always isolates packed samples; add "
                            f"{' '.join(missing)} (packing whose samples attend to each other runs only "
                            f"without --use-dynapipe).")
    if (args.reset_position_ids or args.reset_attention_mask) and batching != "packing":
        raise DynaPipeError("--reset-position-ids / --reset-attention-mask apply to packed rows only "
                            "(--dynapipe-batching packing).")

    recompute, level = recompute_from_args(args)

    cost_model = args.dynapipe_cost_model
    if cost_model != "analytic" and not os.path.isfile(cost_model):
        raise DynaPipeError(f"--dynapipe-cost-model {cost_model!r}: no such profile file; use 'analytic' or "
                            f"write a profile with `python -m dynapipe profile --output {cost_model}`.")
    dyn = DynaPipeArgs(
        enabled=args.use_dynapipe, batching=batching, schedule=args.dynapipe_schedule,
        memory_limit_mb=args.dynapipe_memory_limit_mb, cost_model=cost_model,
        device=args.dynapipe_device or ("h100-80gb" if cuda else "cpu"),
        cluster=args.dynapipe_cluster or ("h100-8x" if cuda else "cpu-local"),
        planner_workers=args.dynapipe_planner_workers, prefetch=args.dynapipe_prefetch,
        kv_backend=args.dynapipe_kv_backend, redis_host=args.dynapipe_redis_host,
        redis_port=args.dynapipe_redis_port, store_retry_s=args.dynapipe_store_retry_s,
        max_tokens=args.dynapipe_max_tokens,
        timeout_s=args.dynapipe_timeout_s, trace_dir=args.dynapipe_trace_dir, recompute=level)

    from megatron_integration.data_args import data_sources_from_args, eval_args_from_args

    sources = data_sources_from_args(args)
    evaluation = eval_args_from_args(args)
    if args.dynapipe_mixture is not None and not os.path.isfile(args.dynapipe_mixture):
        raise DynaPipeError(f"--dynapipe-mixture {args.dynapipe_mixture!r}: no such file.")
    if args.dynapipe_tokens_per_global_batch is not None and not args.use_dynapipe:
        raise DynaPipeError("--dynapipe-tokens-per-global-batch needs --use-dynapipe: the fixed-shape baselines "
                            "take --global-batch-size samples.")
    data = DataArgs(mock_data=args.mock_data, **sources,
                    tokenizer_type=args.tokenizer_type, tokenizer_model=args.tokenizer_model,
                    mixture=args.dynapipe_mixture, overlong=args.dynapipe_overlong,
                    tokens_per_global_batch=args.dynapipe_tokens_per_global_batch,
                    mock_samples=args.dynapipe_mock_samples)

    decay_iters = _positive("lr-decay-iters", args.lr_decay_iters) or args.train_iters
    warmup_iters = _positive("lr-warmup-iters", args.lr_warmup_iters, allow_zero=True)
    if args.lr_warmup_fraction is not None:
        if args.lr_warmup_iters:
            raise DynaPipeError(f"--lr-warmup-fraction {args.lr_warmup_fraction} and --lr-warmup-iters "
                                f"{args.lr_warmup_iters} were both given; give one (as in Megatron-LM).")
        if not 0.0 <= args.lr_warmup_fraction < 1.0:
            raise DynaPipeError(f"--lr-warmup-fraction {args.lr_warmup_fraction}: must be in [0, 1).")
        # Megatron-LM: warm-up steps = fraction x decay steps.
        warmup_iters = int(args.lr_warmup_fraction * decay_iters)
    if args.min_lr > args.lr:
        raise DynaPipeError(f"--min-lr {args.min_lr} is above --lr {args.lr}; the decay would raise the rate.")
    if args.lr_decay_style != "constant" and warmup_iters >= decay_iters:
        raise DynaPipeError(f"the warm-up ({warmup_iters} iterations) must be shorter than the decay "
                            f"({decay_iters} iterations, --lr-decay-iters or --train-iters).")
    if args.optimizer != "adam":
        raise _unsupported("--optimizer", f"{args.optimizer}: only adam (megatron-core's Adam with decoupled "
                                          f"weight decay) is built; use --optimizer adam")
    loss_scale = loss_scale_from_args(args)
    _positive("num-workers", args.num_workers, allow_zero=True)
    _positive("exit-interval", args.exit_interval)
    optimizer = OptimizerArgs(lr=args.lr, min_lr=args.min_lr, lr_decay_style=args.lr_decay_style,
                              lr_warmup_iters=warmup_iters, lr_decay_iters=decay_iters,
                              weight_decay=args.weight_decay, adam_beta1=args.adam_beta1,
                              adam_beta2=args.adam_beta2, adam_eps=args.adam_eps, clip_grad=args.clip_grad,
                              distributed=args.use_distributed_optimizer,
                              override_scheduler=args.override_opt_param_scheduler,
                              use_checkpoint_scheduler=args.use_checkpoint_opt_param_scheduler, **loss_scale)
    if args.save_interval is not None and not args.save:
        raise DynaPipeError("--save-interval needs --save DIR to write the checkpoints to.")
    if args.save:
        from megatron_integration.checkpoint_files import check_save_dir

        check_save_dir(args.save)
    if args.load and not os.path.isdir(args.load):
        raise DynaPipeError(f"--load {args.load!r}: no such checkpoint directory.")
    _checkpoint_args_honoured(args)

    return DynaPipeTrainingConfig(
        model=model, parallel=parallel, optimizer=optimizer, data=data, dynapipe=dyn,
        micro_batch_size=mbs or 1, global_batch_size=gbs, train_iters=args.train_iters, seed=args.seed,
        reset_position_ids=args.reset_position_ids, reset_attention_mask=args.reset_attention_mask,
        save=args.save, load=args.load, save_interval=args.save_interval,
        load_optim=not args.no_load_optim, load_rng=not args.no_load_rng, log_interval=args.log_interval,
        tensorboard_dir=args.tensorboard_dir, recompute=recompute,
        check_for_nan_in_loss_and_grad=getattr(args, "check_for_nan_in_loss_and_grad", True),
        exit_interval=args.exit_interval, evaluation=evaluation, ckpt_format=args.ckpt_format, finetune=args.finetune,
        megatron_args=_recorded_args(args))


def _checkpoint_args_honoured(args: argparse.Namespace) -> None:
    """Refuse the checkpoint flags this build cannot honour."""
    if args.override_opt_param_scheduler and args.use_checkpoint_opt_param_scheduler:
        raise DynaPipeError("--override-opt_param-scheduler and --use-checkpoint-opt_param-scheduler contradict "
                            "each other (this run's schedule vs the checkpoint's); give one of them.")
    if args.ckpt_format == "torch":
        raise _unsupported("--ckpt-format", "torch (Megatron's legacy per-rank files) is not written; use "
                                            "torch_dist (the default, which Megatron-LM loads) or dynapipe")
    if args.finetune and not args.load:
        raise DynaPipeError("--finetune needs --load DIR (the checkpoint whose weights to start from).")


def _recorded_args(args: argparse.Namespace) -> dict:
    """The parsed arguments with plain values, as a checkpoint records them (Megatron-LM's ``args``)."""
    plain = (str, int, float, bool, type(None))
    return {k: (list(v) if isinstance(v, (list, tuple)) else v) for k, v in vars(args).items()
            if isinstance(v, plain) or (isinstance(v, (list, tuple)) and all(isinstance(x, plain) for x in v))}


def _schedule_from_samples(args: argparse.Namespace) -> None:
    """Megatron-LM's ``--train-samples``: iterations = samples // global batch (no batch ramp-up),
    written into ``args.train_iters``; the learning-rate schedule then runs in those iterations."""
    if args.train_samples is None:
        return
    if args.train_iters is not None:
        raise DynaPipeError(f"--train-samples {args.train_samples} and --train-iters {args.train_iters} were both "
                            f"given; give one (as in Megatron-LM).")
    if args.lr_decay_iters is not None or args.lr_warmup_iters:
        raise DynaPipeError("--train-samples schedules in samples: drop --lr-decay-iters / --lr-warmup-iters "
                            "(the decay then spans the run; use --lr-warmup-fraction for the warm-up).")
    if args.dynapipe_tokens_per_global_batch is not None:
        raise DynaPipeError("--train-samples needs global batches of --global-batch-size samples; with "
                            "--dynapipe-tokens-per-global-batch give --train-iters.")
    gbs = _need(args, "global-batch-size", args.global_batch_size)
    _positive("train-samples", args.train_samples)
    if args.train_samples < gbs:
        raise DynaPipeError(f"--train-samples {args.train_samples} is below --global-batch-size {gbs}: not one "
                            f"iteration; raise it.")
    args.train_iters = args.train_samples // gbs


def recompute_from_args(args: argparse.Namespace) -> tuple[RecomputeArgs, Optional[str]]:
    """Megatron's ``--recompute-*`` (validated as Megatron-LM validates them) and the level
    DynaPipe's planner must use (None: ``--dynapipe-recompute auto``, the search chooses)."""
    gran, method, layers = args.recompute_granularity, args.recompute_method, args.recompute_num_layers
    if gran is None and (method is not None or layers is not None):
        raise DynaPipeError("--recompute-method / --recompute-num-layers need --recompute-granularity full.")
    if gran == "selective" and (method is not None or layers is not None):
        raise DynaPipeError("--recompute-granularity selective takes no --recompute-method / --recompute-num-layers "
                            "(as in Megatron-LM); drop them.")
    if gran == "full":
        if method is None or layers is None:
            raise DynaPipeError("--recompute-granularity full needs --recompute-method {uniform,block} and "
                                "--recompute-num-layers N (as in Megatron-LM).")
        per_stage = args.num_layers // max(args.pipeline_model_parallel_size, 1)
        if not 1 <= layers <= per_stage:
            raise DynaPipeError(f"--recompute-num-layers {layers}: must be between 1 and the {per_stage} layers "
                                f"of each pipeline stage.")
    recompute = RecomputeArgs(gran, method, layers)
    dyn = getattr(args, "dynapipe_recompute", "auto")
    if not args.use_dynapipe:
        if dyn != "auto":
            raise DynaPipeError(f"--dynapipe-recompute {dyn} needs --use-dynapipe; the baselines take Megatron's "
                                f"--recompute-granularity.")
        return recompute, None
    if gran == "full" and (method, layers) != ("uniform", 1):
        # The planner's 'full' keeps every layer's input and rematerialises one layer at a time.
        raise DynaPipeError(f"--use-dynapipe plans full recompute layer by layer; --recompute-method {method} "
                            f"--recompute-num-layers {layers} cannot be honoured: use --recompute-method uniform "
                            f"--recompute-num-layers 1, or --dynapipe-recompute full.")
    if gran is not None and dyn not in ("auto", gran):
        raise DynaPipeError(f"--recompute-granularity {gran} and --dynapipe-recompute {dyn} disagree; give one.")
    return recompute, gran or (None if dyn == "auto" else dyn)


def _weight(text: str) -> Optional[float]:
    try:
        return float(text)
    except ValueError:
        return None


def parse_blend(data_path: Sequence[str]) -> tuple[list[str], Optional[list[float]]]:
    """``--data-path`` as Megatron-LM reads it: ``P1 P2 ...`` (no weights) or ``W1 P1 W2 P2 ...``
    (an even count whose every other item is a number). Raises :class:`DynaPipeError` for a
    list that mixes the two or has a weight that is not positive."""
    items = list(data_path)
    weights = [_weight(w) for w in items[0::2]]
    if len(items) % 2 == 0 and items and all(w is not None for w in weights):
        bad = [items[2 * i] for i, w in enumerate(weights) if not (w > 0 and w != float("inf"))]
        if bad:
            raise DynaPipeError(f"--data-path weight {bad[0]}: blend weights must be positive numbers.")
        return items[1::2], weights
    numbers = [x for x in items if _weight(x) is not None]
    if numbers:
        raise DynaPipeError(f"--data-path {' '.join(items)}: {numbers[0]!r} looks like a blend weight but the list "
                            f"is not weight/path pairs; give W1 P1 W2 P2 ... or paths only.")
    return items, None


def data_files(data_path: Sequence[str]) -> list[str]:
    """The paths of ``--data-path`` (without Megatron-style blend weights)."""
    return parse_blend(data_path)[0]


def parse_training_args(argv: Optional[Sequence[str]], world_size: int, cuda: Optional[bool] = None,
                        parser: Optional[argparse.ArgumentParser] = None) -> DynaPipeTrainingConfig:
    """Parse a Megatron-style command line and validate it into a config."""
    parser = parser or build_parser()
    return training_config_from_args(parser.parse_args(argv), world_size, cuda)
