"""Megatron-LM pretraining data: long documents cut into pieces that keep every token, ``--split``
and the per-split data paths, on indexed datasets written by megatron-core's ``IndexedDatasetBuilder``."""
import numpy as np
import pytest
import torch

from dynapipe.data.collate import loss_token_counts
from dynapipe.data.indexed import MegatronIndexedDataset, write_indexed_dataset
from dynapipe.data.pieces import split_documents
from dynapipe.data.samples import LengthLimits, Sample
from dynapipe.data.splits import parse_split, split_ranges
from dynapipe.data.summary import summarize
from dynapipe.errors import DynaPipeError
from megatron_integration.arguments import UNSUPPORTED_MEGATRON_FLAGS, parse_training_args
from megatron_integration.data import GlobalBatches, data_summary_lines, dataset_config

SEQ = 64
# Around every edge: 1 token, just below / at / above the limit, and several pieces.
EDGE_LENGTHS = (1, 2, SEQ - 1, SEQ, SEQ + 1, 2 * SEQ - 2, 2 * SEQ - 1, 2 * SEQ, 5 * SEQ + 3, 700)
BASE = (f"--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length {SEQ} --micro-batch-size 2 "
        f"--global-batch-size 8 --train-iters 4 --lr 1e-3 --vocab-size 4096")


@pytest.fixture(autouse=True)
def megatron_spelling():
    """The spelling a training job's data is opened under (inside pretrain): errors name its flags."""
    from dynapipe.errors import spelled_as
    from megatron_integration.flag_spelling import MEGATRON_SPELLING

    with spelled_as(MEGATRON_SPELLING):
        yield


def _docs(lengths, first_id=0):
    """Documents whose tokens are all distinct: (document id, position) encoded in the id."""
    return [(first_id + d) * 1000 + np.arange(n) % 1000 for d, n in enumerate(lengths)]


def _rebuild(pieces_of_doc):
    """A document from its pieces: every piece after the first repeats its predecessor's last token."""
    return np.concatenate([pieces_of_doc[0]] + [p[1:] for p in pieces_of_doc[1:]])


@pytest.fixture(scope="module")
def corpora(tmp_path_factory):
    root = tmp_path_factory.mktemp("docs")
    rng = np.random.default_rng(1)
    paths = {"edges": str(root / "edges"), "A": str(root / "A"), "B": str(root / "B"), "C": str(root / "C")}
    write_indexed_dataset(paths["edges"], [d % 4096 for d in _docs(EDGE_LENGTHS)])
    # 1000 documents (token ids 0..999 name the document), some longer than SEQ.
    write_indexed_dataset(paths["A"], [np.full(rng.integers(2, 3 * SEQ), d) for d in range(1000)])
    write_indexed_dataset(paths["B"], [np.full(rng.integers(2, SEQ), 1000 + d) for d in range(300)])
    write_indexed_dataset(paths["C"], [np.full(rng.integers(2, SEQ), 2000 + d) for d in range(40)])
    return paths


def test_piece_arithmetic_keeps_every_prediction():
    lengths = np.array(EDGE_LENGTHS)
    p = split_documents(lengths, SEQ)
    assert p.length.max() <= SEQ and p.length.min() >= 1
    for d, n in enumerate(lengths):
        mine = p.document == d
        if n <= SEQ:  # short documents stay whole
            assert mine.sum() == 1 and p.length[mine][0] == n
        else:
            assert p.length[mine].min() >= 2  # no piece without a prediction
        # Pieces overlap by one token: the next-token predictions of the pieces are the document's.
        assert (p.length[mine] - 1).sum() == max(n - 1, 0)
        np.testing.assert_array_equal(p.offset[mine][1:], p.offset[mine][:-1] + p.length[mine][:-1] - 1)
    with pytest.raises(DynaPipeError, match="no tokens"):
        split_documents(np.array([3, 0]), SEQ)


