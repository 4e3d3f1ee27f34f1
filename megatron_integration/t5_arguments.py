"""Megatron-LM's T5 arguments, on top of the shared Megatron and DynaPipe ones.

``--encoder-num-layers`` / ``--decoder-num-layers`` and ``--encoder-seq-length`` /
``--decoder-seq-length`` mean what they mean in Megatron-LM: ``--num-layers`` is the
same as ``--encoder-num-layers`` (give one), the decoder has as many layers as the encoder
unless ``--decoder-num-layers`` says otherwise, ``--seq-length`` is the same as
``--encoder-seq-length`` (give one). Every other flag is validated as for GPT by
:func:`~megatron_integration.arguments.training_config_from_args`.
"""
from __future__ import annotations

import argparse
import re
from dataclasses import replace
from typing import Optional

from dynapipe.errors import DynaPipeError
from megatron_integration.args_checks import _one_of, _unsupported_value, typed_flag
from megatron_integration.arguments import (_positive, _unsupported, build_parser, prepare_output_dirs, resolve_cuda,
                                            training_config_from_args)
from megatron_integration.t5_config import T5TrainingConfig
from megatron_integration.t5_data_args import add_t5_data_args, span_corruption_from_args
from megatron_integration.tokenizer import resolve_tokenizer_type
from megatron_integration.flag_spelling import t5_spelled

# Fixed-shape baselines the T5 script runs (through the DynaPipe executor: megatron-core's
# schedules no longer pipeline encoder-decoder models).
T5_BASELINES = ("padding", "packing")


