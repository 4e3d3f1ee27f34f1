"""DynaPipe's own arguments (Megatron style: one group, ``--dynapipe-*`` names), and their
validation into :class:`DynaPipeArgs`: the micro-batching method against Megatron's
batch sizes, the cost model, the planner workers and plan delivery.

No torch or megatron import.
"""
from __future__ import annotations

import argparse
import os
from typing import Optional, Sequence

from dynapipe.errors import DynaPipeError
from megatron_integration.args_checks import _need, _positive
from megatron_integration.cpu_affinity import AFFINITIES
from megatron_integration.train_config import DynaPipeArgs

BATCHINGS = ("dynapipe", "padding", "padding-mb", "packing", "token-budget")
# Batchings megatron-core's own 1F1B runs (without --use-dynapipe); padding-mb with variable_seq_lengths.
MEGATRON_BATCHINGS = ("padding", "padding-mb", "packing")
# With virtual-pipeline chunks 1f1b runs Megatron's interleaved 1F1B and zb-h1 its split form
# (interleaved-zb); auto searches both, and the interleaved-adaptive order.
SCHEDULES = ("auto", "adaptive", "1f1b", "zb-h1")
RECOMPUTE_CHOICES = ("auto", "none", "selective", "full")
KV_BACKENDS = ("store", "redis")
# Samples of the --mock-data dataset unless --dynapipe-mock-samples says otherwise.
MOCK_SAMPLES_DEFAULT = 65536


