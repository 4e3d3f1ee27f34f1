"""Megatron-LM blends (``--data-path W1 P1 W2 P2``) on indexed datasets written by megatron-core."""
import numpy as np
import pytest

from dynapipe.data.blend import blend_counts, blend_indices, token_share_weights
from dynapipe.data.indexed import write_indexed_dataset
from dynapipe.errors import DynaPipeError
from megatron_integration.arguments import parse_blend, parse_training_args
from megatron_integration.data import GlobalBatches, dataset_config

BASE = ("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 64 --micro-batch-size 2 "
        "--global-batch-size 8 --train-iters 4 --lr 1e-3 --vocab-size 128 --split 1,0,0")  # all of it: training data


@pytest.fixture(scope="module")
def corpora(tmp_path_factory):
    """A: 200 documents of token 5, B: 50 documents of token 7 (lengths 3..40)."""
    root = tmp_path_factory.mktemp("blend")
    rng = np.random.default_rng(0)
    paths = {}
    for name, token, n in (("A", 5, 200), ("B", 7, 50)):
        paths[name] = str(root / name)
        write_indexed_dataset(paths[name], [np.full(rng.integers(3, 41), token) for _ in range(n)])
    return paths


def build(data_path: str):
    cfg = parse_training_args(f"{BASE} --data-path {data_path}".split(), 1, cuda=False)
    return cfg, dataset_config(cfg).build()


def share_of_b(dataset, indices) -> float:
    """Fraction of the samples at ``indices`` whose tokens are B's (read from the files)."""
    samples = [dataset[int(i)] for i in indices]
    assert all(set(s.target_ids.tolist()) in ({5}, {7}) for s in samples)
    return sum(int(s.target_ids[0] == 7) for s in samples) / len(samples)


def test_weights_change_the_mix_in_proportion(corpora):
    a, b = corpora["A"], corpora["B"]
    _, plain = build(f"{a} {b}")
    assert len(plain) == 250 and share_of_b(plain, range(250)) == pytest.approx(0.2)
    for weights, expected in (("0.99 {a} 0.01 {b}", 0.01), ("1 {a} 1 {b}", 0.5), ("25 {a} 75 {b}", 0.75)):
        cfg, blended = build(weights.format(a=a, b=b))
        assert len(blended) == 250 and cfg.data.data_weights  # the parts' total: more than the run's 32
        # The weights are shares of the tokens: samples by largest-remainder rounding of 250 x
        # (weight / mean length), and every sample read back is its part's.
        means = [p.sample_tokens().mean() for p in blended.parts]
        counts = blend_counts(token_share_weights(cfg.data.data_weights, means), 250)
        assert share_of_b(blended, range(250)) * 250 == counts[1]
        tokens = blended.sample_tokens()
        from_b = np.array([blended[i].target_ids[0] == 7 for i in range(250)])
        assert tokens[from_b].sum() / tokens.sum() == pytest.approx(expected, abs=0.01)
        # The parts are interleaved evenly: the first fifth already holds the mix.
        assert share_of_b(blended, range(50)) == pytest.approx(counts[1] / 250, abs=0.021)
    # What training reads: the sampler's global batches carry the mix too.
    cfg, _ = build(f"1 {a} 3 {b}")
    batches = GlobalBatches.create(cfg, consumed_samples=0, start_iteration=0)
    idx = np.concatenate([batches.batch(i).indices for i in range(20)])
    assert share_of_b(batches.dataset, idx) == pytest.approx(0.75, abs=0.1)
    cfg, _ = build(f"{a} {b}")
    plain_batches = GlobalBatches.create(cfg, consumed_samples=0, start_iteration=0)
    idx = np.concatenate([plain_batches.batch(i).indices for i in range(20)])
    assert share_of_b(plain_batches.dataset, idx) == pytest.approx(0.2, abs=0.1)


