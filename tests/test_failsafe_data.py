"""Fail-safety battery, data: damaged indexed (``.bin``/``.idx``) datasets, bad JSONL files and
tokenizers or token ids that do not fit the model's vocabulary.

Data is checked where it enters, and the one-line error names the file and the document
(sequence or line), so that a bad record is found without searching the corpus; an id outside
the vocabulary must never reach an embedding.
"""
from __future__ import annotations

import os

import numpy as np
import pytest

from dynapipe.errors import DynaPipeError

from failsafe_common import truncate_file, write_indexed


@pytest.fixture(autouse=True)
def megatron_spelling():
    """These are a training job's data errors, raised inside pretrain: they name its flags."""
    from dynapipe.errors import spelled_as
    from megatron_integration.flag_spelling import MEGATRON_SPELLING

    with spelled_as(MEGATRON_SPELLING):
        yield


def _idx_case(tmp_path, name):
    p = tmp_path / "data"
    good = [[5, 6, 7], [8, 9], [10, 11, 12, 13]]
    if name == "id_at_vocab":
        return write_indexed(p, [[5, 6], [7, 100]]), ("data.bin", "sequence 1", "id 100")
    if name == "id_far_above":
        return write_indexed(p, [[5, 6], [7, 8], [2**30]]), ("data.bin", "sequence 2", "outside the vocabulary")
    if name == "negative_id":
        return write_indexed(p, [[5, -1], [7, 8]]), ("data.bin", "sequence 0", "id -1", "never negative")
    if name == "uint16_above":
        return write_indexed(p, [[5, 6], [60000]], np.uint16), ("data.bin", "sequence 1", "id 60000")
    if name == "all_empty":
        return write_indexed(p, [[], []]), ("data.idx", "all 2 of its sequences are empty", "no tokens at all")
    prefix = write_indexed(p, good)
    if name == "bin_truncated":
        truncate_file(prefix + ".bin", -3)
        return prefix, ("data.bin", "truncated")
    if name == "bin_empty":
        truncate_file(prefix + ".bin", 0)
        return prefix, ("data.bin", "empty")
    if name == "bin_too_long":  # bytes the index does not know: another dataset's .bin
        with open(prefix + ".bin", "ab") as f:
            f.write(b"\0" * 40)
        return prefix, ("data.bin", "do not belong together")
    if name == "bin_of_another_dtype":  # an int16 index beside the int32 .bin of the same tokens
        other = write_indexed(tmp_path / "narrow", good, np.int16)
        os.replace(other + ".idx", prefix + ".idx")
        return prefix, ("data.bin", "int16", "do not belong together")
    if name == "idx_last_document":  # the document index's end is not the sequence count
        with open(prefix + ".idx", "r+b") as f:
            f.seek(os.path.getsize(prefix + ".idx") - 8)
            f.write(np.int64(7).tobytes())
        return prefix, ("data.idx", "cannot be read as a Megatron index")
    if name == "idx_truncated_tail":
        truncate_file(prefix + ".idx", -5)
        return prefix, ("data.idx", "truncated")
    if name == "idx_truncated_header":
        truncate_file(prefix + ".idx", 12)
        return prefix, ("data.idx", "truncated")
    if name == "idx_empty":
        truncate_file(prefix + ".idx", 0)
        return prefix, ("data.idx", "truncated")
    if name == "idx_garbage":
        with open(prefix + ".idx", "wb") as f:
            f.write(os.urandom(200))
        return prefix, ("data.idx", "not a Megatron index")
    if name in ("idx_bad_version", "idx_bad_dtype"):
        with open(prefix + ".idx", "r+b") as f:
            f.seek(9 if name == "idx_bad_version" else 17)
            f.write(b"\x63")
        return prefix, ("data.idx", "not a Megatron index")
    if name == "idx_negative_length":
        with open(prefix + ".idx", "r+b") as f:
            f.seek(34 + 4)
            f.write(np.int32(-2).tobytes())
        return prefix, ("data.idx", "negative length")
    if name == "idx_bad_pointer":
        with open(prefix + ".idx", "r+b") as f:
            f.seek(34 + 3 * 4 + 8)
            f.write(np.int64(4).tobytes())
        return prefix, ("data.idx", "sequence 1")
    if name == "idx_documents_decrease":  # the document index [0, 2, 1, 3]
        with open(prefix + ".idx", "r+b") as f:
            f.seek(34 + 3 * (4 + 8) + 8)
            f.write(np.array([2, 1], np.int64).tobytes())
        return prefix, ("data.idx", "decreases at entry 2 (2 then 1)")
    if name == "float_ids":
        return write_indexed(tmp_path / "floats", good, np.float32), ("floats.idx", "float32", "not token ids")
    if name == "bin_is_dir":
        os.remove(prefix + ".bin")
        os.mkdir(prefix + ".bin")
        return prefix, ("data.bin", "not a regular file")
    raise KeyError(name)


