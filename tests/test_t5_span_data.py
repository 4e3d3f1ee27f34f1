"""T5 span corruption of Megatron indexed datasets (sentences grouped into documents), made by
megatron-core's ``T5MaskedWordPieceDataset``: the unpadded pairs DynaPipe plans are exactly
Megatron's samples (lengths, sentinels, loss mask; padded rows equal Megatron's tensors), every
span goes back where it was cut from, blends mix their datasets, and bad input is refused in
one line. In-process, with a one-rank gloo group (megatron-core's index builder asks for the rank).
"""
import os
import shutil

import numpy as np
import pytest

from dynapipe.data.indexed import write_indexed_dataset
from dynapipe.errors import DynaPipeError
from megatron_integration.t5_arguments import parse_t5_args
from megatron_integration.t5_batches import t5_row_tensors
from megatron_integration.wordpiece import WordPieceVocab
from t5_span_fixture import SPECIALS, write_sentences, write_vocab

ENC, DEC, EXTRA = 64, 32, 16
BASE = (f"--encoder-num-layers 1 --decoder-num-layers 1 --hidden-size 64 --num-attention-heads 4 "
        f"--encoder-seq-length {ENC} --decoder-seq-length {DEC} --micro-batch-size 2 --global-batch-size 8 "
        f"--train-iters 5 --lr 1e-3 --split 100,0,0 --seed 5 --tokenizer-type BertWordPieceLowerCase "
        f"--vocab-extra-ids {EXTRA}")


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    import torch.distributed as dist

    from megatron_integration.launch import free_port

    root = tmp_path_factory.mktemp("t5span")
    paths = {"vocab": str(root / "vocab.txt"), "a": str(root / "a"), "b": str(root / "b")}
    paths["tokens"] = write_vocab(paths["vocab"])
    paths["docs_a"] = write_sentences(paths["a"], docs=40, seed=1)
    write_sentences(paths["b"], docs=20, seed=2)
    owned = not dist.is_initialized()
    if owned:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    yield paths
    if owned:
        dist.destroy_process_group()


def _args(corpus, *extra, data=None):
    return BASE.split() + ["--vocab-file", corpus["vocab"], "--data-path", *(data or [corpus["a"]])] + list(extra)


def test_wordpiece_vocabulary_has_megatron_lm_ids(corpus):
    cfg = parse_t5_args(_args(corpus), 1, cuda=False)
    vocab = cfg.span_corruption.vocab()
    n = len(corpus["tokens"])
    # Megatron-LM appends [BOS], [EOS], then the sentinels, and sizes the vocabulary with them.
    assert (vocab.bos, vocab.eos, vocab.additional_special_tokens_ids) == (n, n + 1, list(range(n + 2, n + 2 + EXTRA)))
    assert (vocab.pad, vocab.cls, vocab.sep, vocab.mask) == tuple(SPECIALS.index(t) for t in
                                                                  ("[PAD]", "[CLS]", "[SEP]", "[MASK]"))
    assert cfg.base.model.unpadded_vocab_size == n + 2 + EXTRA and cfg.base.model.vocab_size == 128
    assert cfg.span_corruption.num_samples == 5 * 8
    # GPT reads the same vocabulary (pre-tokenised data): no sentinels without T5's --vocab-extra-ids.
    from megatron_integration.arguments import parse_training_args

    gpt = parse_training_args(["--num-layers", "1", "--hidden-size", "64", "--num-attention-heads", "4",
                               "--seq-length", "64", "--micro-batch-size", "2", "--global-batch-size", "8",
                               "--train-iters", "1", "--lr", "1e-3", "--mock-data", "--tokenizer-type",
                               "BertWordPieceCase", "--vocab-file", corpus["vocab"]], 1, cuda=False)
    assert gpt.model.unpadded_vocab_size == n + 2
    with pytest.raises(DynaPipeError, match="--merge-file is read by --tokenizer-type GPT2BPETokenizer only"):
        parse_t5_args(_args(corpus, "--merge-file", corpus["vocab"]), 1, cuda=False)