def test_long_documents_split_into_pieces_no_token_lost(corpora):
    docs = [d % 4096 for d in _docs(EDGE_LENGTHS)]
    ds = MegatronIndexedDataset(corpora["edges"], LengthLimits(SEQ))
    assert ds.target_lengths.max() <= SEQ and not ds.truncated.any() and ds.input_lengths.sum() == 0
    samples = [ds[i].target_ids for i in range(len(ds))]
    # Pieces read from the .bin, grouped by document in order, rebuild every document exactly.
    by_doc = {}
    for i, s in enumerate(samples):
        by_doc.setdefault(int(ds._seqs[i]), []).append(s)
    assert sorted(by_doc) == list(range(len(docs)))
    for d, doc in enumerate(docs):
        np.testing.assert_array_equal(_rebuild(by_doc[d]), doc)
    # The loss counts exactly the documents' next-token predictions.
    assert loss_token_counts(ds.input_lengths, ds.target_lengths, False).sum() == sum(n - 1 for n in EDGE_LENGTHS)
    s = summarize(ds)
    assert (s.documents, s.split_documents, s.samples, s.document_tokens, s.truncated) == (
        len(EDGE_LENGTHS), sum(n > SEQ for n in EDGE_LENGTHS), len(ds), sum(EDGE_LENGTHS), 0)
    assert "6 longer than --seq-length 64, split into pieces" in s.line("train", SEQ)


def test_baselines_train_every_piece(corpora):
    """Padding: one piece a row, padded to --seq-length; packing: pieces packed whole into rows."""
    from megatron_integration.initialize import RankInfo
    from megatron_integration.baseline_step import build_micro_batches

    ds = MegatronIndexedDataset(corpora["edges"], LengthLimits(SEQ))
    n = len(ds) - len(ds) % 2
    samples, lengths = [ds[i] for i in range(n)], ds.planner_lengths(range(n))
    info = RankInfo(0, 1, 0, 1, 0, 1, 0, 1, torch.device("cpu"))
    want = int(loss_token_counts(np.zeros(n), lengths, False).sum())
    for method in ("padding", "packing"):
        mbs, padded = build_micro_batches(method, samples, lengths, SEQ, 2, info)
        assert int(sum(m.loss_mask.sum() for m in mbs)) == want, method
        tokens = torch.cat([m.tokens.reshape(-1) for m in mbs])
        assert sorted(tokens[tokens > 0].tolist()) == sorted(np.concatenate([s.target_ids for s in samples])
                                                             [np.concatenate([s.target_ids for s in samples]) > 0]
                                                             .tolist())


def test_split_parsing_matches_megatron_core():
    from megatron.core.datasets.blended_megatron_dataset_config import parse_and_normalize_split

    # Quoted as Megatron-LM's llama3 and gpt-oss launch scripts pass it ("--split '99,1,0'" expanded unquoted).
    for text in ("969, 30, 1", "90,5,5", "1", "99,1", "0.5/0.25/0.25", "3 1 0", "98:1:1", "8;1;1", "'99,1,0'",
                 '"98,2,0"'):
        assert parse_split(text) == pytest.approx(parse_and_normalize_split(text), abs=0)
    for bad in ("a,b", "0,0,0", "1,2,3,4", "-1,2", ""):
        with pytest.raises(DynaPipeError, match="--split"):
            parse_split(bad)
    r = split_ranges(parse_split("969, 30, 1"))
    assert r["train"] == (0.0, 0.969) and r["valid"][1] == pytest.approx(0.999) and r["test"][1] == 1.0
    assert split_ranges(parse_split("1,0,0"))["valid"] is None


def _tokens(dataset):
    return {int(t) for i in range(len(dataset)) for t in np.unique(dataset[i].target_ids)}


