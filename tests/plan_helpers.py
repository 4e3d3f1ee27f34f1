"""Micro-batches for plan tests: sorted synthetic lengths cut into chunks."""
import numpy as np

from dynapipe.batching.types import MicroBatch


def chunked_micro_batches(lengths, size: int, *, dec_lengths=None, shuffle_seed=None) -> list[MicroBatch]:
    """Sort ``lengths`` and cut them into micro-batches of ``size`` samples, each padded
    to its longest sample rounded up to 8 tokens."""
    lengths = np.asarray(lengths)
    order = np.argsort(lengths, kind="stable")
    out = []
    for i in range(0, len(order), size):
        idx = order[i:i + size]
        pad = lambda x: int(-(-int(x) // 8) * 8)
        dec = pad(np.asarray(dec_lengths)[idx].max()) if dec_lengths is not None else 0
        real = int(np.asarray(dec_lengths)[idx].sum()) if dec_lengths is not None else int(lengths[idx].sum())
        out.append(MicroBatch(idx.tolist(), pad(lengths[idx].max()), dec_seqlen=dec, real_tokens=real))
    if shuffle_seed is not None:
        np.random.default_rng(shuffle_seed).shuffle(out)
    return out