def test_the_index_cache_key_is_megatron_lms_legacy_wordpiece_tokenizers(corpus):
    # megatron-core hashes the tokenizer's unique_identifiers into its index cache's name: the
    # same as Megatron-LM's --legacy-tokenizer WordPiece (a MegatronTokenizer subclass named
    # _BertWordPieceTokenizer, given the path as typed) shares Megatron-LM's cache.
    legacy = pytest.importorskip("megatron.core.datasets.megatron_tokenizer")
    import json

    base = getattr(legacy, "MegatronLegacyTokenizer", None) or legacy.MegatronTokenizer  # older releases: MegatronTokenizer

    class _BertWordPieceTokenizer(base):
        def __init__(self, vocab_file, lower_case=True, vocab_extra_ids=0):
            super().__init__(vocab_file, lower_case=lower_case, vocab_extra_ids=vocab_extra_ids)

        tokenize = vocab = inv_vocab = vocab_size = None

    relative = os.path.relpath(corpus["vocab"])
    for lower in (True, False):
        ours = WordPieceVocab(relative, lower_case=lower, vocab_extra_ids=EXTRA)
        megatron = _BertWordPieceTokenizer(relative, lower_case=lower, vocab_extra_ids=EXTRA)
        assert json.dumps(ours.unique_identifiers) == json.dumps(megatron.unique_identifiers)


def test_pairs_are_megatrons_t5_samples_unpadded(corpus):
    from megatron.core.datasets.indexed_dataset import IndexedDataset
    from megatron.core.datasets.t5_dataset import T5MaskedWordPieceDataset, T5MaskedWordPieceDatasetConfig
    from megatron.core.datasets.utils import Split

    cfg = parse_t5_args(_args(corpus), 1, cuda=False)
    ds = cfg.dataset_config()
    vocab = cfg.span_corruption.vocab()
    # megatron-core's dataset built directly, with Megatron-LM pretrain_t5.py's masking settings.
    mconfig = T5MaskedWordPieceDatasetConfig(
        random_seed=5, sequence_length=ENC, sequence_length_decoder=DEC, blend=([corpus["a"]], None), split="1,0,0",
        tokenizer=vocab, masking_probability=0.15, short_sequence_probability=0.1, masking_max_ngram=10,
        masking_do_full_word=True, masking_do_permutation=False, masking_use_longer_ngrams=False,
        masking_use_geometric_distribution=True)
    megatron = T5MaskedWordPieceDataset(IndexedDataset(corpus["a"]), corpus["a"], np.arange(40, dtype=np.int32),
                                        40, Split.train, mconfig)
    assert len(ds) == 40 and ds.eod_id == vocab.bos and ds.pad_id == 0
    sentences = [s for doc in corpus["docs_a"] for s in doc]
    sentinels = vocab.additional_special_tokens_ids
    spans_seen = []
    for i in range(len(ds)):
        ref = megatron[i]
        pair = ds[i]
        n_in, n_out = int(ref["enc_mask"].sum()), int(ref["loss_mask"].sum())
        assert (ds.input_lengths[i], ds.target_lengths[i]) == (n_in, n_out) == (len(pair.input_ids),
                                                                                  len(pair.target_ids))
        # The padding baseline's row of the pair is Megatron's fixed-shape sample.
        row = t5_row_tensors([[pair]], ENC, DEC, ds.pad_id, ds.eod_id)
        np.testing.assert_array_equal(row["tokens"][0], ref["text_enc"])
        np.testing.assert_array_equal(row["dec_tokens"][0], ref["text_dec"])
        np.testing.assert_array_equal(row["loss_mask"][0], ref["loss_mask"])
        np.testing.assert_array_equal(row["labels"][0][:n_out], ref["labels"][:n_out])
        # Sentinel structure: the k-th sentinel stands in the input where the k-th span was cut
        # out, the target lists each sentinel with its span, then [EOS]; putting the spans back
        # gives the text of the sample's sentences (cut to --encoder-seq-length - 2).
        k_in = [t for t in pair.input_ids if t in sentinels]
        assert k_in == sentinels[:len(k_in)] and pair.target_ids[-1] == vocab.eos
        target = pair.target_ids[:-1].tolist()
        starts = [j for j, t in enumerate(target) if t in sentinels]
        assert [target[j] for j in starts] == k_in and (not starts or starts[0] == 0)
        spans = [target[a + 1:b] for a, b in zip(starts, starts[1:] + [len(target)])]
        assert all(spans) and sum(map(len, spans)) <= 0.15 * (ENC - 2)
        text = []
        for t in pair.input_ids.tolist():
            text.extend(spans[sentinels.index(t)] if t in sentinels else [t])
        beg, end, length = megatron.sample_index[i]
        np.testing.assert_array_equal(text, np.concatenate(sentences[beg:end])[:length])
        spans_seen.append(len(spans))
    # Not a vacuous comparison: pairs of many lengths, samples with several spans.
    assert len(set(ds.input_lengths.tolist())) > 5 and max(spans_seen) >= 2 and min(spans_seen) >= 1


