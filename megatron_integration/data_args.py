"""Megatron-LM's data-source and evaluation arguments: ``--split``, the per-split data paths,
``--eval-interval`` and ``--eval-iters``, with Megatron-LM's meaning and defaults.

- ``--data-path`` is split into train / validation / test by ``--split`` (Megatron-LM's
  legacy default ``"969, 30, 1"`` when ``--split`` is not given), by document.
- ``--train-data-path``, ``--valid-data-path``, ``--test-data-path`` give each split its own
  paths (weighted as ``--data-path`` is); they exclude ``--data-path``, ``--mock-data`` and
  ``--split`` (Megatron-LM asserts a single data source, and megatron-core's
  ``BlendedMegatronDatasetConfig`` refuses a split with per-split blends).
- ``--eval-iters`` (default 100; 0 turns evaluation off) global batches of the validation
  set every ``--eval-interval`` iterations (default: none during training), and of the
  validation and test sets once after training, as Megatron-LM's ``pretrain`` does.

No torch or megatron import here: the config is plain data.
"""
from __future__ import annotations

import argparse
import os
from typing import Optional

from dynapipe.data.splits import MEGATRON_DEFAULT_SPLIT, parse_split
from dynapipe.errors import DynaPipeError
from megatron_integration.train_config import EvalArgs

PER_SPLIT_FLAGS = ("train-data-path", "valid-data-path", "test-data-path")


def add_split_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Declare ``--split`` and the per-split paths."""
    g = parser.add_argument_group("data splits and evaluation")
    g.add_argument("--split", default=None,
                   help=f"train, validation and test proportions of --data-path, by document, normalised "
                        f"(default with --data-path: \"{MEGATRON_DEFAULT_SPLIT}\")")
    for flag in PER_SPLIT_FLAGS:
        g.add_argument(f"--{flag}", nargs="*", default=None,
                       help=f"paths (optionally weighted, as --data-path) of the {flag.split('-')[0]} split; "
                            f"excludes --data-path and --split")
    g.add_argument("--data-args-path", default=None,
                   help="a text file holding --data-path's list (weights and paths, whitespace-separated), for "
                        "lists too long for a command line; excludes --data-path")
    g.add_argument("--per-split-data-args-path", default=None,
                   help='a JSON file {"train": ..., "valid": ..., "test": ...}, each a --train/valid/test-data-path '
                        'list (or one string of it; null: no such split); excludes those flags')
    return parser


def read_data_args_files(args: argparse.Namespace) -> None:
    """Replace ``--data-args-path`` / ``--per-split-data-args-path`` in ``args`` by the lists they
    hold (``args.data_path``; ``args.train_data_path`` ...), as Megatron-LM reads them: the text
    file split at whitespace, each JSON value a list or a string split at whitespace. A split
    the JSON leaves out or sets to null has no data (Megatron-LM needs all three keys); an
    unknown key is refused, so that a misspelt split is not silently dropped."""
    import json

    # Each file is read once (T5 parses the shared flags twice): the flag it leaves behind says so.
    if args.data_args_path is not None and not hasattr(args, "_data_path_flag"):
        if args.data_path is not None:
            raise DynaPipeError("--data-path and --data-args-path were both given; give the list one way (as "
                                "Megatron-LM asserts).")
        args.data_path = _read_list(args.data_args_path, "--data-args-path")
        args._data_path_flag = f"--data-args-path {args.data_args_path}"  # named in later errors
    path = args.per_split_data_args_path
    if path is None or hasattr(args, "_per_split_flag"):
        return
    given = [f"--{f}" for f in PER_SPLIT_FLAGS if getattr(args, f.replace("-", "_")) is not None]
    if given:
        raise DynaPipeError(f"{given[0]} and --per-split-data-args-path were both given; give the splits one way "
                            f"(as Megatron-LM asserts).")
    try:
        splits = json.loads(_read_text(path, "--per-split-data-args-path"))
    except ValueError as e:
        raise DynaPipeError(f"--per-split-data-args-path {path!r} is not JSON ({e}); give "
                            f'{{"train": [...], "valid": [...], "test": [...]}}.') from None
    if not isinstance(splits, dict):
        raise DynaPipeError(f"--per-split-data-args-path {path!r} holds a {type(splits).__name__}; give an object "
                            f'{{"train": [...], "valid": [...], "test": [...]}}.')
    unknown = sorted(set(splits) - {"train", "valid", "test"})
    if unknown:
        raise DynaPipeError(f"--per-split-data-args-path {path!r}: unknown split {unknown[0]!r}; the keys are train, "
                            f"valid and test.")
    for split in ("train", "valid", "test"):
        value = splits.get(split)
        if isinstance(value, str):
            value = value.split()
        if value is not None and not (isinstance(value, list) and all(isinstance(v, (str, int, float))
                                                                      for v in value)):
            raise DynaPipeError(f"--per-split-data-args-path {path!r}: {split!r} must be a list of weights and "
                                f"paths, or one string of them (null: no {split} data).")
        if split == "train" and not value:
            raise DynaPipeError(f"--per-split-data-args-path {path!r} holds no training paths (\"train\"); give "
                                f"them (the validation and test splits may be null).")
        if value is not None and not value:  # Megatron-LM fails on an empty list; null is the way to say none
            raise DynaPipeError(f"--per-split-data-args-path {path!r}: {split!r} is empty; give its weights and "
                                f"paths, or null for no {split} data.")
        setattr(args, f"{split}_data_path", [str(v) for v in value] if value else None)
    args._per_split_flag = f"--per-split-data-args-path {path}"  # named in later errors


def _read_text(path: str, flag: str) -> str:
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except OSError as e:
        raise DynaPipeError(f"{flag} {path!r}: cannot read it ({e.strerror or e}).") from None


def _read_list(path: str, flag: str) -> list[str]:
    values = _read_text(path, flag).split()
    if not values:
        raise DynaPipeError(f"{flag} {path!r} holds no path; give the weights and paths of --data-path in it.")
    return values


def add_eval_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Declare ``--eval-iters`` and ``--eval-interval`` (Megatron-LM's defaults)."""
    g = parser.add_argument_group("evaluation")
    # None stands for Megatron-LM's 100, so that an --eval-iters given for a run without
    # validation or test data can be told from the default and refused (eval_args_from_args).
    g.add_argument("--eval-iters", type=int, default=None,
                   help="global batches per evaluation of the validation (and, after training, test) set; "
                        "0 disables evaluation (default 100)")
    g.add_argument("--eval-interval", type=int, default=None,
                   help="iterations between validation runs during training (default: none; the validation "
                        "and test sets are still evaluated once after training)")
    return parser


