"""The synthetic multi-task mixture: seeded, clipped, shaped like its config, and the synth command."""
from __future__ import annotations

import numpy as np
import pytest

from dynapipe.batching import read_lengths
from dynapipe.cli import main
from dynapipe.data.synthetic import load_mixture, sample_lengths, sample_mixture, sample_token_ids
from dynapipe.errors import DynaPipeError


def test_same_seed_same_lengths_other_seed_differs():
    a, b = sample_lengths(500, 3, 2048), sample_lengths(500, 3, 2048)
    assert np.array_equal(a, b)
    assert not np.array_equal(a, sample_lengths(500, 4, 2048))
    assert np.array_equal(sample_lengths(50, 9, 1024, encoder_decoder=True),
                          sample_lengths(50, 9, 1024, encoder_decoder=True))


def test_clipping():
    dec_only = sample_lengths(5000, 0, 512)
    assert dec_only.min() >= 2 and dec_only.max() <= 512
    pairs = sample_lengths(5000, 0, 512, encoder_decoder=True)
    assert pairs.shape == (5000, 2) and pairs.min() >= 1 and pairs.max() <= 512
    assert (pairs[:, 0] == 512).any()  # the long task does hit the clip


def test_mixture_weights_and_medians_follow_the_config():
    mix = load_mixture()
    s = sample_mixture(mix, 20000, 1, 8192)
    share = np.bincount(s.task_ids, minlength=len(mix.tasks)) / 20000
    assert share == pytest.approx(mix.weights, abs=0.02)
    for t, task in enumerate(mix.tasks):
        inputs = s.input_lengths[s.task_ids == t]
        assert np.median(inputs) == pytest.approx(task.median_input, rel=0.1)
    # The FLAN-like shape: mostly short prompts, a tail of long documents.
    total = s.input_lengths + s.target_lengths
    assert np.median(total) < 250 and np.percentile(total, 95) > 1000


def test_token_ids_are_deterministic_and_skip_padding_id():
    lengths = np.array([5, 17, 3])
    a, b = sample_token_ids(lengths, 7, 512), sample_token_ids(lengths, 7, 512)
    assert [len(x) for x in a] == [5, 17, 3]
    assert all(np.array_equal(x, y) for x, y in zip(a, b))
    assert all(x.min() >= 1 and x.max() < 512 for x in a)


def test_custom_mixture_file(tmp_path):
    p = tmp_path / "mix.yaml"
    p.write_text("tasks:\n  - {name: only, weight: 1, median_input: 50, sigma_input: 0.0, "
                 "median_target: 5, sigma_target: 0.0}\n")
    assert set(sample_lengths(100, 0, 1024, mixture=load_mixture(str(p))).tolist()) == {55}


@pytest.mark.parametrize("text, message", [
    ("tasks: []\n", "non-empty 'tasks'"),
    ("tasks:\n  - {name: a, weight: 0, median_input: 5, sigma_input: 1, median_target: 1, sigma_target: 1}\n",
     "must be > 0"),
    ("tasks:\n  - {name: a, weight: 1}\n", r"task 'a' lacks key\(s\) \['median_input'"),
    ("tasks:\n  - {weight: 1, median_input: 5, sigma_input: 1, median_target: 1, sigma_target: 1}\n",
     r"task 0 lacks key\(s\) \['name'\]"),
    ("tasks:\n  - {name: a, weight: 1, median_input: 5, sigma_input: 1, median_target: 1}\n",
     r"task 'a' lacks key\(s\) \['sigma_target'\]"),
    ("tasks:\n  - {name: a, weight: 1, median_input: 5, sigma_input: 1, median_target: 1, sigma_target: 1, "
     "mean: 3}\n", r"task 'a' has unknown key\(s\) \['mean'\]"),
    ("tasks:\n  - {name: a, weight: -1, median_input: 5, sigma_input: 1, median_target: 1, sigma_target: 1}\n",
     r"task 'a': weight=-1 must be > 0"),
    ("tasks:\n  - {name: a, weight: 1, median_input: 5, sigma_input: 1, median_target: 0, sigma_target: 1}\n",
     r"task 'a': median_target=0 must be > 0"),
    ("tasks:\n  - {name: a, weight: 1, median_input: 5, sigma_input: -0.5, median_target: 1, sigma_target: 1}\n",
     r"task 'a': sigma_input=-0.5 must be between 0 and 10"),
    ("tasks:\n  - {name: a, weight: 1, median_input: 5, sigma_input: 50, median_target: 1, sigma_target: 1}\n",
     r"task 'a': sigma_input=50 must be between 0 and 10"),
    ("tasks:\n  - {name: a, weight: 1, median_input: 5, sigma_input: .inf, median_target: 1, sigma_target: 1}\n",
     r"task 'a': sigma_input=inf must be a finite number"),
    ("tasks:\n" + "  - {name: qa, weight: 1, median_input: 5, sigma_input: 1, median_target: 1, sigma_target: 1}\n" * 2,
     r"task 1 is named 'qa' like an earlier task; give each task its own name"),
])
def test_bad_mixture_files(tmp_path, text, message):
    p = tmp_path / "mix.yaml"
    p.write_text(text)
    with pytest.raises(DynaPipeError, match=message) as e:
        load_mixture(str(p))
    assert str(p) in str(e.value)


def test_wide_sigma_lengths_stay_in_range(tmp_path):
    # At the largest sigma allowed the draws span far past seq_length and below one token.
    p = tmp_path / "mix.yaml"
    p.write_text("tasks:\n  - {name: wide, weight: 1, median_input: 100, sigma_input: 10, "
                 "median_target: 5, sigma_target: 10}\n")
    for ed in (False, True):
        lengths = sample_lengths(2000, 0, 1024, encoder_decoder=ed, mixture=load_mixture(str(p)))
        assert lengths.min() >= 1 and lengths.max() <= 1024


def test_overflowing_draws_are_clipped_not_wrapped():
    from dynapipe.data.synthetic import Mixture, TaskSpec
    mix = Mixture((TaskSpec("huge", 1.0, 100.0, 500.0, 5.0, 500.0),))  # past the loader's limit
    with np.errstate(invalid="raise"):  # the inf -> int64 cast of the old code warned "invalid"
        s = sample_mixture(mix, 1000, 0, 1024)
    total = s.input_lengths + s.target_lengths
    assert s.input_lengths.min() >= 1 and s.target_lengths.min() >= 1 and total.max() <= 1024


def test_bad_sample_requests():
    with pytest.raises(DynaPipeError, match="n=0"):
        sample_lengths(0, 0, 1024)
    with pytest.raises(DynaPipeError, match="seq_length=1"):
        sample_lengths(5, 0, 1)


def test_synth_command_writes_a_lengths_file_the_planner_reads(tmp_path):
    out = tmp_path / "l.txt"
    assert main(["synth", "--samples", "64", "--seed", "5", "--seq-length", "1024", "--output", str(out)]) == 0
    assert np.array_equal(read_lengths(str(out)), sample_lengths(64, 5, 1024))
    pairs = tmp_path / "p.txt"
    assert main(["synth", "--samples", "8", "--encoder-decoder", "--output", str(pairs)]) == 0
    assert read_lengths(str(pairs)).shape == (8, 2)


def test_a_shipped_mixture_is_found_by_name():
    assert load_mixture("flan-mixture") == load_mixture() == load_mixture("flan-mixture.yaml")
    with pytest.raises(DynaPipeError, match="--mixture: mixture file 'flan' does not exist; give a YAML path or a "
                                            "shipped mixture name: flan-mixture"):
        load_mixture("flan", flag="--mixture")
