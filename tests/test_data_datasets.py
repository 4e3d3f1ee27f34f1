"""Datasets: JSONL (multi-task and Megatron text), Megatron indexed datasets, the synthetic
mixture, tokenizers, over-long samples, and micro-batch tensors."""
import json
import pickle

import numpy as np
import pytest

from dynapipe.data.collate import TensorRequest, collate, loss_tokens
from dynapipe.data.config import DatasetConfig
from dynapipe.data.indexed import MegatronIndexedDataset, write_indexed_dataset
from dynapipe.data.jsonl import JsonlDataset
from dynapipe.data.mixture_dataset import MixtureDataset
from dynapipe.data.samples import LengthLimits, Sample
from dynapipe.data.synthetic import sample_lengths
from dynapipe.data.tokenizer import ByteTokenizer, load_megatron_tokenizer
from dynapipe.errors import DynaPipeError

TOK = ByteTokenizer()


def write_jsonl(path, records):
    with open(path, "w") as f:
        for r in records:
            f.write(r if isinstance(r, str) else json.dumps(r))
            f.write("\n")
    return str(path)


def ids(text):
    return np.frombuffer(text.encode(), dtype=np.uint8).astype(np.int64) + ByteTokenizer.OFFSET


# ---- JSONL -------------------------------------------------------------------------------

def test_jsonl_multitask_records_tokenised(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [
        {"input": "classify: good", "target": "pos", "task": "cls"},
        "",  # blank lines are skipped
        {"input": "question?", "target": "answer é", "task": "qa"},
        {"input": "another", "target": "neg", "task": "cls"},
    ])
    ds = JsonlDataset(path, LengthLimits(512))
    assert len(ds) == 3
    assert ds.task_names == ["cls", "qa"]
    assert ds.tasks.tolist() == [0, 1, 0]
    s = ds[1]
    np.testing.assert_array_equal(s.input_ids, ids("question?"))
    np.testing.assert_array_equal(s.target_ids, np.append(ids("answer é"), TOK.eod))
    assert ds.input_lengths.tolist() == [14, 9, 7]
    assert ds.target_lengths.tolist() == [4, len("answer é".encode()) + 1, 4]
    assert ds.planner_lengths([0, 2]).tolist() == [18, 11]
    assert ds.num_truncated == 0


def test_jsonl_megatron_text_records(tmp_path):
    path = write_jsonl(tmp_path / "t.jsonl", [{"text": "hello world"}, {"text": "x"}])
    ds = JsonlDataset(path, LengthLimits(64))
    assert ds[0].input_ids.shape == (0,)
    np.testing.assert_array_equal(ds[0].target_ids, np.append(ids("hello world"), 1))
    assert ds.sample_tokens().tolist() == [12, 2]


def test_jsonl_encoder_decoder_lengths_are_pairs(tmp_path):
    path = write_jsonl(tmp_path / "e.jsonl", [{"input": "abc", "target": "de"}])
    ds = JsonlDataset(path, LengthLimits(64), encoder_decoder=True)
    assert ds.planner_lengths([0]).tolist() == [[3, 3]]


@pytest.mark.parametrize("lines, line_no, words", [
    (['{"text": "a"}', '{"text": "b"', '{"text": "c"}'], 2, "not a valid JSON"),
    (['{"text": "a"}', '{"text": "b"}', '{"input": "q"}'], 3, "needs both 'input' and 'target'"),
    (['{"prompt": "a"}'], 1, "expected fields"),
    (['{"text": "a"}', '[1, 2]'], 2, "expected a JSON object"),
    (['{"input": "a", "target": 5}'], 1, "must be a string"),
    # An empty text would be its end-of-document token alone, with nothing to predict it from.
    (['{"text": "ok"}', '{"text": ""}'], 2, "the 'text' field is empty after tokenising"),
])
def test_jsonl_malformed_line_named(tmp_path, lines, line_no, words):
    path = write_jsonl(tmp_path / "bad.jsonl", lines)
    with pytest.raises(DynaPipeError) as e:
        JsonlDataset(path, LengthLimits(64))
    assert f"bad.jsonl:{line_no}:" in str(e.value)
    assert words in str(e.value)


