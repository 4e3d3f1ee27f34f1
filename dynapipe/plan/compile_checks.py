"""What both plan compilers (:mod:`dynapipe.plan.compile`, :mod:`dynapipe.plan.compile_chunked`)
refuse before compiling, in one line naming the micro-batch or argument: micro-batches no stage
could run, lengths sequence parallelism cannot shard, and tensor-parallel layouts that are not
one.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

from dynapipe.batching.types import MicroBatch
from dynapipe.config import ModelConfig
from dynapipe.errors import DynaPipeError, flag, is_whole


def check_sequence_shards(infos, shards: int) -> None:
    """Refuse a micro-batch (plan ``MicroBatchInfo``) whose padded lengths sequence parallelism
    cannot split evenly over ``shards`` tensor-parallel ranks (message shapes would be floored)."""
    bad = next((i for i in infos if i.seqlen % shards or i.dec_seqlen % shards), None)
    if bad is not None:
        length = bad.seqlen if bad.seqlen % shards else bad.dec_seqlen
        raise DynaPipeError(f"micro-batch {bad.mb} is padded to {length} tokens, which sequence parallelism "
                            f"cannot split over {shards} tensor-parallel ranks; pad micro-batches to multiples "
                            f"of {shards} (the planner does under sequence parallelism).")


def check_micro_batches(caller: str, micro_batches: Sequence[MicroBatch], model: ModelConfig) -> None:
    """Refuse, naming the micro-batch, what no stage could run: no samples (or one that is not
    an index; a micro-batch of packed rows may hold padding rows only, as the fixed-shape
    baselines fill a replica's last one), a padded length (tokens) that is not a whole number
    from 1 to the model's ``max_seq_length``, a decoder length on a decoder-only model, or
    none on an encoder-decoder one. The planner never makes these; a hand-built or edited
    list can, and its plans would validate and then fail (or compute the wrong shapes) on
    the ranks."""
    from itertools import chain

    mbs = list(micro_batches)
    t5 = model.is_encoder_decoder
    if all(type(mb) is MicroBatch for mb in mbs) and mbs:
        # One vectorised pass (plans of tens of thousands of micro-batches); the loop below
        # only runs to name what is wrong.
        seq = np.array([mb.seqlen for mb in mbs])
        dec = np.array([mb.dec_seqlen for mb in mbs])
        counts = np.array([len(mb.samples) or (mb.rows is not None and len(mb.rows)) for mb in mbs])
        samples = np.array(list(chain.from_iterable(mb.samples for mb in mbs)))
        limit = model.max_seq_length
        if (seq.dtype.kind in "iu" and dec.dtype.kind in "iu" and counts.min() >= 1
                and (not samples.size or (samples.dtype.kind in "iu" and samples.min() >= 0))
                and seq.min() >= 1 and seq.max() <= limit
                and ((dec.min() >= 1 and dec.max() <= limit) if t5 else not dec.any())):
            return
    for i, mb in enumerate(mbs):
        if not isinstance(mb, MicroBatch):
            raise DynaPipeError(f"{caller}: micro-batch {i} is a {type(mb).__name__}, not a MicroBatch.")
        if not len(mb.samples) and not mb.rows:
            raise DynaPipeError(f"{caller}: micro-batch {i} has no samples; drop it from the list.")
        samples = np.asarray(mb.samples)
        if len(samples) and (samples.dtype.kind not in "iu" or samples.min() < 0):
            raise DynaPipeError(f"{caller}: micro-batch {i} has samples {list(mb.samples)[:8]!r}; samples are "
                                f"indices into the global batch, whole numbers from 0.")
        for name, low in (("seqlen", 1), ("dec_seqlen", 1 if t5 else 0)):
            value = getattr(mb, name)
            if not is_whole(value, low) or value > model.max_seq_length:
                raise DynaPipeError(f"{caller}: micro-batch {i} has {name}={value!r}; it needs a whole number of "
                                    f"tokens from {low} to the model's max_seq_length {model.max_seq_length}.")
        if not t5 and mb.dec_seqlen:
            raise DynaPipeError(f"{caller}: micro-batch {i} has dec_seqlen={mb.dec_seqlen} but {model.name!r} is "
                                f"decoder-only; give dec_seqlen only for encoder-decoder models.")


def tensor_parallel_layout(caller: str, tp: int, sequence_parallel: bool) -> tuple[int, dict]:
    """(sequence shards of every message, the plan ``meta`` keys) of a TP layout, refused in one
    line when it is not one (``caller`` names the compiler in the error). Only TP plans carry
    the keys, so TP 1 plans stay byte-identical to plans compiled before TP existed."""
    flag("sequence_parallel", sequence_parallel)
    if tp < 1 or (sequence_parallel and tp < 2):
        raise DynaPipeError(f"{caller}(tp={tp}, sequence_parallel={sequence_parallel}): sequence "
                            f"parallelism needs tp >= 2, and tp must be at least 1.")
    meta = ({"tp": int(tp)} if tp > 1 else {}) | ({"sequence_parallel": True} if sequence_parallel else {})
    return (tp if sequence_parallel else 1), meta
