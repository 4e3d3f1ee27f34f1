"""Megatron indexed datasets (``.bin`` / ``.idx``) as samples.

Files written by Megatron's ``preprocess_data.py`` (or megatron-core's
``IndexedDatasetBuilder``) are opened with :class:`dynapipe.data.index_file.IndexFile`, numpy
alone, after the checks below (a damaged or mismatched file is one line, before training).
Lengths come from the ``.idx`` index alone (no token is read until a sample is planned
into a batch). One sequence of the index is one document.

- One prefix per task: ``MegatronIndexedDataset(["flan_cls", "flan_qa"])`` makes two tasks.
- Paired input / target datasets (encoder-decoder training, or instruction data for a
  decoder-only model): ``target_prefixes`` lists, for each input prefix, a dataset with
  the same number of sequences holding the targets.
- Without targets each sequence is a decoder-only document whose every token is a target;
  a document longer than ``--seq-length`` is cut into pieces of at most ``--seq-length``
  tokens that keep every token (:mod:`dynapipe.data.pieces`), each piece a sample. An empty
  sequence (text that tokenised to nothing, written without ``--append-eod``) is skipped, as
  Megatron-LM's GPT dataset trains past it: it holds no token to train on. ``--split`` ranges
  count it, as Megatron-LM's do.

Reading needs no megatron-core (planner workers read every planned batch's tokens and
import nothing of the model); writing (:func:`write_indexed_dataset`) uses its builder.
"""
from __future__ import annotations

import os
from typing import Optional, Sequence

import numpy as np

from dynapipe.data.index_file import DTYPES, HEADER, MAGIC, IndexFile
from dynapipe.data.pieces import split_documents as split_documents_into_pieces
from dynapipe.data.samples import LengthLimits, SampleDataset, clip_lengths
from dynapipe.data.splits import WHOLE, EmptySplitError, range_indices
from dynapipe.errors import DynaPipeError, arg


def _open(prefix: str, mmap: bool = True) -> IndexFile:
    for ext in (".idx", ".bin"):
        if not os.path.exists(prefix + ext):
            raise DynaPipeError(f"indexed dataset {prefix!r}: {prefix}.bin and {prefix}.idx must both exist "
                                f"(pass the path prefix, without the extension).")
        if not os.path.isfile(prefix + ext):
            raise DynaPipeError(f"{prefix}{ext} is not a regular file; give the prefix of a Megatron indexed dataset.")
    _check_index_header(prefix + ".idx")
    handle = IndexFile(prefix, mmap=mmap)
    _check_index(prefix, handle)
    return handle


def check_indexed_files(prefix: str) -> int:
    """Documents of the indexed dataset at ``prefix`` (from its ``.idx`` header), after every
    check that opening it for GPT makes (header, index, ``.bin`` size; a dataset of no
    documents is refused). For readers that hand the files to megatron-core's own datasets
    (T5 span corruption), so a bad file is one line here rather than a traceback there."""
    documents = _check_index_header(prefix + ".idx")
    _open(prefix)
    return documents


def _check_index_header(path: str) -> int:
    """The ``.idx`` header is Megatron's and the file holds every array it announces; returns
    its document count.

    Checked before the file is opened (:class:`IndexFile` trusts its header), and before
    megatron-core's T5 dataset opens it (its reader fails half-way through its constructor on
    a bad file and then prints a second traceback from ``__del__``).
    """
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        head = f.read(HEADER.size)
    if len(head) < HEADER.size:
        raise DynaPipeError(f"{path} is truncated: {size} bytes, shorter than an index header; "
                            f"write it again with Megatron's preprocess_data.py.")
    magic, version, code, sequences, documents = HEADER.unpack(head)
    if magic != MAGIC or version != 1 or code not in DTYPES:
        raise DynaPipeError(f"{path} is not a Megatron index (header {head[:9]!r}, version {version}, dtype code "
                            f"{code}); give the prefix of a dataset written by preprocess_data.py.")
    if not np.issubdtype(DTYPES[code], np.integer):
        raise DynaPipeError(f"{path} holds {np.dtype(DTYPES[code]).name} values (dtype code {code}), not token ids; "
                            f"preprocess_data.py writes integer ids: give the prefix of a tokenised dataset.")
    need = HEADER.size + sequences * (4 + 8) + documents * 8
    if size < need:
        raise DynaPipeError(f"{path} is truncated: {size:,} bytes, but its header announces {sequences:,} sequences "
                            f"and {documents:,} documents ({need:,} bytes); copy the file again or rebuild it.")
    prefix = path[:-len(".idx")]
    if sequences == 0:
        raise DynaPipeError(f"{prefix}: the indexed dataset holds no sequences (its index announces none); it was "
                            f"written from empty input: rebuild it, or leave it out of the data paths.")
    lengths = np.fromfile(path, dtype=np.int32, count=sequences, offset=HEADER.size)
    if not lengths.any():
        raise _all_empty(prefix, len(lengths))
    if os.path.getsize(prefix + ".bin") == 0:
        raise DynaPipeError(f"{prefix}.bin is empty, but its index announces {sequences:,} sequences; copy the file "
                            f"again or rebuild the dataset.")
    # Megatron's document index holds every document's first sequence and one past the last.
    return max(int(documents) - 1, 0)


