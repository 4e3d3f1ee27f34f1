"""The configuration of a training run: plain, validated dataclasses (no torch, no megatron).

:func:`megatron_integration.arguments.training_config_from_args` builds a
:class:`DynaPipeTrainingConfig` from Megatron-style arguments; everything else in the
integration reads the run's settings from it. The model's own shape,
:class:`~megatron_integration.gpt_model_args.GPTModelArgs`, is importable from here too.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from megatron_integration.gpt_model_args import GPTModelArgs
from megatron_integration.manual_gc import ManualGC
from megatron_integration.rerun_settings import RerunSettings
from megatron_integration.non_persistent import NonPersistentArgs
from megatron_integration.rerun_tracker import TrackedSkips


@dataclass(frozen=True)
class ParallelArgs:
    """Process layout: world = tensor x pipeline x data parallel ranks."""

    world_size: int
    tensor_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    backend: str = "gloo"
    timeout_minutes: float = 10.0
    # Megatron's --sequence-parallel: norms, dropout and the activations between stages are
    # split along the sequence over the tensor-parallel ranks.
    sequence_parallel: bool = False
    # --dynapipe-cpu-affinity: "cores" pins each local rank to its own slice of the host's
    # cores (megatron_integration.cpu_affinity), "none" leaves placement to the kernel.
    cpu_affinity: str = "none"
    # --dynapipe-cpu-pretouch-mb: MiB of malloc heap a CPU rank writes once at start-up
    # (megatron_integration.cpu_allocator.pretouch_heap); 0: none.
    cpu_pretouch_mb: int = 0
    # Megatron's interleaved pipeline: model chunks per pipeline rank (None: one, no interleaving),
    # and whether megatron-core's interleaved schedule (the baselines) overlaps its transfers
    # (Megatron-LM's default with chunks; --no-overlap-p2p-communication turns it off).
    virtual_pipeline_model_parallel_size: Optional[int] = None
    overlap_p2p_comm: bool = False
    # Transformer layers of every virtual stage (virtual stage k: chunk k // P of rank k % P) when
    # Megatron's uneven split flags ask for one; None: the even split.
    stage_layers: Optional[tuple[int, ...]] = None
    # --dynapipe-placement auto: stage_layers is chosen at start-up by the planner's cost model
    # (megatron_integration.placement_auto.resolve_gpt_split), before any stage is built.
    auto_split: bool = False

    def rank_layers(self, num_layers: int) -> list[int]:
        """Transformer layers of every pipeline rank (all its chunks), of a ``num_layers`` model."""
        pp = self.pipeline_model_parallel_size
        if self.stage_layers is None:
            return [num_layers // pp] * pp
        return [sum(self.stage_layers[p::pp]) for p in range(pp)]

    @property
    def data_parallel_size(self) -> int:
        return self.world_size // (self.tensor_model_parallel_size * self.pipeline_model_parallel_size)


@dataclass(frozen=True)
class OptimizerArgs:
    """AdamW with Megatron's learning-rate schedule (warm-up, then constant/linear/cosine)."""

    lr: float
    min_lr: float = 0.0
    lr_decay_style: str = "constant"
    # Iterations; a schedule given in samples (--lr-warmup-samples / --lr-decay-samples) is
    # samples / --global-batch-size, which may be fractional: the same rates at every iteration.
    lr_warmup_iters: float = 0
    lr_decay_iters: float = 0
    lr_warmup_init: float = 0.0  # the rate the warm-up starts from (Megatron-LM's --lr-warmup-init)
    # WSD (warm-up, stable, decay): iterations of the final anneal and its shape.
    wsd_decay_iters: Optional[float] = None
    lr_wsd_decay_style: str = "exponential"
    # Iterations the weight decay moves from its start to its end value over: --train-samples /
    # --global-batch-size (fractional, as Megatron-LM counts samples), or None: --train-iters.
    wd_incr_iters: Optional[float] = None
    weight_decay: float = 0.01
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    clip_grad: float = 1.0
    distributed: bool = False  # megatron-core's distributed optimizer (ZeRO-1 over data parallel)
    optimizer: str = "adam"  # Megatron's --optimizer (Adam with decoupled weight decay)
    # On --load, Megatron's rule for the learning-rate schedule: a checkpoint whose schedule
    # differs from these arguments is refused unless one of these says which one wins.
    override_scheduler: bool = False
    use_checkpoint_scheduler: bool = False
    # fp16 loss scaling, Megatron's flags and defaults: a static --loss-scale, else a dynamic
    # scale from --initial-loss-scale, halved after --hysteresis overflowing steps (not below
    # --min-loss-scale) and doubled after --loss-scale-window clean ones.
    loss_scale: Optional[float] = None
    initial_loss_scale: float = 2.0 ** 32
    min_loss_scale: float = 1.0
    loss_scale_window: float = 1000
    hysteresis: int = 2
    # Megatron's --decoupled-lr / --decoupled-min-lr: the input embedding's and output layer's
    # own peak and minimum rates (None: the model's).
    decoupled_lr: Optional[float] = None
    decoupled_min_lr: Optional[float] = None
    # Megatron's --grad-reduce-in-bf16 (with --bf16): gradients all-reduced in bf16, not fp32.
    grad_reduce_in_bf16: bool = False
    # The DDP gradient buffers' dtype, as Megatron-LM resolves it: fp32 under --bf16 (unless
    # --grad-reduce-in-bf16); under --fp16 the parameters' fp16 unless
    # --accumulate-allreduce-grads-in-fp32.
    grad_reduce_in_fp32: bool = True
    # Megatron's weight-decay schedule: from the start to the end value over the run
    # (--weight-decay-incr-style constant, linear or cosine; None: --weight-decay throughout).
    start_weight_decay: Optional[float] = None
    # Megatron's --apply-wd-to-qk-layernorm: the query/key norm weights decay too (other norms
    # and all biases never do).
    apply_wd_to_qk_layernorm: bool = False
    end_weight_decay: Optional[float] = None
    weight_decay_incr_style: str = "constant"
    # Megatron's --log-num-zeros-in-grad: the optimizer counts the zero gradient elements.
    log_num_zeros_in_grad: bool = False

    @property
    def weight_decay_range(self) -> tuple[float, float]:
        """(start, end) weight decay of the schedule."""
        start = self.weight_decay if self.start_weight_decay is None else self.start_weight_decay
        end = self.weight_decay if self.end_weight_decay is None else self.end_weight_decay
        return start, end