def test_default_split_is_megatrons_and_splits_are_disjoint(corpora):
    cfg = parse_training_args(f"{BASE} --data-path {corpora['A']}".split(), 1, cuda=False)
    assert cfg.data.split == pytest.approx((0.969, 0.03, 0.001))
    parts = {s: dataset_config(cfg, s).build() for s in ("train", "valid", "test")}
    docs = {s: _tokens(d) for s, d in parts.items()}  # a document's tokens are its id
    assert docs["train"] == set(range(969)) and docs["valid"] == set(range(969, 999)) and docs["test"] == {999}
    assert all(d.target_lengths.max() <= SEQ for d in parts.values())
    lines = data_summary_lines(cfg)
    assert [ln.split(":")[0] for ln in lines if " data: " in ln] == [" > train data", " > valid data", " > test data"]
    assert "969 documents (" in lines[0] and "split into pieces" in lines[0] and "0 truncated" in lines[0]
    # A Megatron-LM user is told that a sample is a document, not a --seq-length window of them,
    # so the same --global-batch-size trains fewer tokens a step (padding baseline: no token budget).
    mean, gbs = float(parts["train"].sample_tokens().mean()), cfg.global_batch_size
    assert mean < 0.9 * SEQ
    assert lines[1] == (f" > a train sample here is one document (or a piece of a longer one), {mean:,.0f} tokens on "
                        f"average: a global batch of {gbs:,} samples holds about {mean * gbs:,.0f} tokens, where "
                        f"Megatron-LM's GPTDataset packs documents into samples of --seq-length {SEQ} "
                        f"({gbs * SEQ:,} tokens a batch); raise --global-batch-size to train as many tokens a step")
    from megatron_integration.data import _sample_size_note

    assert _sample_size_note(cfg, np.full(10, SEQ - 3)) is None  # samples near --seq-length: nothing to say
    # What training samples: only training documents, never longer than --seq-length.
    batches = GlobalBatches.create(cfg, consumed_samples=0, start_iteration=0)
    idx = np.concatenate([batches.batch(i).indices for i in range(50)])
    assert _tokens_at(batches.dataset, idx) <= set(range(969)) and batches.lengths(batches.batch(0)).max() <= SEQ
    # Asked to reject over-long samples, long documents are refused rather than cut.
    cfg = parse_training_args(f"{BASE} --data-path {corpora['A']} --dynapipe-overlong reject".split(), 1, cuda=False)
    # Named as a document (it has no input or target), with the default that cuts it as the fix.
    with pytest.raises(DynaPipeError, match=r"sequence \d+ is a document of \d+ tokens, more than --seq-length 64 .*"
                                            r"cut into --seq-length pieces .*--dynapipe-overlong truncate, the "
                                            r"default\)"):
        dataset_config(cfg).build()


def _tokens_at(dataset, indices):
    return {int(t) for i in indices for t in np.unique(dataset[int(i)].target_ids)}


def test_blend_weights_keep_working_with_splits(corpora):
    a, b = corpora["A"], corpora["B"]
    cfg = parse_training_args(f"{BASE} --data-path 1 {a} 3 {b} --split 80,20,0".split(), 1, cuda=False)
    train, valid = dataset_config(cfg, "train").build(), dataset_config(cfg, "valid").build()
    assert dataset_config(cfg, "test") is None
    for ds, (a_docs, b_docs) in ((train, (range(800), range(1000, 1240))), (valid, (range(800, 1000),
                                                                                    range(1240, 1300)))):
        seen = _tokens(ds)
        assert seen <= set(a_docs) | set(b_docs)  # each path split on its own, by document
        from_b = np.array([ds[i].target_ids[0] >= 1000 for i in range(len(ds))])
        tokens = ds.sample_tokens()
        # The weights mix the parts of a split, as shares of their tokens.
        assert tokens[from_b].sum() / tokens.sum() == pytest.approx(0.75, abs=0.01)
    assert not _tokens(train) & _tokens(valid)
    # A path too small for a split's range is left out of that split only.
    cfg = parse_training_args(f"{BASE} --data-path 1 {a} 1 {corpora['C']}".split(), 1, cuda=False)
    test = dataset_config(cfg, "test").build()  # C's 40 documents give the test split none
    assert _tokens(test) == {999} and len(test.parts) == 1


def test_per_split_data_paths(corpora):
    a, b, c = corpora["A"], corpora["B"], corpora["C"]
    cfg = parse_training_args(f"{BASE} --train-data-path {a} --valid-data-path 1 {b} 1 {c}".split(), 1, cuda=False)
    assert cfg.data.split == () and dataset_config(cfg, "test") is None
    assert len(_tokens(dataset_config(cfg, "train").build())) == 1000  # all of it, no --split
    valid = dataset_config(cfg, "valid").build()
    assert _tokens(valid) <= set(range(1000, 1300)) | set(range(2000, 2040)) and valid.weights == (1.0, 1.0)
    for extra, needle in (
            (f"--data-path {a} --train-data-path {b}", "give one data source"),
            (f"--mock-data --train-data-path {b}", "give one data source"),
            (f"--train-data-path {a} --split 90,10,0", "drop --split"),
            (f"--valid-data-path {a}", "without --train-data-path"),
            (f"--data-path {a} --split 1,x", "--split '1,x'"),
            (f"--data-path {a} --split 0,1,0", "--split '0,1,0' gives training no share"),
            ("--mock-data --split 0,0,1", "--split '0,0,1' gives training no share"),
            (f"--train-data-path {a}.missing", "--train-data-path"),
            ("", "no data")):
        with pytest.raises(DynaPipeError, match=needle):
            parse_training_args(f"{BASE} {extra}".split(), 1, cuda=False)
    for flag in ("--split", "--train-data-path", "--valid-data-path", "--test-data-path"):
        assert flag not in UNSUPPORTED_MEGATRON_FLAGS