IDX_CASES = ["id_at_vocab", "id_far_above", "negative_id", "uint16_above", "all_empty",
             "bin_truncated", "bin_empty", "bin_too_long", "bin_of_another_dtype", "idx_last_document",
             "idx_truncated_tail", "idx_truncated_header", "idx_empty", "idx_garbage",
             "idx_bad_version", "idx_bad_dtype", "idx_negative_length", "idx_bad_pointer", "bin_is_dir",
             "idx_documents_decrease", "float_ids"]


@pytest.mark.parametrize("name", IDX_CASES)
def test_indexed_data_is_checked_where_it_enters(tmp_path, name):
    from dynapipe.data.config import DatasetConfig

    prefix, needles = _idx_case(tmp_path, name)
    with pytest.raises(DynaPipeError) as e:
        DatasetConfig(kind="indexed", seq_length=64, paths=(prefix,), vocab_size=100).build()
    text = str(e.value)
    assert "\n" not in text
    for needle in needles:
        assert needle in text


def test_empty_documents_are_skipped_as_megatron_lm_trains_past_them(tmp_path):
    # Text that tokenised to nothing, written without --append-eod: Megatron-LM's GPT dataset
    # concatenates past it. The --split ranges count it (Megatron-LM splits by documents).
    from dynapipe.data.config import DatasetConfig
    from dynapipe.data.summary import summarize

    prefix = write_indexed(tmp_path / "data", [[5, 6], [], [7, 8, 9], [], [10, 11], [12]])
    ds = DatasetConfig(kind="indexed", seq_length=64, paths=(prefix,), vocab_size=100).build()
    assert [list(ds[i].target_ids) for i in range(len(ds))] == [[5, 6], [7, 8, 9], [10, 11], [12]]
    line = summarize(ds).line("train", 64)
    assert "4 documents (2 empty skipped)" in line and "8 tokens" in line, line
    # Documents [0, 3) are the first half of six: one of them empty.
    half = DatasetConfig(kind="indexed", seq_length=64, paths=(prefix,), vocab_size=100,
                         split_range=(0.0, 0.5)).build()
    assert [list(half[i].target_ids) for i in range(len(half))] == [[5, 6], [7, 8, 9]]
    assert summarize(half).empty == 1
    # A split range holding empty documents only is an empty split, and says why.
    only_empty = write_indexed(tmp_path / "gap", [[5, 6], [], [], [7]])
    with pytest.raises(DynaPipeError, match=r"hold no sequences \(2 empty\) in the --split range"):
        DatasetConfig(kind="indexed", seq_length=64, paths=(only_empty,), vocab_size=100,
                      split_range=(0.25, 0.75)).build()
    # A path of empty sequences only holds no data: named as such, not as one empty sequence to filter.
    nothing = write_indexed(tmp_path / "nothing", [[], [], []])
    with pytest.raises(DynaPipeError, match=r"nothing.idx: all 3 of its sequences are empty \(no tokens at all\); "
                                            r"drop it from the data paths"):
        DatasetConfig(kind="indexed", seq_length=64, paths=(prefix, nothing), weights=(1.0, 1.0),
                      vocab_size=100).build()


def test_an_overlong_indexed_sample_is_named_by_its_file_and_sequence(tmp_path):
    # Refused under overlong="reject" (paired data is never cut into pieces): named by prefix and
    # sequence, not by an index into every prefix's documents of the split.
    from dynapipe.data.config import DatasetConfig

    short = [[5, 6, 7]] * 10
    a = write_indexed(tmp_path / "a", short)
    b = write_indexed(tmp_path / "b", short[:8] + [list(range(2, 40))] + short[:1])
    targets = [write_indexed(tmp_path / f"{n}_t", [[8, 9]] * 10) for n in ("a", "b")]
    for split in ((0.0, 1.0), (0.5, 1.0)):
        with pytest.raises(DynaPipeError, match=rf"^{b}: sequence 8 has 40 tokens"):
            DatasetConfig(kind="indexed", seq_length=16, paths=(a, b), target_paths=tuple(targets), vocab_size=100,
                          overlong="reject", split_range=split).build()


@pytest.mark.parametrize("name", ["bin_truncated", "bin_too_long", "bin_of_another_dtype", "idx_last_document",
                                  "idx_bad_pointer"])