def add_t5_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Declare Megatron-LM's T5 arguments (names and defaults as Megatron's)."""
    g = parser.add_argument_group("t5")
    g.add_argument("--decoder-num-layers", type=int, default=None,
                   help="decoder layers (default: as many as the encoder)")
    g.add_argument("--decoder-seq-length", type=int, default=None, help="longest decoder target in tokens")
    add_t5_data_args(g)
    return parser


def build_t5_parser(prog: Optional[str] = None, description: Optional[str] = None) -> argparse.ArgumentParser:
    """The GPT parser (Megatron and DynaPipe arguments) with the T5 group added."""
    return add_t5_args(build_parser(prog=prog, description=description))


def _required_one_of(args, flag_a: str, flag_b: str):
    value = _one_of(args, flag_a, flag_b)
    if value is None:
        raise DynaPipeError(f"--{flag_b} (or --{flag_a}) is required.")
    return value


@t5_spelled
def t5_config_from_args(args: argparse.Namespace, world_size: int, cuda: Optional[bool] = None) -> T5TrainingConfig:
    """Validate parsed T5 arguments for a job of ``world_size`` ranks and build the config."""
    resolve_tokenizer_type(args, "BertWordPieceLowerCase")  # Megatron-LM's pretrain_t5.py default
    cuda = resolve_cuda(cuda)
    # Errors name the spelling typed: --num-layers / --seq-length are the encoder's, as in Megatron-LM.
    layers_flag, seq_flag = typed_flag(args, "num-layers", "encoder-num-layers"), typed_flag(args, "seq-length",
                                                                                             "encoder-seq-length")
    enc_layers = _positive(layers_flag[2:], _required_one_of(args, "num-layers", "encoder-num-layers"))
    dec_layers = _positive("decoder-num-layers", args.decoder_num_layers) or enc_layers
    enc_seq = _positive(seq_flag[2:], _required_one_of(args, "seq-length", "encoder-seq-length"))
    if enc_seq < 2:  # the data's length limits need two tokens; found here, before any model is built
        raise DynaPipeError(f"{seq_flag} {enc_seq}: must be at least 2 tokens.")
    if args.decoder_seq_length is None:
        raise DynaPipeError("--decoder-seq-length is required for T5 (the longest target in tokens).")
    dec_seq = _positive("decoder-seq-length", args.decoder_seq_length)
    max_pos = (max(enc_seq, dec_seq) if args.max_position_embeddings is None
               else _positive("max-position-embeddings", args.max_position_embeddings))
    for flag, length in ((seq_flag, enc_seq), ("--decoder-seq-length", dec_seq)):
        if length > max_pos:
            raise DynaPipeError(f"{flag} {length} exceeds --max-position-embeddings {max_pos}; raise it to at "
                                f"least {length}.")
    pp = args.pipeline_model_parallel_size
    # One virtual stage per rank is no interleaving: Megatron-LM reads it so, and so here. Its
    # layers per virtual stage count a T5's --num-layers, the encoder's (the decoder's when only
    # --encoder-num-layers is given), per pipeline rank: never encoder and decoder together.
    megatron_layers = args.num_layers if args.num_layers is not None else dec_layers
    for flag, one_chunk in (("num-layers-per-virtual-pipeline-stage", megatron_layers / pp),
                            ("num-virtual-stages-per-pipeline-rank", 1)):
        value = getattr(args, flag.replace("-", "_"))
        if value is not None and value != one_chunk:
            raise _unsupported(f"--{flag}", f"{value}: T5 chunks are a stage placement here; use "
                                            f"--dynapipe-placement interleaved (or a chunked split such as "
                                            f"1+0,1+0|0+1,0+1)")
    if not args.overlap_p2p_comm:
        raise _unsupported("--no-overlap-p2p-communication", "every T5 method runs through this project's executor, "
                                                             "which posts its transfers where its plans put them "
                                                             "(megatron-core's schedule is not used); drop it")
    for flag, why in (("cross-entropy-loss-fusion", "T5's loss is megatron-core's vocab-parallel cross-entropy, "
                                                    "unfused"),
                      ("decoupled-lr", "the T5 stages' embeddings take the model's learning rate"),
                      ("decoupled-min-lr", "the T5 stages' embeddings take the model's learning rate")):
        if getattr(args, flag.replace("-", "_")) not in (None, False):
            raise _unsupported(f"--{flag}", f"{why}; drop it")
    for flag in ("decoder-first-pipeline-num-layers", "decoder-last-pipeline-num-layers",
                 "pipeline-model-parallel-layout", "account-for-embedding-in-pipeline-split",
                 "account-for-loss-in-pipeline-split"):
        if getattr(args, flag.replace("-", "_")) not in (None, False):
            raise _unsupported(f"--{flag}", "a T5 stage split is a stage placement here; give it with "
                                            "--dynapipe-placement (such as 2+0,1+3), or auto")
    for flag, default in (("use-rope-scaling", False), ("rope-scaling-factor", 8.0),
                          ("rotary-seq-len-interpolation-factor", None), ("rotary-base", 10000)):
        if getattr(args, flag.replace("-", "_")) != default:
            raise _unsupported(f"--{flag}", "T5 stages use learned absolute positions, not rotary ones; drop it")
    for flag in ("use-rotary-position-embeddings", "qk-layernorm", "add-qkv-bias", "apply-wd-to-qk-layernorm"):
        if getattr(args, flag.replace("-", "_")):
            raise _unsupported(f"--{flag}", "T5 stages are built as Megatron's T5 (learned absolute positions, "
                                            "biased linear layers, no query/key norms); drop it")
    if not args.add_position_embedding:
        raise _unsupported("--no-position-embedding", "T5 stages use learned absolute positions; drop it")
    if args.position_embedding_type != "learned_absolute":
        raise _unsupported_value("--position-embedding-type", args.position_embedding_type,
                                 "T5 stages use learned absolute positions; drop it")
    if args.transformer_impl == "transformer_engine" and cuda:
        raise DynaPipeError("the T5 stages are built from megatron-core's local layers (its T5 block specs without "
                            "Transformer Engine), and --transformer-impl is transformer_engine (Megatron-LM's "
                            "default, in effect when the flag is not given); pass --transformer-impl local.")
    pp = args.pipeline_model_parallel_size
    total = enc_layers + dec_layers
    placement_flag = (getattr(args, "dynapipe_placement", None) or "even").strip()
    if placement_flag == "even" and (pp > total or total % pp):
        raise DynaPipeError(f"{layers_flag} {enc_layers} + --decoder-num-layers {dec_layers} = {total} "
                            f"layers cannot be split evenly over --pipeline-model-parallel-size {pp}; use a "
                            f"divisor of {total}.")
    batching = args.dynapipe_batching or ("dynapipe" if args.use_dynapipe else "padding")
    if args.use_dynapipe and batching not in ("dynapipe", "packing"):
        raise DynaPipeError(f"--use-dynapipe --dynapipe-batching {batching}: T5's planner plans dynapipe or packing "
                            f"micro-batches (packing given DynaPipe's schedule search); the baselines "
                            f"({', '.join(T5_BASELINES)}) run without --use-dynapipe.")
    if not args.use_dynapipe and batching not in T5_BASELINES:
        raise DynaPipeError(f"--dynapipe-batching {batching} is not a T5 baseline; use one of "
                            f"{list(T5_BASELINES)}, or --use-dynapipe.")
    if batching == "packing" and not (args.reset_position_ids and args.reset_attention_mask):
        raise DynaPipeError("T5 packing always isolates the packed samples (block-diagonal masks, positions "
                            "restarting per sample); add --reset-position-ids --reset-attention-mask.")
    if args.recompute_granularity == "full" and (args.recompute_method, args.recompute_num_layers) != ("uniform", 1):
        raise DynaPipeError("T5 stages recompute full layers one at a time; use --recompute-method uniform "
                            "--recompute-num-layers 1 with --recompute-granularity full.")
    if args.use_distributed_optimizer:
        raise DynaPipeError("--use-distributed-optimizer: T5 stages keep their embedding copies in sync on whole "
                            "gradients (no sharded optimizer yet); drop it.")
    tp = args.tensor_model_parallel_size
    if args.sequence_parallel and tp > 1 and dec_seq % tp:
        raise DynaPipeError(f"--sequence-parallel splits every sequence over the {tp} tensor-parallel ranks, but "
                            f"--decoder-seq-length {dec_seq} is not a multiple of {tp}; use "
                            f"{-(-dec_seq // tp) * tp}.")
    # The shared validators see the whole model: every layer, the encoder's length.
    shared = argparse.Namespace(**vars(args))
    shared.num_layers, shared.seq_length, shared.max_position_embeddings = total, enc_seq, max_pos
    shared.encoder_num_layers = shared.encoder_seq_length = None  # resolved above, into the two above
    shared.dynapipe_placement = "even"  # T5's placement is its own (below), not a GPT split
    # Checked above to mean no interleaving, counted on T5's layers, not on the whole model's.
    shared.num_layers_per_virtual_pipeline_stage = shared.num_virtual_stages_per_pipeline_rank = None
    if placement_flag != "even" and total % pp:
        shared.num_layers = pp * (total // pp) or pp  # the split is the placement's, not an even one
    # T5's baselines run through the executor too: its flags apply to every method.
    try:
        base = training_config_from_args(shared, world_size, cuda, baselines_use_executor=True,
                                         placement_auto=placement_flag == "auto", check_profile=False,
                                         make_dirs=False)
    except DynaPipeError as e:
        raise DynaPipeError(_as_typed(str(e), args)) from None
    if base.model.num_layers != total:
        base = replace(base, model=replace(base.model, num_layers=total))
    _t5_model_and_data_honoured(args, base)
    cfg = T5TrainingConfig(base=base, encoder_layers=enc_layers, decoder_layers=dec_layers,
                           decoder_seq_length=dec_seq, span_corruption=span_corruption_from_args(args, base, dec_seq))
    d, p = base.dynapipe, base.parallel
    if (d.enabled or placement_flag == "auto") and d.cost_model != "analytic":  # auto prices every method
        from megatron_integration.profile_check import check_profile_for_run

        check_profile_for_run(d.cost_model, cfg.planner_model(), p.pipeline_model_parallel_size,
                              p.tensor_model_parallel_size, p.sequence_parallel, d.device, d.device_given,
                              "local")  # T5 stages are built from megatron-core's local layers
    cfg = _with_placement(cfg, placement_flag, pp)
    prepare_output_dirs(shared)  # last: a refused run leaves no empty directory
    return cfg


def _as_typed(message: str, args: argparse.Namespace) -> str:
    """A shared check's ``message`` with the flags the T5 user typed: the shared checks see the
    encoder's length as ``--seq-length`` and every layer as ``--num-layers``."""
    if args.seq_length is None:
        message = re.sub(r"(?<![\w-])--seq-length\b", "--encoder-seq-length", message)
    if args.num_layers is None:
        message = re.sub(r"(?<![\w-])--num-layers (\d+)",
                         lambda m: f"--encoder-num-layers + --decoder-num-layers ({m.group(1)})", message)
    return message