def test_jsonl_text_record_rejected_for_encoder_decoder(tmp_path):
    path = write_jsonl(tmp_path / "t.jsonl", [{"text": "abc"}])
    with pytest.raises(DynaPipeError, match="t.jsonl:1: an encoder-decoder dataset needs"):
        JsonlDataset(path, LengthLimits(64), encoder_decoder=True)


def test_jsonl_missing_file():
    with pytest.raises(DynaPipeError, match="does not exist"):
        JsonlDataset("/nonexistent/x.jsonl", LengthLimits(64))


def test_megatron_core_tokenizer_is_used(tmp_path):
    tok = load_megatron_tokenizer(metadata={"library": "byte-level"})
    path = write_jsonl(tmp_path / "d.jsonl", [{"input": "hé", "target": "yo"}])
    ds = JsonlDataset(path, LengthLimits(64), tokenizer=tok)
    assert ds[0].input_ids.tolist() == list(tok.tokenize("hé"))
    assert ds[0].target_ids.tolist() == list(tok.tokenize("yo")) + [tok.eod]
    assert ds.vocab_size == tok.vocab_size


# ---- over-long samples -------------------------------------------------------------------

def test_overlong_decoder_sample_truncated_keeping_target(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [
        {"input": "a" * 30, "target": "b" * 5},   # 36 tokens: input cut to 14
        {"input": "c" * 3, "target": "d" * 4},    # fits
        {"text": "e" * 40},                        # 41 tokens: target head kept
    ])
    ds = JsonlDataset(path, LengthLimits(20, overlong="truncate"))
    assert ds.truncated.tolist() == [True, False, True]
    assert ds.num_truncated == 2
    assert ds.input_lengths.tolist() == [14, 3, 0]
    assert ds.target_lengths.tolist() == [6, 5, 20]
    s = ds[0]
    np.testing.assert_array_equal(s.input_ids, ids("a" * 14))
    np.testing.assert_array_equal(s.target_ids, np.append(ids("b" * 5), 1))
    np.testing.assert_array_equal(ds[2].target_ids, ids("e" * 20))


def test_overlong_rejected_with_clear_error(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"text": "ok"}, {"input": "a" * 30, "target": "b"}])
    with pytest.raises(DynaPipeError) as e:
        JsonlDataset(path, LengthLimits(20, overlong="reject"))
    msg = str(e.value)
    assert f"{path}:2 has 32 tokens" in msg and "seq_length=20" in msg and "overlong='truncate'" in msg
    # An encoder-decoder sample names both limits: LengthLimits' fields from Python, the flags a
    # T5 run has under its spelling.
    from dynapipe.errors import spelled_as
    from megatron_integration.flag_spelling import T5_SPELLING

    pairs = write_jsonl(tmp_path / "p.jsonl", [{"input": "a" * 30, "target": "b"}])
    with pytest.raises(DynaPipeError) as e:
        JsonlDataset(pairs, LengthLimits(20, dec_seq_length=8, overlong="reject"), encoder_decoder=True)
    assert "limits 20 / 8" in str(e.value) and "Raise seq_length / dec_seq_length" in str(e.value)
    with spelled_as(T5_SPELLING), pytest.raises(DynaPipeError) as e:
        JsonlDataset(pairs, LengthLimits(20, dec_seq_length=8, overlong="reject"), encoder_decoder=True)
    msg = str(e.value)
    assert "Raise --encoder-seq-length / --decoder-seq-length" in msg and " --seq-length" not in msg
    assert "(--dynapipe-overlong truncate, the default)" in msg


def test_overlong_encoder_decoder_each_side(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"input": "a" * 30, "target": "b" * 30}])
    ds = JsonlDataset(path, LengthLimits(16, dec_seq_length=8), encoder_decoder=True)
    assert ds.planner_lengths([0]).tolist() == [[16, 8]]
    assert ds[0].target_ids.shape == (8,)


def test_bad_overlong_policy():
    with pytest.raises(DynaPipeError, match="'drop' is not known"):
        LengthLimits(16, overlong="drop").validate()


# ---- Megatron indexed datasets -------------------------------------------------------------

