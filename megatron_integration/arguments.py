"""Command-line arguments in Megatron's style, and the training config built from them.

``add_megatron_args`` declares the standard Megatron-LM arguments this project reads
(same names, same meaning, same defaults where Megatron has one), so an existing
Megatron command line carries over; ``add_dynapipe_args`` adds DynaPipe's own group.
``build_parser`` gives a parser usable on its own (the project does not depend on
Megatron-LM's training scripts). ``training_config_from_args`` turns parsed arguments
into a :class:`DynaPipeTrainingConfig` and rejects invalid combinations with a
:class:`~dynapipe.errors.DynaPipeError` that names the flag and the fix.

This module assembles the parser and the config; each concept has its own module, and
every name they define stays importable from here:

* :mod:`~megatron_integration.args_megatron`: Megatron-LM's flags (declarations);
* :mod:`~megatron_integration.args_dynapipe`: DynaPipe's flags, validated into ``DynaPipeArgs``;
* :mod:`~megatron_integration.args_model`: the model shape, vocabulary padding, recompute;
* :mod:`~megatron_integration.args_training`: iterations, learning-rate schedule, optimizer;
* :mod:`~megatron_integration.args_blend`: ``--data-path`` blends;
* :mod:`~megatron_integration.args_refusals`: Megatron-LM flags and values this build refuses;
* :mod:`~megatron_integration.args_checks`: the shared one-line errors.

No torch or megatron import here: the config is plain data.
"""
from __future__ import annotations

import argparse
import os
import re
import sys
from typing import Optional, Sequence

from dynapipe.errors import DynaPipeError
from megatron_integration.args_blend import parse_blend  # noqa: F401  (re-exported)
from megatron_integration.args_checks import _need, _one_of, _positive, _unsupported, _unsupported_value
from megatron_integration.args_dynapipe import (MOCK_SAMPLES_DEFAULT, add_dynapipe_args, batching_from_args,
                                                dynapipe_args_from_args, refuse_redis_flags_without_redis,
                                                refuse_unused_dynapipe_flags)
from megatron_integration.args_megatron import add_megatron_args
from megatron_integration.args_model import (BYTE_LEVEL_VOCAB, check_uniform_recompute,  # noqa: F401
                                             model_args_from_args, padded_vocab_size, recompute_from_args)
from megatron_integration.args_refusals import (UNSUPPORTED_MEGATRON_FLAGS, _checkpoint_args_honoured,  # noqa: F401
                                                _resilience_args_honoured, refused_flag_lines,
                                                rerun_settings_from_args,
                                                refused_value_lines, unsupported_reason)
from megatron_integration.args_training import _schedule_from_samples, optimizer_args_from_args
from megatron_integration.args_layout import pipeline_split_from_args
from megatron_integration.args_checkpoint import dist_ckpt_args_from_args
from megatron_integration.args_ddp import ddp_args_from_args
from megatron_integration.args_logging import tensorboard_args_from_args
from megatron_integration.args_virtual import check_interleaved, overlap_p2p_comm
from megatron_integration.model_flags import nan_check_enabled
from megatron_integration.rerun_tracker import TrackedSkips, tracked_skips
from megatron_integration.run_config import load_run_config  # noqa: F401  (re-exported)
from megatron_integration.tensor_parallel import check_tensor_parallel_args
from megatron_integration.tokenizer import resolve_tokenizer_type
from megatron_integration.training_limits import check_exit_duration
from megatron_integration.exit_signal import exit_signal_from_args
from megatron_integration.non_persistent import non_persistent_from_args
from megatron_integration.train_config import DataArgs, DynaPipeTrainingConfig, ParallelArgs
from megatron_integration.flag_spelling import megatron_spelled


# Megatron-LM adds flags every release: say where the ones this build reads are listed.
UNKNOWN_FLAG_NOTE = (" (a flag this build neither reads nor knows as a Megatron-LM flag to refuse; the Megatron-LM "
                     "flags it reads are under Arguments in the README)")