def parse_t5_args(argv, world_size: int, cuda: Optional[bool] = None) -> T5TrainingConfig:
    """Parse a Megatron-style T5 command line and validate it into a config."""
    return t5_config_from_args(build_t5_parser().parse_args(argv), world_size, cuda)


def _t5_model_and_data_honoured(args: argparse.Namespace, base) -> None:
    """Refuse what T5 training does not do yet instead of ignoring it: other layers than
    Megatron's T5 has. Megatron's data splits and evaluation are honoured for every kind of
    data, and both checkpoint formats (:mod:`megatron_integration.t5_checkpoint`)."""
    model_flags = {"--swiglu": args.swiglu, "--disable-bias-linear": args.disable_bias_linear,
                   "--group-query-attention": args.group_query_attention,
                   "--normalization RMSNorm": args.normalization != "LayerNorm",
                   "--untie-embeddings-and-output-weights": args.untie_embeddings_and_output_weights}
    for flag, given in model_flags.items():
        if given:
            raise DynaPipeError(f"{flag}: T5 stages are built as Megatron's T5 (GeLU MLP with biases, LayerNorm, "
                                f"multi-head attention, tied output layer) in this build; drop it.")


def _with_placement(cfg: T5TrainingConfig, flag: str, pp: int) -> T5TrainingConfig:
    """``cfg`` with ``--dynapipe-placement`` checked against the model (``auto``: chosen at start-up)."""
    from megatron_integration.t5_placement import check_overlap_placement, parse_t5_placement

    placement = parse_t5_placement(flag, cfg.planner_model(), pp)
    check_overlap_placement(replace(cfg, placement_flag=flag), placement)
    return replace(cfg, placement=placement, placement_flag=flag)