def test_indexed_dataset_written_by_megatron_builder_reads_back(tmp_path):
    rng = np.random.default_rng(0)
    seqs = [rng.integers(2, 500, size=n) for n in (5, 17, 1, 40, 9)]
    prefix = str(tmp_path / "docs")
    write_indexed_dataset(prefix, seqs)
    # Truncation instead of Megatron's split into pieces (tests/test_data_documents.py).
    ds = MegatronIndexedDataset(prefix, LengthLimits(32), split_documents=False)
    assert len(ds) == 5
    assert ds.target_lengths.tolist() == [5, 17, 1, 32, 9]
    assert ds.truncated.tolist() == [False, False, False, True, False]
    for i, s in enumerate(seqs):
        np.testing.assert_array_equal(ds[i].target_ids, s[:32])
        assert ds[i].input_ids.shape == (0,)
    # Survives pickling (what planner workers receive) without its memory maps.
    clone = pickle.loads(pickle.dumps(ds))
    np.testing.assert_array_equal(clone[3].target_ids, seqs[3][:32])


@pytest.mark.parametrize("dtype", [np.uint16, np.int32, np.int64])
def test_the_index_reader_agrees_with_megatron_cores(tmp_path, dtype):
    # dynapipe.data.index_file reads what megatron-core's builder wrote as megatron-core's
    # IndexedDataset does: the same index arrays and the same tokens at any offset and length,
    # memory-mapped or read.
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    from dynapipe.data.index_file import IndexFile

    rng = np.random.default_rng(1)
    seqs = [rng.integers(0, 60000, size=n) for n in (5, 17, 1, 40, 9, 3)]
    prefix = str(tmp_path / "docs")
    write_indexed_dataset(prefix, seqs, dtype=dtype)
    theirs = IndexedDataset(prefix)
    for mmap in (True, False):
        ours = IndexFile(prefix, mmap=mmap)
        assert ours.dtype == np.dtype(dtype) == np.dtype(theirs.index.dtype) and len(ours) == len(theirs)
        for name in ("sequence_lengths", "sequence_pointers", "document_indices"):
            np.testing.assert_array_equal(getattr(ours, name), getattr(theirs.index, name))
        for i, s in enumerate(seqs):
            for offset, length in ((0, None), (0, len(s)), (len(s) // 2, None), (len(s) // 3, len(s) // 2)):
                got = ours.get(i, offset, length)
                assert got.dtype == np.dtype(dtype)
                np.testing.assert_array_equal(got, theirs.get(i, offset, length))
                np.testing.assert_array_equal(got, s[offset:offset + (len(s) - offset if length is None else length)])


@pytest.mark.parametrize("mmap", [True, False])
def test_a_bin_cut_short_while_the_job_runs_is_named_at_the_read(tmp_path, mmap):
    from dynapipe.data.index_file import IndexFile
    from dynapipe.errors import DynaPipeError

    prefix = str(tmp_path / "docs")
    write_indexed_dataset(prefix, [np.arange(2, 9), np.arange(2, 5)])
    reader = IndexFile(prefix, mmap=mmap)
    assert reader.get(0, 7, 0).shape == (0,) and reader.get(1).tolist() == [2, 3, 4]
    with open(prefix + ".bin", "r+b") as f:
        f.truncate(8 * 4)  # sequence 1 (bytes 28-40) loses its last token
    with pytest.raises(DynaPipeError, match=r"docs.bin ends before sequence 1's tokens 0..3: the file was truncated"):
        IndexFile(prefix, mmap=mmap).get(1)


def test_indexed_lengths_come_from_the_index_alone(tmp_path):
    prefix = str(tmp_path / "docs")
    write_indexed_dataset(prefix, [np.arange(2, 9), np.arange(2, 5)])
    with open(prefix + ".bin", "r+b") as f:  # scribble over every token
        size = f.seek(0, 2)
        f.seek(0)
        f.write(b"\xff" * size)
    ds = MegatronIndexedDataset(prefix, LengthLimits(64))
    assert ds.target_lengths.tolist() == [7, 3]
    assert ds[0].target_ids.tolist() != list(range(2, 9))


def test_paired_indexed_datasets_encoder_decoder(tmp_path):
    inputs = [np.arange(2, 2 + n) for n in (4, 9, 3)]
    targets = [np.arange(100, 100 + n) for n in (2, 1, 6)]
    write_indexed_dataset(str(tmp_path / "in"), inputs)
    write_indexed_dataset(str(tmp_path / "tg"), targets)
    ds = MegatronIndexedDataset(str(tmp_path / "in"), LengthLimits(8, dec_seq_length=5),
                                target_prefixes=str(tmp_path / "tg"), encoder_decoder=True)
    assert ds.planner_lengths([0, 1, 2]).tolist() == [[4, 2], [8, 1], [3, 5]]
    s = ds[1]
    np.testing.assert_array_equal(s.input_ids, inputs[1][:8])
    np.testing.assert_array_equal(s.target_ids, targets[1])


def test_indexed_multi_task_prefixes_and_errors(tmp_path):
    write_indexed_dataset(str(tmp_path / "a"), [np.arange(2, 5)] * 2)
    write_indexed_dataset(str(tmp_path / "b"), [np.arange(2, 7)] * 3)
    ds = MegatronIndexedDataset([str(tmp_path / "a"), str(tmp_path / "b")], LengthLimits(64))
    assert ds.tasks.tolist() == [0, 0, 1, 1, 1]
    assert ds[4].target_ids.tolist() == list(range(2, 7))
    with pytest.raises(DynaPipeError, match="they must pair one to one"):
        MegatronIndexedDataset(str(tmp_path / "a"), LengthLimits(64), target_prefixes=str(tmp_path / "b"))
    with pytest.raises(DynaPipeError, match=r"\.bin and .*\.idx must both exist"):
        MegatronIndexedDataset(str(tmp_path / "missing"), LengthLimits(64))
    with pytest.raises(DynaPipeError, match="needs paired datasets"):
        MegatronIndexedDataset(str(tmp_path / "a"), LengthLimits(64), encoder_decoder=True)
    # A dataset written from empty input is named as such (its .bin is empty too, but nothing
    # was lost in a copy).
    write_indexed_dataset(str(tmp_path / "empty"), [])
    with pytest.raises(DynaPipeError, match=r"empty: the indexed dataset holds no sequences .* rebuild it, or leave"):
        MegatronIndexedDataset(str(tmp_path / "empty"), LengthLimits(64))


# ---- synthetic mixture -------------------------------------------------------------------

def test_mixture_dataset_lengths_and_tokens_deterministic():
    a = MixtureDataset(300, seed=7, limits=LengthLimits(256), vocab_size=512)
    b = MixtureDataset(300, seed=7, limits=LengthLimits(256), vocab_size=512)
    np.testing.assert_array_equal(a.planner_lengths(range(300)), sample_lengths(300, 7, 256))
    # Any sample reads the same ids whatever was read before it.
    for i in (299, 3, 150):
        np.testing.assert_array_equal(a[i].target_ids, b[i].target_ids)
        np.testing.assert_array_equal(a[i].input_ids, b[i].input_ids)
    s = a[5]
    assert s.input_ids.shape[0] + s.target_ids.shape[0] == a.planner_lengths([5])[0]
    assert min(s.input_ids.min(initial=2), s.target_ids.min()) >= 2 and s.target_ids.max() < 512
    c = MixtureDataset(300, seed=8, limits=LengthLimits(256), vocab_size=512)
    assert not np.array_equal(c.planner_lengths(range(300)), a.planner_lengths(range(300)))


def test_dataset_config_builds_each_kind(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"text": "abc"}])
    write_indexed_dataset(str(tmp_path / "x"), [np.arange(2, 6)])
    assert len(DatasetConfig("jsonl", 32, paths=(path,)).build()) == 1
    assert len(DatasetConfig("indexed", 32, paths=(str(tmp_path / "x"),)).build()) == 1
    assert len(DatasetConfig("synthetic", 32, num_samples=10, vocab_size=100).build()) == 10
    with pytest.raises(DynaPipeError, match="kind 'csv' is not known"):
        DatasetConfig("csv", 32).build()