def stray_values_note(argv: list[str], unknown: list[str]) -> str:
    """Where every unrecognized item is a value (not a flag) following a flag's one value, as in
    Megatron-LM's launch scripts' unquoted ``--split 949 50 1``: a note naming that flag; else ''."""
    if not unknown or any(u.startswith("-") for u in unknown):
        return ""
    try:
        at = next(i for i in reversed(range(len(argv) - len(unknown) + 1)) if argv[i:i + len(unknown)] == unknown)
    except StopIteration:
        return ""
    if at < 2 or not argv[at - 2].startswith("--") or argv[at - 1].startswith("-"):
        return ""
    flag, value = argv[at - 2].split("=", 1)[0], argv[at - 1]
    if flag == "--split":
        return f" (they follow --split {value}, which takes one value: --split {','.join([value, *unknown])})"
    return f" (they follow {flag} {value}, which takes one value)"


def build_parser(prog: Optional[str] = None, description: Optional[str] = None) -> argparse.ArgumentParser:
    """A standalone parser with the Megatron and DynaPipe arguments (one-line errors; a
    Megatron-LM flag this build does not take is named with the reason)."""
    from dynapipe.argparsing import StrictArgumentParser

    class MegatronArgumentParser(StrictArgumentParser):
        def parse_known_args(self, args=None, namespace=None):
            self._argv = list(sys.argv[1:] if args is None else args)
            parsed, extras = super().parse_known_args(args, namespace)
            refused = refused_flag_lines(extras)
            if refused:
                # The refused values of declared flags too, and the flags no one knows, so one
                # pass mends the whole line.
                refused += refused_value_lines(parsed)
                unknown = [item for item in extras if item.startswith("-")
                           and unsupported_reason(item.split("=", 1)[0]) is None]
                if unknown:
                    refused.append(f"{self.prog}: unrecognized arguments: {' '.join(unknown)}{UNKNOWN_FLAG_NOTE}")
                # Every rank of a torchrun job prints them (in one write): a launcher stops the
                # others once one rank exits, so a line left to rank 0 alone could be lost.
                sys.stderr.write("".join(f"error: {line}\n" for line in refused))
                sys.stderr.flush()
                self.exit(2)
            return parsed, extras

        def error(self, message: str):
            if message.startswith("unrecognized arguments:"):
                message += stray_values_note(getattr(self, "_argv", []), message.split(":", 1)[1].split()) \
                    or UNKNOWN_FLAG_NOTE
            super().error(message)

    parser = MegatronArgumentParser(prog=prog, description=description, allow_abbrev=False)
    add_megatron_args(parser)
    add_dynapipe_args(parser)
    return parser


def block_layers(parallel: ParallelArgs, num_layers: int) -> list[int]:
    """Transformer layers of every virtual stage (megatron-core's TransformerBlock of each model
    chunk) under ``parallel``."""
    chunks = parallel.virtual_pipeline_model_parallel_size or 1
    if parallel.stage_layers is not None:
        return list(parallel.stage_layers)
    return [num_layers // (parallel.pipeline_model_parallel_size * chunks)] * (
        parallel.pipeline_model_parallel_size * chunks)


def resolve_cuda(cuda: Optional[bool]) -> bool:
    """Whether a job validated with ``cuda`` runs on GPUs: ``cuda`` itself, or (None) whether
    torch sees a CUDA device here."""
    if cuda is not None:
        return cuda
    import torch

    return torch.cuda.is_available()


@megatron_spelled
def training_config_from_args(args: argparse.Namespace, world_size: int, cuda: Optional[bool] = None,
                              num_nodes: Optional[int] = None,
                              baselines_use_executor: bool = False,
                              placement_auto: Optional[bool] = None, check_profile: bool = True,
                              make_dirs: bool = True) -> DynaPipeTrainingConfig:
    """Validate parsed arguments for a job of ``world_size`` ranks and build the config.

    ``cuda`` says whether the job runs on GPUs (default: ask torch). ``num_nodes``: the nodes
    the job runs on (None: not known here; the data loader checks ``--dynapipe-planner-nodes``
    against the launched layout). ``placement_auto``: whether the split is chosen with the cost
    model at start-up (default: ``--dynapipe-placement auto``; T5 passes its own placement's).
    ``make_dirs``: create the output directories once the arguments pass (:func:`prepare_output_dirs`);
    a caller with checks of its own to run after these passes False and calls it last.
    Raises :class:`DynaPipeError` naming the offending flag for every invalid combination, as
    the user spelled it (``--encoder-seq-length`` for ``--seq-length``, Megatron-LM's other spelling).
    """
    # Megatron-LM's other spellings of the two (its validate_args fills one from the other).
    typed = [(plain, other) for plain, other in (("num-layers", "encoder-num-layers"),
                                                 ("seq-length", "encoder-seq-length"))
             if getattr(args, plain.replace("-", "_")) is None and getattr(args, other.replace("-", "_"), None)]
    args.num_layers = _one_of(args, "num-layers", "encoder-num-layers")
    args.seq_length = _one_of(args, "seq-length", "encoder-seq-length")
    try:
        cfg = _training_config(args, world_size, cuda, num_nodes, baselines_use_executor, placement_auto,
                               check_profile)
    except DynaPipeError as e:
        if not typed:
            raise
        message = str(e)
        for plain, other in typed:
            message = re.sub(rf"(?<![\w-])--{plain}\b", f"--{other}", message)
        raise DynaPipeError(message) from None
    if make_dirs:
        prepare_output_dirs(args)
    return cfg


