"""Megatron-LM's ``--tokenizer-type``: the vocabulary size and end-of-document id a run gets
from its tokenizer, built through megatron-core's tokenizer classes where they work offline.

* ``NullTokenizer`` (``--vocab-size N``): megatron-core's, counted as the installed release
  counts it: 0.16 adds the EOD as id N (N + 1 ids); 0.19, as Megatron-LM does since, keeps N
  ids with the EOD among them (``--null-tokenizer-eod-id``, default N - 1).
* ``GPT2BPETokenizer`` (``--vocab-file vocab.json --merge-file merges.txt``): the vocabulary
  is the JSON file's token -> id map (50,257 ids for GPT-2), EOD is ``<|endoftext|>``.
  megatron-core 0.16's class for it resolves the ``gpt2`` name on the Hugging Face hub even
  with local files, so the size and EOD are read from the files themselves, which is all
  pre-tokenised (indexed) data needs.
* ``HuggingFaceTokenizer`` (``--tokenizer-model DIR_OR_NAME``): megatron-core's class, which
  needs the ``transformers`` package.
* ``ByteLevel`` (the default without vocabulary files): UTF-8 bytes, for JSONL text without a
  tokenizer. With them, the default is Megatron-LM's (:func:`resolve_tokenizer_type`).
* ``BertWordPieceLowerCase`` / ``BertWordPieceCase`` (``--vocab-file vocab.txt``, T5's
  ``--vocab-extra-ids N``): Megatron-LM's WordPiece vocabulary with its added ``[BOS]``,
  ``[EOS]`` and sentinel tokens (:mod:`megatron_integration.wordpiece`); EOD is ``[EOS]``.

The vocabulary is then padded as Megatron-LM pads it (``--make-vocab-size-divisible-by``).
No torch import; megatron-core is imported only for the types that use it.
"""
from __future__ import annotations

import argparse
import json
import os
from dataclasses import dataclass
from typing import Optional

from dynapipe.errors import DynaPipeError

TOKENIZER_TYPES = ("ByteLevel", "NullTokenizer", "GPT2BPETokenizer", "HuggingFaceTokenizer", "BertWordPieceLowerCase",
                   "BertWordPieceCase")
GPT2_EOD = "<|endoftext|>"


@dataclass(frozen=True)
class TokenizerInfo:
    """What the model and the data need of a tokenizer: ``vocab_size`` ids before padding,
    ``eod`` the end-of-document id (None for the byte-level default, which has its own)."""

    tokenizer_type: str
    vocab_size: int
    eod: Optional[int] = None


def add_tokenizer_args(group: argparse._ArgumentGroup) -> None:
    """Megatron-LM's vocabulary-file flags (``--tokenizer-type``/``--tokenizer-model`` are declared
    with the data arguments)."""
    group.add_argument("--vocab-file", default=None, help="GPT2BPETokenizer: the vocabulary JSON (token -> id); "
                                                          "BertWordPiece*: the WordPiece vocab.txt")
    group.add_argument("--merge-file", default=None, help="GPT2BPETokenizer: the BPE merges file")
    group.add_argument("--null-tokenizer-eod-id", type=int, default=None,
                       help="NullTokenizer on megatron-core 0.19+: the end-of-document id (default --vocab-size - 1)")
    group.add_argument("--null-tokenizer-pad-id", type=int, default=-1,
                       help="NullTokenizer's pad id (default -1, none; other values are refused)")


def resolve_tokenizer_type(args: argparse.Namespace, files_default: str) -> str:
    """Set ``args.tokenizer_type`` when it was not given, and return it: ``files_default`` (the
    type Megatron-LM's script defaults to: ``GPT2BPETokenizer`` for GPT, ``BertWordPieceLowerCase``
    for T5) when a vocabulary file is given, else ``ByteLevel`` (mock data and JSONL text, where
    Megatron-LM's default would need files)."""
    if args.tokenizer_type is None:
        files = args.vocab_file or (files_default == "GPT2BPETokenizer" and args.merge_file)
        args.tokenizer_type = files_default if files else "ByteLevel"
    return args.tokenizer_type


def _need_file(flag: str, path: Optional[str], tokenizer_type: str) -> str:
    if not path:
        raise DynaPipeError(f"--tokenizer-type {tokenizer_type} needs {flag} FILE.")
    if not os.path.isfile(path):
        raise DynaPipeError(f"{flag} {path!r}: no such file.")
    return path