# ---- micro-batch tensors -----------------------------------------------------------------

def _req(names, shape, dtypes=None):
    return [TensorRequest(n, shape, (dtypes or {}).get(n, "float32" if n == "loss_mask" else "int64"))
            for n in names]


def test_collate_decoder_labels_and_loss_mask():
    s0 = Sample(np.array([10, 11]), np.array([12, 13, 1]))   # instruction sample
    s1 = Sample(np.zeros(0, np.int64), np.array([20, 21, 22]))  # text sample
    out = collate([[s0], [s1]], _req(["tokens", "position_ids", "labels", "loss_mask"], (2, 8)), 8)
    assert out["tokens"].tolist() == [[10, 11, 12, 13, 1, 0, 0, 0], [20, 21, 22, 0, 0, 0, 0, 0]]
    assert out["position_ids"][0].tolist() == [0, 1, 2, 3, 4, 0, 0, 0]
    assert out["labels"].tolist() == [[11, 12, 13, 1, 0, 0, 0, 0], [21, 22, 0, 0, 0, 0, 0, 0]]
    # Loss where the label is a target token: 12, 13, eod for s0; 21, 22 for s1.
    assert out["loss_mask"].tolist() == [[0, 1, 1, 1, 0, 0, 0, 0], [1, 1, 0, 0, 0, 0, 0, 0]]
    assert out["loss_mask"].dtype == np.float32
    assert out["loss_mask"].sum() == loss_tokens(s0, False) + loss_tokens(s1, False)


