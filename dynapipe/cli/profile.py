"""``python -m dynapipe profile``: measure megatron-core layers, write a cost profile.

Takes the model arguments of a Megatron command line (or ``--model CONFIG`` for a
shipped/YAML model config) and measures the transformer layer, embedding and output
layer over an (mbs, seqlen) grid on this machine's device (the GPU when CUDA is up,
else the CPU). The JSON it writes is what ``--dynapipe-cost-model PATH`` and
``python -m dynapipe plan --cost-model PATH`` read.
"""
from __future__ import annotations

import json
import os
import sys

HELP = "measure megatron-core layers and write a cost profile"

DEFAULT_MBS = "1,2,4,8"
DEFAULT_SEQLENS = "64,128,256,512,1024"


def add_arguments(p) -> None:
    from megatron_integration.arguments import add_megatron_args

    p.add_argument("--output", required=True, help="profile JSON to write")
    p.add_argument("--model", default=None,
                   help="model config (shipped name like gpt-tiny, or a YAML path) for any model argument not given")
    p.add_argument("--mbs", default=DEFAULT_MBS, help=f"micro-batch sizes to measure (default {DEFAULT_MBS})")
    p.add_argument("--seqlens", default=DEFAULT_SEQLENS,
                   help=f"sequence lengths to measure, tokens (default {DEFAULT_SEQLENS})")
    p.add_argument("--repeats", type=int, default=3, help="timed runs per point; the fastest is kept (default 3)")
    p.add_argument("--warmup", type=int, default=1, help="untimed runs per point first (default 1)")
    p.add_argument("--threads", type=int, default=None,
                   help="CPU threads (default: torch's; match the threads each training rank gets)")
    p.add_argument("--no-progress", action="store_true",
                   help="no progress bar (one is drawn only on a terminal, with tqdm installed)")
    p.add_argument("--no-transformer-engine", action="store_true",
                   help="measure megatron-core's local layer spec even when Transformer Engine is available")
    add_megatron_args(p)


def _grid(text: str, flag: str) -> list[int]:
    from dynapipe.errors import DynaPipeError

    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise DynaPipeError(f"{flag} {text!r}: give comma-separated positive integers, e.g. 1,2,4.") from None
    if not values or any(v <= 0 for v in values) or sorted(set(values)) != values:
        raise DynaPipeError(f"{flag} {text!r}: give strictly ascending positive integers, e.g. 1,2,4.")
    return values


def fill_from_model_config(args) -> None:
    """Take model arguments that were not given from ``--model`` (a dynapipe model config)."""
    if args.model is None:
        return
    from dynapipe.config import load_model_config
    from dynapipe.errors import DynaPipeError

    cfg = load_model_config(args.model)
    if cfg.is_encoder_decoder:
        raise DynaPipeError(f"--model {args.model}: profiles are defined for GPT (decoder-only) models only.")
    defaults = dict(num_layers=cfg.num_layers, hidden_size=cfg.hidden_size,
                    num_attention_heads=cfg.num_attention_heads, ffn_hidden_size=cfg.ffn_hidden_size,
                    vocab_size=cfg.vocab_size, seq_length=cfg.max_seq_length,
                    kv_channels=cfg.kv_channels or None)
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if cfg.dtype == "bf16" and not args.fp16 and not args.bf16:
        import torch

        args.bf16 = torch.cuda.is_available()


def run(args) -> int:
    import torch

    from dynapipe.cost.profile import ProfileCostModel
    from dynapipe.errors import DynaPipeError
    from megatron_integration.arguments import ParallelArgs, model_args_from_args
    from megatron_integration.initialize import initialize_megatron
    from megatron_integration.launch import free_port
    from megatron_integration.profiler import profile_model

    fill_from_model_config(args)
    mbs = _grid(args.mbs, "--mbs")
    seqlens = _grid(args.seqlens, "--seqlens")
    if args.repeats < 1 or args.warmup < 0:
        raise DynaPipeError("--repeats must be >= 1 and --warmup >= 0.")
    cuda = torch.cuda.is_available()
    if args.seq_length is None:
        args.seq_length = max(seqlens)
    if args.max_position_embeddings is None:
        args.max_position_embeddings = max(args.seq_length, max(seqlens))
    model = model_args_from_args(args, cuda)
    if model.position_embedding_type == "learned_absolute" and max(seqlens) > model.max_position_embeddings:
        raise DynaPipeError(f"--seqlens reaches {max(seqlens)} tokens, beyond --max-position-embeddings "
                            f"{model.max_position_embeddings}; shorten the grid or raise the limit.")
    out_dir = os.path.dirname(os.path.abspath(args.output))
    if not os.path.isdir(out_dir):
        raise DynaPipeError(f"--output {args.output}: directory {out_dir} does not exist.")
    if args.threads:
        torch.set_num_threads(args.threads)
    if "RANK" not in os.environ:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0", WORLD_SIZE="1")
    initialize_megatron(ParallelArgs(world_size=1, backend="nccl" if cuda else "gloo"), seed=args.seed)
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    print(f"profiling on {device} ({model.dtype}, {torch.get_num_threads()} threads): mbs {mbs} x seqlen {seqlens}",
          file=sys.stderr)
    from dynapipe.progress import Progress

    with Progress(len(mbs) * len(seqlens), "profiling", enabled=not args.no_progress) as bar:
        profile = profile_model(model, mbs, seqlens, device, repeats=args.repeats, warmup=args.warmup,
                                use_te=False if args.no_transformer_engine else None, progress=bar.step)
    # Refuse to write a profile the cost model would not read.
    ProfileCostModel(model.to_model_config("profiled"), profile, num_stages=1, source=args.output)
    with open(args.output, "w") as f:
        json.dump(profile, f, indent=1)
    print(f"wrote {args.output}", file=sys.stderr)
    return 0
