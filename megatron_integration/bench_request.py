"""What a GPT bench request trains, and whether it can be honoured.

An :class:`Entry` is one run (a method, at a micro-batch size for the baselines);
:func:`check_request` refuses, before any process starts, a request the bench would
override, drop or fail on, in one line naming the value. :func:`refuse_unread_bench_flags`
is shared with the T5 bench.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

from dynapipe.errors import DynaPipeError
from megatron_integration.args_dynapipe import without_unused_dynapipe_flags
from megatron_integration.bench_checks import check_warmup_iters
from megatron_integration.bench_presets import (BASELINES, EXECUTOR_METHODS, METHOD_FLAGS, PRESETS, flag_value,
                                                one_replica_ranks, with_defaults)


@dataclass(frozen=True)
class Entry:
    """One thing to train: a method, at a micro-batch size for the baselines (None: as given)."""

    method: str
    micro_batch_size: Optional[int] = None

    @property
    def label(self) -> str:
        return self.method if self.micro_batch_size is None else f"{self.method}@mbs{self.micro_batch_size}"

    def argv(self, argv: Sequence[str]) -> list[str]:
        flags = METHOD_FLAGS[self.method]
        # The DynaPipe runs' planner and executor settings are refused by the baselines.
        out = (list(argv) if "--use-dynapipe" in flags else without_unused_dynapipe_flags(argv, False)) + flags
        if self.micro_batch_size is not None:
            out += ["--micro-batch-size", str(self.micro_batch_size)]
        return out


def method_list(text: str) -> list[str]:
    """``--methods`` as a list; an empty entry (``dynapipe,``) is a typo, refused."""
    methods = [m.strip() for m in text.split(",")]
    if not text.strip() or not all(methods):
        raise DynaPipeError(f"--methods {text!r}: an empty entry; name methods separated by commas.")
    return methods


def refuse_unread_bench_flags(argv: Sequence[str], methods: Sequence[str]) -> None:
    """Refuse training flags the bench would override or drop for its runs (GPT and T5):
    ``--dynapipe-trace-dir`` (every DynaPipe run's trace goes next to ``--output``),
    ``--save`` (the runs train one after another: each would overwrite the last one's
    checkpoints, and with ``--load`` on the same folder resume from them), and
    ``--dynapipe-schedule`` where a method named fixes its own schedule or none is DynaPipe."""
    save = flag_value(argv, "--save")
    saving = [f for f in ("--save-interval", "--save-retain-interval") if flag_value(argv, f) is not None]
    if save is not None or saving:
        # The checkpoint flags together: refusing --save-interval for want of a --save the bench
        # then refuses would send the user round in a circle.
        given = " ".join(f"{f} {flag_value(argv, f)}" for f in ["--save", *saving] if flag_value(argv, f) is not None)
        raise DynaPipeError(f"{given}: the bench trains every method and micro-batch size in turn from the same "
                            f"start, so each run would overwrite the last one's checkpoints (and a --load of the "
                            f"same folder would resume from them), and saving would be timed; drop "
                            f"{'it' if len(given.split()) == 2 else 'them'}.")
    trace = flag_value(argv, "--dynapipe-trace-dir")
    if trace is not None:
        raise DynaPipeError(f"--dynapipe-trace-dir {trace}: the bench writes every DynaPipe run's executor trace "
                            f"next to --output (OUTPUT.traces/); drop it.")
    schedule = flag_value(argv, "--dynapipe-schedule")
    if schedule is None:
        return
    fixed = [m for m in methods if "--dynapipe-schedule" in METHOD_FLAGS.get(m, ())]
    if fixed:
        raise DynaPipeError(f"--dynapipe-schedule {schedule} would be overridden for {', '.join(fixed)}, which "
                            f"run(s) a schedule of their own; drop it, or drop them from --methods.")
    if not any(m.startswith("dynapipe") or m in EXECUTOR_METHODS for m in methods):
        raise DynaPipeError(f"--dynapipe-schedule {schedule}: --methods {','.join(methods)} runs no DynaPipe "
                            f"method (nothing through the DynaPipe executor); drop it.")


def check_request(argv: Sequence[str], methods: Sequence[str], preset: str = "tiny", *,
                  rounds: Optional[int] = None, sweep_top: Optional[int] = None,
                  warmup_iters: Optional[int] = None, nproc: Optional[int] = None,
                  calibrate_iters: Optional[int] = None) -> int:
    """Refuse a bench request it cannot honour before any process starts (DynaPipeError,
    one line naming the value); returns the number of ranks to spawn (default: one
    replica, the pipeline size times the tensor-parallel size). ``None`` arguments take the preset's value."""
    from megatron_integration.arguments import parse_training_args

    if preset not in PRESETS:
        raise DynaPipeError(f"preset {preset!r}: choose one of {', '.join(PRESETS)}.")
    p = PRESETS[preset]
    unknown = [m for m in methods if m not in METHOD_FLAGS]
    if unknown or not methods or len(set(methods)) != len(methods):
        raise DynaPipeError(f"--methods {','.join(methods)!r}: choose each at most once from "
                            f"{', '.join(METHOD_FLAGS)}.")
    if rounds is not None and rounds < 1:
        raise DynaPipeError(f"--rounds {rounds}: must be at least 1.")
    if sweep_top is not None and sweep_top < 0:
        raise DynaPipeError(f"--sweep-top {sweep_top}: must be 0 (no sweep) or more.")
    warmup = p.warmup_iters if warmup_iters is None else warmup_iters
    top = p.sweep_top if sweep_top is None else sweep_top
    given = {a.split("=")[0] for a in argv if a.startswith("--")}
    if top > 0 and "--micro-batch-size" in given and any(m in BASELINES for m in methods):
        raise DynaPipeError("--micro-batch-size: this preset tunes the baselines' micro-batch size; "
                            "add --sweep-top 0 to run the size given instead.")
    for flag in ("--use-dynapipe", "--dynapipe-batching"):
        if flag in given:
            raise DynaPipeError(f"{flag}: the bench sets the method itself; choose methods with --methods.")
    refuse_unread_bench_flags(argv, methods)
    if calibrate_iters is not None:
        check_calibrate_iters(calibrate_iters, argv, methods)
    if sweep_top is not None and not any(m in BASELINES for m in methods):
        raise DynaPipeError(f"--sweep-top {sweep_top} tunes the baselines' micro-batch sizes; --methods "
                            f"{','.join(methods)} runs none: drop it.")
    for flag in ("--num-virtual-stages-per-pipeline-rank", "--num-layers-per-virtual-pipeline-stage"):
        if flag in given:
            # Its simulated sweep, compute floor and breakdown price one chunk a rank.
            raise DynaPipeError(f"{flag}: the bench compares methods on one chunk a rank; compare DynaPipe with "
                                f"and without chunks with scripts/bench_gpt_interleaved.py.")
    for flag in ("--decoder-first-pipeline-num-layers", "--decoder-last-pipeline-num-layers",
                 "--account-for-embedding-in-pipeline-split", "--account-for-loss-in-pipeline-split",
                 "--pipeline-model-parallel-layout", "--dynapipe-placement"):
        if flag in given:
            raise DynaPipeError(f"{flag}: the GPT bench runs Megatron's even split only (its simulated sweep and "
                                f"compute floor price that split); drop it, and train another split with "
                                f"scripts/pretrain_gpt.py.")
    check_warmup_iters(warmup)
    full = with_defaults(argv, preset)
    nproc = nproc or one_replica_ranks(full)
    for m in methods:  # every method's command line, as its run gets it, before starting any process
        cfg = parse_training_args(Entry(m).argv(full), nproc)
    check_some_iteration_timed(cfg, warmup)
    return nproc


def check_calibrate_iters(calibrate_iters: int, argv: Sequence[str], methods: Sequence[str]) -> None:
    """Refuse a calibration the bench cannot run as asked: 1 iteration (the fit leaves the first,
    a warm-up, out), a negative count, a profile given with ``--dynapipe-cost-model`` (the bench
    calibrates the one it measures), or methods none of which runs the DynaPipe executor."""
    from megatron_integration.bench_presets import EXECUTOR_METHODS, flag_value

    if calibrate_iters < 0 or calibrate_iters == 1:
        raise DynaPipeError(f"--calibrate-iters {calibrate_iters}: give 0 (none) or at least 2 (the first "
                            f"iteration is a warm-up the fit leaves out).")
    if calibrate_iters and flag_value(argv, "--dynapipe-cost-model") is not None:
        raise DynaPipeError("--calibrate-iters calibrates the profile the bench measures; with "
                            "--dynapipe-cost-model given there is none to calibrate: drop one of them.")
    if calibrate_iters and not any(m.startswith("dynapipe") or m in EXECUTOR_METHODS for m in methods):
        raise DynaPipeError(f"--calibrate-iters {calibrate_iters} calibrates the plans of the DynaPipe "
                            f"executor; --methods {','.join(methods)} runs nothing through it: drop it.")


def check_some_iteration_timed(cfg, warmup: int) -> None:
    """Refuse a run of ``cfg`` (a training config, GPT's or T5's ``base``) whose iterations all
    fall in the ``warmup`` left out of the figures: by ``--train-iters`` or ``--exit-interval``."""
    if cfg.train_iters <= warmup:
        raise DynaPipeError(f"--train-iters {cfg.train_iters} leaves no timed iteration after --warmup-iters "
                            f"{warmup}; raise --train-iters.")
    if cfg.last_iteration(0) <= warmup:
        raise DynaPipeError(f"--exit-interval {cfg.exit_interval} stops every run after iteration "
                            f"{cfg.last_iteration(0)}, leaving no timed iteration after --warmup-iters {warmup}; "
                            f"drop it.")