def test_weights_are_token_shares_and_a_long_run_draws_all_of_a_small_share(tmp_path):
    # Megatron-LM's samples are all --seq-length tokens, so its weights are token shares; here
    # samples are documents of their own lengths, and the weights keep that meaning.
    rng = np.random.default_rng(4)
    short, long_ = str(tmp_path / "short"), str(tmp_path / "long")
    write_indexed_dataset(short, [np.full(rng.integers(3, 11), 5) for _ in range(400)])
    write_indexed_dataset(long_, [np.full(rng.integers(30, 41), 60 + d) for d in range(60)])  # a token per document
    cfg, blended = build(f"1 {short} 1 {long_}")
    tokens, is_long = blended.sample_tokens(), blended.part_ids == 1
    assert tokens[is_long].sum() / tokens.sum() == pytest.approx(0.5, abs=0.02)
    assert is_long.mean() < 0.25  # far fewer long samples than short ones
    # A path with a small share of the samples (a quarter of the tokens in documents five times
    # as long): the run's 800 samples draw about 47 of its 60 documents, each once, where a blend
    # of the paths' 460 samples would hold about 27, the same ones every epoch.
    run = f"{BASE} --train-iters 100 --data-path 0.75 {short} 0.25 {long_}".split()
    cfg = parse_training_args(run, 1, cuda=False)
    batches = GlobalBatches.create(cfg, consumed_samples=0, start_iteration=0)
    assert len(batches.dataset) == 800
    idx = np.concatenate([batches.batch(i).indices for i in range(100)])
    docs = [int(batches.dataset[int(i)].target_ids[0]) for i in idx]
    long_docs = [d for d in docs if d >= 60]
    assert len(long_docs) == len(set(long_docs)) >= 40, (len(long_docs), len(set(long_docs)))


def test_small_parts_repeat_large_parts_subsample():
    parts, samples = blend_indices([4, 100], [0.5, 0.5], 104, seed=3)
    small = samples[parts == 0]
    assert len(small) == 52 and np.bincount(small).tolist() == [13] * 4  # every pass covers every sample
    large = samples[parts == 1]
    assert len(large) == 52 and len(set(large.tolist())) == 52  # a subsample without repeats
    assert blend_counts([0.99, 0.01], 250).tolist() == [248, 2] and blend_counts([2, 1, 1], 10).sum() == 10
    with pytest.raises(DynaPipeError, match="positive"):
        blend_counts([1, 0], 10)


def test_blend_parsing_matches_megatron_core():
    from megatron.core.datasets.utils import get_blend_from_list

    for blend in (["0.99", "A", "0.01", "B"], ["A", "B"], ["A"], ["30", "A", "70", "B", "1e-3", "C"]):
        paths, weights = parse_blend(blend)
        ref_paths, ref_weights = get_blend_from_list(blend)
        assert paths == list(ref_paths) and weights == (list(ref_weights) if ref_weights else None)
    for bad, needle in ((["0.5", "A", "B", "C"], "not weight/path pairs"), (["0", "A", "1", "B"], "weight 0"),
                        (["-1", "A", "2", "B"], "weight -1")):
        with pytest.raises(DynaPipeError, match=needle):
            parse_blend(bad)


def test_a_bad_blend_names_the_flag_that_gave_it(corpora):
    a, b = corpora["A"], corpora["B"]
    base = BASE.replace(" --split 1,0,0", "")  # per-split paths take no --split
    with pytest.raises(DynaPipeError, match="^--train-data-path weight 0:"):
        parse_training_args(f"{base} --train-data-path 0 {a} 1 {b}".split(), 1, cuda=False)
    with pytest.raises(DynaPipeError, match="^--valid-data-path .*'2' looks like a blend weight"):
        parse_training_args(f"{base} --train-data-path {a} --valid-data-path {b} 2".split(), 1, cuda=False)