def test_data_lists_read_from_files_as_megatron_lm_reads_them(corpora, tmp_path):
    # --data-args-path: --data-path's list in a text file; --per-split-data-args-path: the
    # per-split lists in JSON (a list, or one string of it). The same configs as the flags give.
    import json

    a, b, c = corpora["A"], corpora["B"], corpora["C"]
    listed = tmp_path / "data-args.txt"
    listed.write_text(f"0.3 {a}\n0.7\t{b}\n")
    from_file = parse_training_args(f"{BASE} --data-args-path {listed}".split(), 1, cuda=False)
    from_flag = parse_training_args(f"{BASE} --data-path 0.3 {a} 0.7 {b}".split(), 1, cuda=False)
    assert from_file.data == from_flag.data and from_file.data.split == from_flag.data.split != ()
    per_split = tmp_path / "splits.json"
    per_split.write_text(json.dumps({"train": [a], "valid": f"1 {b} 1 {c}", "test": None}))
    from_json = parse_training_args(f"{BASE} --per-split-data-args-path {per_split}".split(), 1, cuda=False)
    from_flags = parse_training_args(f"{BASE} --train-data-path {a} --valid-data-path 1 {b} 1 {c}".split(), 1,
                                     cuda=False)
    assert from_json.data == from_flags.data and dataset_config(from_json, "test") is None
    assert "_per_split_flag" not in from_json.megatron_args  # checkpoints record Megatron's args only

    def refused(extra: str, needle: str) -> None:
        with pytest.raises(DynaPipeError, match=needle):
            parse_training_args(f"{BASE} {extra}".split(), 1, cuda=False)

    refused(f"--data-args-path {listed} --data-path {a}", "--data-path and --data-args-path were both given")
    refused(f"--per-split-data-args-path {per_split} --train-data-path {a}",
            "--train-data-path and --per-split-data-args-path were both given")
    refused(f"--data-args-path {tmp_path / 'none.txt'}", "--data-args-path .*none.txt.*: cannot read it")
    (tmp_path / "empty.txt").write_text(" \n")
    refused(f"--data-args-path {tmp_path / 'empty.txt'}", "holds no path")
    for text, needle in (("{", "is not JSON"), ("[1]", "holds a list; give an object"),
                         (json.dumps({"train": [a], "validation": [b]}), "unknown split 'validation'"),
                         (json.dumps({"train": {"x": 1}}), "'train' must be a list of weights and paths"),
                         # An empty split was no data, unsaid (Megatron-LM fails on it; null says none).
                         (json.dumps({"train": [a], "valid": []}), "'valid' is empty; give its weights and paths, "
                                                                   "or null"),
                         (json.dumps({"train": [a], "test": ""}), "'test' is empty")):
        per_split.write_text(text)
        refused(f"--per-split-data-args-path {per_split}", needle)
    per_split.write_text(json.dumps({"valid": [b]}))
    refused(f"--per-split-data-args-path {per_split}", "holds no training paths")
    # Later errors name the file's flag, not a flag the user did not type.
    refused(f"--mock-data --data-args-path {listed}", "--mock-data and --data-args-path .*data-args.txt were both given")
    per_split.write_text(json.dumps({"train": [a + ".missing"]}))
    refused(f"--per-split-data-args-path {per_split}", r"--per-split-data-args-path .*splits.json \(train\) .*missing"
                                                       r"': no such file")
    # The dataset's own file for its prefix: named with the prefix to give (it was read as the
    # prefix of a .bin.bin).
    refused(f"--data-path {a}.bin", rf"--data-path '{a}.bin': an indexed dataset is given by its prefix, without "
                                    rf"\.bin: '{a}'")
    # One half of an indexed dataset: the missing half is named.
    import shutil

    shutil.copy(a + ".bin", tmp_path / "half.bin")
    refused(f"--data-path {tmp_path / 'half'}", r"half.bin is there but .*half.idx is missing")
    shutil.copy(a + ".idx", tmp_path / "other.idx")
    refused(f"--data-path {tmp_path / 'other'}", r"other.idx is there but .*other.bin is missing")
    # A file of another kind was found only when the data was first read (a bench: after its profile).
    text = tmp_path / "corpus.txt"
    text.write_text("some words\n")
    refused(f"--data-path {text}", rf"--data-path '{text}': neither a JSONL file \(\.jsonl, \.json\) nor an "
                                   rf"indexed dataset's prefix")