def _check_index(prefix: str, handle: IndexFile) -> None:
    """The index and the ``.bin`` agree: no negative length, contiguous pointers, and a
    ``.bin`` long enough for the last sequence (a truncated copy is caught here, not
    mid-training)."""
    lengths = np.asarray(handle.sequence_lengths, dtype=np.int64)
    pointers = np.asarray(handle.sequence_pointers, dtype=np.int64)
    item = handle.dtype.itemsize
    if lengths.shape[0] == 0:
        return
    # Megatron's document index: every document's first sequence, then the sequence count.
    docs = np.asarray(handle.document_indices, dtype=np.int64)
    down = np.flatnonzero(np.diff(docs) < 0)
    if len(docs) == 0 or docs[0] != 0 or docs[-1] != lengths.shape[0] or len(down):
        if len(down):
            what = (f"its document index decreases at entry {int(down[0]) + 1} ({int(docs[down[0]])} then "
                    f"{int(docs[down[0] + 1])})")
        else:
            ends = f"from {int(docs[0])} to {int(docs[-1])}" if len(docs) else "empty"
            what = f"its document index runs {ends}, not from 0 to its {lengths.shape[0]:,} sequences"
        raise DynaPipeError(f"{prefix}.idx cannot be read as a Megatron index ({what}): the file is truncated, "
                            f"corrupted or not an index; write it again with Megatron's preprocess_data.py.")
    bad = np.flatnonzero(lengths < 0)
    if len(bad):
        raise DynaPipeError(f"{prefix}.idx: sequence {int(bad[0])} has a negative length {int(lengths[bad[0]])}; "
                            f"the index is corrupted.")
    ends = pointers + lengths * item
    gaps = np.flatnonzero((pointers[1:] != ends[:-1]) | (pointers[1:] < 0))
    if pointers[0] != 0 or len(gaps):
        i = 0 if pointers[0] != 0 else int(gaps[0]) + 1
        raise DynaPipeError(f"{prefix}.idx: sequence {i} starts at byte {int(pointers[i])}, not where the sequence "
                            f"before it ends; the index is corrupted.")
    need, have = int(ends[-1]), os.path.getsize(prefix + ".bin")
    if have < need:
        raise DynaPipeError(f"{prefix}.bin is truncated: {have:,} bytes, but its index needs {need:,}; copy the "
                            f"file again or rebuild the dataset.")
    if have > need:
        # Megatron's builder writes exactly the indexed tokens: a longer .bin is another
        # dataset's (or one of another token dtype), and reading it would train on wrong ids.
        raise DynaPipeError(f"{prefix}.bin holds {have:,} bytes, but its index describes {need:,} "
                            f"({lengths.shape[0]:,} sequences of {handle.dtype.name}): the .idx and .bin do "
                            f"not belong together; pair the files written together, or rebuild the dataset.")


# Token ids are checked this many at a time, so a large .bin never sits in memory whole.
_CHECK_CHUNK = 1 << 24


def _token_chunks(handle: IndexFile):
    """``(start, ids)`` over the ``.bin`` of ``handle`` in chunks of :data:`_CHECK_CHUNK` tokens
    (plain reads when it does not memory-map); nothing for no tokens."""
    total = int(np.asarray(handle.sequence_lengths, dtype=np.int64).sum())
    for start in range(0, total, _CHECK_CHUNK):
        yield start, handle.tokens(start, min(_CHECK_CHUNK, total - start))


def largest_token(handle: IndexFile) -> int:
    """The largest token id in the dataset of ``handle`` (-1 without tokens)."""
    return max((int(chunk.max()) for _, chunk in _token_chunks(handle)), default=-1)


