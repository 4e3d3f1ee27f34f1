"""``python -m dynapipe cost``: the cost model's figures for given shapes.

Prints exactly what the planner uses for a micro-batch (the bottleneck stage unless
``--stage`` is given), so anyone can check a plan against its own cost model. Also home
of the argument helpers every planning command shares: building the cost model and the
memory limit from ``--model/--device/--stages/--profile/--recompute/--memory-limit-mb``.
"""
from __future__ import annotations

import argparse
import json
import re
import sys
from dataclasses import dataclass
from typing import Optional

from dynapipe.config import DeviceConfig, ModelConfig, TensorParallelConfig, load_device_config, load_model_config
from dynapipe.cost import RECOMPUTE_LEVELS, CostModel, build_cost_model
from dynapipe.errors import DynaPipeError

HELP = "print the cost model's time and memory for given shapes"
_DIGITS = re.compile(r"[+-]?[0-9]{1,12}\Z")


def add_cost_model_arguments(p: argparse.ArgumentParser) -> None:
    """Arguments that choose the model, the device, the pipeline depth and the cost model."""
    p.add_argument("--model", required=True, help="model config: a YAML path or a shipped name (e.g. gpt-7b)")
    p.add_argument("--device", required=True, help="device config: a YAML path or a shipped name (e.g. a100-40gb)")
    p.add_argument("--stages", type=int, required=True, help="pipeline stages S")
    p.add_argument("--profile", default=None,
                   help="measured cost profile (JSON) instead of the analytic cost model, measured on the --device "
                        "given (which still sets the memory; a CPU profile with a GPU config is refused); "
                        "'analytic' names the analytic model")
    p.add_argument("--recompute", choices=RECOMPUTE_LEVELS, default="none",
                   help="activation recomputation level (default none)")
    p.add_argument("--tp", type=int, default=1,
                   help="tensor-parallel ranks per stage, inside a node; figures are per TP rank (default 1)")
    p.add_argument("--sequence-parallel", action="store_true",
                   help="Megatron's sequence parallelism over the TP ranks (needs --tp 2 or more)")


def add_memory_arguments(p: argparse.ArgumentParser) -> None:
    """``--memory-limit-mb``: device memory in MiB (default: the device config's)."""
    p.add_argument("--memory-limit-mb", type=float, default=None,
                   help="device memory in MiB the plan must fit (default: the device config's memory_mib; "
                        "1e12 for no limit). The device's reserved_mib and the stage's model states come off it.")


@dataclass(frozen=True)
class CostSetup:
    """What the cost-model arguments resolve to; memory in MiB."""

    model: ModelConfig
    device: DeviceConfig
    cost_model: CostModel
    memory_limit_mib: float
    reserved_mib: float
    recompute: str
    tp: TensorParallelConfig = TensorParallelConfig()


def tp_from_args(args: argparse.Namespace, model: ModelConfig, device: DeviceConfig) -> TensorParallelConfig:
    """``--tp``/``--sequence-parallel``, priced on the intra-node link of ``--cluster`` (or the
    shipped cluster of the device)."""
    from dynapipe.cli.schedule_options import resolve_cluster

    size = getattr(args, "tp", 1)
    sp = bool(getattr(args, "sequence_parallel", False))
    cluster = resolve_cluster(getattr(args, "cluster", None), device.name)
    tp = TensorParallelConfig(size, sp, cluster.intra_node).validate(model, cluster.gpus_per_node)
    if sp and hasattr(args, "seq_length"):  # plan and trace cut rows of --seq-length (default: the model's)
        given = args.seq_length is not None
        check_sequence_split(args.seq_length if given else model.max_seq_length, size, model,
                             "--seq-length" if given else f"the max_seq_length of model {model.name!r}")
    return tp


