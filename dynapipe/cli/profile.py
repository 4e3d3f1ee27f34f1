"""``python -m dynapipe profile``: measure megatron-core layers, write a cost profile.

Takes the model arguments of a Megatron command line (or ``--model CONFIG`` for a
shipped/YAML model config) and measures the transformer layer, embedding and output
layer over an (mbs, seqlen) grid on this machine's device (the GPU when CUDA is up,
else the CPU). The JSON it writes is what ``--dynapipe-cost-model PATH`` and
``python -m dynapipe plan --profile PATH`` read.

With ``--tensor-model-parallel-size N`` (and ``--sequence-parallel``) it spawns N local
ranks, one tensor-parallel group, and measures one TP rank of megatron-core's
tensor-parallel layers, collectives included; the profile then prices runs of that TP
size and sequence-parallel setting only.

With ``--t5`` (or a ``--model`` config of an encoder-decoder) it measures megatron-core's T5
encoder layer, decoder layer (over ``--dec-seqlens`` decoder tokens for every encoder
length of ``--seqlens``), embedding and LM head with loss, and writes an encoder-decoder
profile (:mod:`dynapipe.cost.profile_t5`) that prices T5 runs.
"""
from __future__ import annotations

import json
import os
import sys

from dynapipe.cli.profile_request import (check_grid_lengths, check_output, check_tensor_parallel,
                                          refuse_unread_training_flags)
from dynapipe.output_paths import write_output

HELP = "measure megatron-core layers and write a cost profile"

DEFAULT_MBS = "1,2,4,8"
DEFAULT_SEQLENS = "64,128,256,512,1024"
DEFAULT_DEC_SEQLENS = "32,64,128,256"
# Wall-clock limit of a spawned tensor-parallel profiling job, s: a rank that hangs is killed.
TP_TIMEOUT_S = 3600.0


def add_arguments(p) -> None:
    """Add the ``profile`` command's flags to ``p``."""
    from megatron_integration.arguments import add_megatron_args

    p.add_argument("--output", required=True, help="profile JSON to write")
    p.add_argument("--model", default=None,
                   help="model config (shipped name like gpt-tiny, or a YAML path) for any model argument not given")
    p.add_argument("--mbs", default=DEFAULT_MBS, help=f"micro-batch sizes to measure (default {DEFAULT_MBS})")
    p.add_argument("--seqlens", default=None,
                   help=f"sequence lengths to measure, tokens, at least two (default: powers of two from 64 up to "
                        f"--seq-length, else --model's max_seq_length, itself included; {DEFAULT_SEQLENS} without "
                        f"either)")
    p.add_argument("--t5", action="store_true",
                   help="measure a T5 (encoder-decoder): encoder layer, decoder layer, embedding, LM head")
    p.add_argument("--dec-seqlens", default=None,
                   help=f"--t5: decoder lengths to measure, tokens (default {DEFAULT_DEC_SEQLENS})")
    p.add_argument("--repeats", type=int, default=3, help="timed runs per point; the fastest is kept (default 3)")
    p.add_argument("--warmup", type=int, default=1, help="untimed runs per point first (default 1)")
    p.add_argument("--threads", type=int, default=None,
                   help="CPU threads (default: torch's; match the threads each training rank gets)")
    p.add_argument("--no-progress", action="store_true",
                   help="no progress bar (one is drawn only on a terminal, with tqdm installed)")
    p.add_argument("--no-transformer-engine", action="store_true",
                   help="measure megatron-core's local layer spec even when Transformer Engine is available "
                        "(the same as --transformer-impl local; CPUs always measure it)")
    add_megatron_args(p)
    # Left unset (None), these take --model's values, else Megatron's defaults
    # (fill_from_model_config): so an explicit --hidden-dropout 0.1 holds against a config of 0.
    p.set_defaults(**{key: None for key in MEGATRON_LAYER_DEFAULTS})


# Megatron's defaults of the layer flags a model config may also set.
MEGATRON_LAYER_DEFAULTS = {"hidden_dropout": 0.1, "attention_dropout": 0.1,
                           "position_embedding_type": "learned_absolute", "normalization": "LayerNorm"}


