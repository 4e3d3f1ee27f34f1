"""The compute floor: no batching of a global batch computes less, and batching equal samples
at the best size reaches it."""
from __future__ import annotations

import numpy as np
import pytest

from dynapipe.config import load_device_config, load_model_config
from dynapipe.cost import build_cost_model
from dynapipe.cost.compute_floor import compute_floor_ms, floor_over_batches, micro_batch_sizes, shapes_compute_ms
from dynapipe.errors import DynaPipeError
from dynapipe.method_compare import global_batch_of_tokens, plan_shapes
from dynapipe.pipeline_planner import plan_iteration

A100 = load_device_config("a100-40gb")
GPT = build_cost_model(load_model_config("gpt-7b"), A100, 4)
T5 = build_cost_model(load_model_config("t5-11b"), A100, 8)


def _compute_ms(cost_model, shapes) -> float:
    """Forward + backward ms of micro-batches of ``shapes`` summed over every stage, by hand."""
    return sum(float(cost_model.stage_cost(*shape, stage=s).time_ms)
               for shape in shapes for s in range(cost_model.num_stages))


def test_shapes_compute_sums_every_micro_batch_on_every_stage():
    shapes = [(2, 512), (1, 1024), (4, 128)]
    assert shapes_compute_ms(GPT, shapes) == pytest.approx(_compute_ms(GPT, shapes), rel=1e-12)
    assert shapes_compute_ms(GPT, shapes, recompute="full") > shapes_compute_ms(GPT, shapes)
    assert shapes_compute_ms(T5, [(2, 400, 64)]) == pytest.approx(_compute_ms(T5, [(2, 400, 64)]), rel=1e-12)


@pytest.mark.parametrize("cost_model,encdec", [(GPT, False), (T5, True)])
@pytest.mark.parametrize("seed", [0, 1])
def test_no_method_computes_less_than_the_floor(cost_model, encdec, seed):
    seq = 2048
    lengths = global_batch_of_tokens(32 * 1024, seed, seq, encoder_decoder=encdec)
    floor = compute_floor_ms(cost_model, lengths)
    computed = {}
    for method in ("padding", "packing", "packing-per-sample", "dynapipe"):
        sized = {} if method == "dynapipe" else {"micro_batch_size": 2}  # the DP sizes its own
        plan = plan_iteration(lengths, cost_model, method=method, seq_length=seq, schedule="1f1b", **sized)
        mbs = plan.batch_plan.micro_batches
        computed[method] = shapes_compute_ms(cost_model, plan_shapes(plan, encdec),
                                             attention=[mb.attention for mb in mbs])
        assert computed[method] >= floor * (1 - 1e-9), (method, computed[method], floor)
    # Per-sample rows skip the attention between samples: less than the masked rows, not below the floor.
    assert computed["packing-per-sample"] < computed["packing"]
    # The floor is not vacuous: padding to the longest sample wastes, DynaPipe's cuts waste less.
    assert computed["padding"] > 1.2 * floor
    assert computed["dynapipe"] < computed["padding"]


def test_equal_samples_batched_at_the_best_size_reach_the_floor():
    lengths = np.full(8, 512)
    best = min(8 // m * float(sum(GPT.stage_cost(m, 512, stage=s).time_ms for s in range(GPT.num_stages)))
               for m in (1, 2, 4, 8))
    assert compute_floor_ms(GPT, lengths) == pytest.approx(best, rel=1e-12)
    pairs = np.tile([[400, 64]], (4, 1))
    best_t5 = min(4 // m * _compute_ms(T5, [(m, 400, 64)]) for m in (1, 2, 4))
    assert compute_floor_ms(T5, pairs) == pytest.approx(best_t5, rel=1e-12)


def test_the_floor_grows_with_the_samples_and_averages_over_batches():
    a, b = np.array([100, 200, 300]), np.array([100, 200, 300, 900])
    assert compute_floor_ms(GPT, b) > compute_floor_ms(GPT, a)
    mean = floor_over_batches(GPT, [a, b])
    assert mean == pytest.approx((compute_floor_ms(GPT, a) + compute_floor_ms(GPT, b)) / 2)


def test_micro_batch_sizes_are_every_small_size_then_powers_of_two_and_the_batch():
    assert micro_batch_sizes(1) == [1]
    assert micro_batch_sizes(12) == list(range(1, 13))
    assert micro_batch_sizes(200) == list(range(1, 65)) + [128, 200]


@pytest.mark.parametrize("n", [3, 5, 6, 7])
def test_the_floor_is_below_one_micro_batch_of_any_size(n):
    # Powers of two alone priced three equal samples above the one micro-batch holding them.
    cost_model = build_cost_model(load_model_config("gpt-tiny"), A100, 2)
    lengths = np.full(n, 128)
    assert compute_floor_ms(cost_model, lengths) <= shapes_compute_ms(cost_model, [(n, 128)]) * (1 + 1e-12)
    # A cap above the batch's size tries no micro-batch larger than the batch.
    assert compute_floor_ms(cost_model, lengths, max_micro_batch=64) == compute_floor_ms(cost_model, lengths)


@pytest.mark.parametrize("cost_model,lengths,needle", [
    (GPT, np.zeros((0,), dtype=int), "shape (0,)"),
    (GPT, np.array([[10, 2]]), "1-D list"),
    (T5, np.array([10, 20]), "(n, 2) input and target"),
    (GPT, np.array([10, 0, 5]), "sample length 0"),
])
def test_bad_lengths_are_refused_with_what_to_give(cost_model, lengths, needle):
    with pytest.raises(DynaPipeError, match=None) as e:
        compute_floor_ms(cost_model, lengths)
    assert needle in str(e.value)
    with pytest.raises(DynaPipeError, match="no global batches"):
        floor_over_batches(GPT, [])
