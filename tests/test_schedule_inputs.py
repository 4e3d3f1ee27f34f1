"""Inputs the schedule search and the chunked plan compiler refuse, or take, as they are given."""
from dataclasses import replace

import numpy as np
import pytest

from dynapipe.batching.types import MicroBatch
from dynapipe.config import DeviceConfig, ModelConfig
from dynapipe.cost import AnalyticCostModel, StagePlacement
from dynapipe.errors import DynaPipeError
from dynapipe.plan.compile import _proxy_times
from dynapipe.plan.compile_chunked import compile_chunked_plans
from dynapipe.schedule.interleaved import interleaved_1f1b, simulate_chunked
from dynapipe.schedule.search import search_schedules

DEVICE = DeviceConfig("toy", peak_tflops=10.0, achievable_fraction=0.5, memory_mib=1e9, op_overhead_ms=0.01)
GPT = ModelConfig("gpt-toy", num_layers=8, hidden_size=512, num_attention_heads=8, ffn_hidden_size=2048,
                  vocab_size=1000, max_seq_length=1024, dtype="bf16")


def _micro_batches(n, seqlen=128):
    return [MicroBatch(samples=[i], seqlen=seqlen) for i in range(n)]


def _interleaved_for(n):
    """An interleaved 1F1B schedule of ``n`` micro-batches on 2 ranks x 2 chunks, its
    timeline and the virtual stages' layouts."""
    layouts = AnalyticCostModel(GPT, DEVICE, 2).with_placement(
        StagePlacement.parse("2,2|2,2", GPT, 2)).placement.virtual_layouts()
    schedule = interleaved_1f1b(2, 2, n)
    timeline = simulate_chunked(schedule, replace(_proxy_times(_micro_batches(n), 4), state_mib=np.zeros(2)),
                                record_memory=False)
    return schedule, timeline, layouts


@pytest.mark.parametrize("given", [3, 5])
def test_chunked_plans_refuse_a_micro_batch_count_the_schedule_does_not_run(given):
    # Three for a schedule of four ended in an IndexError; five compiled a micro-batch no op runs.
    schedule, timeline, layouts = _interleaved_for(4)
    with pytest.raises(DynaPipeError) as e:
        compile_chunked_plans(schedule, _micro_batches(given), GPT, timeline, layouts)
    assert str(e.value) == f"schedule 'interleaved' runs 4 micro-batches, {given} were given."
    plans = compile_chunked_plans(schedule, _micro_batches(4), GPT, timeline, layouts)
    assert [len(p.micro_batches) for p in plans] == [4, 4]


def test_search_takes_an_iterator_of_replicas():
    # The check for a flat list used to consume the iterator: "there are no micro-batches".
    cm = AnalyticCostModel(GPT, DEVICE, 2)
    mbs = _micro_batches(4)
    from_iterator = search_schedules(iter([mbs]), cm, schedule="1f1b")
    assert from_iterator.best.makespan_ms == search_schedules([mbs], cm, schedule="1f1b").best.makespan_ms
    assert search_schedules((list(r) for r in [mbs[:2], mbs[2:]]), cm, schedule="1f1b").best.fits


@pytest.mark.parametrize("replicas, needle", [
    ([[1, 2]], "replicas: int 1 is not a MicroBatch"),
    ([["a"]], "replicas: str 'a' is not a MicroBatch"),
    ([3], "replicas: give one list of micro-batches per data-parallel replica"),
    (7, "replicas: give one list of micro-batches per data-parallel replica"),
    (["ab"], "replicas: give one list of micro-batches per data-parallel replica"),
    (_micro_batches(2), "replicas: give one list of micro-batches per data-parallel replica"),
])
def test_search_refuses_replicas_that_are_not_lists_of_micro_batches(replicas, needle):
    # [[1, 2]] raised AttributeError ('int' object has no attribute 'mbs') deep in the search.
    with pytest.raises(DynaPipeError) as e:
        search_schedules(replicas, AnalyticCostModel(GPT, DEVICE, 2))
    assert needle in str(e.value) and "\n" not in str(e.value)