def prepare_output_dirs(args: argparse.Namespace) -> None:
    """Create ``--save``, ``--tensorboard-dir`` and ``--dynapipe-trace-dir`` where missing and prove
    each writable, on every rank before any work: a directory only the logging rank or a failing
    rank finds unwritable would stop it alone, mid-run, while the others wait. Called once every
    other check passed, so that a refused run leaves no empty directory behind."""
    from megatron_integration.checkpoint_files import check_writable_dir

    for flag, path, what in (("--save", args.save, "the checkpoints"),
                             ("--tensorboard-dir", args.tensorboard_dir, "TensorBoard's event files"),
                             ("--dynapipe-trace-dir", args.dynapipe_trace_dir, "the traces")):
        if path:
            check_writable_dir(path, flag, what)


def _training_config(args: argparse.Namespace, world_size: int, cuda: Optional[bool], num_nodes: Optional[int],
                     baselines_use_executor: bool, placement_auto: Optional[bool],
                     check_profile: bool) -> DynaPipeTrainingConfig:
    resolve_tokenizer_type(args, "GPT2BPETokenizer")  # Megatron-LM's pretrain_gpt.py default
    cuda = resolve_cuda(cuda)
    _default_global_batch(args, world_size)
    _schedule_from_samples(args)
    for flag in ("global-batch-size", "train-iters", "lr"):
        _need(args, flag, getattr(args, flag.replace("-", "_")))
    for flag in ("global-batch-size", "train-iters", "micro-batch-size", "tensor-model-parallel-size",
                 "pipeline-model-parallel-size", "log-interval", "save-interval", "dynapipe-planner-workers",
                 "dynapipe-max-tokens", "dynapipe-tokens-per-global-batch", "dynapipe-memory-limit-mb",
                 "dynapipe-timeout-s", "dynapipe-mock-samples", "dynapipe-prefetch"):
        _positive(flag, getattr(args, flag.replace("-", "_")))
    _positive("lr", args.lr, allow_zero=True)
    _positive("dynapipe-store-retry-s", args.dynapipe_store_retry_s, allow_zero=True)
    if not 0 < args.dynapipe_redis_port < 65536:
        raise DynaPipeError(f"--dynapipe-redis-port {args.dynapipe_redis_port}: a TCP port is 1 to 65535.")
    model = model_args_from_args(args, cuda)
    parallel = _parallel_args_from_args(args, world_size, cuda)
    dp = parallel.data_parallel_size
    batching, mbs = batching_from_args(args, dp)
    if placement_auto is None:
        placement_auto = (getattr(args, "dynapipe_placement", None) or "even").strip() == "auto"
    refuse_unused_dynapipe_flags(args, baselines_use_executor, placement_auto)
    refuse_redis_flags_without_redis(args)
    recompute, level = recompute_from_args(args, max(parallel.rank_layers(args.num_layers)))
    if not placement_auto:  # an auto split is checked once chosen (training.py)
        check_uniform_recompute(recompute, block_layers(parallel, args.num_layers))
    dyn = dynapipe_args_from_args(args, cuda, batching, level, dp, num_nodes)

    from megatron_integration.data_args import (check_jsonl_tokenizer, data_sources_from_args, eval_args_from_args,
                                                is_jsonl)

    sources = data_sources_from_args(args)
    # Before the model is built (the loader's own check would come after it, and after a --load).
    # Data of JSONL files alone: a mix with indexed prefixes gets its own error (T5 refuses it).
    paths = [p for k, v in sources.items() if k.endswith("_path") for p in v]
    if paths and all(is_jsonl(p) for p in paths):
        check_jsonl_tokenizer(paths, args.tokenizer_type)
    evaluation = eval_args_from_args(args, sources)
    if args.dynapipe_mixture is not None and not os.path.isfile(args.dynapipe_mixture):
        raise DynaPipeError(f"--dynapipe-mixture {args.dynapipe_mixture!r}: no such file.")
    for flag, value, default in (("dynapipe-mixture", args.dynapipe_mixture, None),
                                 ("dynapipe-mock-samples", args.dynapipe_mock_samples, MOCK_SAMPLES_DEFAULT)):
        if value != default and not args.mock_data:
            raise DynaPipeError(f"--{flag} {value} shapes the --mock-data dataset; this run reads --data-path "
                                f"data: drop it (or add --mock-data).")
    if args.dynapipe_tokens_per_global_batch is not None and not args.use_dynapipe:
        raise DynaPipeError("--dynapipe-tokens-per-global-batch needs --use-dynapipe: the fixed-shape baselines "
                            "take --global-batch-size samples.")
    if not args.create_attention_mask_in_dataloader and args.reset_attention_mask:
        # Megatron-LM's data loader then returns no mask, so its packed samples would see each other.
        raise DynaPipeError("--no-create-attention-mask-in-dataloader drops the masks that --reset-attention-mask "
                            "needs to keep packed samples apart; give one of them.")
    data = DataArgs(mock_data=args.mock_data, **sources,
                    tokenizer_type=args.tokenizer_type, tokenizer_model=args.tokenizer_model,
                    mixture=args.dynapipe_mixture, overlong=args.dynapipe_overlong,
                    tokens_per_global_batch=args.dynapipe_tokens_per_global_batch,
                    mock_samples=args.dynapipe_mock_samples, mmap_bin_files=args.mmap_bin_files)

    optimizer = optimizer_args_from_args(args)
    if args.seed <= 0:
        raise DynaPipeError(f"--seed {args.seed}: Megatron-LM takes a positive integer seed (default 1234); "
                            f"give one.")
    _positive("num-workers", args.num_workers, allow_zero=True)
    _positive("exit-interval", args.exit_interval, allow_zero=True)  # 0: off, as Megatron-LM reads it
    _positive("check-weight-hash-across-dp-replicas-interval", args.check_weight_hash_across_dp_replicas_interval)
    from megatron_integration.manual_gc import ManualGC

    manual_gc = ManualGC(args.manual_gc, args.manual_gc_interval, args.manual_gc_eval).validate()
    for flag in ("save", "load", "tensorboard_dir", "dynapipe_trace_dir"):
        if getattr(args, flag) == "":
            # Megatron-LM reads '' as not given; here it is refused, as an unset shell variable
            # (--save $CKPT) would otherwise train for hours and write nothing.
            raise DynaPipeError(f"--{flag.replace('_', '-')} '': an empty path; give a directory, or leave the flag "
                                f"out.")
    if args.save_interval is not None and not args.save:
        raise DynaPipeError("--save-interval needs --save DIR to write the checkpoints to.")
    if args.save_retain_interval is not None:
        # Megatron-LM's asserts, as one line each.
        if not args.save or not args.save_interval:
            raise DynaPipeError(f"--save-retain-interval {args.save_retain_interval} thins the checkpoints "
                                f"--save-interval writes to --save; give both (or drop it).")
        if args.save_retain_interval < 1 or args.save_retain_interval % args.save_interval:
            raise DynaPipeError(f"--save-retain-interval {args.save_retain_interval}: must be a positive multiple "
                                f"of --save-interval {args.save_interval}, as Megatron-LM requires.")
    from megatron_integration.checkpoint_files import check_checkpoint_dirs, same_dir

    # A missing --load that is the --save directory is a self-resuming job's first launch (Megatron-LM's
    # scripts pass both the same path): it starts from scratch. Any other missing --load is a typo.
    if args.load and not os.path.isdir(args.load) and not same_dir(args.load, args.save):
        raise DynaPipeError(f"--load {args.load!r}: no such checkpoint directory (a job that resumes itself gives "
                            f"--save the same path, and starts from scratch while it holds no checkpoint).")
    check_checkpoint_dirs(args.load, args.save, args.finetune)
    _checkpoint_args_honoured(args)
    _resilience_args_honoured(args)
    rerun = rerun_settings_from_args(args)
    tracked = tracked_skips(rerun.result_rejected_tracker_filename)

    cfg = DynaPipeTrainingConfig(
        model=model, parallel=parallel, optimizer=optimizer, data=data, dynapipe=dyn,
        micro_batch_size=mbs or 1, global_batch_size=args.global_batch_size, train_iters=args.train_iters,
        seed=args.seed,
        reset_position_ids=args.reset_position_ids, reset_attention_mask=args.reset_attention_mask,
        packed_attention=args.dynapipe_packed_attention, padded_attention=args.dynapipe_padded_attention,
        save=args.save, load=args.load, save_interval=args.save_interval,
        save_retain_interval=args.save_retain_interval, non_persistent=non_persistent_from_args(args),
        load_optim=not args.no_load_optim, load_rng=not args.no_load_rng, log_interval=args.log_interval,
        log_throughput=args.log_throughput, log_params_norm=args.log_params_norm, logging_level=args.logging_level,
        tensorboard=tensorboard_args_from_args(args),
        tensorboard_dir=args.tensorboard_dir, recompute=recompute, ddp=ddp_args_from_args(args),
        check_for_nan_in_loss_and_grad=nan_check_enabled(args.check_for_nan_in_loss_and_grad, args.fp16,
                                                         args.loss_scale),
        rerun=rerun, tracked_skips=tracked,
        exit_interval=args.exit_interval, iterations_to_skip=_iterations_to_skip(args.iterations_to_skip, tracked),
        weight_hash_interval=args.check_weight_hash_across_dp_replicas_interval,
        exit_duration_in_mins=check_exit_duration(args.exit_duration_in_mins),
        exit_signal=exit_signal_from_args(args.exit_signal_handler, args.exit_signal),
        empty_unused_memory_level=args.empty_unused_memory_level, manual_gc=manual_gc, evaluation=evaluation, ckpt_format=args.ckpt_format,
        finetune=args.finetune, exit_on_missing_checkpoint=args.exit_on_missing_checkpoint,
        dist_ckpt=dist_ckpt_args_from_args(args, cuda), megatron_args=_recorded_args(args))
    if check_profile and (dyn.enabled or placement_auto) and dyn.cost_model != "analytic":
        # A profile of another model stops the job here, not after the model and data are built
        # (--dynapipe-placement auto prices every method's split with it).
        from megatron_integration.profile_check import check_profile_for_run

        check_profile_for_run(dyn.cost_model, model.to_model_config("megatron-gpt"),
                              parallel.pipeline_model_parallel_size, parallel.tensor_model_parallel_size,
                              parallel.sequence_parallel, dyn.device, dyn.device_given,
                              "transformer_engine" if model.transformer_impl == "transformer_engine" else "local")
    return cfg