def is_jsonl(path: str) -> bool:
    """Whether a data path names a JSONL file (else an indexed-dataset prefix)."""
    return path.endswith((".jsonl", ".json"))


def check_jsonl_tokenizer(paths, tokenizer_type: str) -> None:
    """Refuse JSONL ``paths`` with a ``tokenizer_type`` other than ByteLevel: this build
    tokenises JSONL byte-level, and other vocabularies come as indexed datasets."""
    if tokenizer_type != "ByteLevel" and any(is_jsonl(p) for p in paths):
        raise DynaPipeError(f"--tokenizer-type {tokenizer_type}: this build tokenises JSONL byte-level "
                            f"(--tokenizer-type ByteLevel); pre-tokenise other vocabularies into a Megatron "
                            f"indexed dataset with Megatron's preprocess_data.py.")


def data_sources_from_args(args: argparse.Namespace) -> dict:
    """The data fields of :class:`~megatron_integration.train_config.DataArgs` that say where
    each split's samples come from, validated as Megatron-LM validates them."""
    from megatron_integration.arguments import parse_blend

    read_data_args_files(args)
    per_split = {f: getattr(args, f.replace("-", "_")) for f in PER_SPLIT_FLAGS}
    given = [f for f, v in per_split.items() if v is not None]
    # The flags the user typed: a list read from a file is named by the file's flag.
    data_flag = getattr(args, "_data_path_flag", "--data-path")
    split_flag = getattr(args, "_per_split_flag", "--train/valid/test-data-path")
    sources = [name for name, on in (("--mock-data", args.mock_data), (data_flag, args.data_path is not None),
                                     (split_flag, bool(given))) if on]
    if len(sources) > 1:
        raise DynaPipeError(f"{' and '.join(sources)} were both given; give one data source (as in Megatron-LM).")
    if not sources:
        raise DynaPipeError("no data: give --data-path FILE... (or --train-data-path ...) or --mock-data "
                            "(the synthetic multi-task mixture).")
    if given and args.split is not None:
        where = getattr(args, "_per_split_flag", f"--{given[0]}")
        raise DynaPipeError(f"--split {args.split!r} applies to --data-path; with {where} each split has its "
                            f"own paths: drop --split (as megatron-core's dataset config requires).")
    if given and per_split["train-data-path"] is None:
        raise DynaPipeError("--valid-data-path / --test-data-path without --train-data-path: give the training "
                            "data with --train-data-path.")
    fields: dict = {}
    for flag, value in [("data-path", args.data_path)] + list(per_split.items()):
        if value is None:
            continue
        if not value:
            raise DynaPipeError(f"--{flag} was given without a path.")
        shown = (getattr(args, "_data_path_flag", None) if flag == "data-path"
                 else getattr(args, "_per_split_flag", None) and f"{args._per_split_flag} ({flag.split('-')[0]})")
        paths, weights = parse_blend(value, shown or "--" + flag)
        for path in paths:
            stem, suffix = os.path.splitext(path)
            if suffix in (".bin", ".idx") and os.path.exists(stem + ".bin") and os.path.exists(stem + ".idx"):
                # Megatron names an indexed dataset by its prefix; the file itself would be read as
                # the prefix of PATH.bin.bin.
                raise DynaPipeError(f"{shown or '--' + flag} {path!r}: an indexed dataset is given by its prefix, "
                                    f"without {suffix}: {stem!r}.")
            halves = [ext for ext in (".bin", ".idx") if os.path.exists(path + ext)]
            if len(halves) == 1 and not os.path.exists(path):
                missing = ".idx" if halves == [".bin"] else ".bin"
                raise DynaPipeError(f"{shown or '--' + flag} {path!r}: {path}{halves[0]} is there but {path}{missing} "
                                    f"is missing; an indexed dataset needs both (preprocess_data.py writes them "
                                    f"together).")
            if not (os.path.exists(path) or os.path.exists(path + ".idx")):
                raise DynaPipeError(f"{shown or '--' + flag} {path!r}: no such file (nor an indexed dataset "
                                    f"{path}.idx/.bin).")
            if os.path.isfile(path) and not is_jsonl(path) and not os.path.exists(path + ".idx"):
                # Found only when the data is first read: after a bench's profile, or a job's start-up.
                raise DynaPipeError(f"{shown or '--' + flag} {path!r}: neither a JSONL file (.jsonl, .json) nor an "
                                    f"indexed dataset's prefix ({path}.bin/.idx); convert it with Megatron-LM's "
                                    f"tools/preprocess_data.py, or give it a .jsonl name if it is JSONL.")
        key = flag.replace("-", "_")
        fields[key] = tuple(paths)
        fields[key.replace("_path", "_weights")] = tuple(weights or ())
    if args.data_path is not None or args.mock_data:
        split = args.split if args.split is not None else (MEGATRON_DEFAULT_SPLIT if args.data_path else None)
        if split is not None:
            fields["split"] = tuple(parse_split(split))
            if fields["split"][0] <= 0:
                raise DynaPipeError(f"--split {split!r} gives training no share of the data; give the train "
                                    f"split a positive proportion first, e.g. --split 98,2,0.")
    return fields