def test_long_instruction_samples_truncated_or_rejected_and_counted(tmp_path):
    """Instruction data (input/target) is not split: a long sample is truncated (default) or refused."""
    import json

    path = tmp_path / "tasks.jsonl"
    with open(path, "w") as f:
        for i, (n_in, n_out) in enumerate(((10, 5), (80, 20), (30, 10), (5, 90))):
            f.write(json.dumps({"input": "i" * n_in, "target": "t" * n_out, "task": f"t{i % 2}"}) + "\n")
    argv = f"{BASE.replace('--vocab-size 4096', '')} --data-path {path} --split 1,0,0".split()
    cfg = parse_training_args(argv, 1, cuda=False)
    assert cfg.data.overlong == "truncate"
    ds = dataset_config(cfg).build()
    assert ds.truncated.tolist() == [False, True, False, True] and ds.planner_lengths(range(4)).max() == SEQ
    kept = int(ds.sample_tokens().sum())
    assert kept < 254  # the two truncated samples lost tokens the stored count still holds
    # Half the samples cut: a line of its own, not just the count (a quarter of them would be too).
    assert data_summary_lines(cfg) == [f" > train data: 4 documents -> 4 samples, 254 tokens, 2 truncated "
                                       f"({kept} tokens after truncation)",
                                       f" > note: 2 of the 4 train samples (50%) are longer than --seq-length and were "
                                       f"cut to fit; raise --seq-length, or refuse such samples with "
                                       f"--dynapipe-overlong reject"]
    # A token budget is checked against what is left, at start-up (before any stage is built).
    budget = parse_training_args(argv + ["--use-dynapipe", "--dynapipe-tokens-per-global-batch", str(kept + 1)], 1,
                                 cuda=False)
    with pytest.raises(DynaPipeError, match=f"--dynapipe-tokens-per-global-batch {kept + 1}: more than the {kept} "
                                            f"tokens of the whole training data"):
        data_summary_lines(budget)
    fits = parse_training_args(argv + ["--use-dynapipe", "--dynapipe-tokens-per-global-batch", str(kept)], 1,
                               cuda=False)
    assert len(data_summary_lines(fits)) == 2
    cfg = parse_training_args(argv + ["--dynapipe-overlong", "reject"], 1, cuda=False)
    with pytest.raises(DynaPipeError, match=r"tasks.jsonl:2 has 101 tokens .*--seq-length 64.*2 over-long"):
        dataset_config(cfg).build()


def test_unweighted_jsonl_files_are_split_each_on_its_own(tmp_path):
    # As megatron-core splits every path (and as the indexed prefixes are split here): train
    # takes the first half of each file, not the first file whole.
    import json

    paths = []
    for name in ("a", "b"):
        path = tmp_path / f"{name}.jsonl"
        path.write_text("".join(json.dumps({"text": f"{name}{i:03d}"}) + "\n" for i in range(100)))
        paths.append(str(path))
    argv = f"{BASE.replace('--vocab-size 4096', '')} --data-path {paths[0]} {paths[1]} --split 50,50,0".split()
    cfg = parse_training_args(argv, 1, cuda=False)
    for split, first in (("train", range(0, 50)), ("valid", range(50, 100))):
        ds = dataset_config(cfg, split).build()
        from dynapipe.data.tokenizer import ByteTokenizer

        ids = [ds[i].target_ids[:4] - ByteTokenizer.OFFSET for i in range(len(ds))]
        texts = {bytes(t.astype(np.uint8)).decode() for t in ids}
        assert texts == {f"{n}{i:03d}" for n in "ab" for i in first}, split