def add_dynapipe_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Declare DynaPipe's arguments (Megatron style: one group, ``--dynapipe-*`` names)."""
    g = parser.add_argument_group("dynapipe")
    g.add_argument("--use-dynapipe", action="store_true",
                   help="plan variable-shape micro-batches and run them through the DynaPipe executor; "
                        "without it the fixed-shape baselines run padding or packing (GPT: megatron-core's 1F1B; "
                        "T5: this project's executor on fixed-shape plans)")
    g.add_argument("--dynapipe-placement", default="even", metavar="even|auto|SPEC",
                   help="layers per pipeline stage: even (Megatron's split, default) or auto (DynaPipe's cost model "
                        "chooses from the run's first global batches so that no stage is the bottleneck; every "
                        "method runs on it); T5 also takes interleaved or ENC+DEC per stage such as 3+0,1+4 (GPT "
                        "splits are written with --pipeline-model-parallel-layout; the GPT bench runs the even "
                        "split only)")
    g.add_argument("--dynapipe-batching", default=None, choices=BATCHINGS,
                   help="micro-batching method (default: dynapipe with --use-dynapipe, padding without)")
    g.add_argument("--dynapipe-schedule", default="auto", choices=SCHEDULES,
                   help="pipeline schedule (auto: the fastest of 1f1b, adaptive and, where the stages can "
                        "split their backward, zb-h1 that fits in memory; zb-h1: 1F1B with each backward split "
                        "into an input part and a weight part that fills the bubbles, megatron-core's local "
                        "linear layers only; with virtual-pipeline chunks 1f1b and zb-h1 are their interleaved "
                        "forms)")
    g.add_argument("--dynapipe-memory-limit-mb", type=float, default=None,
                   help="device memory the plans may use, MiB (default: the device config's)")
    g.add_argument("--dynapipe-cost-model", default="analytic",
                   help="'analytic', or the path of a profile written by `python -m dynapipe profile`")
    g.add_argument("--dynapipe-device", default=None,
                   help="device config for the analytic cost model (default: cpu without CUDA; on a GPU the shipped "
                        "config of the GPU found, else h100-80gb's figures within the GPU's memory)")
    g.add_argument("--dynapipe-cluster", default=None,
                   help="cluster config for link costs (default: on CPU cpu-local; on GPUs the shipped cluster of "
                        "the device config's GPU, such as a100-8x for a100-40gb, else h100-8x)")
    g.add_argument("--dynapipe-planner-workers", type=int, default=1, help="planner worker processes per node")
    g.add_argument("--dynapipe-planner-nodes", type=int, default=0,
                   help="nodes that plan: the first N of the job, their local rank 0 hosting the planner workers "
                        "(default 0: every node); they take turns by iteration")
    g.add_argument("--dynapipe-split-replicas", action="store_true",
                   help="every planner node plans every iteration but compiles and publishes only its share of "
                        "the data-parallel replicas (replica r on planner node r mod N; at most one planner node "
                        "a replica); no effect with one planner node")
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
    g.add_argument("--dynapipe-packed-attention", default="mask", choices=("mask", "per-sample"),
                   help="how packed rows (--dynapipe-batching packing --reset-attention-mask, through megatron-core "
                        "or with --use-dynapipe the DynaPipe executor) keep samples apart: mask (Megatron's block-diagonal mask over the whole row) or "
                        "per-sample (the local attention run on each sample alone, no work between samples, as "
                        "Transformer Engine's THD format on GPUs; the same loss)")
    g.add_argument("--dynapipe-padded-attention", default="mask", choices=("mask", "per-sample"),
                   help="how DynaPipe's own micro-batches (--use-dynapipe, one sample a row, padded to the "
                        "micro-batch's longest) compute attention: mask (over the whole padded row, as Megatron's "
                        "local layers do) or per-sample (each row's real tokens only, the padding tail skipped, as "
                        "a varlen kernel such as Transformer Engine's THD format does; the planner prices each "
                        "micro-batch at that attention; the same loss)")
    g.add_argument("--dynapipe-overlong", default="truncate", choices=("truncate", "reject"),
                   help="samples longer than --seq-length: truncate (instruction samples truncated, counted and "
                        "logged; pretraining documents cut into --seq-length pieces, as Megatron's GPTDataset "
                        "does) or reject")
    g.add_argument("--dynapipe-mixture", default=None,
                   help="mixture YAML for --mock-data (default configs/data/flan-mixture.yaml)")
    g.add_argument("--dynapipe-mock-samples", type=int, default=MOCK_SAMPLES_DEFAULT,
                   help=f"samples in the --mock-data dataset (reshuffled every epoch; default {MOCK_SAMPLES_DEFAULT})")
    g.add_argument("--dynapipe-timeout-s", type=float, default=300.0,
                   help="seconds a rank waits for a plan, or (on CPU) for a peer's transfer, before failing; on "
                        "GPUs transfers wait on the NCCL stream, bounded by --distributed-timeout-minutes "
                        "(default 300)")
    g.add_argument("--dynapipe-trace-dir", default=None, help="write per-rank Chrome traces of what ran")
    g.add_argument("--dynapipe-cpu-affinity", default="none", choices=AFFINITIES,
                   help="cores: pin each rank on a host to its own equal slice of the cores (refused with fewer "
                        "cores than ranks); none: the kernel places them (default)")
    g.add_argument("--dynapipe-cpu-pretouch-mb", type=int, default=0,
                   help="CPU ranks: write this many MiB of malloc heap once at start-up, so a short run's passes "
                        "find memory already faulted in, as a long run's do (default 0: none; refused on GPUs)")
    g.add_argument("--dynapipe-recompute", default="auto", choices=RECOMPUTE_CHOICES,
                   help="recompute level the planner uses on every stage (auto: the schedule search chooses "
                        "per stage, lightest first)")
    return parser


def batching_from_args(args: argparse.Namespace, dp: int) -> tuple[str, Optional[int]]:
    """The micro-batching method (``--dynapipe-batching``, defaulted by ``--use-dynapipe``) and
    the micro-batch size it needs (samples; None where the planner cuts the micro-batches),
    validated against the global batch and the ``dp`` data-parallel replicas."""
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
    if batching != "token-budget" and args.dynapipe_max_tokens is not None:
        raise DynaPipeError(f"--dynapipe-max-tokens {args.dynapipe_max_tokens} is the budget of --use-dynapipe "
                            f"--dynapipe-batching token-budget; {batching} batching does not read it: drop it.")
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
    if args.dynapipe_packed_attention == "per-sample":
        if batching != "packing" or not args.reset_attention_mask:
            raise DynaPipeError("--dynapipe-packed-attention per-sample is how packed rows keep their samples "
                                "apart: it needs --dynapipe-batching packing with --reset-attention-mask (with or "
                                "without --use-dynapipe); drop it or use packing.")
    if args.dynapipe_padded_attention == "per-sample" and not (args.use_dynapipe and batching == "dynapipe"):
        raise DynaPipeError(f"--dynapipe-padded-attention per-sample is how DynaPipe's own micro-batches skip their "
                            f"padding: it needs --use-dynapipe with --dynapipe-batching dynapipe (the run has "
                            f"{batching} batching{'' if args.use_dynapipe else ' without --use-dynapipe'}); drop "
                            f"it, or for packed rows use --dynapipe-packed-attention per-sample.")
    return batching, mbs