def gpt2_bpe_info(vocab_file: str, merge_file: str) -> TokenizerInfo:
    """Size and EOD of a GPT-2 BPE vocabulary from its files (Megatron-LM's ``--vocab-file``
    JSON and ``--merge-file``), checked for the shape GPT-2's files have."""
    try:
        with open(vocab_file, encoding="utf-8") as f:
            encoder = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise DynaPipeError(f"--vocab-file {vocab_file!r} is not a GPT-2 vocabulary JSON ({e}).") from None
    if not isinstance(encoder, dict) or not encoder or not all(isinstance(v, int) for v in encoder.values()):
        raise DynaPipeError(f"--vocab-file {vocab_file!r}: expected a JSON object of token -> integer id.")
    if GPT2_EOD not in encoder:
        raise DynaPipeError(f"--vocab-file {vocab_file!r} has no {GPT2_EOD!r} token (GPT2BPETokenizer's "
                            f"end of document); give GPT-2's vocabulary or use --tokenizer-type HuggingFaceTokenizer.")
    try:
        with open(merge_file, encoding="utf-8") as f:
            merges = [line for line in f.read().splitlines() if line and not line.startswith("#version")]
    except UnicodeDecodeError as e:
        raise DynaPipeError(f"--merge-file {merge_file!r} is not a GPT-2 merges text file (not UTF-8: byte "
                            f"{e.start}); give the merges.txt that goes with --vocab-file.") from None
    bad = next((m for m in merges if len(m.split(" ")) != 2), None)
    if bad is not None:
        raise DynaPipeError(f"--merge-file {merge_file!r}: line {bad!r} is not a BPE merge ('left right').")
    return TokenizerInfo("GPT2BPETokenizer", len(encoder), int(encoder[GPT2_EOD]))


def null_library() -> str:
    """The installed megatron-core's library name of ``NullTokenizer``: ``null`` (0.16, ids
    0..N-1 and its EOD at N) or ``null-text`` (0.19 and Megatron-LM since it: N ids, the EOD
    among them, last unless ``--null-tokenizer-eod-id``)."""
    from megatron.core.tokenizers import megatron_tokenizer

    libraries = getattr(megatron_tokenizer, "TEXT_LIBRARIES", getattr(megatron_tokenizer, "TOKENIZER_LIBRARIES", ()))
    return "null-text" if "null-text" in libraries else "null"


def null_info(vocab_size: int, eod_id: Optional[int] = None) -> TokenizerInfo:
    """megatron-core's ``NullTokenizer`` of ``--vocab-size`` as the installed release (and the
    Megatron-LM of its time) counts it: 0.16 adds its EOD as id N (N + 1 ids); 0.19 keeps N ids
    with the EOD at ``eod_id`` (``--null-tokenizer-eod-id``, default N - 1)."""
    from megatron.core.tokenizers import MegatronTokenizer

    library = null_library()
    if library == "null-text":
        eod = vocab_size - 1 if eod_id is None else eod_id
        if not 0 <= eod < vocab_size:
            raise DynaPipeError(f"--null-tokenizer-eod-id {eod}: outside the vocabulary [0, {vocab_size}); give an "
                                f"id below --vocab-size {vocab_size}.")
        tok = MegatronTokenizer.from_pretrained(metadata_path={"library": library}, vocab_size=vocab_size, eod_id=eod)
    else:
        if eod_id is not None:
            raise DynaPipeError(f"--null-tokenizer-eod-id {eod_id}: megatron-core {_core_version()}'s NullTokenizer "
                                f"puts its EOD at --vocab-size ({vocab_size}) and takes no other; drop it, or use "
                                f"megatron-core 0.19 or newer.")
        tok = MegatronTokenizer.from_pretrained(metadata_path={"library": library}, vocab_size=vocab_size)
    return TokenizerInfo("NullTokenizer", int(tok.vocab_size), int(tok.eod))


def _core_version() -> str:
    from dynapipe.megatron_core import installed_version

    return installed_version() or "(unknown)"


