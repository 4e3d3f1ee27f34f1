"""JSONL datasets: multi-task ``{"input", "target", "task"}`` records or Megatron's ``{"text"}``.

Each non-blank line is one JSON object. ``{"input": str, "target": str, "task": str}``
is an instruction / encoder-decoder sample (``task`` optional); ``{"text": str}`` is a
decoder-only document whose every token is a target. Files are tokenised once when the
dataset is built, into one flat int64 array with offsets (cheap to pickle into planner
workers). A malformed line is rejected with its file and line number.

With ``split_range``, each file keeps its own ``--split`` range of records (as megatron-core
splits every path); with ``split_documents``, a decoder-only document (a record without an
input) longer than ``seq_length`` is cut into pieces that keep every token, as indexed
pretraining documents are (:mod:`dynapipe.data.pieces`), instead of being truncated.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from dynapipe.data.pieces import split_documents as split_into_pieces
from dynapipe.data.samples import LengthLimits, SampleDataset, clip_lengths
from dynapipe.data.splits import WHOLE, EmptySplitError, per_file_indices
from dynapipe.data.tokenizer import ByteTokenizer, check_tokenizer, tokenize_to_array
from dynapipe.errors import DynaPipeError, arg


@dataclass
class _Parsed:
    inputs: list
    targets: list
    tasks: list
    files: list
    lines: list


def _field(obj: dict, name: str, where: str) -> str:
    value = obj[name]
    if not isinstance(value, str):
        raise DynaPipeError(f"{where}: field {name!r} must be a string, got {type(value).__name__}.")
    return value


def _tokens(tokenizer, obj: dict, name: str, where: str) -> np.ndarray:
    try:
        return tokenize_to_array(tokenizer, _field(obj, name, where))
    except UnicodeEncodeError as e:
        # JSON escapes can spell lone surrogates ("\ud800"), which are not text.
        raise DynaPipeError(f"{where}: field {name!r} holds {e.object[e.start:e.end]!r}, which is not valid "
                            f"Unicode text (a lone surrogate); fix the line.") from None


def _parse_file(path: str, tokenizer, encoder_decoder: bool, append_eod: bool,
                task_ids: dict, out: _Parsed, file_index: int = 0) -> None:
    eod = np.array([tokenizer.eod], dtype=np.int64) if append_eod else np.zeros(0, dtype=np.int64)
    empty = np.zeros(0, dtype=np.int64)
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, start=1):
            where = f"{path}:{lineno}"
            if not raw.strip():
                continue
            try:
                obj = json.loads(raw)
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                raise DynaPipeError(f"{where}: not a valid JSON line ({e}); every line must be one JSON object.") from None
            except RecursionError:
                raise DynaPipeError(f"{where}: the JSON is nested too deeply to be a sample.") from None
            if not isinstance(obj, dict):
                raise DynaPipeError(f"{where}: expected a JSON object, got {type(obj).__name__}.")
            if "input" in obj or "target" in obj:
                if "input" not in obj or "target" not in obj:
                    raise DynaPipeError(f"{where}: a multi-task record needs both 'input' and 'target'.")
                inp = _tokens(tokenizer, obj, "input", where)
                tgt = np.concatenate([_tokens(tokenizer, obj, "target", where), eod])
            elif "text" in obj:
                if encoder_decoder:
                    raise DynaPipeError(f"{where}: an encoder-decoder dataset needs 'input' and 'target' "
                                        f"fields; {{\"text\"}} records are for decoder-only models.")
                inp = empty
                tgt = np.concatenate([_tokens(tokenizer, obj, "text", where), eod])
            else:
                raise DynaPipeError(f"{where}: expected fields 'input' and 'target' (multi-task) or "
                                    f"'text' (Megatron), found {sorted(obj)}.")
            # A record's empty field is named: an empty target would teach only the end-of-document
            # token, and an encoder needs an input token to attend to.
            empty_fields = [name for name, toks in (("input", inp), ("target", tgt[:tgt.shape[0] - eod.shape[0]]))
                            if toks.shape[0] == 0 and "input" in obj and (name == "target" or encoder_decoder)]
            if "text" in obj and "input" not in obj and tgt.shape[0] == eod.shape[0]:
                empty_fields = ["text"]  # an end-of-document token alone: nothing to predict it from
            if empty_fields:
                fields = " and ".join(repr(f) for f in empty_fields)
                are = "fields are" if len(empty_fields) > 1 else "field is"
                raise DynaPipeError(f"{where}: the {fields} {are} empty after tokenising; remove the line or fill it.")
            if tgt.shape[0] == 0:
                raise DynaPipeError(f"{where}: the sample tokenises to no tokens; remove the line.")
            task = obj.get("task", "")
            if not isinstance(task, (str, int)):
                raise DynaPipeError(f"{where}: field 'task' must be a string, got {type(task).__name__}.")
            out.inputs.append(inp)
            out.targets.append(tgt)
            out.tasks.append(task_ids.setdefault(str(task), len(task_ids)))
            out.files.append(file_index)
            out.lines.append(lineno)


def _flatten(arrays: list) -> tuple[np.ndarray, np.ndarray]:
    lengths = np.fromiter((a.shape[0] for a in arrays), dtype=np.int64, count=len(arrays))
    offsets = np.zeros(len(arrays) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    flat = np.concatenate(arrays) if arrays else np.zeros(0, dtype=np.int64)
    return flat.astype(np.int64, copy=False), offsets


class JsonlDataset(SampleDataset):
    """Samples from one or more JSONL files, tokenised with ``tokenizer`` (byte-level by default).

    ``append_eod`` appends the tokenizer's end-of-document id to every target (as
    Megatron's ``preprocess_data.py --append-eod`` does). ``task_names[i]`` is the name
    of task id ``i``, in order of first appearance.
    """

    def __init__(self, paths: str | Sequence[str], limits: LengthLimits, tokenizer=None,
                 encoder_decoder: bool = False, append_eod: bool = True,
                 split_range: tuple[float, float] = WHOLE, split_documents: bool = False):
        paths = [paths] if isinstance(paths, str) else list(paths)
        if not paths:
            raise DynaPipeError("no JSONL file given; pass at least one path.")
        tokenizer = tokenizer or ByteTokenizer()
        check_tokenizer(tokenizer)
        self.encoder_decoder = encoder_decoder
        self.paths = paths
        task_ids: dict = {}
        parsed = _Parsed([], [], [], [], [])
        for i, path in enumerate(paths):
            if not os.path.exists(path):
                raise DynaPipeError(f"JSONL file {path!r} does not exist.")
            if not os.path.isfile(path):
                raise DynaPipeError(f"JSONL file {path!r} is not a regular file.")
            try:
                _parse_file(path, tokenizer, encoder_decoder, append_eod, task_ids, parsed, i)
            except OSError as e:
                raise DynaPipeError(f"JSONL file {path!r} cannot be read: {e.strerror}.") from None
        if not parsed.targets:
            raise DynaPipeError(f"JSONL file(s) {paths} hold no samples.")
        self.task_names = list(task_ids)
        self._input_flat, self._input_off = _flatten(parsed.inputs)
        self._target_flat, self._target_off = _flatten(parsed.targets)
        # Where each record came from, for messages: file index and line number.
        self._files = np.asarray(parsed.files, dtype=np.int32)
        self._lines = np.asarray(parsed.lines, dtype=np.int64)
        rec_in, rec_tg = np.diff(self._input_off), np.diff(self._target_off)
        if not encoder_decoder and int((rec_in + rec_tg).max()) < 2:
            # A decoder predicts each token from the ones before: one-token samples (an empty text
            # and its end-of-document token) train on nothing, and a run of them logs a loss of 0.
            raise DynaPipeError(f"JSONL file(s) {paths}: every sample is one token or none (empty texts); there "
                                f"is nothing to predict.")
        # Long decoder-only documents become pieces (never truncated or refused); every other
        # record is one sample, clipped or refused as limits.overlong says.
        cut_all = np.zeros(len(rec_in), dtype=bool)
        if split_documents and not encoder_decoder:
            cut_all = (rec_in == 0) & (rec_tg > limits.validate().seq_length)
        in_len, tg_len, truncated = clip_lengths(rec_in, np.where(cut_all, 1, rec_tg), limits, encoder_decoder,
                                                 lambda i: f"{paths[int(self._files[i])]}:{int(self._lines[i])}",
                                                 documents=True)
        docs = np.arange(len(rec_in)) if split_range == WHOLE else per_file_indices(self._files, split_range)
        if len(docs) == 0:
            raise EmptySplitError(f"the --split range {split_range} holds none of the {len(rec_in)} records of "
                                  f"{paths}.")
        self.num_documents = int(len(docs))
        self.document_tokens = int((rec_in[docs] + rec_tg[docs]).sum())  # as stored, before any cut
        cut = cut_all[docs]
        counts = np.ones(len(docs), dtype=np.int64)
        pieces = split_into_pieces(rec_tg[docs][cut], limits.seq_length) if cut.any() else None
        if pieces is not None:
            counts[cut] = np.bincount(pieces.document, minlength=int(cut.sum()))
        self.num_split_documents = int(cut.sum())
        self._record = np.repeat(docs, counts)  # the record of every sample
        self._offset = np.zeros(len(self._record), dtype=np.int64)  # its first target token
        self.input_lengths = np.repeat(in_len[docs], counts)
        self.target_lengths = np.repeat(tg_len[docs], counts)
        self.truncated = np.repeat(truncated[docs], counts)
        if pieces is not None:
            piece = np.repeat(cut, counts)  # pieces sit in document order, as split_into_pieces made them
            self._offset[piece], self.target_lengths[piece] = pieces.offset, pieces.length
        self.tasks = np.asarray(parsed.tasks, dtype=np.int64)[self._record]
        self.vocab_size = int(tokenizer.vocab_size)
        self.eod_id = int(tokenizer.eod)
        pad = getattr(tokenizer, "pad", None)
        self.pad_id = int(pad) if isinstance(pad, (int, np.integer)) and 0 <= pad < self.vocab_size else 0

    def _check_token_ids(self, vocab_size: int) -> None:
        for flat, offsets in ((self._input_flat, self._input_off), (self._target_flat, self._target_off)):
            bad = np.flatnonzero((flat < 0) | (flat >= vocab_size))
            if len(bad):
                sample = int(np.searchsorted(offsets, bad[0], side="right")) - 1
                where = f"{self.paths[int(self._files[sample])]}:{int(self._lines[sample])}"
                raise DynaPipeError(f"{where}: token id {int(flat[bad[0]])} is outside the vocabulary "
                                    f"[0, {vocab_size}); the tokenizer's vocabulary is larger than "
                                    f"{arg('vocab_size')}.")

    def _read(self, idx: int, input_len: int, target_len: int):
        record = self._record[idx]
        i0 = self._input_off[record]
        t0 = self._target_off[record] + self._offset[idx]
        return (self._input_flat[i0:i0 + input_len], self._target_flat[t0:t0 + target_len],
                int(self.tasks[idx]))


def read_jsonl(paths: str | Sequence[str], seq_length: int, overlong: str = "truncate",
               tokenizer=None, encoder_decoder: bool = False,
               dec_seq_length: int = 0) -> JsonlDataset:
    """Convenience: a :class:`JsonlDataset` with :class:`LengthLimits` built from arguments."""
    return JsonlDataset(paths, LengthLimits(seq_length, dec_seq_length, overlong), tokenizer, encoder_decoder)


__all__ = ["JsonlDataset", "read_jsonl"]
