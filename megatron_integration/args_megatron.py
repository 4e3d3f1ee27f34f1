"""Megatron-LM's own arguments, declared with Megatron's names, meanings and defaults.

``add_megatron_args`` declares the standard Megatron-LM flags this project reads, so an
existing Megatron command line carries over (the network size group is declared in
:mod:`~megatron_integration.args_network`). Declarations only: the values are validated
where they become config (:mod:`~megatron_integration.args_model`,
:mod:`~megatron_integration.args_training`, :mod:`~megatron_integration.arguments`), and
the Megatron-LM flags this build refuses are in :mod:`~megatron_integration.args_refusals`.

No torch or megatron import.
"""
from __future__ import annotations

import argparse

from megatron_integration.model_flags import add_loss_scale_args
from megatron_integration.tokenizer import add_tokenizer_args

# Megatron-LM's choices for these flags; the values not built here are refused with a reason
# (megatron_integration.args_refusals), not by argparse's bare "invalid choice".
POSITION_EMBEDDINGS = ("learned_absolute", "rope", "yarn", "mrope", "relative", "none")
OPTIMIZERS = ("adam", "sgd", "muon", "dist_muon", "lion", "soap", "adaptive_muon")
CKPT_FORMATS = ("torch_dist", "torch", "torch_dcp", "fsdp_dtensor", "dynapipe")
TRANSFORMER_IMPLS = ("local", "transformer_engine", "inference_optimized")
LR_DECAY_STYLES = ("constant", "linear", "cosine", "inverse-square-root", "WSD")
WEIGHT_DECAY_DEFAULT = 0.01  # Megatron-LM's --weight-decay
WSD_DECAY_STYLES = ("exponential", "linear", "cosine", "minus_sqrt")
ATTENTION_BACKENDS = ("auto", "flash", "fused", "unfused", "local")


# Where defaults are filled in (a run config, a bench preset), a typed flag must also keep out
# the defaults Megatron-LM would refuse beside it: its other spelling of the same setting (its
# validate_args fills one from the other), the other choices of an alternative, other data.
OTHER_SPELLING = {"--num-layers": "--encoder-num-layers", "--encoder-num-layers": "--num-layers",
                  "--seq-length": "--encoder-seq-length", "--encoder-seq-length": "--seq-length"}
_WHOLE_DATA = ("--mock-data", "--data-path", "--data-args-path", "--per-split-data-args-path")
_SPLIT_DATA = ("--train-data-path", "--valid-data-path", "--test-data-path")
_ALTERNATIVES = (("--train-iters", "--train-samples"),
                 ("--lr-warmup-iters", "--lr-warmup-samples", "--lr-warmup-fraction"),
                 ("--lr-decay-iters", "--lr-decay-samples"))


def shadowed_by(typed) -> set:
    """The flags a command line's ``typed`` flags (``--name`` strings) replace besides themselves,
    where defaults are filled in (a run config, a bench preset):
    Megatron-LM's other spelling of a setting, the other choices of an alternative (a length in
    iterations or in samples), and the file's data for data given (the whole data for
    ``--data-path``, ``--mock-data`` and the like; the whole-data flags and ``--split`` for one
    split's path)."""
    typed = set(typed)
    out = typed | {OTHER_SPELLING[f] for f in typed if f in OTHER_SPELLING}
    for group in _ALTERNATIVES:
        if typed & set(group):
            out |= set(group)
    if typed & set(_WHOLE_DATA):
        out |= set(_WHOLE_DATA + _SPLIT_DATA)
    elif typed & set(_SPLIT_DATA):
        # --split divides --data-path's documents: it goes with the data it divided.
        out |= set(_WHOLE_DATA) | {"--split"}
    return out - typed


