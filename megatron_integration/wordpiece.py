"""Megatron-LM's ``--tokenizer-type BertWordPieceLowerCase`` / ``BertWordPieceCase`` vocabulary,
as its T5 and BERT datasets see it.

Megatron-LM's WordPiece tokenizer reads ``--vocab-file`` (one token a line, the line number
its id), then appends ``[BOS]`` and ``[EOS]`` when the file lacks them and ``--vocab-extra-ids N``
sentinels ``<extra_id_0>`` ... ``<extra_id_{N-1}>``, each new token taking the next id. Its
size (before Megatron's vocabulary padding) counts them all.

Span-corruption data is pre-tokenised (Megatron's ``preprocess_data.py --split-sentences``),
so what megatron-core's :class:`~megatron.core.datasets.t5_dataset.T5MaskedWordPieceDataset`
needs is the vocabulary, not text tokenisation: the id -> token map (whole-word masking
looks for ``##`` continuation pieces) and the special ids. :class:`WordPieceVocab` offers
exactly those, offline and pure Python, with Megatron-LM's ids. Case only matters for text
tokenisation; it is kept as part of the vocabulary's identity (megatron-core's index cache key).
"""
from __future__ import annotations

import os
from collections import OrderedDict
from dataclasses import dataclass, field

from dynapipe.errors import DynaPipeError

WORDPIECE_TYPES = {"BertWordPieceLowerCase": True, "BertWordPieceCase": False}  # type -> lower case
REQUIRED_TOKENS = ("[CLS]", "[SEP]", "[PAD]", "[MASK]")


@dataclass
class WordPieceVocab:
    """A WordPiece vocabulary with Megatron-LM's added tokens (see the module docstring).

    ``vocab`` maps token -> id, ``inv_vocab`` id -> token; ``cls``, ``sep``, ``pad``, ``mask``,
    ``bos``, ``eos`` (and ``eod``, which Megatron-LM makes ``eos``) are ids;
    ``additional_special_tokens_ids`` are the sentinel ids in order; ``file_size`` counts the
    file's own entries (ids the data may hold; the added ones follow them where missing).
    """

    vocab_file: str
    lower_case: bool = True
    vocab_extra_ids: int = 0
    vocab: "OrderedDict[str, int]" = field(default_factory=OrderedDict, repr=False)

    def __post_init__(self) -> None:
        if not self.vocab:
            self.vocab = _read_vocab_file(self.vocab_file)
        missing = [t for t in REQUIRED_TOKENS if t not in self.vocab]
        if missing:
            raise DynaPipeError(f"--vocab-file {self.vocab_file!r} has no {', '.join(missing)} token(s); give the "
                                f"BERT WordPiece vocabulary the data was tokenised with.")
        # Ids from here on are Megatron-LM's additions, which no token of the data may hold.
        self.file_size = len(self.vocab)
        for token in ("[BOS]", "[EOS]", *self.sentinel_tokens):
            self.vocab.setdefault(token, len(self.vocab))
        self.inv_vocab = {i: t for t, i in self.vocab.items()}
        # megatron-core hashes this into its dataset index cache key. Exactly what Megatron-LM's
        # legacy WordPiece tokenizer records (its class name, the path as typed, the options as
        # strings), so a run shares the index cache Megatron-LM built for the same data.
        self.unique_identifiers = OrderedDict(
            [("class", "_BertWordPieceTokenizer"), ("tokenizer_path", [self.vocab_file]),
             ("lower_case", str(self.lower_case)), ("vocab_extra_ids", str(self.vocab_extra_ids))])

    @property
    def sentinel_tokens(self) -> list[str]:
        return [f"<extra_id_{i}>" for i in range(self.vocab_extra_ids)]

    @property
    def vocab_size(self) -> int:
        """Ids of the vocabulary, added tokens included, before Megatron's padding."""
        return len(self.vocab)

    @property
    def cls(self) -> int:
        return self.vocab["[CLS]"]

    @property
    def sep(self) -> int:
        return self.vocab["[SEP]"]

    @property
    def pad(self) -> int:
        return self.vocab["[PAD]"]

    @property
    def mask(self) -> int:
        return self.vocab["[MASK]"]

    @property
    def bos(self) -> int:
        return self.vocab["[BOS]"]

    @property
    def eos(self) -> int:
        return self.vocab["[EOS]"]

    @property
    def eod(self) -> int:
        return self.eos

    @property
    def additional_special_tokens_ids(self) -> list[int]:
        return [self.vocab[t] for t in self.sentinel_tokens]


def _read_vocab_file(path: str) -> "OrderedDict[str, int]":
    """Token -> id from a WordPiece vocabulary file: line ``i`` (stripped) is token ``i``; a token
    repeated later takes the later line's id, as Megatron-LM's reader does."""
    if not path:
        raise DynaPipeError("--tokenizer-type BertWordPieceLowerCase/BertWordPieceCase needs --vocab-file "
                            "(the BERT vocab.txt the data was tokenised with).")
    if not os.path.isfile(path):
        raise DynaPipeError(f"--vocab-file {path!r}: no such file.")
    vocab: "OrderedDict[str, int]" = OrderedDict()
    try:
        with open(path, encoding="utf-8") as f:
            for i, line in enumerate(f):
                vocab[line.strip()] = i
    except UnicodeDecodeError as e:
        raise DynaPipeError(f"--vocab-file {path!r} is not UTF-8 text ({e}); give a WordPiece vocab.txt.") from None
    return vocab


def wordpiece_vocab(tokenizer_type: str, vocab_file: str, vocab_extra_ids: int = 0) -> WordPieceVocab:
    """The vocabulary of ``--tokenizer-type`` (a key of :data:`WORDPIECE_TYPES`) and its flags."""
    if vocab_extra_ids < 0:
        raise DynaPipeError(f"--vocab-extra-ids {vocab_extra_ids}: must be >= 0.")
    return WordPieceVocab(vocab_file, WORDPIECE_TYPES[tokenizer_type], vocab_extra_ids)