def test_indexed_files_handed_to_megatron_core_get_the_same_checks(tmp_path, name):
    # T5 span corruption hands the files to megatron-core's own dataset, which fails on these
    # with a traceback naming no file (or reads wrong tokens): they are refused first.
    from dynapipe.data.indexed import check_indexed_files

    prefix, needles = _idx_case(tmp_path, name)
    with pytest.raises(DynaPipeError) as e:
        check_indexed_files(prefix)
    assert "\n" not in str(e.value) and all(needle in str(e.value) for needle in needles), str(e.value)


def test_token_check_runs_once_per_dataset_and_is_vectorised(tmp_path, monkeypatch):
    from dynapipe.data import indexed
    from dynapipe.data.config import DatasetConfig

    prefix = write_indexed(tmp_path / "ok", [list(range(2, 48)) + ([49] if i == 38 else []) for i in range(40)])
    calls = []
    real = indexed.first_bad_token
    monkeypatch.setattr(indexed, "first_bad_token", lambda *a: calls.append(a) or real(*a))
    monkeypatch.setattr(indexed, "_CHECK_CHUNK", 100)  # several chunks: the bad id is in a later one
    ds = DatasetConfig(kind="indexed", seq_length=64, paths=(prefix,), vocab_size=100).build()
    ds.validate_tokens(100)
    ds.validate_tokens(100)
    assert len(calls) == 1
    with pytest.raises(DynaPipeError, match="sequence 38, token 46 has id 49"):
        ds.validate_tokens(49)
    import pickle

    assert pickle.loads(pickle.dumps(ds))._tokens_valid_below == 100  # travels into planner workers


JSONL = {
    "lone_surrogate": ('{"text": "ab\\ud800cd"}\n', ":1", "lone surrogate"),
    "lone_surrogate_target": ('{"text": "ok"}\n{"input": "a", "target": "\\udfff"}\n', ":2", "surrogate"),
    "not_json": ('{"text": "a"\n', ":1", "not a valid JSON"),
    "not_object": ('[1, 2]\n', ":1", "JSON object"),
    "no_fields": ('{"body": "a"}\n', ":1", "'text'"),
    "input_only": ('{"input": "a"}\n', ":1", "both"),
    "text_not_string": ('{"text": 5}\n', ":1", "must be a string"),
    "empty_text_no_eod": None,
    "task_list": ('{"text": "a", "task": [1]}\n', ":1", "task"),
    "deep": ('{"text": ' + "[" * 100000 + "]" * 100000 + '}\n', ":1", "nested too deeply"),
    "invalid_utf8": (b'{"text": "\xff\xfe"}\n', ":1", "JSON"),
    "no_samples": ("\n\n", "hold no samples", "no samples"),
    # An empty text is its end-of-document token alone: nothing to predict, named by its line.
    "only_empty_texts": ('{"text": ""}\n{"text": ""}\n', ":1", "the 'text' field is empty after tokenising"),
    "an_empty_text": ('{"text": "ok fine"}\n{"text": ""}\n', ":2", "the 'text' field is empty after tokenising"),
    # A multi-task record's empty target would teach only the end-of-document token: named, as is
    # an encoder-decoder record's empty input (below), where "the sample tokenises to no tokens" was wrong.
    "empty_target": ('{"input": "a", "target": ""}\n', ":1", "the 'target' field is empty after tokenising"),
}


@pytest.mark.parametrize("name", sorted(k for k, v in JSONL.items() if v is not None))
def test_bad_jsonl(tmp_path, name):
    from dynapipe.data.config import DatasetConfig

    content, *needles = JSONL[name]
    p = tmp_path / "data.jsonl"
    p.write_bytes(content if isinstance(content, bytes) else content.encode("utf-8"))
    with pytest.raises(DynaPipeError) as e:
        DatasetConfig(kind="jsonl", seq_length=64, paths=(str(p),), vocab_size=384).build()
    text = str(e.value)
    assert "\n" not in text
    for needle in needles:
        assert needle in text


def test_jsonl_ids_above_the_vocabulary_name_the_line(tmp_path):
    from dynapipe.data.config import DatasetConfig

    class Wide:
        vocab_size, eod, pad = 100, 1, 0

        def tokenize(self, text):
            return [ord(c) for c in text]

    p = tmp_path / "data.jsonl"
    p.write_text('{"text": "AB"}\n\n{"text": "Ab"}\n')  # 'b' is 98 + eod... fine; 'A'..; id 98 < 100
    DatasetConfig(kind="jsonl", seq_length=64, paths=(str(p),), vocab_size=100, tokenizer=Wide()).build()
    p.write_text('{"text": "AB"}\n\n{"text": "Az"}\n')  # 'z' is 122
    with pytest.raises(DynaPipeError, match=r"data.jsonl:3: token id 122 is outside the vocabulary \[0, 100\)"):
        DatasetConfig(kind="jsonl", seq_length=64, paths=(str(p),), vocab_size=100, tokenizer=Wide()).build()