def _grid(text: str, flag: str, at_least: int = 1) -> list[int]:
    from dynapipe.errors import DynaPipeError

    if not text.strip() or any(not v.strip() for v in text.split(",")):
        # An empty entry (1,,2) or list is a typo, not "measure the default grid".
        raise DynaPipeError(f"{flag} {text!r}: an empty entry; give comma-separated positive integers, e.g. 1,2,4.")
    try:
        values = [int(v) for v in text.split(",")]
    except ValueError:
        raise DynaPipeError(f"{flag} {text!r}: give comma-separated positive integers, e.g. 1,2,4.") from None
    if not values or any(v <= 0 for v in values) or sorted(set(values)) != values:
        raise DynaPipeError(f"{flag} {text!r}: give strictly ascending positive integers, e.g. 1,2,4.")
    if len(values) < at_least:
        # Lengths beyond the grid follow the power law through its last two points.
        raise DynaPipeError(f"{flag} {text!r}: give at least {at_least} lengths; the cost model prices other "
                            f"lengths from the trend between them.")
    return values


def default_seqlens(model_name, seq_length=None) -> str:
    """The ``--seqlens`` grid when none is given: powers of two from 64 up to ``--seq-length``
    or else ``--model``'s max_seq_length (itself the last point), so the profile reaches every
    length the model trains at instead of extrapolating the longest; :data:`DEFAULT_SEQLENS`
    without either."""
    if seq_length is not None:
        top = int(seq_length)
    elif model_name is None:
        return DEFAULT_SEQLENS
    else:
        from dynapipe.config import load_model_config

        top = load_model_config(model_name, flag="--model").max_seq_length
    grid = [s for s in (32 * 2 ** k for k in range(1, 20)) if s < top] + [top]
    return ",".join(map(str, grid if len(grid) > 1 else [max(top // 2, 1), top]))


def fill_from_model_config(args) -> None:
    """Take model arguments that were not given from ``--model`` (a dynapipe model config);
    dropout and positions not given and not in a config take Megatron's defaults."""
    config = None
    if args.model is not None:
        from dynapipe.config import load_model_config

        config = load_model_config(args.model, flag="--model")
    # Dropout and positions change what a layer keeps and how long it takes: one not given
    # takes the config's.
    for key, megatron_default in MEGATRON_LAYER_DEFAULTS.items():
        if getattr(args, key, None) is None:
            setattr(args, key, getattr(config, key) if config is not None else megatron_default)
    if config is None:
        return

    cfg = config
    if cfg.is_encoder_decoder:
        args.t5 = True
    elif args.t5:
        from dynapipe.errors import DynaPipeError

        # A T5 profile of a GPT's widths: its kind is recorded, but nothing would ever price with it.
        raise DynaPipeError(f"--t5 with --model {args.model}, a decoder-only model config; give a T5 model config "
                            f"(such as t5-11b) or drop --t5.")
    defaults = dict(num_layers=cfg.num_layers, hidden_size=cfg.hidden_size,
                    num_attention_heads=cfg.num_attention_heads, ffn_hidden_size=cfg.ffn_hidden_size,
                    vocab_size=cfg.vocab_size, seq_length=cfg.max_seq_length,
                    kv_channels=cfg.kv_channels or None)
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    # The layer kind too (the cost model refuses a profile of another kind): a switch the
    # config turns on is turned on, unless given otherwise on the command line.
    args.swiglu = args.swiglu or cfg.gated_linear_unit
    args.disable_bias_linear = args.disable_bias_linear or not cfg.add_bias_linear
    args.add_qkv_bias = args.add_qkv_bias or cfg.add_qkv_bias
    args.qk_layernorm = args.qk_layernorm or cfg.qk_layernorm
    args.attention_softmax_in_fp32 = args.attention_softmax_in_fp32 or cfg.attention_softmax_in_fp32
    if cfg.num_query_groups and not args.group_query_attention:
        args.group_query_attention, args.num_query_groups = True, cfg.num_query_groups
    if cfg.dtype in ("bf16", "fp16") and not args.fp16 and not args.bf16:
        # Measured in the precision the model trains in, on a CPU too: a profile prices only that.
        setattr(args, cfg.dtype, True)


def default_dec_seqlens(model_name) -> str:
    """The ``--dec-seqlens`` grid when none is given: :data:`DEFAULT_DEC_SEQLENS` up to the
    ``--model`` config's max_seq_length (itself the last point when shorter)."""
    grid = [int(v) for v in DEFAULT_DEC_SEQLENS.split(",")]
    if model_name is not None:
        from dynapipe.config import load_model_config

        top = load_model_config(model_name, flag="--model").max_seq_length
        grid = [s for s in grid if s < top] + ([top] if top <= grid[-1] else [])
    return ",".join(map(str, grid if len(grid) > 1 else [max(grid[0] // 2, 2), grid[0]]))


def run(args) -> int:
    """Run ``profile`` with parsed ``args``; the process exit status (0: done)."""
    import torch

    from dynapipe.cost.profile import ProfileCostModel
    from dynapipe.errors import DynaPipeError
    from megatron_integration.args_checks import _one_of
    from megatron_integration.arguments import ParallelArgs, model_args_from_args
    from megatron_integration.cpu_affinity import use_profiler_threads
    from megatron_integration.initialize import initialize_megatron
    from megatron_integration.profiler import profile_model

    # Everything a measurement could be refused for afterwards is checked before it starts.
    refuse_unread_training_flags(args)
    check_output(args.output, args)
    if args.threads is not None and args.threads < 1:
        raise DynaPipeError(f"--threads {args.threads}: must be at least 1 (the CPU threads a measurement "
                            f"uses); leave it out for torch's default.")
    # Megatron-LM's other spellings of the two (both given is refused, as for training).
    args.num_layers = _one_of(args, "num-layers", "encoder-num-layers")
    args.seq_length = _one_of(args, "seq-length", "encoder-seq-length")
    typed_seq_length, typed_num_layers = args.seq_length, args.num_layers
    fill_from_model_config(args)
    # The tokenizer a --vocab-file means, as the training script of the kind would read it
    # (T5's WordPiece, not GPT-2's BPE, which would also need --merge-file).
    from megatron_integration.tokenizer import resolve_tokenizer_type

    resolve_tokenizer_type(args, "BertWordPieceLowerCase" if args.t5 else "GPT2BPETokenizer")
    if args.t5 and typed_num_layers is not None:
        raise DynaPipeError(f"--num-layers {typed_num_layers}: a T5 profile measures one encoder and one decoder "
                            f"layer, which any layer count prices; drop it.")
    if typed_seq_length is not None and typed_seq_length < 2:
        raise DynaPipeError(f"--seq-length {typed_seq_length}: a profile needs at least 2 tokens.")
    mbs = _grid(args.mbs, "--mbs")
    seqlens = _grid(args.seqlens if args.seqlens is not None else default_seqlens(args.model, typed_seq_length),
                    "--seqlens", at_least=2)
    if args.dec_seqlens is not None and not args.t5:
        raise DynaPipeError("--dec-seqlens measures T5 decoder lengths; add --t5 (or --model with a T5 config).")
    dec_text = args.dec_seqlens if args.dec_seqlens is not None else default_dec_seqlens(args.model)
    dec_seqlens = _grid(dec_text, "--dec-seqlens", at_least=2) if args.t5 else []
    # Named as the user set them: a grid nobody typed is --seq-length's, or the default.
    seq_flag = "--seqlens" if args.seqlens is not None else (
        f"--seq-length {typed_seq_length} (the --seqlens grid's top)" if typed_seq_length is not None
        else "the default --seqlens grid")
    check_grid_lengths(args.model, seqlens, dec_seqlens, (seq_flag, "--dec-seqlens"))
    # Said once the command line is accepted (a refused one prints its error alone).
    notes = [f"note: {flag} measures two lengths ({grid[0]}, {grid[1]}); longer micro-batches will be priced "
             f"from a line and a power law through them, which under-price a layer's attention (a stage "
             f"of gpt-tiny at 4x the longest: 51.2 MiB planned, 62.5 measured); measure three or more "
             f"lengths to price its square term"
             # Beyond the grid the cost model reads a layer's square term from the last three lengths.
             for flag, grid in ((seq_flag, seqlens), ("--dec-seqlens", dec_seqlens)) if len(grid) == 2]
    if args.repeats < 1 or args.warmup < 0:
        raise DynaPipeError(f"--repeats {args.repeats} --warmup {args.warmup}: --repeats must be >= 1 (timed runs "
                            f"a point) and --warmup >= 0.")
    timeout = _timeout_minutes(args)
    cuda = torch.cuda.is_available()
    if args.t5 and args.num_layers is None:
        args.num_layers = 2  # one layer of each kind is measured; the count changes nothing measured
    if args.seq_length is None:
        args.seq_length = max(seqlens)
    if args.max_position_embeddings is None:
        args.max_position_embeddings = max([args.seq_length, *seqlens, *dec_seqlens])
    if args.no_transformer_engine:
        args.transformer_impl = "local"
    model = model_args_from_args(args, cuda)
    # The layers --transformer-impl names (local on CPUs), as training builds them: the profile
    # records them, and training and the cost model refuse a profile of other layers.
    use_te = model.transformer_impl == "transformer_engine"
    if use_te and args.t5:
        raise DynaPipeError("--transformer-impl transformer_engine (Megatron-LM's default on GPUs): T5 stages are "
                            "built from megatron-core's local layers, which a T5 profile measures; give "
                            "--transformer-impl local (as T5 training needs on GPUs).")
    if use_te and not args.t5:
        from megatron_integration.model import te_available

        if not te_available():
            raise DynaPipeError("--transformer-impl transformer_engine (Megatron-LM's default on GPUs) profiles "
                                "Transformer Engine's layers, and megatron-core cannot load it here; install a "
                                "matching one, or profile the local layers (--transformer-impl local or "
                                "--no-transformer-engine) for a run that trains them.")
    if model.position_embedding_type == "learned_absolute" and max(seqlens) > model.max_position_embeddings:
        raise DynaPipeError(f"--seqlens reaches {max(seqlens)} tokens, beyond --max-position-embeddings "
                            f"{model.max_position_embeddings}; shorten the grid or raise the limit.")
    if args.t5:
        return _run_t5(args, model, mbs, seqlens, dec_seqlens, notes)
    tp, sp = check_tensor_parallel(args, model, seqlens)
    for note in notes:
        print(note, file=sys.stderr)
    if tp > 1:
        return _run_tensor_parallel(args, model, mbs, seqlens, tp, sp, use_te)
    use_profiler_threads(args.threads, cuda)
    initialize_megatron(ParallelArgs(world_size=1, backend="nccl" if cuda else "gloo", timeout_minutes=timeout),
                        seed=args.seed, deterministic=model.deterministic_mode, private_store=True)
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    print(f"profiling on {device} ({model.dtype}, {torch.get_num_threads()} thread(s)): mbs {mbs} x seqlen {seqlens}",
          file=sys.stderr)
    from dynapipe.progress import Progress

    with Progress(len(mbs) * len(seqlens), "profiling", enabled=not args.no_progress) as bar:
        profile = profile_model(model, mbs, seqlens, device, repeats=args.repeats, warmup=args.warmup,
                                use_te=use_te, progress=bar.step)
    # Refuse to write a profile the cost model would not read.
    ProfileCostModel(model.to_model_config("profiled"), profile, num_stages=1, source=args.output)
    write_output(args.output, json.dumps(profile, indent=1), "--output")
    print(f"wrote {args.output}", file=sys.stderr)
    return 0


def _timeout_minutes(args) -> float:
    """``--distributed-timeout-minutes``: the process group's timeout (min), positive."""
    from dynapipe.errors import DynaPipeError

    value = args.distributed_timeout_minutes
    if not value > 0:
        raise DynaPipeError(f"--distributed-timeout-minutes {value}: must be a positive number of minutes.")
    return float(value)


def _run_tensor_parallel(args, model, mbs: list[int], seqlens: list[int], tp: int, sp: bool,
                         use_te: bool) -> int:
    """Measure one TP group: ``tp`` spawned local ranks (NCCL on GPUs, else gloo)."""
    import torch

    from megatron_integration.profile_job import measure_profile

    threads = args.threads or max(1, (os.cpu_count() or 1) // tp)
    where = f"{tp} GPUs" if torch.cuda.is_available() else f"{tp} CPU ranks x {threads} threads"
    print(f"profiling a tensor-parallel group of {tp}{' with sequence parallelism' if sp else ''} on {where} "
          f"({model.dtype}): mbs {mbs} x seqlen {seqlens}", file=sys.stderr)
    measure_profile(model, args.output, mbs, seqlens, repeats=args.repeats, warmup=args.warmup, threads=threads,
                    timeout_s=TP_TIMEOUT_S, tp=tp, sequence_parallel=sp, seed=args.seed,
                    use_te=use_te, progress=not args.no_progress, timeout_minutes=_timeout_minutes(args))
    print(f"wrote {args.output}", file=sys.stderr)
    return 0


def _run_t5(args, model, mbs: list[int], seqlens: list[int], dec_seqlens: list[int], notes: list[str]) -> int:
    """Measure a T5's ops in this process, or in ``--tensor-model-parallel-size`` spawned ranks
    (one tensor-parallel group, with ``--sequence-parallel`` on sequence shards); ``notes`` are
    printed once the arguments are accepted."""
    import torch

    from dynapipe.errors import DynaPipeError
    from megatron_integration.t5_profiler import measure_t5_profile, write_t5_profile

    tp, sp = check_tensor_parallel(args, model, seqlens, dec_seqlens)
    for flag, bad in (("--swiglu", model.swiglu), ("--disable-bias-linear", not model.add_bias_linear),
                      ("--group-query-attention", bool(model.num_query_groups)),
                      ("--qk-layernorm", model.qk_layernorm), ("--add-qkv-bias", model.add_qkv_bias),
                      ("--normalization RMSNorm", model.normalization != "LayerNorm"),
                      ("--position-embedding-type", model.position_embedding_type != "learned_absolute")):
        if bad:
            raise DynaPipeError(f"--t5 {flag}: T5 stages are built as Megatron's T5 (GeLU MLP with biases, "
                                f"LayerNorm, multi-head attention, learned absolute positions); drop it.")
    longest = max(seqlens + dec_seqlens)
    if longest > model.max_position_embeddings:
        raise DynaPipeError(f"--seqlens/--dec-seqlens reach {longest} tokens, beyond --max-position-embeddings "
                            f"{model.max_position_embeddings}; shorten the grid or raise the limit.")
    for note in notes:
        print(note, file=sys.stderr)
    if tp > 1:
        threads = args.threads or max(1, (os.cpu_count() or 1) // tp)
        where = f"{tp} GPUs" if torch.cuda.is_available() else f"{tp} CPU ranks x {threads} threads"
        print(f"profiling a T5 tensor-parallel group of {tp}{' with sequence parallelism' if sp else ''} on {where}: "
              f"mbs {mbs} x seqlen {seqlens} x dec_seqlen {dec_seqlens}", file=sys.stderr)
        measure_t5_profile(model, args.output, mbs, seqlens, dec_seqlens, repeats=args.repeats, warmup=args.warmup,
                           threads=threads, timeout_s=TP_TIMEOUT_S, tp=tp, sequence_parallel=sp, seed=args.seed,
                           progress=not args.no_progress, timeout_minutes=_timeout_minutes(args))
        print(f"wrote {args.output}", file=sys.stderr)
        return 0
    print(f"profiling a T5 on {'cuda' if torch.cuda.is_available() else 'cpu'} ({args.threads or torch.get_num_threads()}"
          f" threads): mbs {mbs} x seqlen {seqlens} x dec_seqlen {dec_seqlens}", file=sys.stderr)
    write_t5_profile(model, args.output, mbs, seqlens, dec_seqlens, repeats=args.repeats, warmup=args.warmup,
                     threads=args.threads, seed=args.seed, progress=not args.no_progress,
                     timeout_minutes=_timeout_minutes(args))
    print(f"wrote {args.output}", file=sys.stderr)
    return 0