def test_collate_packed_rows_restart_positions():
    a = Sample(np.zeros(0, np.int64), np.array([5, 6, 7]))
    b = Sample(np.zeros(0, np.int64), np.array([8, 9]))
    out = collate([[a, b]], _req(["tokens", "position_ids", "labels", "segment_ids"], (1, 6)), 6)
    assert out["tokens"].tolist() == [[5, 6, 7, 8, 9, 0]]
    assert out["position_ids"].tolist() == [[0, 1, 2, 0, 1, 0]]
    assert out["labels"].tolist() == [[6, 7, 0, 9, 0, 0]]  # nothing predicts across samples
    assert out["segment_ids"].tolist() == [[1, 1, 1, 2, 2, 0]]


def test_collate_encoder_decoder():
    s = Sample(np.array([3, 4, 5]), np.array([7, 8]))
    reqs = _req(["tokens", "enc_mask"], (1, 4)) + _req(["dec_tokens", "labels", "loss_mask"], (1, 3))
    out = collate([[s]], reqs, 4, 3, encoder_decoder=True, eod_id=1)
    assert out["tokens"].tolist() == [[3, 4, 5, 0]]
    assert out["dec_tokens"].tolist() == [[1, 7, 0]]
    assert out["labels"].tolist() == [[7, 8, 0]]
    assert out["loss_mask"].tolist() == [[1, 1, 0]]
    assert out["enc_mask"].tolist() == [[1, 1, 1, 0]]


def test_collate_errors_name_the_problem():
    s = Sample(np.zeros(0, np.int64), np.arange(2, 12))
    with pytest.raises(DynaPipeError, match="does not know"):
        collate([[s]], _req(["pixels"], (1, 16)), 16)
    with pytest.raises(DynaPipeError, match="needs 10 tokens but the plan pads it to 8"):
        collate([[s]], _req(["tokens"], (1, 8)), 8)
    with pytest.raises(DynaPipeError, match=r"shape \[2, 16\]"):
        collate([[s]], _req(["tokens"], (2, 16)), 16)
    # A [seqlen, mbs] request gets the transpose.
    assert collate([[s]], _req(["tokens"], (16, 1)), 16)["tokens"].shape == (16, 1)


def test_a_tokenizer_path_without_its_metadata_is_refused(tmp_path):
    # It was ignored: the JSONL went through the byte-level tokenizer.
    from dynapipe.data.config import DatasetConfig

    path = write_jsonl(tmp_path / "d.jsonl", [{"text": "hello"}])
    with pytest.raises(DynaPipeError, match=r"^tokenizer_path '/models/gpt2' without tokenizer_metadata"):
        DatasetConfig(kind="jsonl", seq_length=64, paths=(path,), tokenizer_path="/models/gpt2").build()


def test_encoder_decoder_mock_targets_are_drawn_within_the_decoder_length():
    # They were drawn up to the encoder's length and then counted as truncated (refused under
    # overlong="reject"): mock data that its own run called over-long.
    from dynapipe.data.mixture_dataset import MixtureDataset

    limits = LengthLimits(512, 64, overlong="reject")
    ds = MixtureDataset(2000, 3, limits, 512, encoder_decoder=True)
    assert ds.num_truncated == 0 and int(ds.target_lengths.max()) == 64 and int(ds.input_lengths.max()) > 64