# What only the planner and its loader read, with the defaults declared above: given without
# --use-dynapipe they would change nothing, so they are refused.
# What only the Redis plan store reads (--dynapipe-kv-backend redis).
REDIS_ONLY = {"redis-host": "127.0.0.1", "redis-port": 6379, "store-retry-s": 30.0}
PLANNER_ONLY = {"schedule": "auto", "planner-workers": 1, "prefetch": 4, "kv-backend": "store", **REDIS_ONLY}
# What only the executor reads: GPT's fixed-shape baselines run megatron-core's schedules.
EXECUTOR_ONLY = {"timeout-s": 300.0, "trace-dir": None}
# What prices the plans: read by the planner, and at start-up by --dynapipe-placement auto,
# which chooses the split with the planner's cost model for every method.
PRICING = {"device": None, "cluster": None, "cost-model": "analytic", "memory-limit-mb": None}


def refuse_redis_flags_without_redis(args: argparse.Namespace) -> None:
    """Refuse a Redis setting given while the plans go through the job's own store."""
    if args.dynapipe_kv_backend == "redis":
        return
    for flag, default in REDIS_ONLY.items():
        value = getattr(args, "dynapipe_" + flag.replace("-", "_"))
        if value != default:
            raise DynaPipeError(f"--dynapipe-{flag} {value} sets the Redis plan store; plans go through "
                                f"--dynapipe-kv-backend {args.dynapipe_kv_backend}: add --dynapipe-kv-backend redis "
                                f"or drop it.")


def _unused(baselines_use_executor: bool, placement_auto: bool) -> dict:
    return dict(PLANNER_ONLY, **({} if baselines_use_executor else EXECUTOR_ONLY),
                **({} if placement_auto else PRICING))


def refuse_unused_dynapipe_flags(args: argparse.Namespace, baselines_use_executor: bool,
                                 placement_auto: bool = False) -> None:
    """Refuse a ``--dynapipe-*`` flag that nothing reads without ``--use-dynapipe``: the planner's,
    the cost model's unless ``placement_auto`` (``--dynapipe-placement auto`` prices splits with
    it), and, where the baselines run megatron-core's schedules, the executor's."""
    if args.use_dynapipe:
        return
    for flag, default in _unused(baselines_use_executor, placement_auto).items():
        value = getattr(args, "dynapipe_" + flag.replace("-", "_"))
        if value != default:
            where = ("the DynaPipe planner" if flag in PLANNER_ONLY else
                     "the DynaPipe planner (and --dynapipe-placement auto)" if flag in PRICING else
                     "the DynaPipe executor")
            raise DynaPipeError(f"--dynapipe-{flag} {value} is read by {where}, which runs with --use-dynapipe "
                                f"only; add --use-dynapipe or drop it.")


def without_unused_dynapipe_flags(argv: Sequence[str], baselines_use_executor: bool) -> list[str]:
    """``argv`` less the flags :func:`refuse_unused_dynapipe_flags` refuses without
    ``--use-dynapipe`` (each with its value): a bench that gives every method the same
    command line passes the DynaPipe runs' settings to those runs only."""
    names = set(_unused(baselines_use_executor, _placement_of(argv) == "auto"))
    flags = {f"--dynapipe-{n}" for n in names}
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a in flags:
            skip = True
        elif a.split("=", 1)[0] not in flags:
            out.append(a)
    return out


def _placement_of(argv: Sequence[str]) -> str:
    """The last ``--dynapipe-placement`` value of a command line (``even`` when not given)."""
    value = "even"
    for i, a in enumerate(argv):
        if a == "--dynapipe-placement" and i + 1 < len(argv):
            value = argv[i + 1]
        elif a.startswith("--dynapipe-placement="):
            value = a.split("=", 1)[1]
    return value.strip()


