"""The parallel layouts a model can train with on a number of GPUs (tensor-parallel x
pipeline-parallel x data-parallel, the distributed optimizer on or off, model chunks per
pipeline rank), as :func:`dynapipe.advise.advise` ranks them by simulation. Tensor
parallelism stays inside a node, as Megatron places it. Pure Python + numpy: no torch.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np

from dynapipe.config import ClusterConfig, ModelConfig, TensorParallelConfig
from dynapipe.errors import DynaPipeError, arg, given, whole_number


@dataclass(frozen=True)
class Layout:
    """One way to place the model on the GPUs: ``tp x pp x dp`` GPUs, ``zero``: the
    optimizer state sharded over the ``dp`` replicas (Megatron's distributed optimizer),
    ``sp``: Megatron's sequence parallelism over the ``tp`` ranks (only with ``tp`` > 1),
    ``chunks``: model chunks a pipeline rank holds (Megatron's interleaved pipeline,
    ``--num-virtual-stages-per-pipeline-rank``; 1: the plain pipeline)."""

    tp: int
    pp: int
    dp: int
    zero: bool = False
    sp: bool = False
    chunks: int = 1

    def __post_init__(self):
        for name in ("tp", "pp", "dp", "chunks"):
            whole_number(f"layout {name}", getattr(self, name))
        if self.sp and self.tp < 2:
            raise DynaPipeError(f"{self.label()}: sequence parallelism needs TP 2 or more.")
        if self.chunks < 1 or (self.chunks > 1 and self.pp < 2):
            raise DynaPipeError(f"{self.label()}: model chunks need PP 2 or more (and at least one chunk).")

    def label(self) -> str:
        tp = f"TP{self.tp}" + (" SP" if self.sp else "")
        pp = f"PP{self.pp}" + (f" VPP{self.chunks}" if self.chunks > 1 else "")
        return f"{tp} {pp} DP{self.dp}" + (" ZeRO-1" if self.zero else "")


def default_tp_sizes(model: ModelConfig, gpus: int, cluster: Optional[ClusterConfig] = None) -> list[int]:
    """The tensor-parallel sizes worth trying: the powers of two up to the GPUs of a node
    (``gpus`` without a cluster) that divide ``gpus``, the GPUs of a node and the model's
    attention heads, query groups and FFN width."""
    per_node = cluster.gpus_per_node if cluster is not None else gpus
    out, t = [], 1
    while t <= gpus:
        if not gpus % t and _tp_fits(model, t, per_node):
            out.append(t)
        t *= 2
    return out


def _tp_fits(model: ModelConfig, tp: int, per_node: int) -> bool:
    """Whether :meth:`TensorParallelConfig.validate` takes ``tp`` (model split, inside a node)."""
    try:
        TensorParallelConfig(tp).validate(model, per_node)
    except DynaPipeError:
        return False
    return True


def enumerate_layouts(model: ModelConfig, gpus: int, cluster: Optional[ClusterConfig] = None, *,
                      tp_sizes: Optional[Sequence[int]] = None, zero: Optional[bool] = None,
                      sequence_parallel: bool = True, chunk_counts: Sequence[int] = (1,),
                      seq_length: Optional[int] = None) -> list[Layout]:
    """Every layout of ``gpus`` GPUs: TP among ``tp_sizes`` (default
    :func:`default_tp_sizes`), PP dividing the model's layers, DP the rest; with the
    distributed optimizer off and (when DP > 1, and not for encoder-decoder models, whose
    stages refuse it) on. ``zero``: only that setting (``None``: both).
    ``sequence_parallel``: layouts with TP > 1 use it where ``seq_length`` (tokens; ``None``:
    any) divides by the TP size, as Megatron-LM's ``--sequence-parallel`` requires.
    ``chunk_counts``: model chunks a rank to try with PP > 1 (Megatron's interleaved
    pipeline; counts that do not split the layers evenly, and any for encoder-decoder
    models, which interleave through their planned placement, are skipped). The plain
    pipeline (1) is always tried; default ``(1,)``: only it, since a chunked layout plans
    several times slower.
    A TP size that leaves a node, does not divide ``gpus`` or does not split the model is
    refused with the reason."""
    if isinstance(gpus, bool) or not isinstance(gpus, (int, np.integer)) or gpus < 1:
        raise DynaPipeError(f"{given('gpus', gpus)}: need a whole number of GPUs, at least one.")
    per_node = cluster.gpus_per_node if cluster is not None else gpus
    if tp_sizes is None:
        tp_sizes = default_tp_sizes(model, gpus, cluster)
    if not len(tp_sizes):
        raise DynaPipeError(f"{given('tp_sizes', list(tp_sizes))}: no tensor-parallel size to try; give at least "
                            f"one (1: none), or leave it out for the sizes that split {model.name!r} within a node.")
    for tp in tp_sizes:
        TensorParallelConfig(tp).validate(model, per_node, flag=arg("tp_sizes"))
        if gpus % tp:
            raise DynaPipeError(f"{given('tp_sizes', tp)} does not divide {given('gpus', gpus)}; use a divisor of "
                                f"{gpus}.")
    layers = model.total_layers
    out = []
    for tp in sorted(set(tp_sizes)):
        for pp in range(1, layers + 1):
            if layers % pp or gpus % (tp * pp):
                continue
            dp = gpus // (tp * pp)
            # T5 stages refuse the distributed optimizer (they sync embedding copies on whole grads).
            settings = (False, True) if dp > 1 and not model.is_encoder_decoder else (False,)
            chunks = sorted({1} | {c for c in chunk_counts if pp > 1 and not model.is_encoder_decoder
                                   and c > 1 and not layers % (pp * c)})
            sp = sequence_parallel and tp > 1 and (seq_length is None or not seq_length % tp)
            for c in chunks:
                for z in settings:
                    if zero is None or z == zero:
                        out.append(Layout(tp, pp, dp, z, sp=sp, chunks=c))
    if not out:
        raise DynaPipeError(f"no layout of {gpus} GPU(s) splits the {layers} layers of {model.name!r}: use a GPU "
                            f"count with a divisor that also divides {layers}.")
    return out


def leave_out_idle_replicas(layouts: Sequence[Layout],
                            batches: Sequence[np.ndarray]) -> tuple[list[Layout], list[tuple[Layout, str]]]:
    """``(kept, left_out)``: the layouts whose data-parallel size is at most the samples of the
    smallest of ``batches``, and the others with the reason. A replica without a sample would
    idle, and a run config for such a layout would need a larger global batch than the one
    simulated: another workload. Refuses when none is kept."""
    fewest = min(len(b) for b in batches)
    kept = [l for l in layouts if l.dp <= fewest]
    why = f"DP above the {fewest} samples of a global batch (replicas without a sample would idle)"
    left_out = [(l, why) for l in layouts if l.dp > fewest]
    if layouts and not kept:
        least = min(l.dp for l in layouts)
        raise DynaPipeError(f"every layout has more data-parallel replicas (DP{least} at the least) than the {fewest} "
                            f"samples of a global batch, so replicas would idle; raise "
                            f"{arg('tokens_per_iteration', 'the tokens of a global batch')} or use fewer "
                            f"{arg('gpus', 'GPUs')}.")
    return kept, left_out
