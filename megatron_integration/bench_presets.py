"""What ``python -m dynapipe bench`` trains: the methods and the presets.

:data:`METHOD_FLAGS` gives every method's Megatron flags (DynaPipe, DynaPipe's
micro-batches under plain 1F1B or the zero-bubble schedule, megatron-core's padding, per-micro-batch padding and
packing baselines, and packing with per-sample attention through the DynaPipe executor's schedule search). Two presets (:data:`PRESETS`): ``tiny`` (the quick start: hidden 64 at
1,024 tokens, where attention is most of a layer's FLOPs) and ``representative`` (a shape
whose attention share of the layer FLOPs matches GPT-7B at 4,096 tokens).
:func:`with_defaults` completes a command line with a preset's arguments, :func:`flag_value`
reads one back.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping, Optional, Sequence

from megatron_integration.args_megatron import shadowed_by

METHOD_FLAGS = {
    "dynapipe": ["--use-dynapipe"],
    # DynaPipe's micro-batches under plain 1F1B: the gain of cutting without the schedule search.
    "dynapipe-1f1b": ["--use-dynapipe", "--dynapipe-schedule", "1f1b"],
    # The same micro-batches under the zero-bubble schedule (each backward split in two).
    "dynapipe-zb": ["--use-dynapipe", "--dynapipe-schedule", "zb-h1"],
    # DynaPipe's rows with each sample's attention alone (the padding tails skipped): the same
    # kernel as packing-per-sample's and packing-search's, so those pairs compare the cut alone.
    "dynapipe-per-sample": ["--use-dynapipe", "--dynapipe-padded-attention", "per-sample"],
    "padding": ["--dynapipe-batching", "padding"],
    # Each micro-batch padded to its own longest sample (megatron-core's variable_seq_lengths).
    "padding-mb": ["--dynapipe-batching", "padding-mb"],
    # Megatron's packing with per-sample positions and attention isolation: the same loss as the others.
    "packing": ["--dynapipe-batching", "packing", "--reset-position-ids", "--reset-attention-mask"],
    # The same rows, each sample's attention computed alone: no work between samples, as
    # Transformer Engine's THD format does on GPUs (megatron_integration/segment_attention.py).
    "packing-per-sample": ["--dynapipe-batching", "packing", "--reset-position-ids", "--reset-attention-mask",
                           "--dynapipe-packed-attention", "per-sample"],
    # The same per-sample rows through the DynaPipe executor, given its schedule search (schedule,
    # order and recompute per stage): the strongest packing, with DynaPipe's schedule freedom.
    "packing-search": ["--use-dynapipe", "--dynapipe-batching", "packing", "--reset-position-ids",
                       "--reset-attention-mask", "--dynapipe-packed-attention", "per-sample"],
}
BASELINES = ("padding", "padding-mb", "packing", "packing-per-sample", "packing-search")
DYNAPIPE_METHODS = ("dynapipe", "dynapipe-1f1b", "dynapipe-zb", "dynapipe-per-sample")
#: The methods the DynaPipe executor runs (planned with the bench's profile, traced); the other
#: baselines run through megatron-core's schedule.
EXECUTOR_METHODS = DYNAPIPE_METHODS + ("packing-search",)

# --manual-gc (Megatron-LM's): measured in a T5 bench job, one threshold-triggered full
# collection took 190 ms on both ranks in the middle of a run (a third of an iteration); with
# the collector off during training, collections happen before the first iteration instead.
_COMMON = {"--lr": "1e-4", "--hidden-dropout": "0", "--attention-dropout": "0", "--log-interval": "1",
           "--seed": "1234", "--vocab-size": "512", "--pipeline-model-parallel-size": "2", "--manual-gc": None}
#: --dynapipe-cpu-pretouch-mb of the CPU presets: every rank's heap written once at start-up, so
#: no method's timed iterations pay for memory faulted in for the first time (a long run pays it
#: once, early). A DynaPipe stage of the tiny GPT reached a new high in a timed iteration, 64 MiB
#: taking 270 ms of system time; 1 GiB covers every preset's stage with room (the report shows
#: what is left).
CPU_PRETOUCH_MB = 1024


@dataclass(frozen=True)
class Preset:
    """Default arguments and protocol of a bench preset. ``sweep_top``: how many of the
    baselines' micro-batch sizes (best simulated first) run for real; 0 keeps
    ``--micro-batch-size``. ``sweep_within``: of those, only sizes simulated at least
    ``1 - sweep_within`` times the best simulated throughput run (0: all ``sweep_top``).
    ``profile_mbs``: micro-batch sizes the cost profile measures (larger ones scale
    linearly from the largest). ``calibrate_iters``: iterations of an untimed DynaPipe run
    after profiling, from whose traces the profile's fixed cost per stage op is fitted
    (:mod:`megatron_integration.bench_calibrate`; 0: none). ``profile_levels``: also
    profile the recompute levels (else derived; the baselines never recompute here).
    ``sweep_top_of``: ``sweep_top`` of single methods (when the preset's applies).
    ``cpu_pretouch_mb``: ``--dynapipe-cpu-pretouch-mb`` of every rank on a host without CUDA
    (:func:`host_defaults`)."""

    args: dict
    methods: tuple[str, ...]
    rounds: int
    sweep_top: int
    warmup_iters: int
    about: str
    profile_repeats: int = 3
    sweep_within: float = 0.0
    profile_mbs: tuple[int, ...] = (1, 2, 4, 8)
    calibrate_iters: int = 0
    profile_levels: bool = True
    sweep_top_of: dict = field(default_factory=dict)
    cpu_pretouch_mb: int = CPU_PRETOUCH_MB


# Every preset plans one iteration ahead (--dynapipe-prefetch 2): the next iteration's planning
# then shares the cores with the timed iterations, as all through a long run. With the default 4
# and 4 iterations, every plan would be made during the untimed warm-up.
PRESETS = {
    # The README's quick start: the tiny GPT, 2 stages, the mixture at 1,024 tokens, one round.
    "tiny": Preset(
        args={"--num-layers": "4", "--hidden-size": "64", "--num-attention-heads": "4", "--ffn-hidden-size": "256",
              "--seq-length": "1024", "--max-position-embeddings": "1024", "--micro-batch-size": "4",
              "--global-batch-size": "64", "--train-iters": "4", "--dynapipe-prefetch": "2", **_COMMON},
        # Each baseline at its best simulated micro-batch size (a fixed --micro-batch-size 4 ran
        # packing at its slowest: two micro-batches a replica on two stages).
        methods=("dynapipe", "dynapipe-per-sample", "padding", "packing", "packing-per-sample", "packing-search"),
        rounds=1, sweep_top=1,
        warmup_iters=1,
        # Padding's rows are all 1,024 tokens, so its sizes simulate within a few percent of each
        # other while their working sets differ 16-fold: at 16 rows a stage outgrew the
        # pre-touched heap and paid 2.5 s of page faults an iteration. Its two best sizes run when
        # they simulate within 5%, and the faster measured one counts.
        sweep_top_of={"padding": 2}, sweep_within=0.05,
        about="tiny GPT (hidden 64) at 1,024 tokens: attention dominates, the quick demo"),
    # Hidden = sequence length with FFN 4h: on full rows the attention core is 4s/(4s + 24h) = 1/7 of a
    # layer's FLOPs, as GPT-7B's at 4,096 tokens. One layer a stage keeps it within minutes on 2 cores.
    "representative": Preset(
        args={"--num-layers": "2", "--hidden-size": "512", "--num-attention-heads": "8", "--ffn-hidden-size": "2048",
              "--seq-length": "512", "--max-position-embeddings": "512", "--micro-batch-size": "1",
              "--global-batch-size": "16", "--train-iters": "4", "--dynapipe-prefetch": "2", **_COMMON},
        # The two best simulated sizes of padding-mb and packing both run: a profile measured on a
        # loaded machine can misrank them. The profile stops at 4 samples (8 x 512 tokens costs as
        # much to measure as all smaller shapes together).
        methods=("dynapipe", "dynapipe-1f1b", "dynapipe-per-sample", "padding", "padding-mb", "packing",
                 "packing-per-sample", "packing-search"), rounds=2,
        sweep_top=2,
        warmup_iters=1, profile_repeats=2, sweep_within=0.0, profile_mbs=(1, 2, 4), calibrate_iters=3,
        profile_levels=False,
        # Padding to --seq-length is twice as slow as any other baseline at this shape: a second
        # size of it cannot change which baseline is best, and its runs are the longest.
        sweep_top_of={"padding": 1},
        about="GPT-7B's attention share of layer FLOPs (hidden 512 at 512 tokens), tuned baselines"),
}
PROFILE_MBS = (1, 2, 4, 8)  # the default of Preset.profile_mbs
PROFILE_SEQLENS = (32, 64, 128, 256, 512, 1024)
# GPT-7B at this sequence length is the attention-share reference (issue: within 5 points).
REFERENCE_SEQ_LENGTH = 4096


def host_defaults(nproc: int, cpu_pretouch_mb: int) -> dict:
    """The settings a bench adds for this host where the command line does not give them:
    ``--dynapipe-cpu-affinity`` (``cores`` where each of ``nproc`` ranks gets a core) and, without
    CUDA, ``--dynapipe-cpu-pretouch-mb`` (MiB; GPU ranks keep activations in device memory, where
    the flag is refused)."""
    import torch

    from megatron_integration.cpu_affinity import bench_default

    out = {"--dynapipe-cpu-affinity": bench_default(nproc)}
    if not torch.cuda.is_available():
        out["--dynapipe-cpu-pretouch-mb"] = str(int(cpu_pretouch_mb))
    return out


def with_defaults(argv: Sequence[str], preset: str = "tiny") -> list[str]:
    """``argv`` plus every default of the preset it does not set (and ``--mock-data`` unless
    data is given)."""
    return fill_defaults(argv, PRESETS[preset].args)


def fill_defaults(argv: Sequence[str], defaults: Mapping[str, Optional[str]]) -> list[str]:
    """``argv`` plus every ``defaults`` flag it does not set, and ``--mock-data`` unless it
    names data (``--data-path``); a bench preset's command line, GPT or T5. A ``None`` value
    is a switch (``--manual-gc``)."""
    out = list(argv)
    typed = {a.split("=")[0] for a in out if a.startswith("--")}
    given = typed | shadowed_by(typed)  # a flag typed, or one that an alternative typed replaces
    for flag, value in defaults.items():
        if flag not in given:
            out += [flag] if value is None else [flag, value]
    if "--mock-data" not in given:  # no data given
        out.append("--mock-data")
    return out


def one_replica_ranks(argv: Sequence[str]) -> int:
    """Ranks of one data-parallel replica of ``argv``: a rank for every pipeline stage and
    tensor-parallel shard (the bench's default ``--nproc``)."""
    return (int(flag_value(argv, "--pipeline-model-parallel-size", "1"))
            * int(flag_value(argv, "--tensor-model-parallel-size", "1")))


def flag_value(argv: Sequence[str], flag: str, default: Optional[str] = None) -> Optional[str]:
    """The value ``argv`` gives ``flag`` (``--flag value`` or ``--flag=value``), else ``default``."""
    value = default
    for i, a in enumerate(argv):  # the last occurrence wins, as with argparse
        if a == flag and i + 1 < len(argv):
            value = argv[i + 1]
        elif a.startswith(flag + "="):
            value = a.split("=", 1)[1]
    return value
