"""One Megatron indexed dataset (``.idx`` + ``.bin``) opened with numpy alone.

The format is what Megatron-LM's ``preprocess_data.py`` and megatron-core's
``IndexedDatasetBuilder`` write (version 1): a 34-byte header (magic ``MMIDIDX\\0\\0``, version,
token dtype code, sequence and document counts), then every sequence's length (int32), every
sequence's byte offset in the ``.bin`` (int64), and the document index (int64); the ``.bin`` holds
the tokens back to back.

Why not megatron-core's reader: importing ``megatron.core.datasets`` imports the whole
``megatron.core`` package first (model layers, fused kernels: 5-8 s of CPU), and DynaPipe's
planner worker processes, which read the tokens of every planned batch, import nothing of the
model. tests/test_data_datasets.py reads files written by megatron-core's builder with both
readers and checks they agree.
"""
from __future__ import annotations

import struct
from typing import Optional

import numpy as np

from dynapipe.errors import DynaPipeError

MAGIC = b"MMIDIDX\x00\x00"
HEADER = struct.Struct("<9sQBQQ")  # magic, version, dtype code, sequences, documents
# Megatron's token dtype codes.
DTYPES = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64, 6: np.float64, 7: np.float32,
          8: np.uint16}


class IndexFile:
    """The index of the dataset at ``prefix`` and reads of its tokens.

    ``sequence_lengths`` (tokens), ``sequence_pointers`` (bytes into the ``.bin``) and
    ``document_indices`` are read-only views of the memory-mapped ``.idx``; ``mmap`` False reads
    tokens with plain file reads (Megatron's ``--no-mmap-bin-files``). The header must have been
    checked (``_check_index_header`` in :mod:`dynapipe.data.indexed`): this class trusts it.
    """

    def __init__(self, prefix: str, mmap: bool = True):
        self.prefix, self.mmap = prefix, mmap
        with open(prefix + ".idx", "rb") as f:
            _, _, code, sequences, documents = HEADER.unpack(f.read(HEADER.size))
        self.dtype = np.dtype(DTYPES[code])
        index = np.memmap(prefix + ".idx", dtype=np.uint8, mode="r")
        at = HEADER.size
        self.sequence_lengths = np.frombuffer(index, dtype=np.int32, count=sequences, offset=at)
        at += self.sequence_lengths.nbytes
        self.sequence_pointers = np.frombuffer(index, dtype=np.int64, count=sequences, offset=at)
        at += self.sequence_pointers.nbytes
        self.document_indices = np.frombuffer(index, dtype=np.int64, count=documents, offset=at)
        self._bin: Optional[np.memmap] = None

    def __len__(self) -> int:
        return int(self.sequence_lengths.shape[0])

    def tokens(self, start: int, count: int, what: str = "") -> np.ndarray:
        """``count`` tokens of the ``.bin`` from token ``start`` (counted over the whole file), in
        the file's dtype: a view of the memory map, or a fresh array without one. ``what``: the
        tokens as an error names them (default: by position in the file)."""
        begin = start * self.dtype.itemsize
        if not self.mmap:
            out = np.fromfile(self.prefix + ".bin", dtype=self.dtype, count=count, offset=begin)
        else:
            if self._bin is None:
                self._bin = np.memmap(self.prefix + ".bin", dtype=np.uint8, mode="r")
            end = begin + count * self.dtype.itemsize
            out = np.frombuffer(self._bin[begin:end], dtype=self.dtype) if end <= len(self._bin) else None
        if out is None or len(out) != count:
            # Checked at the start against the index: the file changed since (a copy over it).
            raise DynaPipeError(f"{self.prefix}.bin ends before {what or f'its tokens {start}..{start + count}'}: the "
                                f"file was truncated or replaced while the job ran; copy it again.")
        return out

    def get(self, idx: int, offset: int = 0, length: Optional[int] = None) -> np.ndarray:
        """Tokens ``offset .. offset + length`` of sequence ``idx`` (to its end without
        ``length``), as :meth:`tokens` returns them."""
        if length is None:
            length = int(self.sequence_lengths[idx]) - offset
        first = int(self.sequence_pointers[idx]) // self.dtype.itemsize + offset
        return self.tokens(first, length, f"sequence {idx}'s tokens {offset}..{offset + length}")
