"""Bad input to the planner: clear errors that name the value and the fix."""
from __future__ import annotations

import io

import numpy as np
import pytest

from dynapipe.batching import plan_micro_batches, read_lengths, validate_lengths
from dynapipe.config import load_device_config, load_model_config
from dynapipe.cost import build_cost_model
from dynapipe.errors import DynaPipeError

A100 = load_device_config("a100-40gb")
CM = build_cost_model(load_model_config("gpt-7b"), A100, 8)
T5 = build_cost_model(load_model_config("t5-11b"), A100, 8)


def _file(tmp_path, text):
    p = tmp_path / "lengths.txt"
    p.write_text(text)
    return str(p)


def test_reads_one_and_two_columns(tmp_path):
    assert read_lengths(_file(tmp_path, "5\n\n# comment\n7\n")).tolist() == [5, 7]
    assert read_lengths(_file(tmp_path, "5 1\n7 2\n")).tolist() == [[5, 1], [7, 2]]
    assert read_lengths("-", io.StringIO("3\n4\n")).tolist() == [3, 4]
    # An editor's byte-order mark is not part of the first length.
    assert read_lengths(_file(tmp_path, "\ufeff100\r\n200\r\n")).tolist() == [100, 200]
    assert read_lengths("-", io.StringIO("\ufeff100\n200\n")).tolist() == [100, 200]


@pytest.mark.parametrize("text, message", [
    ("5\n0\n", r"line 2: length 0 must be a positive"),
    ("5\n7\n-3\n", r"line 3: length -3 must be a positive"),
    ("5\nabc\n", r"line 2: 'abc' is not an integer"),
    ("5\n2.5\n", r"line 2: '2.5' is not an integer"),
    ("1e3\n", r"line 1: '1e3' is not an integer"),
    ("5 1\n7\n", r"line 2: .* has 1 value\(s\) but line 1 has 2"),
    ("5 1 2\n", r"line 1: .* has 3 values"),
    ("", r"empty"),
    ("\n# nothing\n", r"empty"),
])
def test_bad_lengths_files(tmp_path, text, message):
    with pytest.raises(DynaPipeError, match=message):
        read_lengths(_file(tmp_path, text))


def test_missing_lengths_file(tmp_path):
    with pytest.raises(DynaPipeError, match="does not exist"):
        read_lengths(str(tmp_path / "nope.txt"))


@pytest.mark.parametrize("lengths, message", [
    ([], "empty"),
    ([5, 0, 3], r"sample 1: length 0"),
    ([5, -2], r"sample 1: length -2"),
    ([5.0, 2.5], r"sample 1: length 2.5 is not an integer"),
    (np.array([3.0, np.nan]), r"sample 1: length nan is not an integer"),
    (["a", "b"], r"sample 0: length 'a' is not an integer"),
    ([[5, 1]], "decoder-only"),
])
def test_bad_length_arrays(lengths, message):
    with pytest.raises(DynaPipeError, match=message):
        validate_lengths(lengths, encoder_decoder=False)


def test_integral_floats_are_accepted():
    assert validate_lengths([5.0, 6.0], False).tolist() == [5, 6]


def test_encoder_decoder_needs_pairs():
    with pytest.raises(DynaPipeError, match="encoder-decoder"):
        plan_micro_batches([5, 6], T5)


def test_oversized_sample_names_index_length_memory_and_fixes():
    lengths = [100, 4000, 200, 3900]
    with pytest.raises(DynaPipeError) as e:
        plan_micro_batches(lengths, CM, memory_limit_mib=30000, reserved_mib=A100.reserved_mib)
    msg = str(e.value)
    # The shortest sample that does not fit, its need, the budget, and every remedy.
    assert "sample 3 (length 3900 tokens, padded to 3904)" in msg
    assert "1 more sample(s)" in msg
    c = CM.stage_cost(1, 3904)
    assert f"needs {float(c.stored_mib + c.peak_mib):.1f} MiB" in msg
    assert "memory limit 30000 MiB" in msg
    for fix in ("raise the memory limit", "recompute level selective or full", "smaller seq_length"):
        assert fix in msg


def test_recompute_makes_the_oversized_sample_fit():
    lengths = [100, 3900]
    plan = plan_micro_batches(lengths, CM, memory_limit_mib=30000, reserved_mib=A100.reserved_mib,
                              recompute="full")
    assert all(mb.stored_mib + mb.peak_mib <= plan.extra["activation_budget_mib"] for mb in plan.micro_batches)


def test_truncation_with_seq_length_makes_it_fit_and_is_reported():
    lengths = [100, 4000, 200, 3900]
    plan = plan_micro_batches(lengths, CM, memory_limit_mib=30000, reserved_mib=A100.reserved_mib, seq_length=1024)
    assert plan.extra["truncated_samples"] == 2
    assert max(mb.seqlen for mb in plan.micro_batches) == 1024
    assert sum(mb.real_tokens for mb in plan.micro_batches) == 100 + 1024 + 200 + 1024


def test_samples_longer_than_the_model_allows():
    with pytest.raises(DynaPipeError, match=r"sample 1 has length 5000 tokens.*max_seq_length 4096.*seq_length=4096"):
        plan_micro_batches([10, 5000], CM)
    with pytest.raises(DynaPipeError, match=r"seq_length=8192 exceeds"):
        plan_micro_batches([10], CM, seq_length=8192)


def test_model_states_that_do_not_fit():
    with pytest.raises(DynaPipeError, match=r"model states .* add pipeline stages or raise the memory limit"):
        plan_micro_batches([10], CM, memory_limit_mib=10000)


@pytest.mark.parametrize("kw, message", [
    (dict(method="bogus"), r"method='bogus'"),
    (dict(dp=0), r"dp=0"),
    (dict(dp=3), r"dp=3 exceeds the 2 sample\(s\) of the global batch.*use dp=2 or less"),
    (dict(micro_batch_size=0), r"micro_batch_size=0"),
    (dict(method="token-budget", max_tokens=-5), r"max_tokens=-5"),
    (dict(memory_limit_mib=-1.0), r"memory_limit_mib=-1.0"),
    (dict(recompute="half"), r"recompute='half'"),
])
def test_bad_options(kw, message):
    with pytest.raises(DynaPipeError, match=message):
        plan_micro_batches([10, 20], CM, **kw)


def test_distributed_optimizer_frees_memory_for_activations():
    from dynapipe.batching import plan_micro_batches
    from dynapipe.config import load_device_config, load_model_config
    from dynapipe.cost import build_cost_model

    device = load_device_config("a100-40gb")
    cm = build_cost_model(load_model_config("gpt-13b"), device, 8)
    lengths = np.array([2048, 1500, 900, 64, 300, 12] * 4)
    kw = dict(dp=2, memory_limit_mib=device.memory_mib, reserved_mib=device.reserved_mib)
    sharded = plan_micro_batches(lengths, cm, zero=True, **kw)
    assert sharded.extra["model_state_mib"] == pytest.approx(cm.model_state_mib(dp=2, zero=True))
    assert sharded.extra["model_state_mib"] < cm.model_state_mib()
    with pytest.raises(DynaPipeError, match="does not fit in memory even alone"):
        plan_micro_batches(lengths, cm, zero=False, **kw)