def check_sequence_split(length: int, tp: int, model: ModelConfig, what: str) -> None:
    """Refuse a sequence length ``what`` that sequence parallelism cannot split evenly over
    ``tp`` ranks (training refuses it), naming the nearest lengths that it can split."""
    if length % tp == 0:
        return
    below, above = length // tp * tp, -(-length // tp) * tp
    # Nearest first; a tie goes up, as training's own check suggests.
    near = [n for n in sorted((above, below), key=lambda n: abs(n - length)) if 0 < n <= model.max_seq_length]
    fix = "use --seq-length " + " or ".join(map(str, near)) if near else "use a smaller --tp"
    raise DynaPipeError(f"--sequence-parallel splits every sequence over the {tp} tensor-parallel ranks (--tp {tp}), "
                        f"but {what} {length} is not a multiple of {tp}; {fix}.")


def cost_setup_from_args(args: argparse.Namespace) -> CostSetup:
    """Load the configs and build the cost model and memory limit from parsed arguments."""
    if args.stages < 1:
        raise DynaPipeError(f"--stages {args.stages}: must be at least 1 (pipeline stages).")
    model = load_model_config(args.model, flag="--model")
    device = load_device_config(args.device, flag="--device")
    tp = tp_from_args(args, model, device)
    cost_model = build_cost_model(model, device, args.stages, getattr(args, "profile", None), tp,
                                  device_flag="--device")
    limit: Optional[float] = getattr(args, "memory_limit_mb", None)
    if limit is None:
        limit = device.memory_mib
    elif not limit > 0:
        raise DynaPipeError(f"--memory-limit-mb {limit:g} must be positive (1e12 means no limit).")
    return CostSetup(model, device, cost_model, float(limit), float(device.reserved_mib),
                     getattr(args, "recompute", "none"), tp)


def parse_shape(text: str, encoder_decoder: bool) -> tuple[int, int, Optional[int]]:
    """``MBS,SEQLEN[,DEC_SEQLEN]`` -> integers; the decoder length only for encoder-decoder models."""
    parts = text.split(",")
    want = "MBS,SEQLEN,DEC_SEQLEN" if encoder_decoder else "MBS,SEQLEN"
    if not all(_DIGITS.match(v) for v in parts):
        if all(re.fullmatch(r"[+-]?[0-9]+", v) for v in parts):
            raise DynaPipeError(f"--shape {text!r}: a value of more than 12 digits is beyond any micro-batch; give "
                                f"{want} as the samples and tokens of one micro-batch.")
        raise DynaPipeError(f"--shape {text!r}: expected {want} as positive integers (ASCII digits).")
    values = [int(v) for v in parts]
    if len(values) != (3 if encoder_decoder else 2):
        kind = "encoder-decoder" if encoder_decoder else "decoder-only"
        raise DynaPipeError(f"--shape {text!r}: the model is {kind}, so give {want}.")
    if any(v <= 0 for v in values):
        raise DynaPipeError(f"--shape {text!r}: every value must be a positive integer.")
    return values[0], values[1], (values[2] if encoder_decoder else None)


def check_shape(text: str, shape: tuple[int, int, Optional[int]], model: ModelConfig,
                tp: Optional[TensorParallelConfig] = None) -> None:
    """Refuse a shape the model cannot run: a sequence above its ``max_seq_length``, or, under
    sequence parallelism (``tp``), one its TP ranks cannot split evenly."""
    longest = max(s for s in shape[1:] if s is not None)
    if longest > model.max_seq_length:
        raise DynaPipeError(f"--shape {text!r}: {longest} tokens exceed the model's max_seq_length "
                            f"{model.max_seq_length} ({model.name}); use a shorter sequence.")
    if tp is not None and tp.sequence_parallel:
        for seq in shape[1:]:
            if seq is not None and seq % tp.size:
                raise DynaPipeError(f"--shape {text!r}: --sequence-parallel splits every sequence over the "
                                    f"{tp.size} tensor-parallel ranks, but {seq} tokens is not a multiple of "
                                    f"{tp.size}; use {-(-seq // tp.size) * tp.size}.")


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Add the ``cost`` command's flags to ``p``."""
    add_cost_model_arguments(p)
    p.add_argument("--shape", action="append", required=True, metavar="MBS,SEQLEN[,DEC_SEQLEN]",
                   help="micro-batch shape: samples, padded tokens (and decoder tokens); repeat for more")
    p.add_argument("--stage", type=int, default=None,
                   help="price this stage (0-based) instead of the bottleneck over all stages")
    p.add_argument("--placement", default="even", metavar="even|interleaved|SPEC",
                   help="layers per pipeline stage, as plan's --placement writes them: even (Megatron's split, "
                        "default), interleaved (T5: the encoder as chunk 0 and the decoder as chunk 1 of every "
                        "stage) or a split such as 12,12,8 (GPT) or 6+0,5+1,0+7 (T5); a stage with chunks is "
                        "priced as all its chunks' layers. auto needs a batch: run plan --placement auto and "
                        "give the split it prints")


