"""Megatron indexed datasets (``.bin`` / ``.idx``), read through megatron-core.

Files written by Megatron's ``preprocess_data.py`` (or megatron-core's
``IndexedDatasetBuilder``) are opened with ``megatron.core.datasets.indexed_dataset``.
Lengths come from the ``.idx`` index alone (no token is read until a sample is planned
into a batch). One sequence of the index is one sample.

- One prefix per task: ``MegatronIndexedDataset(["flan_cls", "flan_qa"])`` makes two tasks.
- Paired input / target datasets (encoder-decoder training, or instruction data for a
  decoder-only model): ``target_prefixes`` lists, for each input prefix, a dataset with
  the same number of sequences holding the targets.
- Without targets each sequence is a decoder-only document whose every token is a target.

megatron-core is imported only when a dataset is opened, so the rest of ``dynapipe.data``
imports without it.
"""
from __future__ import annotations

from typing import Optional, Sequence

import numpy as np

from dynapipe.data.samples import LengthLimits, SampleDataset, clip_lengths
from dynapipe.errors import DynaPipeError


def _open(prefix: str):
    try:
        from megatron.core.datasets.indexed_dataset import IndexedDataset as _MegatronIndexed
    except ImportError as e:  # pragma: no cover - megatron-core is a dependency
        raise DynaPipeError(f"reading {prefix!r} needs megatron-core ({e}).") from None
    if not _MegatronIndexed.exists(prefix):
        raise DynaPipeError(f"indexed dataset {prefix!r}: {prefix}.bin and {prefix}.idx must both exist "
                            f"(pass the path prefix, without the extension).")
    return _MegatronIndexed(prefix, mmap=True)


def _as_list(x: Optional[str | Sequence[str]]) -> list[str]:
    if x is None:
        return []
    return [x] if isinstance(x, str) else list(x)


class MegatronIndexedDataset(SampleDataset):
    """Samples from Megatron indexed datasets; see the module docstring.

    ``pad_id`` / ``eod_id`` / ``vocab_size`` are the tokenizer's the files were written
    with (they are not stored in the files).
    """

    def __init__(self, prefixes: str | Sequence[str], limits: LengthLimits,
                 target_prefixes: Optional[str | Sequence[str]] = None,
                 encoder_decoder: bool = False, pad_id: int = 0, eod_id: int = 1, vocab_size: int = 0):
        self.prefixes = _as_list(prefixes)
        self.target_prefixes = _as_list(target_prefixes)
        if not self.prefixes:
            raise DynaPipeError("no indexed dataset prefix given.")
        if self.target_prefixes and len(self.target_prefixes) != len(self.prefixes):
            raise DynaPipeError(f"{len(self.prefixes)} input prefixes but {len(self.target_prefixes)} target "
                                f"prefixes; give one target dataset per input dataset.")
        if encoder_decoder and not self.target_prefixes:
            raise DynaPipeError("an encoder-decoder model needs paired datasets: pass target_prefixes "
                                "(one target dataset per input dataset).")
        self.encoder_decoder = encoder_decoder
        self.pad_id, self.eod_id, self.vocab_size = pad_id, eod_id, vocab_size
        self._handles: dict = {}
        raw_in, raw_tg, tasks, self._starts = [], [], [], [0]
        for task, prefix in enumerate(self.prefixes):
            # Copy the lengths while the handle lives: they are a view of its memory map.
            lengths = np.array(self._handle(prefix).sequence_lengths, dtype=np.int64)
            if self.target_prefixes:
                tprefix = self.target_prefixes[task]
                tlengths = np.array(self._handle(tprefix).sequence_lengths, dtype=np.int64)
                if tlengths.shape != lengths.shape:
                    raise DynaPipeError(f"paired datasets disagree: {prefix!r} holds {lengths.shape[0]} sequences, "
                                        f"{tprefix!r} holds {tlengths.shape[0]}; they must pair one to one.")
                raw_in.append(lengths)
                raw_tg.append(tlengths)
            else:
                raw_in.append(np.zeros_like(lengths))
                raw_tg.append(lengths)
            tasks.append(np.full(lengths.shape[0], task, dtype=np.int64))
            self._starts.append(self._starts[-1] + lengths.shape[0])
        self.tasks = np.concatenate(tasks)
        if self.tasks.shape[0] == 0:
            raise DynaPipeError(f"indexed dataset(s) {self.prefixes} hold no sequences.")
        self.input_lengths, self.target_lengths, self.truncated = clip_lengths(
            np.concatenate(raw_in), np.concatenate(raw_tg), limits, encoder_decoder, ",".join(self.prefixes))

    def __getstate__(self):
        state = dict(self.__dict__)
        state["_handles"] = {}  # memory maps are reopened where the dataset is used
        return state

    def _handle(self, prefix: str):
        h = self._handles.get(prefix)
        if h is None:
            h = self._handles[prefix] = _open(prefix)
        return h

    def _read(self, idx: int, input_len: int, target_len: int):
        task = int(self.tasks[idx])
        local = idx - self._starts[task]
        if self.target_prefixes:
            inp = self._handle(self.prefixes[task]).get(local, 0, input_len) if input_len else np.zeros(0, np.int64)
            tgt = self._handle(self.target_prefixes[task]).get(local, 0, target_len)
        else:
            inp = np.zeros(0, dtype=np.int64)
            tgt = self._handle(self.prefixes[task]).get(local, 0, target_len)
        # Copies: the reads are views of memory maps that close with their handle.
        return np.array(inp, dtype=np.int64), np.array(tgt, dtype=np.int64), task


def write_indexed_dataset(prefix: str, sequences: Sequence[np.ndarray], dtype=np.int32) -> None:
    """Write ``sequences`` (token id arrays) as ``prefix.bin`` / ``prefix.idx`` with
    megatron-core's ``IndexedDatasetBuilder``, one document per sequence."""
    import torch
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=dtype)
    for seq in sequences:
        builder.add_item(torch.from_numpy(np.asarray(seq, dtype=np.int64)))
        builder.end_document()
    builder.finalize(prefix + ".idx")