def huggingface_info(model: str) -> TokenizerInfo:
    """megatron-core's ``HuggingFaceTokenizer`` of ``--tokenizer-model`` (needs ``transformers``)."""
    try:
        import transformers  # noqa: F401
    except ImportError:
        raise DynaPipeError("--tokenizer-type HuggingFaceTokenizer needs the transformers package: "
                            "pip install transformers (or pre-tokenise and use --tokenizer-type NullTokenizer "
                            "--vocab-size N).") from None
    from megatron.core.tokenizers import MegatronTokenizer

    try:
        tok = MegatronTokenizer.from_pretrained(tokenizer_path=model, metadata_path={"library": "huggingface"})
    except Exception as e:  # transformers raises many types for a missing or malformed model
        raise DynaPipeError(f"--tokenizer-model {model!r}: could not load a Hugging Face tokenizer "
                            f"({' '.join(str(e).split())[:200]}).") from None
    return TokenizerInfo("HuggingFaceTokenizer", int(tok.vocab_size), int(tok.eod))


def tokenizer_info(args: argparse.Namespace) -> TokenizerInfo:
    """The run's tokenizer from Megatron-LM's flags, validated; a flag the chosen type does not
    read is refused rather than ignored (an unset type takes GPT's default, see
    :func:`resolve_tokenizer_type`)."""
    kind = resolve_tokenizer_type(args, "GPT2BPETokenizer")
    if kind not in TOKENIZER_TYPES:
        raise DynaPipeError(f"--tokenizer-type {kind}: not supported; use one of {', '.join(TOKENIZER_TYPES)}.")
    readers = {"--vocab-file": ("GPT2BPETokenizer", "BertWordPieceLowerCase", "BertWordPieceCase"),
               "--merge-file": ("GPT2BPETokenizer",)}
    for flag, value in (("--vocab-file", args.vocab_file), ("--merge-file", args.merge_file)):
        if value and kind not in readers[flag]:
            raise DynaPipeError(f"{flag} is read by --tokenizer-type {' / '.join(readers[flag])} only (not {kind}); "
                                f"drop it or set the tokenizer type.")
    if kind != "NullTokenizer" and args.null_tokenizer_eod_id is not None:
        raise DynaPipeError(f"--null-tokenizer-eod-id is read by --tokenizer-type NullTokenizer only (not {kind}).")
    if args.null_tokenizer_pad_id != -1:
        raise DynaPipeError(f"--null-tokenizer-pad-id {args.null_tokenizer_pad_id}: this build's datasets never pad "
                            f"with the tokenizer's id (the padded positions carry no loss); drop it.")
    if args.tokenizer_model and kind != "HuggingFaceTokenizer":
        raise DynaPipeError(f"--tokenizer-model is read by --tokenizer-type HuggingFaceTokenizer only (not {kind}).")
    if kind == "ByteLevel":
        from megatron_integration.arguments import BYTE_LEVEL_VOCAB

        return TokenizerInfo(kind, args.vocab_size or BYTE_LEVEL_VOCAB)
    if kind == "NullTokenizer":
        if not args.vocab_size:
            raise DynaPipeError("--tokenizer-type NullTokenizer needs --vocab-size N (ids in the data, "
                                "end of document excluded).")
        return null_info(args.vocab_size, args.null_tokenizer_eod_id)
    if kind.startswith("BertWordPiece"):
        from megatron_integration.wordpiece import wordpiece_vocab

        vocab = wordpiece_vocab(kind, args.vocab_file, getattr(args, "vocab_extra_ids", 0))
        info = TokenizerInfo(kind, vocab.vocab_size, vocab.eod)
    elif kind == "GPT2BPETokenizer":
        info = gpt2_bpe_info(_need_file("--vocab-file", args.vocab_file, kind),
                             _need_file("--merge-file", args.merge_file, kind))
    else:
        if not args.tokenizer_model:
            raise DynaPipeError("--tokenizer-type HuggingFaceTokenizer needs --tokenizer-model (a local "
                                "tokenizer directory).")
        info = huggingface_info(args.tokenizer_model)
    if args.vocab_size and args.vocab_size != info.vocab_size:
        raise DynaPipeError(f"--vocab-size {args.vocab_size} disagrees with the {kind}'s {info.vocab_size} ids "
                            f"(Megatron sizes the vocabulary from the tokenizer); drop --vocab-size.")
    return info