def test_blend_mixes_the_datasets_and_survives_pickling(corpus):
    import pickle

    cfg = parse_t5_args(_args(corpus, data=["2", corpus["a"], "1", corpus["b"]]), 1, cuda=False)
    assert cfg.span_corruption.weights == (2.0, 1.0)
    ds = cfg.dataset_config()
    assert len(ds) == 40 and set(ds.tasks.tolist()) == {0, 1} and (ds.tasks == 0).sum() > (ds.tasks == 1).sum()
    # A planner worker receives the dataset pickled, without megatron-core objects, and reopens it.
    copy = pickle.loads(pickle.dumps(ds))
    assert copy._megatron is None
    for i in (0, 7, 39):
        np.testing.assert_array_equal(copy[i].input_ids, ds[i].input_ids)
        np.testing.assert_array_equal(copy[i].target_ids, ds[i].target_ids)


def test_train_data_path_gives_the_pairs_of_the_whole_data_path(corpus):
    whole = parse_t5_args(_args(corpus), 1, cuda=False).dataset_config()
    argv = BASE.replace("--split 100,0,0", "").split() + ["--vocab-file", corpus["vocab"], "--train-data-path",
                                                          corpus["a"]]
    cfg = parse_t5_args(argv, 1, cuda=False)
    assert cfg.span_corruption.split is None and cfg.span_corruption.paths == (corpus["a"],)
    train = cfg.dataset_config()
    np.testing.assert_array_equal(train.input_lengths, whole.input_lengths)
    np.testing.assert_array_equal(train[5].target_ids, whole[5].target_ids)
    # --valid-data-path: Megatron's validation blend of its own, evaluated as megatron-core builds it.
    from megatron.core.datasets.indexed_dataset import IndexedDataset
    from megatron.core.datasets.t5_dataset import T5MaskedWordPieceDataset
    from megatron.core.datasets.utils import Split

    from megatron_integration.t5_span_data import megatron_dataset_config

    evaluated = parse_t5_args(argv + ["--valid-data-path", corpus["b"], "--eval-iters", "1"], 1, cuda=False)
    valid = evaluated.dataset_config("valid")
    assert evaluated.dataset_config("test") is None and len(valid) == 8  # one evaluation, after training
    megatron = T5MaskedWordPieceDataset(IndexedDataset(corpus["b"]), corpus["b"], np.arange(20, dtype=np.int32), 8,
                                        Split.valid, megatron_dataset_config(evaluated.span_corruption))
    for i in range(len(valid)):
        ref = megatron[i]
        assert (valid.input_lengths[i], valid.target_lengths[i]) == (int(ref["enc_mask"].sum()),
                                                                     int(ref["loss_mask"].sum()))
    with open(str(corpus["b"]) + ".jsonl", "w") as f:
        f.write('{"input": "a b", "target": "c"}\n')
    refused = {"--valid-data-path": (str(corpus["b"]) + "x", "no such file"),
               "--test-data-path": (str(corpus["b"]) + ".jsonl", "a JSONL file beside indexed")}
    for flag, (value, text) in refused.items():
        with pytest.raises(DynaPipeError, match=f"{flag} .*{text}"):
            parse_t5_args(argv + [flag, value], 1, cuda=False)
    # JSONL training pairs with an indexed validation prefix: one kind for every split.
    jsonl = BASE.replace("--split 100,0,0", "").replace("--tokenizer-type BertWordPieceLowerCase",
                                                          "--tokenizer-type ByteLevel --vocab-size 300")
    jsonl = jsonl.replace(f"--vocab-extra-ids {EXTRA}", "").split()
    with pytest.raises(DynaPipeError, match="an indexed prefix beside JSONL training pairs"):
        parse_t5_args(jsonl + ["--train-data-path", str(corpus["b"]) + ".jsonl", "--valid-data-path", corpus["b"]],
                      1, cuda=False)


