"""Megatron-LM's T5 span-corruption data arguments: ``--vocab-extra-ids``, ``--mask-prob``,
``--short-seq-prob``, ``--data-cache-path``, with Megatron-LM's meanings and defaults.

They apply to ``--data-path`` (or ``--train-data-path``) indexed datasets (sentences grouped
into documents), which T5 reads through megatron-core's ``T5MaskedWordPieceDataset``
(:mod:`megatron_integration.t5_span_data`); JSONL pairs and ``--mock-data`` are already
(input, target) pairs, so a non-default masking flag with them is refused. No torch or
megatron import here.
"""
from __future__ import annotations

import argparse
import os
from typing import Optional

from dynapipe.data.indexed import check_indexed_files
from dynapipe.data.splits import MEGATRON_DEFAULT_SPLIT, documents_per_split, parse_split
from dynapipe.errors import DynaPipeError
from megatron_integration.args_checks import _fraction, typed_flag
from megatron_integration.data_args import is_jsonl
from megatron_integration.t5_span_data import SpanCorruptionConfig
from megatron_integration.wordpiece import WORDPIECE_TYPES

DEFAULTS = {"mask_prob": 0.15, "short_seq_prob": 0.1, "data_cache_path": None}


def add_t5_data_args(group: argparse._ArgumentGroup) -> None:
    """Declare the span-corruption flags (Megatron-LM's names and defaults)."""
    group.add_argument("--vocab-extra-ids", type=int, default=0,
                       help="sentinel tokens <extra_id_0>... added to a WordPiece vocabulary; T5 span corruption "
                            "needs them (Megatron-LM's T5 uses 100)")
    # Default None, filled in where used: a flag typed at its default value is still refused
    # where it cannot apply.
    group.add_argument("--mask-prob", type=float, default=None,
                       help=f"fraction of a sample's tokens masked into spans (indexed data; default "
                            f"{DEFAULTS['mask_prob']})")
    group.add_argument("--short-seq-prob", type=float, default=None,
                       help=f"probability of a sample shorter than --encoder-seq-length (indexed data; default "
                            f"{DEFAULTS['short_seq_prob']})")
    # --data-cache-path is the shared parser's (megatron_integration.args_megatron).


def _check_cache_folder(folder: str, how: str) -> None:
    """Refuse a cache folder megatron-core could never create: its nearest existing ancestor is
    a file, or a folder this process cannot write. An existing folder is let be (its index
    cache may be built already, on a read-only file system)."""
    if os.path.isdir(folder):
        return
    parent = os.path.abspath(folder)
    while not os.path.exists(parent):
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent) or not os.access(parent, os.W_OK | os.X_OK):
        what = "is a file" if not os.path.isdir(parent) else "cannot be written"
        raise DynaPipeError(f"{how} {folder}: {parent} {what}, so megatron-core could not write the T5 dataset's "
                            f"index cache there; give --data-cache-path a writable folder.")


