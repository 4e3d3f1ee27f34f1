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
from typing import Optional, Sequence

from dynapipe.errors import DynaPipeError
from megatron_integration.run_config import RunConfig, load_run_config  # noqa: F401  (re-exported)
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
                   help="vocabulary size (default: the tokenizer's, padded to a multiple of 128)")
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
    g.add_argument("--lr-decay-style", default="constant", choices=LR_DECAY_STYLES)
    g.add_argument("--lr-warmup-iters", type=int, default=0)
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
    g.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    g.add_argument("--distributed-backend", default=None, choices=("nccl", "gloo"),
                   help="default: nccl with CUDA, gloo without")
    g.add_argument("--distributed-timeout-minutes", type=float, default=10.0)

    g = parser.add_argument_group("data")
    g.add_argument("--data-path", nargs="*", default=None,
                   help="JSONL files or Megatron indexed-dataset prefixes (optionally weighted: W1 P1 W2 P2)")
    g.add_argument("--mock-data", action="store_true", help="train on the synthetic multi-task mixture")
    g.add_argument("--tokenizer-type", default="ByteLevel", help="tokenizer for JSONL data (default ByteLevel)")
    g.add_argument("--tokenizer-model", default=None, help="tokenizer model file or name, when the type needs one")

    g = parser.add_argument_group("checkpointing")
    g.add_argument("--save", default=None, help="directory to save checkpoints to")
    g.add_argument("--load", default=None, help="directory to resume from (its latest checkpoint)")
    g.add_argument("--save-interval", type=int, default=None, help="iterations between checkpoints")
    g.add_argument("--no-load-optim", action="store_true", help="do not restore the optimizer state")
    g.add_argument("--no-load-rng", action="store_true", help="do not restore the RNG states")

    g = parser.add_argument_group("logging")
    g.add_argument("--log-interval", type=int, default=100, help="iterations between log lines")
    g.add_argument("--tensorboard-dir", default=None, help="write TensorBoard scalars here")
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
    """A standalone parser with the Megatron and DynaPipe arguments."""
    from dynapipe.cli.argtypes import StrictArgumentParser

    parser = StrictArgumentParser(prog=prog, description=description, allow_abbrev=False)
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


def _default_vocab_size(args) -> int:
    if args.vocab_size is not None:
        return args.vocab_size
    # A byte-level tokenizer (256 bytes + a few specials) padded as Megatron pads vocabularies.
    return 384


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
    max_pos = args.max_position_embeddings or args.seq_length
    if args.position_embedding_type == "learned_absolute" and args.seq_length > max_pos:
        raise DynaPipeError(f"--seq-length {args.seq_length} exceeds --max-position-embeddings {max_pos}; "
                            f"raise --max-position-embeddings to at least {args.seq_length} or shorten --seq-length.")
    return GPTModelArgs(
        num_layers=args.num_layers, hidden_size=args.hidden_size, num_attention_heads=args.num_attention_heads,
        ffn_hidden_size=args.ffn_hidden_size or 4 * args.hidden_size,
        kv_channels=args.kv_channels or args.hidden_size // args.num_attention_heads,
        seq_length=args.seq_length, max_position_embeddings=max_pos, vocab_size=_default_vocab_size(args),
        position_embedding_type=args.position_embedding_type,
        tie_embeddings=not args.untie_embeddings_and_output_weights, normalization=args.normalization,
        hidden_dropout=args.hidden_dropout, attention_dropout=args.attention_dropout,
        init_method_std=args.init_method_std, dtype=dtype)