@dataclass(frozen=True)
class DataArgs:
    """Where samples come from: the synthetic mixture or files, and how long ones are handled."""

    mock_data: bool
    data_path: tuple[str, ...] = ()
    data_weights: tuple[float, ...] = ()  # Megatron's blend weights, one per path (empty: no blend)
    tokenizer_type: str = "ByteLevel"
    tokenizer_model: Optional[str] = None
    mixture: Optional[str] = None
    overlong: str = "truncate"
    tokens_per_global_batch: Optional[int] = None
    mock_samples: int = 65536
    # Megatron's --split, normalised train/valid/test proportions of --data-path (empty: no
    # split, --data-path is all training data; with --mock-data each split is its own mixture).
    split: tuple[float, ...] = ()
    # Megatron's --train/valid/test-data-path (instead of --data-path), weighted like it.
    train_data_path: tuple[str, ...] = ()
    train_data_weights: tuple[float, ...] = ()
    valid_data_path: tuple[str, ...] = ()
    valid_data_weights: tuple[float, ...] = ()
    test_data_path: tuple[str, ...] = ()
    test_data_weights: tuple[float, ...] = ()
    # Megatron's --no-mmap-bin-files clears it: indexed .bin files are read, not memory-mapped.
    mmap_bin_files: bool = True
    # A resumed run's weighted training blend, sized as the checkpoint's run sized it: ("samples",
    # N) or ("tokens", T); None: sized by this run (megatron_integration.blend_resume).
    resumed_blend_size: Optional[tuple[str, int]] = None


@dataclass(frozen=True)
class EvalArgs:
    """Megatron's evaluation: ``eval_iters`` global batches of the validation set every
    ``eval_interval`` iterations (None: not during training) and of the validation and test
    sets after training; ``eval_iters`` 0 turns evaluation off."""

    eval_iters: int = 100
    eval_interval: Optional[int] = None
    eval_iters_given: bool = False  # typed, not Megatron-LM's default: refused where nothing is evaluated


@dataclass(frozen=True)
class RecomputeArgs:
    """Megatron's activation recomputation (``--recompute-granularity/-method/-num-layers``).

    ``granularity``: None (no recompute), ``selective`` (core attention) or ``full``
    (whole layers; ``method`` ``uniform`` or ``block`` and ``num_layers`` as in Megatron).
    """

    granularity: Optional[str] = None
    method: Optional[str] = None
    num_layers: Optional[int] = None

    @property
    def level(self) -> Optional[str]:
        """The planner's level this fixes (None: not fixed)."""
        return self.granularity