@pytest.mark.parametrize("vocab", [1, 100, 258])
def test_tokenizer_larger_than_the_model_vocabulary_is_refused(tmp_path, vocab):
    from dynapipe.data.config import DatasetConfig

    p = tmp_path / "data.jsonl"
    p.write_text('{"text": "hello"}\n')
    with pytest.raises(DynaPipeError, match=f"259 ids but --vocab-size is {vocab}"):
        DatasetConfig(kind="jsonl", seq_length=64, paths=(str(p),), vocab_size=vocab).build()


def test_overlong_error_names_the_real_flag(tmp_path):
    from dynapipe.data.config import DatasetConfig
    from megatron_integration.arguments import build_parser

    p = tmp_path / "data.jsonl"
    p.write_text('{"text": "' + "x" * 100 + '"}\n')
    with pytest.raises(DynaPipeError) as e:
        DatasetConfig(kind="jsonl", seq_length=64, paths=(str(p),), overlong="reject", vocab_size=384,
                      split_documents=False).build()  # as --dynapipe-overlong reject builds it
    flags = [f.rstrip(",.;:)") for f in str(e.value).split() if f.startswith("--")]
    known = {s for a in build_parser()._actions for s in a.option_strings}
    assert flags and all(f in known for f in flags), flags


def test_an_encoder_decoder_record_with_an_empty_field_names_it(tmp_path):
    from dynapipe.data.config import DatasetConfig

    p = tmp_path / "pairs.jsonl"
    for line, expected in (('{"input": "", "target": "w"}', "data.jsonl:2: the 'input' field is empty"),
                           ('{"input": "w", "target": ""}', "data.jsonl:2: the 'target' field is empty"),
                           ('{"input": "", "target": ""}', "the 'input' and 'target' fields are empty")):
        p = tmp_path / "data.jsonl"
        p.write_text('{"input": "a b", "target": "c"}\n' + line + "\n")
        with pytest.raises(DynaPipeError, match=expected):
            DatasetConfig(kind="jsonl", seq_length=64, paths=(str(p),), vocab_size=384, encoder_decoder=True).build()
    # A decoder-only record may have an empty input: the target is the text.
    p.write_text('{"input": "", "target": "w"}\n{"input": "a", "target": "b"}\n')
    assert len(DatasetConfig(kind="jsonl", seq_length=64, paths=(str(p),), vocab_size=384).build()) == 2


def test_file_token_ids_are_checked_against_the_tokenizers_vocabulary_not_the_padded_one(tmp_path):
    # NullTokenizer --vocab-size 450: 451 ids with its end-of-document one, padded to 512. An id
    # in the padding (499) is no token of it: data of another vocabulary, refused.
    from megatron_integration.arguments import parse_training_args
    from megatron_integration.data import dataset_config

    prefix = write_indexed(tmp_path / "data", [[5, 6, 7], [8, 499], [905, 3]])
    argv = (f"--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 64 --micro-batch-size 2 "
            f"--global-batch-size 2 --lr 1e-3 --train-iters 1 --tokenizer-type NullTokenizer --vocab-size 450 "
            f"--data-path {prefix} --split 100,0,0").split()
    cfg = parse_training_args(argv, 1, cuda=False)
    assert (cfg.model.unpadded_vocab_size, cfg.model.vocab_size) == (451, 512)
    # The size suggested is the whole data's largest id + 1, not the first bad id's (a user
    # following that advice met the next bad id, and a new size, on every retry).
    with pytest.raises(DynaPipeError, match=r"sequence 1, token 1 has id 499, outside the vocabulary \[0, 451\).*"
                                            r"its largest id is 905.*--vocab-size of at least 906"):
        dataset_config(cfg).build()
    from dynapipe.data.config import DatasetConfig

    other = write_indexed(tmp_path / "other", [[1, 1200]])
    for weights in ((), (0.5, 0.5)):  # one dataset of two prefixes, and a weighted blend of two datasets
        with pytest.raises(DynaPipeError, match=r"has id 499.*its largest id is 1200.*--vocab-size of at least 1201"):
            DatasetConfig(kind="indexed", seq_length=64, paths=(prefix, other), weights=weights,
                          vocab_size=451).build()
    # Mock data draws its ids below the padded size, as it always has.
    mock = parse_training_args([a for a in argv if a not in (f"{prefix}", "--data-path")] + ["--mock-data"], 1,
                               cuda=False)
    assert dataset_config(mock).vocab_size == 512