def dynapipe_args_from_args(args: argparse.Namespace, cuda: bool, batching: str, recompute: Optional[str],
                            dp: int, num_nodes: Optional[int]) -> DynaPipeArgs:
    """DynaPipe's planner, executor and loader settings, validated; ``batching`` from
    :func:`batching_from_args`, ``recompute`` the planner's fixed level (None: it chooses),
    ``dp`` the data-parallel replicas, ``num_nodes`` the job's nodes (None: not known yet)."""
    cost_model = args.dynapipe_cost_model
    if cost_model != "analytic" and os.path.isdir(cost_model):
        raise DynaPipeError(f"--dynapipe-cost-model {cost_model!r} is a directory; give the profile JSON file in it "
                            f"(`python -m dynapipe profile --output FILE` writes one), or 'analytic'.")
    if cost_model != "analytic" and not os.path.isfile(cost_model):
        raise DynaPipeError(f"--dynapipe-cost-model {cost_model!r}: no such profile file; use 'analytic' or "
                            f"write a profile with `python -m dynapipe profile --output {cost_model}`.")
    planner_nodes, split = planner_nodes_from_args(args, dp, num_nodes)
    _check_named_configs(args, cuda)
    _check_redis_host(args.dynapipe_redis_host)
    device = args.dynapipe_device or ("h100-80gb" if cuda else "cpu")
    split_backward = _split_backward(args, cuda)
    return DynaPipeArgs(
        enabled=args.use_dynapipe, batching=batching, schedule=args.dynapipe_schedule,
        memory_limit_mb=args.dynapipe_memory_limit_mb, cost_model=cost_model,
        device=device, device_given=args.dynapipe_device is not None,
        cluster=args.dynapipe_cluster or default_cluster(device, cuda), cluster_given=args.dynapipe_cluster is not None,
        planner_workers=args.dynapipe_planner_workers, planner_nodes=planner_nodes, split_replicas=split,
        prefetch=args.dynapipe_prefetch,
        kv_backend=args.dynapipe_kv_backend, redis_host=args.dynapipe_redis_host,
        redis_port=args.dynapipe_redis_port, store_retry_s=args.dynapipe_store_retry_s,
        max_tokens=args.dynapipe_max_tokens,
        timeout_s=args.dynapipe_timeout_s, trace_dir=args.dynapipe_trace_dir, recompute=recompute,
        split_backward=split_backward)


def default_cluster(device: str, cuda: bool) -> str:
    """The cluster config a run plans with when ``--dynapipe-cluster`` is not given: ``cpu-local``
    on CPU; on GPUs the shipped cluster of the device config's GPU (``a100-40gb`` ->
    ``a100-8x``: an A100's links are half an H100's), else ``h100-8x``."""
    from dynapipe.cost.profile_device import shipped_cluster_for_device

    if not cuda:
        return "cpu-local"
    return shipped_cluster_for_device(device) or "h100-8x"


def _split_backward(args: argparse.Namespace, cuda: bool) -> bool:
    """Whether the stages get a splittable backward (``DynaPipeArgs.split_backward``): for
    ``zb-h1``, refusing what it cannot honour yet; for ``auto``, where it could run. Never for
    the baselines (without ``--use-dynapipe``): their plans are whole 1F1B, and the split's
    own accumulation would only slow them. Virtual-pipeline chunks split too (``interleaved-zb``)."""
    if args.dynapipe_schedule not in ("zb-h1", "auto") or not args.use_dynapipe:
        return False
    # With --transformer-impl transformer_engine (Megatron-LM's default) the GPU stages are built
    # from its layers, whose weight gradients are not deferred.
    te = cuda and args.transformer_impl == "transformer_engine"
    if args.dynapipe_schedule == "auto":
        return not te
    if te:
        raise DynaPipeError("--dynapipe-schedule zb-h1 splits the backward of megatron-core's own linear "
                            "layers; with --transformer-impl transformer_engine (Megatron-LM's default) the GPU "
                            "stages use Transformer Engine's layers, which it does not split yet. Use "
                            "--transformer-impl local, or --dynapipe-schedule auto or 1f1b.")
    return True