class TokenOutOfVocabulary(DynaPipeError):
    """A token id at ``where`` (a file and sequence) outside ``[0, vocab_size)``; ``largest``:
    the largest id of the data the check covered, so the size suggested is one that holds it
    all (a blend raises it again with every path's largest)."""

    def __init__(self, where: str, vocab_size: int, largest: int):
        self.where, self.vocab_size, self.largest = where, int(vocab_size), int(largest)
        # The model's vocabulary is the tokenizer's where one is given (--vocab-size is then
        # refused), so the fix is the tokenizer the data was built with, not a bigger size.
        super().__init__(f"{where}, outside the vocabulary [0, {vocab_size}) (the tokenizer's, or {arg('vocab_size')} "
                         f"without one): the data was tokenised with a larger vocabulary (its largest id is "
                         f"{largest}); give the tokenizer it was built with (--tokenizer-type and its files; without "
                         f"one, {arg('vocab_size')} of at least {largest + 1}), or rebuild it with the model's.")


def first_bad_token(handle: IndexFile, vocab_size: int) -> Optional[tuple[int, int, int]]:
    """(sequence index, position in it, id) of the first token id outside ``[0, vocab_size)``
    in the dataset of ``handle``, or None. Vectorised over the ``.bin`` in chunks."""
    dtype = handle.dtype
    for start, chunk in _token_chunks(handle):
        if int(chunk.min()) >= 0 and int(chunk.max()) < vocab_size:
            continue
        pos = start + int(np.flatnonzero((chunk < 0) | (chunk >= vocab_size))[0])
        starts = np.asarray(handle.sequence_pointers, dtype=np.int64) // dtype.itemsize
        seq = int(np.searchsorted(starts, pos, side="right")) - 1
        return seq, pos - int(starts[seq]), int(chunk[pos - start])
    return None


def _all_empty(prefix: str, sequences: int) -> DynaPipeError:
    """A dataset whose every sequence is empty: empty documents are skipped, but a path of
    nothing else holds no data at all (and filtering them out would leave nothing)."""
    return DynaPipeError(f"{prefix}.idx: all {sequences:,} of its sequences are empty (no tokens at all); drop it "
                         f"from the data paths, or rebuild it (text that tokenised to nothing, written without "
                         f"--append-eod, leaves empty sequences).")


def _no_empty(prefix: str, lengths: np.ndarray) -> None:
    empty = np.flatnonzero(lengths == 0)
    if len(empty):
        raise DynaPipeError(f"{prefix}.idx: sequence {int(empty[0])} has no tokens ({len(empty)} empty sequence(s) "
                            f"in all); every sample needs at least one token: filter them out when building it.")


def _as_list(x: Optional[str | Sequence[str]]) -> list[str]:
    if x is None:
        return []
    return [x] if isinstance(x, str) else list(x)