@dataclass(frozen=True)
class DynaPipeArgs:
    """DynaPipe's planner, executor and loader settings."""

    enabled: bool
    batching: str
    schedule: str = "auto"
    memory_limit_mb: Optional[float] = None
    cost_model: str = "analytic"
    device: str = "cpu"
    device_given: bool = False  # --dynapipe-device named on the command line (a profile's GPU model is compared)
    cluster: str = "cpu-local"
    cluster_given: bool = False  # --dynapipe-cluster named: else it follows the device config's GPU
    planner_workers: int = 1
    # Nodes that plan (0: every node), and whether they share out each iteration's replicas
    # instead of taking turns by iteration (LoaderConfig.planner_nodes / split_replicas).
    planner_nodes: int = 0
    split_replicas: bool = False
    prefetch: int = 4
    kv_backend: str = "store"
    redis_host: str = "127.0.0.1"
    redis_port: int = 6379
    store_retry_s: float = 30.0  # seconds a lost Redis connection is retried
    max_tokens: Optional[int] = None
    timeout_s: float = 300.0
    trace_dir: Optional[str] = None
    # The recompute level the planner must use (None: the schedule search chooses per stage).
    recompute: Optional[str] = None
    # Whether single-chunk stages give their linear layers a splittable backward, so that
    # plans may split it: `zb-h1`, or `auto` (which then also tries zb-h1) where the stages
    # are megatron-core's own layers and the pipeline has no virtual-pipeline chunks.
    split_backward: bool = False


@dataclass(frozen=True)
class TensorBoardArgs:
    """Megatron's TensorBoard settings (with ``--tensorboard-dir``): scalars every ``log_interval``
    iterations, at most ``queue_size`` pending events; the iteration's timers (its measured
    time split) and validation perplexity when asked for."""

    log_interval: int = 1
    queue_size: int = 1000
    log_timers: bool = False
    log_validation_ppl: bool = False
    log_loss_scale: bool = True  # cleared by --no-log-loss-scale-to-tensorboard
    log_world_size: bool = False  # --log-world-size-to-tensorboard


@dataclass(frozen=True)
class DistCkptArgs:
    """How ``torch_dist`` checkpoints are written and read, Megatron-LM's flags and defaults:
    the data-parallel replicas split the writing of what they share (``fully_parallel_save``)
    and, when asked, the reading (``fully_parallel_load``); ``strictness`` is megatron-core's
    ``StrictHandling`` for keys the checkpoint and the run do not share."""

    fully_parallel_save: bool = True
    fully_parallel_load: bool = False
    strictness: str = "assume_ok_unexpected"


@dataclass(frozen=True)
class DDPArgs:
    """megatron-core DDP's gradient reduction, Megatron-LM's flags and defaults.

    ``overlap_grad_reduce``: each bucket's data-parallel reduction starts as soon as the
    iteration's last backward has produced its gradients (else all of them are reduced in one
    bucket after the backward). Buckets hold ``bucket_size`` parameters (None: megatron-core's
    default, max(40M, 1M x data-parallel size)), or the rank's parameters over ``num_buckets``."""

    overlap_grad_reduce: bool = False
    bucket_size: Optional[int] = None
    num_buckets: Optional[int] = None
    pad_buckets_for_high_nccl_busbw: bool = False