def add_megatron_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Declare the Megatron-LM arguments the project reads (names and defaults as Megatron's)."""
    from megatron_integration.args_network import add_network_size_args

    add_network_size_args(parser)
    _add_training_args(parser)
    _add_learning_rate_args(parser)
    _add_distributed_args(parser)
    _add_data_args(parser)
    _add_checkpointing_args(parser)

    from megatron_integration.args_ddp import add_ddp_args
    from megatron_integration.args_logging import add_logging_args
    from megatron_integration.data_args import add_eval_args, add_split_args

    add_logging_args(parser)
    add_ddp_args(parser)
    add_split_args(parser)
    add_eval_args(parser)
    return parser


def _add_training_args(parser: argparse.ArgumentParser) -> None:
    """Declare the training group."""
    g = parser.add_argument_group("training")
    _add_run_length_args(g)
    _add_manual_gc_args(g)
    _add_seed_precision_and_checks_args(g)
    _add_recompute_args(g)
    _add_runtime_numerics_args(g)
    _add_fusion_args(g)


def _add_run_length_args(g: argparse._ArgumentGroup) -> None:
    """Sequence length, batch sizes and the run's length in iterations or samples."""
    g.add_argument("--seq-length", type=int, default=None, help="maximum sequence length in tokens")
    g.add_argument("--encoder-seq-length", type=int, default=None,
                   help="the same as --seq-length (Megatron-LM's other spelling; give one); T5: the longest input")
    g.add_argument("--micro-batch-size", type=int, default=None,
                   help="samples (or packed rows) per micro-batch of the fixed-shape baselines")
    g.add_argument("--global-batch-size", type=int, default=None,
                   help="samples per iteration over all replicas; a sample is a document (or its piece of at "
                        "most --seq-length tokens), of its own length, where Megatron-LM's are windows of "
                        "exactly --seq-length tokens")
    g.add_argument("--train-iters", type=int, default=None, help="iterations to train")
    g.add_argument("--train-samples", type=int, default=None,
                   help="samples to train (instead of --train-iters): iterations = samples // --global-batch-size; "
                        "samples as --global-batch-size counts them")
    g.add_argument("--exit-interval", type=int, default=None,
                   help="stop (after saving, with --save) at the first iteration divisible by this")
    g.add_argument("--iterations-to-skip", type=int, nargs="+", default=[],
                   help="iterations whose global batch is consumed untrained, numbered from 1 as the log lines and "
                        "Megatron-LM (core_v0.17 on) number them: 2 skips the one logged as iteration 2")


def _add_manual_gc_args(g: argparse._ArgumentGroup) -> None:
    """Megatron-LM's manual garbage collection."""
    g.add_argument("--manual-gc", action="store_true",
                   help="Python's garbage collector off during training, collecting only at the start, every "
                        "--manual-gc-interval iterations and around evaluations, on every rank at once")
    g.add_argument("--manual-gc-interval", type=int, default=0,
                   help="with --manual-gc: iterations between collections (default 0: none between iterations)")
    g.add_argument("--no-manual-gc-eval", "--disable-manual-gc-eval", dest="manual_gc_eval", action="store_false",
                   help="with --manual-gc: no collection before and after each periodic evaluation")


def _add_seed_precision_and_checks_args(g: argparse._ArgumentGroup) -> None:
    """Seed, bf16/fp16, packed-row resets and the NaN/Inf check."""
    g.add_argument("--seed", type=int, default=1234, help="random seed (initialisation, data, dropout)")
    g.add_argument("--bf16", action="store_true",
                   help="bfloat16 parameters and activations (fp32 main copies in the optimizer)")
    g.add_argument("--fp16", action="store_true",
                   help="float16 parameters and activations, loss-scaled (fp32 main copies in the optimizer)")
    g.add_argument("--reset-position-ids", action="store_true",
                   help="packing: restart position ids at every sample of a packed row")
    g.add_argument("--reset-attention-mask", action="store_true",
                   help="packing: samples of a packed row do not attend to each other")
    g.add_argument("--check-for-nan-in-loss-and-grad", action=argparse.BooleanOptionalAction, default=None,
                   help="stop the job when the loss or the gradient norm is NaN or infinite, before the optimizer "
                        "step (default on, off under --fp16 with dynamic loss scaling as in Megatron-LM, where "
                        "asking for it by name is refused; --no-check-for-nan-in-loss-and-grad disables)")
    g.add_argument("--rerun-mode", default="validate_results", choices=("disabled", "validate_results", "report_stats"),
                   help="Megatron-LM's rerun state machine: validate_results (default) computes an iteration whose "
                        "loss or gradient norm is NaN or Inf again to tell a transient fault (exit 17) from a "
                        "reproducible result (exit 16: resume elsewhere); report_stats computes every iteration twice "
                        "and reports the differences; disabled stops on the first NaN or Inf")
    g.add_argument("--error-injection-rate", type=int, default=0,
                   help="test the rerun state machine: each validation injects a rejected result with probability "
                        "1/N (0: never)")
    g.add_argument("--error-injection-type", default="transient_error",
                   choices=("correct_result", "transient_error", "persistent_error"),
                   help="what an injected result turns out to be when computed again")
    g.add_argument("--check-for-spiky-loss", action="store_true",
                   help="compute an iteration again when a rank's loss is 10x the largest of its first 100 "
                        "iterations, and say whether it reproduces; training goes on")
    g.add_argument("--check-for-large-grads", action="store_true",
                   help="the same for a rank's gradient norm")
    g.add_argument("--check-weight-hash-across-dp-replicas-interval", type=int, default=None,
                   help="every N iterations (and at the start), check that the data-parallel replicas' weights are "
                        "bit-identical (SHA-1 of every parameter); a difference stops every rank")
    g.add_argument("--result-rejected-tracker-filename", default=None,
                   help="a file every rejected result is appended to, in Megatron-LM's format; a job started with "
                        "it skips the iterations it names twice on one rank with a reproducible result")


def _add_recompute_args(g: argparse._ArgumentGroup) -> None:
    """Activation recomputation."""
    g.add_argument("--recompute-granularity", default=None, choices=("full", "selective"),
                   help="activation recomputation: selective (core attention) or full (whole layers)")
    g.add_argument("--recompute-method", default=None, choices=("uniform", "block"),
                   help="full recompute: uniform (chunks of --recompute-num-layers layers) or block "
                        "(the first --recompute-num-layers layers of each stage)")
    g.add_argument("--recompute-num-layers", type=int, default=None,
                   help="full recompute: layers per chunk (uniform) or layers recomputed per stage (block)")
    g.add_argument("--recompute-modules", nargs="*", default=None,
                   help="selective recompute: the submodules to recompute (only core_attn, Megatron's default, "
                        "is built)")
    g.add_argument("--recompute-activations", action="store_true",
                   help="Megatron-LM's short form of --recompute-granularity selective")


def _add_runtime_numerics_args(g: argparse._ArgumentGroup) -> None:
    """Wall-time exit, memory release, determinism, the loss's reduction and reduced-precision switches."""
    g.add_argument("--exit-duration-in-mins", type=int, default=None,
                   help="stop (after saving, with --save) once the job has run this many minutes")
    g.add_argument("--exit-signal-handler", action="store_true",
                   help="on --exit-signal (SIGTERM), stop at the next iteration boundary after saving (with --save)")
    g.add_argument("--exit-signal", default=None,
                   help="the signal --exit-signal-handler catches, by name (default SIGTERM)")
    g.add_argument("--empty-unused-memory-level", type=int, default=0, choices=(0, 1, 2),
                   help="return the CUDA caching allocator's unused memory: 1 after each forward-backward, 2 also "
                        "after each optimizer step (no effect on CPU, which has no such cache)")
    g.add_argument("--disable-bf16-reduced-precision-matmul", action="store_true",
                   help="with --bf16: no reduced-precision reductions in cuBLAS's bf16 matmuls (a GPU setting)")
    g.add_argument("--deterministic-mode", action="store_true",
                   help="bit-reproducible execution: deterministic torch algorithms, NCCL ring reductions, a "
                        "deterministic cuBLAS workspace (as Megatron-LM sets them)")
    g.add_argument("--calculate-per-token-loss", action="store_true",
                   help="accepted: the loss is always a sum over tokens divided by the global batch's token count")
    g.add_argument("--cross-entropy-loss-fusion", action="store_true",
                   help="megatron-core's fused cross-entropy for the loss")
    g.add_argument("--grad-reduce-in-bf16", action="store_true",
                   help="with --bf16: all-reduce gradients in bf16 instead of fp32")
    g.add_argument("--accumulate-allreduce-grads-in-fp32", action="store_true",
                   help="--fp16: accumulate and all-reduce gradients in fp32 (default: in fp16, as "
                        "Megatron-LM; --bf16 does it in fp32 anyway unless --grad-reduce-in-bf16)")
    g.add_argument("--attention-softmax-in-fp32", action="store_true",
                   help="compute the attention softmax of --bf16/--fp16 runs in fp32 (default: in the run's "
                        "precision, as Megatron-LM; --apply-query-key-layer-scaling turns it on; megatron-core's "
                        "local attention only, Transformer Engine's chooses its own)")


def _add_fusion_args(g: argparse._ArgumentGroup) -> None:
    """Megatron-LM's kernel-fusion switches (megatron-core's unfused paths run)."""
    # Megatron-LM fuses these kernels by default on GPUs (torch.compile'd or CUDA extensions);
    # this build runs megatron-core's unfused paths. The one whose maths differs is honoured:
    # the fused bias-GeLU is GeLU's tanh approximation, so that is the default GeLU here too.
    g.add_argument("--no-bias-gelu-fusion", action="store_false", dest="bias_gelu_fusion",
                   help="the exact (erf) GeLU of Megatron-LM's unfused path; default: the tanh approximation its "
                        "fused bias-GeLU computes (run unfused here, same maths)")
    for flag in ("--no-masked-softmax-fusion", "--no-bias-swiglu-fusion", "--no-bias-dropout-fusion",
                 "--no-gradient-accumulation-fusion", "--no-persist-layer-norm", "--no-rope-fusion"):
        g.add_argument(flag, action="store_true", help="accepted: megatron-core's unfused path runs (the same maths)")


def _add_learning_rate_args(parser: argparse.ArgumentParser) -> None:
    """Declare the learning rate and optimizer group."""
    g = parser.add_argument_group("learning rate and optimizer")
    _add_lr_schedule_args(g)
    _add_optimizer_and_loss_scale_args(g)
    _add_lr_extent_and_decoupled_args(g)
    _add_weight_decay_args(g)
    _add_adam_and_clip_args(g)


def _add_lr_schedule_args(g: argparse._ArgumentGroup) -> None:
    """Peak and minimum learning rate, decay style (WSD's anneal) and warm-up."""
    g.add_argument("--lr", type=float, default=None, help="peak learning rate")
    g.add_argument("--min-lr", type=float, default=0.0)
    g.add_argument("--lr-decay-style", default="linear", choices=LR_DECAY_STYLES)
    g.add_argument("--lr-wsd-decay-style", default="exponential", choices=WSD_DECAY_STYLES,
                   help="WSD: the shape of the final anneal (Megatron-LM's default: exponential)")
    g.add_argument("--lr-wsd-decay-iters", type=int, default=None, help="WSD: iterations of the final anneal")
    g.add_argument("--lr-wsd-decay-samples", type=int, default=None,
                   help="WSD with --train-samples: samples of the final anneal")
    g.add_argument("--lr-warmup-iters", type=int, default=0)
    g.add_argument("--lr-warmup-fraction", type=float, default=None,
                   help="warm-up as a fraction of the decay iterations (instead of --lr-warmup-iters)")
    g.add_argument("--lr-warmup-init", type=float, default=0.0,
                   help="learning rate the warm-up starts from (Megatron-LM's; default 0)")


def _add_optimizer_and_loss_scale_args(g: argparse._ArgumentGroup) -> None:
    """The optimizer and the fp16/bf16 loss scale."""
    g.add_argument("--optimizer", default="adam", choices=OPTIMIZERS,
                   help="adam (megatron-core's Adam with decoupled weight decay); Megatron-LM's others are refused")
    g.add_argument("--loss-scale", type=float, default=None,
                   help="static loss scale, --fp16 or --bf16 (default: fp16 scales dynamically, bf16 not at all)")
    g.add_argument("--initial-loss-scale", type=float, default=2.0 ** 32, help="fp16: initial dynamic loss scale")
    add_loss_scale_args(g)


def _add_lr_extent_and_decoupled_args(g: argparse._ArgumentGroup) -> None:
    """The decay's and warm-up's span (iterations or samples) and the decoupled embedding/output rates."""
    g.add_argument("--lr-decay-iters", type=int, default=None, help="default: --train-iters")
    g.add_argument("--lr-decay-samples", type=int, default=None,
                   help="with --train-samples: samples the decay spans (default: --train-samples)")
    g.add_argument("--lr-warmup-samples", type=int, default=0, help="with --train-samples: samples of warm-up")
    g.add_argument("--decoupled-lr", type=float, default=None,
                   help="separate peak learning rate for the input embedding and the output layer")
    g.add_argument("--decoupled-min-lr", type=float, default=None,
                   help="minimum learning rate for the input embedding and the output layer")


def _add_weight_decay_args(g: argparse._ArgumentGroup) -> None:
    """Weight decay, its start/end values and increment style."""
    g.add_argument("--weight-decay", type=float, default=WEIGHT_DECAY_DEFAULT)
    g.add_argument("--apply-wd-to-qk-layernorm", action="store_true",
                   help="with --qk-layernorm: decay the query/key norm weights too (other norms and biases never decay)")
    g.add_argument("--start-weight-decay", type=float, default=None,
                   help="weight decay at the start (with --weight-decay-incr-style linear or cosine)")
    g.add_argument("--end-weight-decay", type=float, default=None,
                   help="weight decay at the end (with --weight-decay-incr-style linear or cosine)")
    g.add_argument("--weight-decay-incr-style", default="constant", choices=("constant", "linear", "cosine"),
                   help="how the weight decay goes from its start to its end value over the run")


def _add_adam_and_clip_args(g: argparse._ArgumentGroup) -> None:
    """Adam's betas and epsilon, gradient clipping, the distributed optimizer."""
    g.add_argument("--adam-beta1", type=float, default=0.9)
    g.add_argument("--adam-beta2", type=float, default=0.999)
    g.add_argument("--adam-eps", type=float, default=1e-8)
    g.add_argument("--clip-grad", type=float, default=1.0, help="gradient norm clip (0 disables)")
    g.add_argument("--use-distributed-optimizer", action="store_true",
                   help="shard optimizer state over data-parallel ranks (megatron-core's distributed optimizer)")


def _add_distributed_args(parser: argparse.ArgumentParser) -> None:
    """Declare the distributed group."""
    g = parser.add_argument_group("distributed")
    g.add_argument("--tensor-model-parallel-size", type=int, default=1)
    g.add_argument("--sequence-parallel", action="store_true",
                   help="split norms, dropout and the activations between stages along the sequence over the "
                        "tensor-parallel ranks; at --tensor-model-parallel-size 1 switched off with Megatron-LM's "
                        "warning")
    g.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    _add_pipeline_split_args(g)
    g.add_argument("--distributed-backend", default=None, choices=("nccl", "gloo"),
                   help="default: nccl with CUDA, gloo without")
    g.add_argument("--distributed-timeout-minutes", type=int, default=10)
    g.add_argument("--context-parallel-size", type=int, default=1,
                   help="context-parallel ranks (only 1, the default: no context parallelism)")
    g.add_argument("--expert-model-parallel-size", type=int, default=1,
                   help="expert-parallel ranks (only 1, the default: mixture-of-experts models are not built)")


def _add_pipeline_split_args(g: argparse._ArgumentGroup) -> None:
    """The interleaved (virtual) pipeline, uneven pipeline splits and p2p overlap."""
    # Megatron-LM's interleaved (virtual) pipeline: each rank holds several chunks of layers.
    g.add_argument("--num-layers-per-virtual-pipeline-stage", type=int, default=None,
                   help="layers per virtual pipeline stage (interleaved schedule; default: none)")
    g.add_argument("--num-virtual-stages-per-pipeline-rank", type=int, default=None,
                   help="virtual pipeline stages (model chunks) per pipeline rank (interleaved schedule)")
    # Megatron-LM's uneven pipeline splits (megatron_integration.args_layout).
    g.add_argument("--decoder-first-pipeline-num-layers", type=int, default=None,
                   help="transformer layers on the first pipeline stage (default: the even split)")
    g.add_argument("--decoder-last-pipeline-num-layers", type=int, default=None,
                   help="transformer layers on the last pipeline stage (default: the even split)")
    g.add_argument("--account-for-embedding-in-pipeline-split", action="store_true",
                   help="count the embedding as a layer of the split (the first stage builds one layer fewer)")
    g.add_argument("--account-for-loss-in-pipeline-split", action="store_true",
                   help="count the output layer and loss as a layer of the split (the last stage builds one fewer)")
    g.add_argument("--pipeline-model-parallel-layout", default=None,
                   help='every (virtual) stage written out: E embedding, t transformer layer, L loss, | between '
                        'stages, (..)*n and x*n repeat; e.g. "Ettt|(tt|)*2,ttL" (default: none)')
    # Megatron-LM's flag since 2023: the interleaved schedule overlaps its transfers unless told not to.
    g.add_argument("--no-overlap-p2p-communication", action="store_false", dest="overlap_p2p_comm",
                   help="interleaved schedule: do not overlap the pipeline's sends and receives with compute "
                        "(default: overlap, as in Megatron-LM; without interleaving nothing is overlapped)")


def _add_data_args(parser: argparse.ArgumentParser) -> None:
    """Declare the data group."""
    g = parser.add_argument_group("data")
    g.add_argument("--data-path", nargs="*", default=None,
                   help="JSONL files or Megatron indexed-dataset prefixes (optionally weighted: W1 P1 W2 P2)")
    g.add_argument("--mock-data", action="store_true", help="train on the synthetic multi-task mixture")
    g.add_argument("--tokenizer-type", default=None,
                   help="ByteLevel, NullTokenizer, GPT2BPETokenizer, HuggingFaceTokenizer, BertWordPieceLowerCase or "
                        "BertWordPieceCase: the vocabulary size and end of document; JSONL text is tokenised "
                        "byte-level (default: Megatron-LM's, GPT2BPETokenizer for GPT and BertWordPieceLowerCase "
                        "for T5, when --vocab-file is given; else ByteLevel)")
    g.add_argument("--tokenizer-model", default=None, help="tokenizer model file or name, when the type needs one")
    g.add_argument("--legacy-tokenizer", action="store_true",
                   help="accepted: the WordPiece ids here are those of Megatron-LM's legacy tokenizers (the file's "
                        "lines, then [BOS], [EOS] and --vocab-extra-ids sentinels), which this flag selected there "
                        "until Megatron-LM removed them (2026-02)")
    add_tokenizer_args(g)
    g.add_argument("--data-cache-path", default=None,
                   help="directory for dataset index caches: T5 span corruption's (megatron-core's; default beside "
                        "each data prefix); GPT data caches none (its sampler orders samples in memory)")
    g.add_argument("--no-mmap-bin-files", action="store_false", dest="mmap_bin_files",
                   help="read indexed datasets' .bin files with plain reads instead of memory-mapping them")
    g.add_argument("--no-create-attention-mask-in-dataloader", action="store_false",
                   dest="create_attention_mask_in_dataloader",
                   help="accepted: masks are made on the device, and only for packed rows; refused with "
                        "--reset-attention-mask, whose packed rows need them")
    g.add_argument("--num-workers", type=int, default=2,
                   help="data-loader workers (accepted; samples are read in-process from memory-mapped files)")


def _add_checkpointing_args(parser: argparse.ArgumentParser) -> None:
    """Declare the checkpointing group."""
    g = parser.add_argument_group("checkpointing")
    g.add_argument("--save", default=None, help="directory to save checkpoints to")
    g.add_argument("--load", default=None, help="directory to resume from (its latest checkpoint)")
    g.add_argument("--save-interval", "--persistent-save-interval", type=int, default=None,
                   help="iterations between checkpoints")
    g.add_argument("--save-retain-interval", type=int, default=None,
                   help="keep the checkpoints at multiples of it (and the newest): each other one is deleted once "
                        "the next is saved, as Megatron-LM does (a multiple of --save-interval; default: keep all)")
    g.add_argument("--non-persistent-save-interval", type=int, default=None,
                   help="iterations between non-persistent checkpoints, each replacing the one before (with "
                        "--non-persistent-ckpt-type global)")
    g.add_argument("--non-persistent-ckpt-type", default=None, choices=("global", "local"),
                   help="global: saved under --save/non_persistent (or --non-persistent-global-ckpt-dir) and "
                        "loaded when newer than --load's; local is not built")
    g.add_argument("--non-persistent-global-ckpt-dir", default=None,
                   help="directory of the global non-persistent checkpoints (default: non_persistent under --save)")
    g.add_argument("--no-load-optim", action="store_true", help="do not restore the optimizer state")
    g.add_argument("--no-load-rng", action="store_true", help="do not restore the RNG states")
    g.add_argument("--ckpt-format", default="torch_dist", choices=CKPT_FORMATS,
                   help="torch_dist: megatron-core's distributed checkpoint, as Megatron-LM writes it (default); "
                        "dynapipe: this project's per-rank files (torch, torch_dcp, fsdp_dtensor: Megatron-LM's "
                        "other formats, not written)")
    g.add_argument("--override-opt_param-scheduler", "--override-opt-param-scheduler", action="store_true",
                   help="on --load, take the learning-rate schedule from this run's arguments, not the checkpoint's")
    g.add_argument("--use-checkpoint-opt_param-scheduler", "--use-checkpoint-opt-param-scheduler", action="store_true",
                   help="on --load, keep the checkpoint's learning-rate schedule whatever this run's arguments say "
                        "(without either flag a schedule that differs from the checkpoint's is refused)")
    g.add_argument("--finetune", action="store_true",
                   help="load the model weights only (no optimizer, scheduler or RNG) and start at iteration 0")
    g.add_argument("--exit-on-missing-checkpoint", action="store_true",
                   help="with --load, stop when it holds no checkpoint instead of starting from random weights")
    g.add_argument("--auto-detect-ckpt-format", action="store_true",
                   help="accepted: --load always reads the format the checkpoint is in")
    g.add_argument("--use-dist-ckpt", action="store_true", help="deprecated in Megatron-LM (see --ckpt-format); no effect")
    from megatron_integration.args_checkpoint import add_checkpoint_args

    add_checkpoint_args(g)