def test_an_asked_for_validation_on_an_empty_validation_split_is_refused(corpora):
    from megatron_integration.evaluation import Evaluator

    # 40 documents: --split 998,1,1 leaves the validation split none.
    argv = f"{BASE} --data-path {corpora['C']} --split 998,1,1".split()
    cfg = parse_training_args(argv + ["--eval-interval", "2"], 1, cuda=False)
    with pytest.raises(DynaPipeError, match="--eval-interval 2: the validation split holds no document"):
        Evaluator(cfg, None, None)
    # Not asked for during training: the empty split is only not evaluated.
    assert not Evaluator(parse_training_args(argv, 1, cuda=False), None, None).has("valid")
    # Evaluation batches without a loss token (one-token documents) were logged as loss 0, PPL 1.
    import types

    import torch

    ok_argv = f"{BASE} --data-path {corpora['C']} --split 50,50,0 --eval-iters 2".split()
    cpu, stage = types.SimpleNamespace(device=torch.device("cpu")), types.SimpleNamespace(module=torch.nn.Linear(1, 1))
    evaluator = Evaluator(parse_training_args(ok_argv, 1, cuda=False), cpu, stage, batch_fn=lambda *a: (0.0, 0))
    with pytest.raises(DynaPipeError, match="evaluating the validation set: its 2 global batch\\(es\\) from batch 0 "
                                            "hold no loss tokens"):
        evaluator.evaluate("valid", 0)
    evaluator.batch_fn = lambda *a: (6.0, 3)
    assert evaluator.evaluate("valid", 0).loss == pytest.approx(2.0)
    # An --eval-iters typed for a run whose validation and test splits both round to nothing
    # evaluated nothing, unsaid.
    with pytest.raises(DynaPipeError, match="--eval-iters 5: the validation and test splits hold no document "
                                            "\\(their --split shares of the data round to none\\)"):
        Evaluator(parse_training_args(argv + ["--eval-iters", "5"], 1, cuda=False), None, None)


@pytest.mark.parametrize("tail, summary, error", [
    # The last five of 50 documents empty: --split 90,8,2 gives the validation split four of
    # them. Not a share that rounds to none: a larger share would not help.
    (0, "valid data: empty (its 4 document(s) are all empty, skipped)",
     r"--eval-interval 1: the validation split holds no document \(its 4 document\(s\) are all empty \(0 tokens, "
     r"skipped\)\); drop the empty documents from the data or give --valid-data-path"),
    # One token each: samples without a next token to predict. Refused before the first
    # iteration, not at the first evaluation after training up to it.
    (1, "valid data: 4 documents",
     r"--eval-interval 1: the validation set's 4 sample\(s\) hold no loss tokens"),
])
def test_a_validation_split_that_cannot_be_evaluated_is_refused_at_start_up(tmp_path, tail, summary, error):
    from megatron_integration.data import data_summary_lines
    from megatron_integration.evaluation import Evaluator

    prefix = str(tmp_path / "tail")
    write_indexed_dataset(prefix, [np.arange(2, 40) for _ in range(45)] + [np.full(tail, 7)] * 5)
    cfg = parse_training_args(f"{BASE} --data-path {prefix} --split 90,8,2 --eval-iters 1 --eval-interval 1".split(),
                              1, cuda=False)
    assert any(summary in line for line in data_summary_lines(cfg)), data_summary_lines(cfg)
    with pytest.raises(DynaPipeError, match=error):
        Evaluator(cfg, None, None)


def test_a_first_evaluation_without_loss_tokens_is_refused_at_start_up(tmp_path):
    # A validation path of 400 one-token documents and 2 normal ones: the split holds loss
    # tokens, but its first evaluation's batch drew none and stopped the run after training.
    from megatron_integration.evaluation import Evaluator

    train, valid = str(tmp_path / "train"), str(tmp_path / "valid")
    write_indexed_dataset(train, [np.arange(2, 40) for _ in range(40)])
    write_indexed_dataset(valid, [np.full(1, 7)] * 400 + [np.arange(2, 40)] * 2)
    argv = f"{BASE} --train-data-path {train} --valid-data-path {valid} --eval-interval 1".split()
    with pytest.raises(DynaPipeError, match=r"--eval-interval 1: the first evaluation of the validation set \(its "
                                            r"first 1 global batch\(es\)\) holds no loss tokens: 0.5% of its samples "
                                            r"have a token to predict .*; drop such documents from the data, or raise "
                                            r"--eval-iters so an evaluation reaches them"):
        Evaluator(parse_training_args(argv + ["--eval-iters", "1"], 1, cuda=False), None, None)
    # An evaluation long enough to reach them runs.
    assert Evaluator(parse_training_args(argv + ["--eval-iters", "200"], 1, cuda=False), None, None).has("valid")