def cost_rows(setup: CostSetup, shapes: list[tuple[int, int, Optional[int]]],
              stage: Optional[int] = None) -> list[dict]:
    """One dict per shape: ``fw_ms``, ``bw_ms``, ``stored_mib``, ``peak_mib`` (and the shape)."""
    enc_dec = setup.model.is_encoder_decoder
    c = setup.cost_model.stage_cost([s[0] for s in shapes], [s[1] for s in shapes],
                                    [s[2] for s in shapes] if enc_dec else None,
                                    recompute=setup.recompute, stage=stage)
    rows = []
    for i, (mbs, seq, dec) in enumerate(shapes):
        row = {"mbs": mbs, "seqlen": seq}
        if enc_dec:
            row["dec_seqlen"] = dec
        row.update(fw_ms=float(c.fw_ms[i]), bw_ms=float(c.bw_ms[i]), stored_mib=float(c.stored_mib[i]),
                   peak_mib=float(c.peak_mib[i]))
        rows.append(row)
    return rows


def run(args: argparse.Namespace) -> int:
    """Run ``cost`` with parsed ``args``; the process exit status (0: done)."""
    setup = cost_setup_from_args(args)
    if args.placement == "auto":
        example = "6+0,5+1,0+7" if setup.model.is_encoder_decoder else "12,12,8"
        raise DynaPipeError(f"--placement auto chooses the split on a batch of lengths, and cost prices shapes; "
                            f"run plan --lengths FILE ... --placement auto and give the split it prints "
                            f"(such as --placement {example}), or even.")
    from dynapipe.cli.placement_options import apply_placement

    setup, _ = apply_placement(args, setup, None)
    shapes = [parse_shape(s, setup.model.is_encoder_decoder) for s in args.shape]
    for text, shape in zip(args.shape, shapes):
        check_shape(text, shape, setup.model, setup.tp)
    if args.stage is not None and not 0 <= args.stage < args.stages:
        raise DynaPipeError(f"--stage {args.stage}: stages are numbered 0 to {args.stages - 1}.")
    json.dump(cost_rows(setup, shapes, args.stage), sys.stdout, indent=2)
    sys.stdout.write("\n")
    for text, shape in zip(args.shape, shapes):
        for line in extrapolation_notes(setup.cost_model, [shape]):
            print(f"note: --shape {text}: {line}.", file=sys.stderr)
    return 0


def extrapolation_notes(cost_model, shapes) -> list[str]:
    """One line per profile axis that ``shapes`` (``(mbs, seqlen[, dec_seqlen])``, tokens) pass
    beyond the profile's measured grid, where they are priced by extrapolation; none for the
    analytic model."""
    beyond = getattr(cost_model, "beyond_grid", None)
    if beyond is None or not len(shapes):
        return []
    top = [max(int(s[i] or 0) if len(s) > i else 0 for s in shapes) for i in range(3)]
    return [f"{axis} is beyond the profile's grid and priced by extrapolation; measure a profile that "
            f"covers it (`python -m dynapipe profile ... {flag} ...` up to {value}) to price it from measurements"
            for axis, flag, value in beyond(*top)]