def _check_named_configs(args: argparse.Namespace, cuda: bool) -> None:
    """Read ``--dynapipe-device`` / ``--dynapipe-cluster`` now, so a misspelt name stops the job
    at start-up, under its flag, not when the planner first prices a batch; refuse a GPU's device
    config for ranks without CUDA."""
    from dynapipe.config import load_cluster_config, load_device_config

    for flag, name, load in (("--dynapipe-device", args.dynapipe_device, load_device_config),
                             ("--dynapipe-cluster", args.dynapipe_cluster, load_cluster_config)):
        if name is not None:
            try:
                loaded = load(name)
            except DynaPipeError as e:
                raise DynaPipeError(f"{flag} {name}: {e}") from None
            if flag == "--dynapipe-device" and not cuda and loaded.dropout_mask_bytes:
                # Its activation figures are CUDA's (a dropout mask of 1 byte where a CPU keeps the
                # activation's dtype): plans on CPU ranks would promise less memory than they use.
                raise DynaPipeError(f"--dynapipe-device {name}: its dropout_mask_bytes {loaded.dropout_mask_bytes} "
                                    f"is CUDA's (a bool mask), and these ranks train on CPUs, whose "
                                    f"dropout keeps its mask in the activation's dtype; use --dynapipe-device cpu, "
                                    f"or set dropout_mask_bytes: 0 in the config.")


def _check_redis_host(host: str) -> None:
    """Refuse a URL or ``host:port`` as ``--dynapipe-redis-host``: it would be looked up as a
    host name and fail only after ``--dynapipe-store-retry-s`` of retries."""
    if "://" in host or (host.count(":") == 1 and host.rsplit(":", 1)[1].isdigit()):
        raise DynaPipeError(f"--dynapipe-redis-host {host!r}: give the server's host name or address alone; its "
                            f"port goes in --dynapipe-redis-port.")


def planner_nodes_from_args(args: argparse.Namespace, dp: int, num_nodes: Optional[int]) -> tuple[int, bool]:
    """``--dynapipe-planner-nodes`` and ``--dynapipe-split-replicas``, validated (see
    :func:`check_planner_nodes`); both need ``--use-dynapipe``, the only path that plans."""
    planner_nodes = _positive("dynapipe-planner-nodes", args.dynapipe_planner_nodes, allow_zero=True)
    split = args.dynapipe_split_replicas
    if not args.use_dynapipe and (planner_nodes or split):
        flag = f"--dynapipe-planner-nodes {planner_nodes}" if planner_nodes else "--dynapipe-split-replicas"
        raise DynaPipeError(f"{flag} needs --use-dynapipe: without it every rank cuts its own fixed-shape "
                            f"micro-batches and nothing is planned.")
    check_planner_nodes(planner_nodes, split, num_nodes, dp)
    return planner_nodes, split


def check_planner_nodes(planner_nodes: int, split_replicas: bool, num_nodes: Optional[int], dp: int) -> None:
    """Refuse planner nodes the job cannot honour: more than its ``num_nodes`` nodes (None: not
    known, as when the command line is parsed outside torchrun; the data loader's caller checks
    again with the launched layout), or, when splitting, more than its ``dp`` data-parallel
    replicas (a node would have no replica to plan). Splitting over one planner node is
    accepted: that node plans every replica, exactly as without the flag."""
    if planner_nodes < 0:
        raise DynaPipeError(f"--dynapipe-planner-nodes {planner_nodes}: must be non-negative (0: every node plans).")
    if num_nodes is not None and planner_nodes > num_nodes:
        raise DynaPipeError(f"--dynapipe-planner-nodes {planner_nodes}: the job runs on {num_nodes} node(s); "
                            f"give at most {num_nodes} (0: every node plans).")
    if split_replicas and planner_nodes > dp:
        raise DynaPipeError(f"--dynapipe-planner-nodes {planner_nodes} --dynapipe-split-replicas: the job has "
                            f"{dp} data-parallel replica(s) to share out; give at most {dp} planner nodes, or "
                            f"drop --dynapipe-split-replicas (the nodes then take turns by iteration).")