def test_long_jsonl_text_documents_are_cut_into_pieces_like_indexed_ones(tmp_path):
    # {"text"} records are pretraining documents: cut into pieces that keep every prediction,
    # as indexed documents are, not truncated; instruction records are still truncated.
    import json

    from dynapipe.data.tokenizer import ByteTokenizer

    lengths = [10, SEQ - 1, SEQ, 3 * SEQ + 5, 200]
    texts = ["".join(chr(97 + (d + i) % 26) for i in range(n)) for d, n in enumerate(lengths)]
    path = tmp_path / "docs.jsonl"
    with open(path, "w") as f:
        for t in texts:
            f.write(json.dumps({"text": t}) + "\n")
        f.write(json.dumps({"input": "q" * 80, "target": "a" * 10}) + "\n")
    argv = f"{BASE.replace('--vocab-size 4096', '')} --data-path {path} --split 1,0,0".split()
    ds = dataset_config(parse_training_args(argv, 1, cuda=False)).build()
    assert ds.target_lengths.max() <= SEQ and ds.num_documents == 6 and ds.num_split_documents == 3  # with their EOD
    eod = ByteTokenizer().eod
    for d, text in enumerate(texts):
        ids = np.array([ord(c) + ByteTokenizer.OFFSET for c in text] + [eod])
        pieces = [ds[i].target_ids for i in range(len(ds)) if ds._record[i] == d]
        assert (len(pieces) > 1) == (len(ids) > SEQ)
        np.testing.assert_array_equal(_rebuild(pieces), ids)  # every token, every prediction once
    assert ds.truncated.tolist() == [False] * (len(ds) - 1) + [True]  # the instruction sample
    assert " > train data: 6 documents (3 longer than --seq-length 64, split into pieces)" in \
        data_summary_lines(parse_training_args(argv, 1, cuda=False))[0]
    # Asked to reject over-long samples, the long documents are refused, not cut.
    with pytest.raises(DynaPipeError, match="more than --seq-length 64"):
        dataset_config(parse_training_args(argv + ["--dynapipe-overlong", "reject"], 1, cuda=False)).build()


def test_padding_mb_rows_split_evenly_under_sequence_parallelism():
    # Sequence parallelism splits every row over the TP ranks: padding-mb's own lengths must be
    # multiples of the TP size too (TP 3 does not divide the usual multiple of 8), never above
    # --seq-length (a multiple of it, checked at start-up).
    from megatron_integration.baseline_step import build_micro_batches
    from megatron_integration.initialize import RankInfo

    lengths = np.array([5, 17, 40, 63, 100, 191])
    samples = [Sample(np.zeros(0, np.int64), np.arange(1, n + 1)) for n in lengths]
    info = RankInfo(0, 1, 0, 1, 0, 1, 0, 1, torch.device("cpu"))
    for shards, multiple in ((1, 8), (3, 24)):
        mbs, _ = build_micro_batches("padding-mb", samples, lengths, 192, 2, info, sp_shards=shards)
        widths = [int(m.tokens.shape[1]) for m in mbs]
        assert all(w % multiple == 0 or w == 192 for w in widths) and max(widths) <= 192, (shards, widths)
        assert all(w % shards == 0 for w in widths)


def test_only_documents_are_named_documents_when_rejected():
    # A sample without an input is a pretraining document only where the data would cut it
    # into pieces; the synthetic mixture's (or paired data's) empty-input sample is truncated.
    from dynapipe.data.samples import clip_lengths

    limits = LengthLimits(16, 0, "reject")
    with pytest.raises(DynaPipeError, match="is a document of 38 tokens"):
        clip_lengths(np.array([0]), np.array([38]), limits, False, "docs", documents=True)
    with pytest.raises(DynaPipeError, match=r"has 38 tokens \(input 0 \+ target 38\).*--dynapipe-overlong truncate, the default\)"):
        clip_lengths(np.array([0]), np.array([38]), limits, False, "pairs")
