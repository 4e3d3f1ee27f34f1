"""Megatron-LM blends (``--data-path W1 P1 W2 P2``) on indexed datasets written by megatron-core."""
import numpy as np
import pytest

from dynapipe.data.blend import blend_counts, blend_indices
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
        assert len(blended) == 250 and cfg.data.data_weights
        # Largest-remainder rounding of 250 x share; every sample read back is its part's.
        assert share_of_b(blended, range(250)) * 250 == blend_counts(cfg.data.data_weights, 250)[1]
        assert abs(blend_counts(cfg.data.data_weights, 250)[1] - 250 * expected) <= 1
        # The parts are interleaved evenly: the first fifth already holds the mix.
        assert share_of_b(blended, range(50)) == pytest.approx(expected, abs=0.021)
    # What training reads: the sampler's global batches carry the mix too.
    cfg, _ = build(f"1 {a} 3 {b}")
    batches = GlobalBatches.create(cfg, consumed_samples=0, start_iteration=0)
    idx = np.concatenate([batches.batch(i).indices for i in range(20)])
    assert share_of_b(batches.dataset, idx) == pytest.approx(0.75, abs=0.1)
    cfg, _ = build(f"{a} {b}")
    plain_batches = GlobalBatches.create(cfg, consumed_samples=0, start_iteration=0)
    idx = np.concatenate([plain_batches.batch(i).indices for i in range(20)])
    assert share_of_b(plain_batches.dataset, idx) == pytest.approx(0.2, abs=0.1)


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