def training_config_from_args(args: argparse.Namespace, world_size: int,
                              cuda: Optional[bool] = None) -> DynaPipeTrainingConfig:
    """Validate parsed arguments for a job of ``world_size`` ranks and build the config.

    ``cuda`` says whether the job runs on GPUs (default: ask torch). Raises
    :class:`DynaPipeError` naming the offending flag for every invalid combination.
    """
    if cuda is None:
        import torch

        cuda = torch.cuda.is_available()
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
    if tp > 1 and not cuda:
        raise DynaPipeError(f"--tensor-model-parallel-size {tp} needs GPUs; on CPU use 1.")
    if pp > args.num_layers or args.num_layers % pp:
        raise DynaPipeError(f"--num-layers {args.num_layers} cannot be split evenly over "
                            f"--pipeline-model-parallel-size {pp}; use a divisor of the layer count.")
    backend = args.distributed_backend or ("nccl" if cuda else "gloo")
    if backend == "nccl" and not cuda:
        raise DynaPipeError("--distributed-backend nccl needs GPUs; use gloo on CPU.")
    parallel = ParallelArgs(world_size=world_size, tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                            backend=backend, timeout_minutes=args.distributed_timeout_minutes)
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

    if args.mock_data and args.data_path:
        raise DynaPipeError("--mock-data and --data-path were both given; use one.")
    if not args.mock_data and not args.data_path:
        raise DynaPipeError("no data: give --data-path FILE... or --mock-data (the synthetic multi-task mixture).")
    for path in data_files(args.data_path or ()):
        if not (os.path.exists(path) or os.path.exists(path + ".idx")):
            raise DynaPipeError(f"--data-path {path!r}: no such file (nor an indexed dataset {path}.idx/.bin).")
    if args.dynapipe_mixture is not None and not os.path.isfile(args.dynapipe_mixture):
        raise DynaPipeError(f"--dynapipe-mixture {args.dynapipe_mixture!r}: no such file.")
    if args.dynapipe_tokens_per_global_batch is not None and not args.use_dynapipe:
        raise DynaPipeError("--dynapipe-tokens-per-global-batch needs --use-dynapipe: the fixed-shape baselines "
                            "take --global-batch-size samples.")
    data = DataArgs(mock_data=args.mock_data, data_path=tuple(args.data_path or ()),
                    tokenizer_type=args.tokenizer_type, tokenizer_model=args.tokenizer_model,
                    mixture=args.dynapipe_mixture, overlong=args.dynapipe_overlong,
                    tokens_per_global_batch=args.dynapipe_tokens_per_global_batch,
                    mock_samples=args.dynapipe_mock_samples)

    if args.lr_decay_style != "constant" and args.lr_warmup_iters >= (args.lr_decay_iters or args.train_iters):
        raise DynaPipeError(f"--lr-warmup-iters {args.lr_warmup_iters} must be below the decay iterations "
                            f"({args.lr_decay_iters or args.train_iters}).")
    optimizer = OptimizerArgs(lr=args.lr, min_lr=args.min_lr, lr_decay_style=args.lr_decay_style,
                              lr_warmup_iters=args.lr_warmup_iters,
                              lr_decay_iters=args.lr_decay_iters or args.train_iters,
                              weight_decay=args.weight_decay, adam_beta1=args.adam_beta1,
                              adam_beta2=args.adam_beta2, adam_eps=args.adam_eps, clip_grad=args.clip_grad,
                              distributed=args.use_distributed_optimizer)
    if args.save_interval is not None and not args.save:
        raise DynaPipeError("--save-interval needs --save DIR to write the checkpoints to.")
    if args.save:
        from megatron_integration.checkpoint_files import check_save_dir

        check_save_dir(args.save)
    if args.load and not os.path.isdir(args.load):
        raise DynaPipeError(f"--load {args.load!r}: no such checkpoint directory.")

    return DynaPipeTrainingConfig(
        model=model, parallel=parallel, optimizer=optimizer, data=data, dynapipe=dyn,
        micro_batch_size=mbs or 1, global_batch_size=gbs, train_iters=args.train_iters, seed=args.seed,
        reset_position_ids=args.reset_position_ids, reset_attention_mask=args.reset_attention_mask,
        save=args.save, load=args.load, save_interval=args.save_interval,
        load_optim=not args.no_load_optim, load_rng=not args.no_load_rng, log_interval=args.log_interval,
        tensorboard_dir=args.tensorboard_dir, recompute=recompute,
        check_for_nan_in_loss_and_grad=getattr(args, "check_for_nan_in_loss_and_grad", True))


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


def data_files(data_path: Sequence[str]) -> list[str]:
    """The paths of ``--data-path``, skipping Megatron-style blend weights."""
    out = []
    for item in data_path:
        try:
            float(item)
        except ValueError:
            out.append(item)
    return out


def parse_training_args(argv: Optional[Sequence[str]], world_size: int, cuda: Optional[bool] = None,
                        parser: Optional[argparse.ArgumentParser] = None) -> DynaPipeTrainingConfig:
    """Parse a Megatron-style command line and validate it into a config."""
    parser = parser or build_parser()
    return training_config_from_args(parser.parse_args(argv), world_size, cuda)