def _iterations_to_skip(values, tracked: Optional[TrackedSkips] = None) -> tuple[int, ...]:
    """Megatron-LM's ``--iterations-to-skip`` (numbered from 1, as logged) with those the
    ``tracked`` file names, in order and once each; 0 or less names no iteration and is refused."""
    bad = [v for v in values or () if v < 1]
    if bad:
        raise DynaPipeError(f"--iterations-to-skip {bad[0]}: iterations are numbered from 1, as the log lines and "
                            f"Megatron-LM since core_v0.17 number them (2 skips the one logged as iteration 2); give "
                            f"numbers of at least 1.")
    return tuple(sorted(set(values or ()) | set(tracked.skip if tracked else ())))


def _check_world_size(world_size: int, tp: int, pp: int) -> None:
    """Refuse a world size that is no whole number of tensor x pipeline groups."""
    if world_size % (tp * pp):
        raise DynaPipeError(f"world size {world_size} is not divisible by --tensor-model-parallel-size {tp} x "
                            f"--pipeline-model-parallel-size {pp}; launch a multiple of {tp * pp} ranks.")


def _parallel_args_from_args(args: argparse.Namespace, world_size: int, cuda: bool) -> ParallelArgs:
    """The process layout (tensor x pipeline x data parallel ranks) and its backend, validated
    against the world size, the layer count and the device."""
    tp, pp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size
    _check_world_size(world_size, tp, pp)
    pretouch = _positive("dynapipe-cpu-pretouch-mb", getattr(args, "dynapipe_cpu_pretouch_mb", 0), allow_zero=True)
    if pretouch and not sys.platform.startswith("linux"):
        raise DynaPipeError(f"--dynapipe-cpu-pretouch-mb {pretouch} writes glibc's malloc heap, which this "
                            f"{sys.platform} host does not use: drop it.")
    if pretouch and cuda:
        raise DynaPipeError(f"--dynapipe-cpu-pretouch-mb {pretouch} writes a CPU rank's malloc heap; on GPUs the "
                            f"activations live in device memory, which PyTorch's caching allocator keeps: drop it.")
    check_tensor_parallel_args(args, cuda)
    if args.context_parallel_size != 1:
        raise _unsupported_value("--context-parallel-size", args.context_parallel_size,
                                 "no context parallelism (1, the default); split long sequences over fewer tokens "
                                 "per sample instead")
    if args.expert_model_parallel_size != 1:
        raise _unsupported_value("--expert-model-parallel-size", args.expert_model_parallel_size,
                                 "mixture-of-experts models are not built (1, the default); drop it")
    backend = args.distributed_backend or ("nccl" if cuda else "gloo")
    if backend == "nccl" and not cuda:
        raise DynaPipeError("--distributed-backend nccl needs GPUs; use gloo on CPU.")
    if backend == "gloo" and cuda:
        # The stages' tensors live on the GPUs, and gloo sends no CUDA tensor point to point (nor
        # would each rank get its own GPU: the device is set for NCCL).
        raise DynaPipeError("--distributed-backend gloo with GPUs: the stages exchange CUDA tensors, which gloo "
                            "does not send point to point; use nccl (the default on GPUs).")
    split = pipeline_split_from_args(args, pp)
    chunks = split.chunks
    check_interleaved(args, chunks, pp, world_size // (tp * pp), backend)
    timeout = _positive("distributed-timeout-minutes", args.distributed_timeout_minutes)
    return ParallelArgs(world_size=world_size, tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                        backend=backend, timeout_minutes=timeout,
                        sequence_parallel=args.sequence_parallel,
                        cpu_affinity=getattr(args, "dynapipe_cpu_affinity", "none"), cpu_pretouch_mb=pretouch,
                        virtual_pipeline_model_parallel_size=chunks, stage_layers=split.layers, auto_split=split.auto,
                        overlap_p2p_comm=overlap_p2p_comm(args, chunks))


def _default_global_batch(args: argparse.Namespace, world_size: int) -> None:
    """Megatron-LM's default ``--global-batch-size``: one micro-batch a data-parallel replica
    (``--micro-batch-size`` x the ranks over tensor x pipeline size), when both are known."""
    if args.global_batch_size is not None:
        return
    tp, pp = args.tensor_model_parallel_size or 1, args.pipeline_model_parallel_size or 1
    if tp > 0 and pp > 0:
        # The cause, not the missing batch size the default could not be computed for.
        _check_world_size(world_size, tp, pp)
    if args.micro_batch_size is None:
        budget = getattr(args, "dynapipe_tokens_per_global_batch", None)
        what = (f" (with --dynapipe-tokens-per-global-batch {budget} it sets only the evaluation batches' sample "
                f"count)" if budget else "")
        raise DynaPipeError(f"--global-batch-size is required{what}: Megatron-LM's default, --micro-batch-size x "
                            f"the data-parallel size, needs --micro-batch-size.")
    if args.micro_batch_size > 0 and tp > 0 and pp > 0:  # else the checks that follow name the flag
        args.global_batch_size = args.micro_batch_size * (world_size // (tp * pp))


def _recorded_args(args: argparse.Namespace) -> dict:
    """The parsed arguments with plain values, as a checkpoint records them (Megatron-LM's ``args``)."""
    plain = (str, int, float, bool, type(None))
    return {k: (list(v) if isinstance(v, (list, tuple)) else v) for k, v in vars(args).items() if not k.startswith("_")
            and (isinstance(v, plain) or (isinstance(v, (list, tuple)) and all(isinstance(x, plain) for x in v)))}


def parse_training_args(argv: Optional[Sequence[str]], world_size: int, cuda: Optional[bool] = None,
                        parser: Optional[argparse.ArgumentParser] = None,
                        num_nodes: Optional[int] = None) -> DynaPipeTrainingConfig:
    """Parse a Megatron-style command line and validate it into a config (``num_nodes``: see
    :func:`training_config_from_args`)."""
    parser = parser or build_parser()
    return training_config_from_args(parser.parse_args(argv), world_size, cuda, num_nodes=num_nodes)