def eval_args_from_args(args: argparse.Namespace, sources: Optional[dict] = None) -> EvalArgs:
    """``--eval-iters`` / ``--eval-interval``, validated; with ``sources`` (the fields of
    :func:`data_sources_from_args`), refused where the run has no data to evaluate on."""
    iters = 100 if args.eval_iters is None else args.eval_iters  # Megatron-LM's default
    if iters < 0:
        raise DynaPipeError(f"--eval-iters {iters}: must be >= 0 (0 disables evaluation).")
    interval: Optional[int] = args.eval_interval
    if interval is not None and interval <= 0:
        raise DynaPipeError(f"--eval-interval {interval}: must be positive (leave it out for no evaluation "
                            f"during training).")
    if interval is not None and iters == 0:
        # Megatron-LM evaluates nothing then, and says nothing: the interval would be dropped.
        raise DynaPipeError(f"--eval-interval {interval} with --eval-iters 0: evaluation is off, so nothing runs "
                            f"every {interval} iterations; drop --eval-interval, or give --eval-iters the global "
                            f"batches to evaluate.")
    if sources is not None and iters:
        valid, test = eval_splits(sources)
        wanted = [(f"--eval-interval {interval}", valid, "validation set") if interval is not None else None,
                  (f"--eval-iters {iters}", valid or test, "validation or test set")
                  if args.eval_iters is not None else None]
        for flag, present, what in filter(None, wanted):
            if not present:
                why, fix = _no_eval_data_why(sources, args.split, validation=what == "validation set")
                raise DynaPipeError(f"{flag}: this run has no {what} to evaluate ({why}); {fix} or drop "
                                    f"{flag.split()[0]}.")
    return EvalArgs(eval_iters=iters, eval_interval=interval, eval_iters_given=args.eval_iters is not None)


def eval_splits(sources: dict) -> tuple[bool, bool]:
    """Whether the data of ``sources`` (:func:`data_sources_from_args`) has a validation and
    a test split."""
    if "split" in sources:
        split = sources["split"]
        return split[1] > 0, split[2] > 0
    return bool(sources.get("valid_data_path")), bool(sources.get("test_data_path"))


def _no_eval_data_why(sources: dict, split_text: Optional[str], validation: bool = False) -> tuple[str, str]:
    """Why ``sources`` have nothing to evaluate on (``validation``: no validation set, which
    ``--eval-interval`` needs; else neither set), and the fix; ``split_text``: ``--split`` as
    typed (None: not given)."""
    if "split" in sources:
        typed = split_text if split_text is not None else ",".join(str(v) for v in sources["split"])
        return (f"--split {typed!r} leaves it no share",
                "give --split a share for it (such as 98,1,1)")
    if sources.get("train_data_path"):
        if validation:  # a --test-data-path does not help: only the validation set is evaluated during training
            return "--train-data-path without --valid-data-path", "add --valid-data-path"
        return ("--train-data-path without --valid-data-path / --test-data-path",
                "add --valid-data-path (or --test-data-path)")
    # Megatron-LM's mock data would be split 1,1,1; here mock data trains only unless --split is given.
    return "--mock-data without --split trains on every mock sample", "add --split (such as 98,1,1)"