def test_validation_pairs_are_megatrons_validation_split_unpadded(corpus):
    from megatron.core.datasets.indexed_dataset import IndexedDataset
    from megatron.core.datasets.t5_dataset import T5MaskedWordPieceDataset
    from megatron.core.datasets.utils import Split

    from megatron_integration.t5_span_data import megatron_dataset_config

    cfg = parse_t5_args(_args(corpus, "--split", "80,20,0", "--eval-interval", "2", "--eval-iters", "1"), 1,
                        cuda=False)
    valid, train = cfg.dataset_config("valid"), cfg.dataset_config()
    assert cfg.dataset_config("test") is None  # no test part in --split
    # Megatron-LM's count: one evaluation after iterations 2 and 4 and one after training, a batch each.
    assert len(valid) == 3 * 8 and len(train) == 5 * 8
    # megatron-core's own validation split: documents 32..39 of 40.
    mconfig = megatron_dataset_config(cfg.span_corruption)
    megatron = T5MaskedWordPieceDataset(IndexedDataset(corpus["a"]), corpus["a"], np.arange(32, 40, dtype=np.int32),
                                        len(valid), Split.valid, mconfig)
    for i in range(len(valid)):
        ref, pair = megatron[i], valid[i]
        assert (valid.input_lengths[i], valid.target_lengths[i]) == (int(ref["enc_mask"].sum()),
                                                                     int(ref["loss_mask"].sum()))
        row = t5_row_tensors([[pair]], ENC, DEC, valid.pad_id, valid.eod_id)
        np.testing.assert_array_equal(row["tokens"][0], ref["text_enc"])
        np.testing.assert_array_equal(row["dec_tokens"][0], ref["text_dec"])
        np.testing.assert_array_equal(row["loss_mask"][0], ref["loss_mask"])
    # Training reads the other 80% of the documents: not the pairs of --split 100,0,0.
    whole = parse_t5_args(_args(corpus), 1, cuda=False).dataset_config()
    assert not np.array_equal(train.input_lengths, whole.input_lengths[:len(train)])


def test_lengths_are_kept_next_to_megatrons_index_cache(corpus):
    cfg = parse_t5_args(_args(corpus), 1, cuda=False)
    ds = cfg.dataset_config()
    cache = ds._table_cache_path(len(ds))
    assert cache.startswith(os.path.join(corpus["a"], "cache")) and os.path.isfile(cache)
    table = np.load(cache)
    np.testing.assert_array_equal(table[:, 0], ds.input_lengths)
    np.testing.assert_array_equal(table[:, 1], ds.target_lengths)
    table[3, 0] += 1
    np.save(cache, table)
    stale = cfg.dataset_config()  # reads the cache instead of corrupting every sample again
    assert stale.input_lengths[3] == ds.input_lengths[3] + 1
    with pytest.raises(DynaPipeError, match="disagree with the data"):
        stale[3]
    os.remove(cache)