@dataclass(frozen=True)
class DynaPipeTrainingConfig:
    """Everything one training run needs, validated. Built by :func:`training_config_from_args`."""

    model: GPTModelArgs
    parallel: ParallelArgs
    optimizer: OptimizerArgs
    data: DataArgs
    dynapipe: DynaPipeArgs
    micro_batch_size: int
    global_batch_size: int
    train_iters: int
    seed: int = 1234
    reset_position_ids: bool = False
    reset_attention_mask: bool = False
    # Packed rows' attention: Megatron's mask over the row, or each sample alone (segment_attention.py).
    packed_attention: str = "mask"
    # DynaPipe's own rows (one sample each, padded to the micro-batch's longest): attention over
    # the whole row, or over each sample's tokens alone, the padding tail skipped.
    padded_attention: str = "mask"
    save: Optional[str] = None
    load: Optional[str] = None
    save_interval: Optional[int] = None
    # Megatron's --save-retain-interval: the checkpoints kept (with the newest); None: all.
    save_retain_interval: Optional[int] = None
    # Megatron's --non-persistent-save-interval / -ckpt-type / -global-ckpt-dir
    # (megatron_integration.non_persistent).
    non_persistent: NonPersistentArgs = field(default_factory=NonPersistentArgs)
    load_optim: bool = True
    load_rng: bool = True
    log_interval: int = 100
    log_throughput: bool = False  # Megatron's --log-throughput: model TFLOP/s per GPU on the log line
    log_params_norm: bool = False  # Megatron's --log-params-norm: the parameters' L2 norm on the log line
    logging_level: Optional[int] = None  # Megatron's --logging-level: Python's root logger (None: not set)
    tensorboard_dir: Optional[str] = None
    tensorboard: TensorBoardArgs = field(default_factory=lambda: TensorBoardArgs())
    recompute: RecomputeArgs = field(default_factory=RecomputeArgs)
    ddp: DDPArgs = field(default_factory=DDPArgs)
    dist_ckpt: DistCkptArgs = field(default_factory=DistCkptArgs)
    # Megatron's --check-for-nan-in-loss-and-grad: validate the loss and gradient norm (NaN/Inf),
    # and --rerun-mode with its error injection: what a rejected result leads to.
    check_for_nan_in_loss_and_grad: bool = True
    rerun: RerunSettings = field(default_factory=RerunSettings)
    # Megatron's --exit-interval: stop (after saving, with --save) at the first multiple of it.
    exit_interval: Optional[int] = None
    # Megatron's --iterations-to-skip: iterations (numbered from 1, as logged) whose global batch is
    # consumed without training on it.
    iterations_to_skip: tuple[int, ...] = ()
    # What --result-rejected-tracker-filename named at start-up (its skips are in iterations_to_skip).
    tracked_skips: Optional[TrackedSkips] = None
    # Megatron's --check-weight-hash-across-dp-replicas-interval (None: never): the data-parallel
    # replicas' weights compared by hash at the start and after every N-th iteration.
    weight_hash_interval: Optional[int] = None
    # Megatron's --exit-duration-in-mins (None: no limit) and --empty-unused-memory-level
    # (megatron_integration.training_limits).
    exit_duration_in_mins: Optional[int] = None
    empty_unused_memory_level: int = 0
    # Megatron's --exit-signal-handler with its --exit-signal (a signal name; None: no handler).
    exit_signal: Optional[str] = None
    # Megatron's --manual-gc, --manual-gc-interval, --no-manual-gc-eval.
    manual_gc: ManualGC = field(default_factory=ManualGC)
    evaluation: EvalArgs = field(default_factory=EvalArgs)
    # Checkpoints: Megatron's --ckpt-format (torch_dist or this project's dynapipe) and --finetune
    # (weights only, from iteration 0); the parsed arguments, stored as the checkpoint's ``args``.
    ckpt_format: str = "torch_dist"
    finetune: bool = False
    # Megatron's --exit-on-missing-checkpoint: a --load that holds no checkpoint is an error.
    exit_on_missing_checkpoint: bool = False
    megatron_args: dict = field(default_factory=dict, compare=False)
    extra: dict = field(default_factory=dict, compare=False)

    @property
    def method(self) -> str:
        """``dynapipe`` (the executor path) or the megatron baseline: ``padding`` / ``packing``."""
        return "dynapipe" if self.dynapipe.enabled else self.dynapipe.batching

    @property
    def per_sample_attention(self) -> bool:
        """Whether this run's rows compute attention on each sample alone
        (:mod:`megatron_integration.segment_attention`): packed rows with
        ``--dynapipe-packed-attention per-sample``, DynaPipe's padded rows with
        ``--dynapipe-padded-attention per-sample``."""
        batching = self.dynapipe.batching if self.dynapipe.enabled else self.method
        if batching == "packing":
            return self.packed_attention == "per-sample"
        return self.dynapipe.enabled and batching == "dynapipe" and self.padded_attention == "per-sample"

    def last_iteration(self, start_iteration: int) -> int:
        """The iteration a run resumed at ``start_iteration`` stops after (``--exit-interval``
        as Megatron-LM applies it: the first multiple of it past the start whose iteration was
        trained, not skipped by ``--iterations-to-skip``, capped by ``--train-iters``)."""
        if not self.exit_interval:
            return self.train_iters
        last = (start_iteration // self.exit_interval + 1) * self.exit_interval
        # Megatron-LM decides to exit after a trained iteration only: a skipped one continues.
        while last < self.train_iters and last in self.iterations_to_skip:
            last += self.exit_interval
        return min(self.train_iters, last)

    @property
    def num_micro_batches(self) -> int:
        """Micro-batches per replica of the fixed-shape baselines."""
        return self.global_batch_size // (self.micro_batch_size * self.parallel.data_parallel_size)