def span_corruption_from_args(args: argparse.Namespace, base, dec_seq: int) -> Optional[SpanCorruptionConfig]:
    """The span-corruption data of a T5 run validated from its arguments (``base``: the shared
    config, already validated), or None when the run reads JSONL pairs or ``--mock-data``."""
    if args.vocab_extra_ids < 0:
        raise DynaPipeError(f"--vocab-extra-ids {args.vocab_extra_ids}: the number of sentinel tokens cannot be "
                            f"negative; give 0 (none) or more (Megatron-LM's T5 uses 100).")
    flag = "--data-path" if base.data.data_path else "--train-data-path"
    paths = tuple(base.data.data_path or base.data.train_data_path)
    weights = tuple(base.data.data_weights if base.data.data_path else base.data.train_data_weights)
    indexed = [p for p in paths if not is_jsonl(p)]
    if not indexed:
        other = [p for s in ("valid", "test") for p in getattr(base.data, f"{s}_data_path")
                 if not is_jsonl(p)]
        if paths and other:
            raise DynaPipeError(f"{other[0]}: an indexed prefix beside JSONL training pairs; give every split in "
                                f"one kind (JSONL pairs, or indexed datasets for span corruption).")
        given = [f"--{k.replace('_', '-')}" for k in DEFAULTS if getattr(args, k) is not None]
        if given:
            raise DynaPipeError(f"{given[0]} applies to T5 span corruption of indexed --data-path datasets; JSONL "
                                f"pairs and --mock-data are not masked: drop it.")
        _record_defaults(args)
        if args.vocab_extra_ids and args.tokenizer_type not in WORDPIECE_TYPES:
            raise DynaPipeError(f"--vocab-extra-ids {args.vocab_extra_ids}: sentinels are added to the WordPiece "
                                f"vocabularies only (--tokenizer-type BertWordPieceLowerCase or BertWordPieceCase), "
                                f"not to {args.tokenizer_type}; drop it.")
        return None
    if len(indexed) != len(paths):
        raise DynaPipeError(f"{flag} mixes JSONL files and indexed-dataset prefixes; give one kind.")
    # With --train-data-path, --valid-data-path / --test-data-path name the evaluation sets (one
    # blend a split, as megatron-core's blend_per_split).
    per_split = {} if base.data.data_path else {
        s: (tuple(getattr(base.data, f"{s}_data_path")), tuple(getattr(base.data, f"{s}_data_weights")))
        for s in ("valid", "test") if getattr(base.data, f"{s}_data_path")}
    for flag_of, prefixes in [(flag, paths)] + [(f"--{s}-data-path", p) for s, (p, _) in per_split.items()]:
        for p in prefixes:
            if is_jsonl(p):
                raise DynaPipeError(f"{flag_of} {p}: a JSONL file beside indexed --train-data-path prefixes; give "
                                    f"every split in one kind.")
            if not (os.path.isfile(p + ".bin") and os.path.isfile(p + ".idx")):
                raise DynaPipeError(f"{flag_of} {p}: no indexed dataset there ({p}.bin and {p}.idx must both exist; "
                                    f"pass the prefix preprocess_data.py wrote, without the extension).")
            documents = check_indexed_files(p)
            if flag_of == "--data-path":
                _every_split_has_documents(p, documents, _train_split(args))
    blends = [(flag, paths, weights)] + [(f"--{s}-data-path", p, w) for s, (p, w) in per_split.items()]
    for flag_of, prefixes, given_weights in blends:
        if len(prefixes) > 1 and not given_weights:
            # megatron-core sizes each prefix's T5 dataset from its weighted share of the samples;
            # unweighted, it builds them at no size, which its span-corruption index cannot take
            # (a TypeError deep in its C++ helpers, in Megatron-LM too).
            raise DynaPipeError(f"{flag_of} {' '.join(prefixes)}: several span-corruption prefixes need a weight each; "
                                f"give {' '.join(f'1 {q}' for q in prefixes)} (or one prefix).")
    kind = args.tokenizer_type
    if kind not in WORDPIECE_TYPES:
        default = " (the default without --vocab-file)" if getattr(args, "vocab_file", None) is None else ""
        raise DynaPipeError(f"--tokenizer-type {kind}{default}: T5 span corruption of indexed data masks whole WordPiece "
                            f"words, as Megatron's T5 dataset does; use --tokenizer-type BertWordPieceLowerCase or "
                            f"BertWordPieceCase with the --vocab-file the data was tokenised with.")
    if args.vocab_extra_ids <= 0:
        raise DynaPipeError(f"--vocab-extra-ids {args.vocab_extra_ids}: T5 span corruption replaces every masked "
                            f"span by a sentinel token and needs them; add --vocab-extra-ids 100 (Megatron-LM's T5).")
    if not args.mmap_bin_files:
        raise DynaPipeError("--no-mmap-bin-files: megatron-core's T5 span-corruption dataset always memory-maps its "
                            "indexed files (its reader takes no such option); drop it.")
    _record_defaults(args)
    mask_prob = _fraction("mask-prob", args.mask_prob, low_open=True, default=DEFAULTS["mask_prob"])
    short_seq_prob = _fraction("short-seq-prob", args.short_seq_prob, high_open=False,
                               default=DEFAULTS["short_seq_prob"])
    enc_seq = base.model.seq_length
    if enc_seq < 4:
        flag = typed_flag(args, "seq-length", "encoder-seq-length")
        raise DynaPipeError(f"{flag} {enc_seq}: too short for T5 span corruption, whose samples hold "
                            f"{flag} - 2 text tokens; use at least 4.")
    if base.data.tokens_per_global_batch:
        raise DynaPipeError("--dynapipe-tokens-per-global-batch: Megatron's T5 dataset draws --train-iters x "
                            "--global-batch-size samples; give global batches by --global-batch-size.")
    if base.data.overlong == "reject":
        raise DynaPipeError("--dynapipe-overlong reject: megatron-core's T5 dataset cuts every document to "
                            "--encoder-seq-length itself (its samples are Megatron-LM's), so there is nothing "
                            "over-long to reject; drop it.")
    if base.seed <= 0:
        raise DynaPipeError(f"--seed {base.seed}: megatron-core's T5 sample mapping needs a positive seed.")
    # As Megatron-LM builds it: --train-samples itself where given (megatron-core's sample mapping
    # covers whole epochs shuffled over its length, so a rounded count would draw other samples).
    train_samples = getattr(args, "train_samples", None)
    cfg = SpanCorruptionConfig(
        paths=paths, weights=weights, split=_train_split(args) if base.data.data_path else None,
        num_samples=train_samples if train_samples is not None else base.train_iters * base.global_batch_size,
        encoder_seq_length=enc_seq, decoder_seq_length=dec_seq, seed=base.seed, tokenizer_type=kind,
        vocab_file=args.vocab_file, vocab_extra_ids=args.vocab_extra_ids, mask_prob=mask_prob,
        short_seq_prob=short_seq_prob, cache_path=args.data_cache_path,
        valid_paths=per_split.get("valid", ((), ()))[0], valid_weights=per_split.get("valid", ((), ()))[1],
        test_paths=per_split.get("test", ((), ()))[0], test_weights=per_split.get("test", ((), ()))[1])
    for folder, how in ([(args.data_cache_path, "--data-cache-path")] if args.data_cache_path else
                        [(os.path.join(q, "cache"), f"megatron-core's default cache of {q}") for q in
                         paths + tuple(q for p, _ in per_split.values() for q in p)]):
        _check_cache_folder(folder, how)
    if dec_seq < min(3, cfg.worst_decoder_length):
        raise DynaPipeError(f"--decoder-seq-length {dec_seq}: too short for T5 span corruption ([BOS], a sentinel "
                            f"and a masked token); use at least 3 (up to {cfg.worst_decoder_length} at these lengths).")
    return cfg