def test_a_blend_is_no_larger_than_one_whole_pass_of_every_path(corpora):
    # A (200 documents) and B (50) at equal token shares: B's 50 documents fill its share after
    # about 100 samples, A's 200 after about 400; a run of 100,000 samples needs no larger blend.
    a, b = corpora["A"], corpora["B"]
    cfg = parse_training_args(f"{BASE} --train-iters 12500 --data-path 1 {a} 1 {b}".split(), 1, cuda=False)
    blended = dataset_config(cfg).build()
    counts = np.bincount(blended.part_ids, minlength=2)
    assert 250 < len(blended) < 500 and counts[0] >= 200 and counts[1] >= 50
    assert len(set(blended.part_samples[blended.part_ids == 0].tolist())) == 200  # all of A, each epoch


def test_a_resumed_run_keeps_the_checkpoints_blend_whatever_its_train_iters(tmp_path):
    from megatron_integration.blend_resume import blend_record, keep_resumed_blend

    # Sized by the run between what the paths hold (460) and one whole pass of every path: a
    # resume with another --train-iters would build another blend, another order.
    rng = np.random.default_rng(4)
    short, long_ = str(tmp_path / "short"), str(tmp_path / "long")
    write_indexed_dataset(short, [np.full(rng.integers(3, 11), 5) for _ in range(400)])
    write_indexed_dataset(long_, [np.full(rng.integers(30, 41), 60 + d) for d in range(60)])
    blend = f"--data-path 0.75 {short} 0.25 {long_}"
    saved = parse_training_args(f"{BASE} --train-iters 100 {blend}".split(), 1, cuda=False)
    record = blend_record(saved)
    assert record == ["samples", 800]
    longer = parse_training_args(f"{BASE} --train-iters 150 {blend}".split(), 1, cuda=False)
    kept, line = keep_resumed_blend(longer, record)
    assert line == (" > keeping the weighted blend as the checkpoint sized it (800 samples; this run's "
                    "--train-iters 150 would size it for 1,200 samples), so the consumed samples continue its order")
    assert blend_record(kept) == record  # what its own checkpoints record in turn
    at = 50  # resumed after 50 iterations of 8 samples
    original = GlobalBatches.create(saved, consumed_samples=at * 8, start_iteration=at)
    resumed = GlobalBatches.create(kept, consumed_samples=at * 8, start_iteration=at)
    rebuilt = GlobalBatches.create(longer, consumed_samples=at * 8, start_iteration=at)
    for i in range(at, 100):
        assert np.array_equal(resumed.batch(i).indices, original.batch(i).indices)
    assert not all(np.array_equal(rebuilt.batch(i).indices, original.batch(i).indices) for i in range(at, 60))
    resumed.batch(149)  # past the kept blend's epoch: its next epoch carries the stream on
    # Nothing to keep: the same size, no record (an earlier build's checkpoint), no weighted blend.
    assert keep_resumed_blend(saved, record) == (saved, None)
    assert keep_resumed_blend(longer, None) == (longer, None)
    single = parse_training_args(f"{BASE} --train-iters 150 --data-path {short}".split(), 1, cuda=False)
    assert blend_record(single) is None and keep_resumed_blend(single, record) == (single, None)
    # megatron-core's own blends (T5 span corruption) stay Megatron-LM's.
    assert blend_record(longer, megatron_blend=True) is None
    assert keep_resumed_blend(longer, record, megatron_blend=True) == (longer, None)
    for bad in (["epochs", 3], ["samples", 0], ["samples"], "samples"):
        with pytest.raises(DynaPipeError, match="records its training blend's size as .*not \\[\"samples\" or "):
            keep_resumed_blend(longer, bad)


def test_a_numeric_prefix_that_names_data_is_a_path(tmp_path, monkeypatch):
    # Megatron-LM reads a list that is not weight/path pairs as paths, so a prefix named 2024
    # is data; a number that names nothing is still a misplaced weight.
    write_indexed_dataset(str(tmp_path / "2024"), [np.arange(5, 9)])
    monkeypatch.chdir(tmp_path)
    assert parse_blend(["2024"]) == (["2024"], None)
    with pytest.raises(DynaPipeError, match="'2025' looks like a blend weight"):
        parse_blend(["2025"])