class MegatronIndexedDataset(SampleDataset):
    """Samples from Megatron indexed datasets; see the module docstring.

    ``pad_id`` / ``eod_id`` / ``vocab_size`` are the tokenizer's the files were written
    with (they are not stored in the files). ``split_range`` keeps the documents of one
    ``--split`` range of every prefix (:mod:`dynapipe.data.splits`). Without targets, a
    document longer than the limit is cut into pieces that keep every token
    (:mod:`dynapipe.data.pieces`) unless ``split_documents`` is False (then it is truncated
    or rejected as ``limits.overlong`` says, like any over-long sample). ``mmap`` False reads
    the ``.bin`` files with plain reads (Megatron's ``--no-mmap-bin-files``).
    """

    def __init__(self, prefixes: str | Sequence[str], limits: LengthLimits,
                 target_prefixes: Optional[str | Sequence[str]] = None,
                 encoder_decoder: bool = False, pad_id: int = 0, eod_id: int = 1, vocab_size: int = 0,
                 split_range: tuple[float, float] = WHOLE, split_documents: bool = True, mmap: bool = True):
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
        self.mmap = mmap
        self.pad_id, self.eod_id, self.vocab_size = pad_id, eod_id, vocab_size
        self._handles: dict = {}
        raw_in, raw_tg, tasks, seqs = [], [], [], []
        self.num_empty_documents = 0
        for task, prefix in enumerate(self.prefixes):
            # Copy the lengths while the handle lives: they are a view of its memory map.
            lengths = np.array(self._handle(prefix).sequence_lengths, dtype=np.int64)
            begin, end = range_indices(split_range, lengths.shape[0])
            if self.target_prefixes:
                tprefix = self.target_prefixes[task]
                tlengths = np.array(self._handle(tprefix).sequence_lengths, dtype=np.int64)
                if tlengths.shape != lengths.shape:
                    raise DynaPipeError(f"paired datasets disagree: {prefix!r} holds {lengths.shape[0]} sequences, "
                                        f"{tprefix!r} holds {tlengths.shape[0]}; they must pair one to one.")
                _no_empty(tprefix, tlengths)
                if encoder_decoder:
                    _no_empty(prefix, lengths)
                kept = np.arange(begin, end, dtype=np.int64)
                raw_in.append(lengths[kept])
                raw_tg.append(tlengths[kept])
            else:
                if not lengths.any():
                    raise _all_empty(prefix, len(lengths))
                kept = np.flatnonzero(lengths[begin:end] > 0).astype(np.int64) + begin
                self.num_empty_documents += (end - begin) - len(kept)
                raw_in.append(np.zeros(len(kept), dtype=np.int64))
                raw_tg.append(lengths[kept])
            tasks.append(np.full(len(kept), task, dtype=np.int64))
            seqs.append(kept)
        doc_tasks, doc_seqs = np.concatenate(tasks), np.concatenate(seqs)
        raw_in, raw_tg = np.concatenate(raw_in), np.concatenate(raw_tg)
        if doc_tasks.shape[0] == 0:
            empty = f" ({self.num_empty_documents:,} empty)" if self.num_empty_documents else ""
            raise EmptySplitError(f"indexed dataset(s) {self.prefixes} hold no sequences{empty}"
                                  + ("" if split_range == WHOLE else f" in the --split range {split_range}") + ".",
                                  empty_documents=self.num_empty_documents)
        self.num_documents = int(doc_tasks.shape[0])
        self.document_tokens = int(raw_in.sum() + raw_tg.sum())
        if self.target_prefixes or not split_documents:
            self.tasks, self._seqs = doc_tasks, doc_seqs
            self._offsets = np.zeros_like(doc_seqs)
            self.input_lengths, self.target_lengths, self.truncated = clip_lengths(
                raw_in, raw_tg, limits, encoder_decoder,
                lambda i: f"{self.prefixes[int(doc_tasks[i])]}: sequence {int(doc_seqs[i])}",
                documents=not self.target_prefixes)
            self.num_split_documents = 0
        else:
            pieces = split_documents_into_pieces(raw_tg, limits.validate().seq_length)
            self.tasks, self._seqs = doc_tasks[pieces.document], doc_seqs[pieces.document]
            self._offsets = pieces.offset
            self.target_lengths = pieces.length
            self.input_lengths = np.zeros_like(pieces.length)
            self.truncated = np.zeros(len(pieces), dtype=bool)
            self.num_split_documents = int((raw_tg > limits.seq_length).sum())

    def _check_token_ids(self, vocab_size: int) -> None:
        for prefix in self.prefixes + self.target_prefixes:
            bad = first_bad_token(self._handle(prefix), vocab_size)
            if bad is not None:
                seq, pos, token = bad
                where = f"{prefix}.bin: sequence {seq}, token {pos} has id {token}"
                if token < 0:
                    raise DynaPipeError(f"{where}: token ids are never negative; the file is damaged or was "
                                        f"not written as token ids of its .idx's dtype; rebuild it.")
                # The size to suggest is the whole data's largest id + 1: the first bad id's would
                # only move the error to the next one.
                raise TokenOutOfVocabulary(where, vocab_size, self.largest_token_id())

    def largest_token_id(self) -> int:
        """The largest token id in every file of this dataset (-1 without tokens)."""
        return max(largest_token(self._handle(p)) for p in self.prefixes + self.target_prefixes)

    def __getstate__(self):
        state = dict(self.__dict__)
        state["_handles"] = {}  # memory maps are reopened where the dataset is used
        return state

    def _handle(self, prefix: str):
        h = self._handles.get(prefix)
        if h is None:
            h = self._handles[prefix] = _open(prefix, self.mmap)
        return h

    def _read(self, idx: int, input_len: int, target_len: int):
        task = int(self.tasks[idx])
        local, offset = int(self._seqs[idx]), int(self._offsets[idx])
        if self.target_prefixes:
            inp = self._handle(self.prefixes[task]).get(local, 0, input_len) if input_len else np.zeros(0, np.int64)
            tgt = self._handle(self.target_prefixes[task]).get(local, 0, target_len)
        else:
            inp = np.zeros(0, dtype=np.int64)
            tgt = self._handle(self.prefixes[task]).get(local, offset, target_len)
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