def _record_defaults(args: argparse.Namespace) -> None:
    """Fill in Megatron-LM's values of the masking flags left untyped, so the arguments a
    checkpoint records hold them as Megatron-LM's do."""
    for key in ("mask_prob", "short_seq_prob"):
        if getattr(args, key) is None:
            setattr(args, key, DEFAULTS[key])


def _every_split_has_documents(prefix: str, documents: int, split: str) -> None:
    """Refuse a ``--split`` that leaves a split with a share none of ``prefix``'s documents:
    megatron-core's T5 dataset builds every split with a share (even one no sample is drawn
    from) and fails on an empty one with an IndexError."""
    for name, count in documents_per_split(parse_split(split), documents).items():
        if count == 0:
            raise DynaPipeError(f"--split {split!r} gives the {name} split none of the {documents:,} documents of "
                                f"--data-path {prefix}, and megatron-core's T5 dataset cannot build an empty split "
                                f"(it builds every split with a share, read or not): give the {name} split a larger "
                                f"share, or none (such as --split 98,2,0), or use more documents.")


def _train_split(args: argparse.Namespace) -> str:
    """megatron-core's split string of a T5 run's ``--split``, as typed (Megatron-LM passes it
    through, and megatron-core normalises it once: normalising it here first moved a split's
    boundary by a document at 7,2,1); Megatron-LM's default 969,30,1 with --data-path."""
    return args.split if args.split is not None else MEGATRON_DEFAULT_SPLIT


def span_split_samples(base, split: str) -> int:
    """Samples of ``split`` a Megatron-LM run draws (``base``: the run's shared config): every
    training sample; ``--eval-iters`` global batches per evaluation for validation (one every
    ``--eval-interval`` iterations and one after training) and test (once)."""
    e, gbs = base.evaluation, base.global_batch_size
    if split == "train":
        return base.train_iters * gbs
    if split == "valid":
        periodic = base.train_iters // e.eval_interval if e.eval_interval else 0
        return (periodic + 1) * e.eval_iters * gbs
    return e.eval_iters * gbs