def test_bad_span_corruption_input_is_refused_in_one_line(corpus, tmp_path):
    only_idx = str(tmp_path / "only_idx")
    shutil.copy(corpus["a"] + ".idx", only_idx + ".idx")
    refused = {
        ("--vocab-extra-ids", "0"): "--vocab-extra-ids 0: T5 span corruption",
        ("--data-path", str(tmp_path / "missing")): "no such file",
        ("--data-path", only_idx): "only_idx.idx is there but .*only_idx.bin is missing",
        ("--encoder-seq-length", "3", "--max-position-embeddings", "32"): "too short for T5 span corruption",
        ("--decoder-seq-length", "2"): "--decoder-seq-length 2: too short",
        ("--tokenizer-type", "ByteLevel", "--vocab-file", ""): "masks whole WordPiece words",
        ("--vocab-file", str(tmp_path / "none.txt")): "--vocab-file .* no such file",
        ("--mask-prob", "1.5"): "--mask-prob 1.5: must be in",
        ("--dynapipe-tokens-per-global-batch", "500", "--use-dynapipe"): "--global-batch-size samples",
        # megatron-core's T5 dataset memory-maps whatever the flag says: refused, not ignored.
        ("--no-mmap-bin-files",): "--no-mmap-bin-files: megatron-core's T5 span-corruption dataset always",
        ("--rotary-base", "500"): "--rotary-base is a Megatron-LM flag .* learned absolute positions",
        # megatron-core's dataset cuts long documents itself: nothing is left to reject.
        ("--dynapipe-overlong", "reject"): "--dynapipe-overlong reject: megatron-core's T5 dataset cuts",
    }
    for extra, text in refused.items():
        with pytest.raises(DynaPipeError, match=text):
            parse_t5_args(_args(corpus) + list(extra), 1, cuda=False)
    # Files megatron-core's T5 dataset would fail on with a traceback are refused by name first.
    empty, truncated = str(tmp_path / "empty"), str(tmp_path / "truncated")
    write_indexed_dataset(empty, [])
    shutil.copy(corpus["a"] + ".bin", truncated + ".bin")
    with open(corpus["a"] + ".idx", "rb") as f:
        head = f.read()
    with open(truncated + ".idx", "wb") as f:
        f.write(head[:len(head) // 2])
    for prefix, text in ((empty, "holds no sequences"), (truncated, r"truncated\.idx is truncated")):
        with pytest.raises(DynaPipeError, match=text):
            parse_t5_args(_args(corpus, data=[prefix]), 1, cuda=False)
    bare = BASE.replace("--tokenizer-type BertWordPieceLowerCase ", "").split() + ["--data-path", corpus["a"]]
    with pytest.raises(DynaPipeError, match=r"--tokenizer-type ByteLevel \(the default without --vocab-file\): T5"):
        parse_t5_args(bare, 1, cuda=False)
    # megatron-core builds unweighted prefixes at no size, which its T5 index took as a TypeError.
    with pytest.raises(DynaPipeError, match=f"several span-corruption prefixes need a weight each; give "
                                            f"1 {corpus['a']} 1 {corpus['b']}"):
        parse_t5_args(_args(corpus, data=[corpus["a"], corpus["b"]]), 1, cuda=False)
    # A cache megatron-core could not create (a path under a file) was a traceback on the first read.
    under_file = os.path.join(corpus["vocab"], "cache")
    with pytest.raises(DynaPipeError, match=f"--data-cache-path {under_file}: .*vocab.txt is a file"):
        parse_t5_args(_args(corpus, "--data-cache-path", under_file), 1, cuda=False)
    assert parse_t5_args(_args(corpus, "--data-cache-path", str(tmp_path / "new" / "cache")), 1,
                         cuda=False).span_corruption.cache_path == str(tmp_path / "new" / "cache")
    mock = BASE.replace("--split 100,0,0", "--mock-data").split() + ["--vocab-file", corpus["vocab"]]
    assert parse_t5_args(mock, 1, cuda=False).span_corruption is None
    for typed in (["--mask-prob", "0.3"], ["--mask-prob", "0.15"], ["--short-seq-prob", "0.1"]):
        # Refused where it cannot apply, at Megatron-LM's default value too.
        with pytest.raises(DynaPipeError, match=f"{typed[0]} applies to T5 span corruption of indexed"):
            parse_t5_args(mock + typed, 1, cuda=False)
    # megatron-core's masked dataset asserts 0 < p < 1: refused in one line here instead.
    with pytest.raises(DynaPipeError, match=r"--mask-prob 1.0: must be in \(0, 1\)"):
        parse_t5_args(_args(corpus) + ["--mask-prob", "1"], 1, cuda=False)
    # JSONL pairs are tokenised byte-level: a WordPiece vocabulary is refused before any model is built.
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text('{"input": "a b", "target": "c"}\n')
    jsonl = BASE.replace("--split 100,0,0", f"--data-path {pairs}").split() + ["--vocab-file", corpus["vocab"]]
    with pytest.raises(DynaPipeError, match="--tokenizer-type BertWordPieceLowerCase: this build tokenises JSONL "
                                            "byte-level"):
        parse_t5_args(jsonl, 1, cuda=False)
    with pytest.raises(DynaPipeError, match="sentinels are added to the WordPiece vocabularies only"):
        parse_t5_args(mock + ["--tokenizer-type", "ByteLevel", "--vocab-file", ""], 1, cuda=False)
    with pytest.raises(DynaPipeError, match="--vocab-extra-ids -3: the number of sentinel tokens cannot be negative"):
        parse_t5_args(BASE.replace("--split 100,0,0", "--mock-data").replace("--vocab-extra-ids 16", "--vocab-extra-ids -3")
                      .replace("--tokenizer-type BertWordPieceLowerCase ", "").split(), 1, cuda=False)


def test_a_split_of_no_documents_is_refused_before_megatron_core_fails_on_it(corpus):
    # 40 documents: Megatron-LM's default 969,30,1 leaves the test split none (0.04 of one),
    # and megatron-core builds every split with a share, read or not (an IndexError there).
    for split, empty in (("969,30,1", "test"), ("99,1,0", "valid")):
        with pytest.raises(DynaPipeError, match=f"--split '{split}' gives the {empty} split none of the 40 documents "
                                                f"of --data-path .*a, .* larger share, or none"):
            parse_t5_args(_args(corpus, "--split", split), 1, cuda=False)
    with pytest.raises(DynaPipeError, match="the test split none of the 40 documents"):
        parse_t5_args([x for x in _args(corpus) if x not in ("--split", "100,0,0")], 1, cuda=False)
    cfg = parse_t5_args(_args(corpus, "--split", "90,5,5", "--eval-iters", "1", "--eval-interval", "5"), 1,
                        cuda=False)
    assert len(cfg.dataset_config(split="test")) == 8  # 2 documents, one global batch drawn


def test_split_and_train_samples_reach_megatron_core_as_megatron_lm_passes_them(corpus):
    # The --split string as typed (megatron-core normalises it once: normalised twice, 7,2,1
    # moved a boundary by a document), and --train-samples itself, not rounded to whole batches.
    cfg = parse_t5_args(_args(corpus, "--split", "7,2,1"), 1, cuda=False)
    assert cfg.span_corruption.split == "7,2,1"
    argv = BASE.replace("--train-iters 5", "--train-samples 43").split()
    cfg = parse_t5_args(argv + ["--vocab-file", corpus["vocab"], "--data-path", corpus["a"]], 1, cuda=False)
    assert cfg.base.train_iters == 5 and cfg.span_corruption.num_samples == 43
    assert len(cfg.dataset_config()) == 43


def test_global_batches_are_megatron_lms_consecutive_samples(corpus):
    # megatron-core's T5 dataset is already shuffled and Megatron-LM's sampler reads it in order:
    # batch k holds samples [k x gbs, (k + 1) x gbs), not a second shuffle of them (JSONL and
    # mixture data, which no megatron-core dataset ordered, are still shuffled).
    from dynapipe.data.sampler import GlobalBatchSampler
    from megatron_integration.data import sampler_config

    cfg = parse_t5_args(_args(corpus), 1, cuda=False)
    config = cfg.dataset_config()
    assert sampler_config(cfg.base, config).shuffle is False
    sampler = GlobalBatchSampler(config.build().sample_tokens(), sampler_config(cfg.base, config), 8)
    assert sampler.batch(0).indices.tolist() == list(range(8, 16))
    assert sampler_config(cfg.base).shuffle is True
    # The DynaPipe loader's and evaluation's samplers read it the same way.
    from megatron_integration.data import eval_sampler_config
    from megatron_integration.dynapipe_loader import loader_config

    assert loader_config(cfg.base, 0, 0, config).shuffle is False and loader_config(cfg.base, 0, 0).shuffle
    assert eval_sampler_config(cfg.base, config).shuffle is False


def test_samples_megatron_cannot_make_are_refused_before_training(corpus, tmp_path):
    # A decoder too short for some sample's spans (Megatron asserts mid-training).
    with pytest.raises(DynaPipeError, match="T5 training sample [0-9]+: .*longer than --decoder-seq-length 6; raise"):
        parse_t5_args(_args(corpus, "--decoder-seq-length", "6"), 1, cuda=False).dataset_config()
    # Fewer sentinels than a sample's spans.
    with pytest.raises(DynaPipeError, match="masks more spans than the 1 sentinels of --vocab-extra-ids"):
        parse_t5_args(_args(corpus, "--vocab-extra-ids", "1"), 1, cuda=False).dataset_config()
    # Data tokenised with another vocabulary.
    foreign = str(tmp_path / "foreign")
    write_sentences(foreign, docs=10, seed=3)
    vocab = str(tmp_path / "small.txt")
    with open(vocab, "w") as f:
        f.write("\n".join(SPECIALS + ["w0"]) + "\n")
    with pytest.raises(DynaPipeError, match=r"is not in --vocab-file .* \(6 entries, 24 ids with the tokens Megatron"):
        parse_t5_args(_args(corpus, "--vocab-file", vocab, data=[foreign]), 1, cuda=False).dataset_config()
    # Tokenised with a vocabulary a little larger than --vocab-file: the ids past its last entry
    # are those of the [BOS], [EOS] and sentinel tokens Megatron-LM appends, which megatron-core
    # would read as such (no lookup fails), so the encoder input would hold sentinels of the data.
    short = str(tmp_path / "short.txt")
    with open(corpus["vocab"]) as f:
        lines = f.read().splitlines()
    with open(short, "w") as f:
        f.write("\n".join(lines[:50]) + "\n")
    with pytest.raises(DynaPipeError, match=r"T5 training sample [0-9]+: the data holds token id (5[0-9]|6[0-4]), "
                                            r"which is (\[BOS\]|\[EOS\]|<extra_id_[0-9]+>) here: --vocab-file .*short"
                                            r"\.txt' has 50 entries"):
        parse_t5_args(_args(corpus, "--vocab-file", short), 1, cuda=False).dataset_config()


def test_pretrain_t5_script_refuses_missing_sentinels_with_exit_status_2(corpus, capsys):
    import importlib.util

    path = os.path.join(os.path.dirname(__file__), "..", "scripts", "pretrain_t5.py")
    spec = importlib.util.spec_from_file_location("pretrain_t5_span_script", path)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    assert script.main(_args(corpus, "--vocab-extra-ids", "0")) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: --vocab-extra-ids 0") and "\n" not in err


@pytest.mark.parametrize("split, expected", [("969, 30, 1", [True, True, True]), ("99,1", [True, True, False]),
                                             ("100", [True, False, False]), ("98/2/0", [True, True, False]),
                                             ("99 1 0", [True, True, False])])
def test_which_splits_hold_data_reads_split_as_megatron_core_does(split, expected):
    # Any separator, missing shares 0: "99,1" has no test split (it raised IndexError, "98/2/0"
    # ValueError, once evaluation asked).
    from megatron_integration.t5_span_data import SpanCorruptionConfig

    cfg = SpanCorruptionConfig(paths=("p",), weights=(), split=split, num_samples=8, encoder_seq_length=64,
                               decoder_seq_length=32, seed=1, tokenizer_type="BertWordPieceLowerCase",
                               vocab_file="v.txt", vocab_extra_ids=100)
    assert [cfg.has_split(i) for i in range(3)] == expected
