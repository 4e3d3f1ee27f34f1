"""The planning API's lower layers refuse bad input by name, as its entry points do.

Each case below was, before, a silently wrong figure (a NaN limit, a price at the wrong
tensor-parallel size, a string read as true) or a raw TypeError / KeyError from deep inside.
"""
import numpy as np
import pytest

from dynapipe.batching import MicroBatch, plan_micro_batches
from dynapipe.config import ClusterConfig, LinkConfig, TensorParallelConfig, load_device_config, load_model_config
from dynapipe.config import model_config_from_dict
from dynapipe.cost import StagePlacement, build_cost_model, plan_placement
from dynapipe.cost.compute_floor import compute_floor_ms, shapes_compute_ms
from dynapipe.cost.placement import PlacementSample
from dynapipe.advise import enumerate_layouts
from dynapipe.errors import DynaPipeError
from dynapipe.pipeline_planner import plan_iteration
from dynapipe.plan import compile_plans
from dynapipe.runtime.plan_source import PlannerSettings, check_planner_settings
from dynapipe.schedule import StageTimes, one_f_one_b, search_schedules
from dynapipe.schedule.adaptive import adaptive_schedule
from dynapipe.schedule.zero_bubble import zb_h1

GPT = load_model_config("gpt-tiny")
T5 = load_model_config("t5-11b")
CPU = load_device_config("cpu")
CM = build_cost_model(GPT, CPU, 2)
LENS = np.arange(16, 48)
MBS = [[MicroBatch([0], 64), MicroBatch([1], 32)]]
ONES = np.ones((2, 3))
TIMES = StageTimes(ONES, 2 * ONES, ONES, ONES, np.zeros((1, 3)), np.zeros((1, 3)), np.zeros(2))

CASES = [
    # plan_iteration: the tensor-parallel size must be the cost model's, which prices compute and links.
    (lambda: plan_iteration(LENS, CM, tp=4), r"tp 4: the cost model prices tensor-parallel size 1"),
    (lambda: plan_iteration(LENS, CM, memory_limit_mib="4000"), r"memory_limit_mib='4000': must be a finite number"),
    (lambda: plan_iteration(LENS, CM, memory_limit_mib=float("nan")), r"memory_limit_mib=nan"),
    (lambda: plan_iteration(LENS, CM, zero="no"), r"zero='no': must be True or False"),
    (lambda: plan_iteration(LENS, CM, iteration=1.5), r"iteration=1.5: must be a whole number"),
    (lambda: plan_iteration(LENS, CM, cluster="cpu-local"), r"cluster 'cpu-local': give a ClusterConfig"),
    (lambda: plan_iteration(LENS, CM, cluster=ClusterConfig("c", gpus_per_node=0)), r"gpus_per_node=0"),
    (lambda: plan_iteration(LENS, CM, cluster=ClusterConfig("c", inter_node=LinkConfig(-1.0))),
     r"inter_node: bandwidth_gbps=-1.0 must be > 0"),
    (lambda: plan_micro_batches(LENS, CM, gap=-0.1), r"gap -0.1: the relative optimality gap"),
    (lambda: plan_micro_batches(LENS, CM, memory_limit_mib="4000"), r"memory_limit_mib='4000': the memory limit \(MiB\) must be a positive"),
    (lambda: plan_micro_batches(LENS, CM, micro_batch_share="0.5"), r"micro_batch_share '0.5': must be a number"),
    (lambda: plan_micro_batches(LENS, CM, micro_batch_share=True), r"micro_batch_share True: must be a number"),
    # numpy turns [True, 6] into [1, 6]: a 1-token sample nobody asked for.
    (lambda: plan_micro_batches([True, 6], CM), r"sample 0: length True is not an integer"),
    (lambda: plan_micro_batches(np.array([True, False]), CM), r"lengths are True/False values"),
    (lambda: compile_plans("1f1b", MBS[0], GPT, num_stages=2, recompute="bogus"),
     r"recompute='bogus' is not a recompute level"),
    # search_schedules
    (lambda: search_schedules(MBS, CM, must_beat_ms=float("nan")), r"must_beat_ms=nan"),
    (lambda: search_schedules(MBS, CM, capacity_mib=float("nan")), r"capacity_mib=nan"),
    (lambda: search_schedules(MBS, CM, dp=3), r"dp 3: 1 replica list\(s\) were given"),
    (lambda: search_schedules(MBS, CM, tp=0), r"tp=0: must be a whole number"),
    (lambda: search_schedules(MBS[0], CM), r"give one list of micro-batches per data-parallel replica"),
    # build_cost_model: configs built by hand get the loaders' checks.
    (lambda: build_cost_model("gpt-tiny", CPU, 2), r"model 'gpt-tiny': give a ModelConfig"),
    (lambda: build_cost_model(GPT, "cpu", 2), r"device 'cpu': give a DeviceConfig"),
    (lambda: build_cost_model(GPT, CPU, 2.0), r"num_stages=2.0: must be a whole number"),
    (lambda: build_cost_model(GPT, CPU, 2, tp=TensorParallelConfig(2, link=LinkConfig(0.0))),
     r"tp 2: link: bandwidth_gbps=0.0 must be > 0"),
    (lambda: model_config_from_dict([1, 2]), r"is not a mapping of model fields"),
    # Placement
    (lambda: StagePlacement.from_json([2, 2], GPT), r"stage placement \[2, 2\]: give \{'layers'"),
    (lambda: StagePlacement.from_json({"layers": "22"}, GPT), r"stage placement layers='22'"),
    (lambda: StagePlacement.from_json({"layers": [2, 2], "chunk": 2}, GPT), r"give \{'layers'\[, 'chunks'\]\}"),
    (lambda: StagePlacement.from_json({"layers": [2, 2], "chunks": 1.7}, GPT), r"chunks=1.7"),
    (lambda: StagePlacement.from_json({"encoder_layers": [24]}, T5), r"'decoder_layers', 'encoder_layers'"),
    (lambda: StagePlacement.even(GPT, 2.0), r"num_stages=2.0"),
    (lambda: plan_placement(CM, PlacementSample.of(MBS[0]), 1.5), r"num_stages=1.5"),
    (lambda: plan_placement(CM, PlacementSample.of(MBS[0]), capacity_mib=float("nan")), r"capacity_mib=nan"),
    (lambda: PlacementSample(np.ones(2), np.ones(1), np.zeros(1)), r"1-D arrays of one equal, non-zero length"),
    (lambda: PlacementSample(np.ones(1), -np.ones(1), np.zeros(1)), r"PlacementSample.seqlen holds values below 1"),
    # A T5 micro-batch without target tokens priced every stage at NaN and split 24,0,0,0.
    (lambda: plan_placement(build_cost_model(T5, load_device_config("a100-40gb"), 4),
                            PlacementSample(np.ones(2), np.full(2, 512.0), np.array([0.0, 64.0]))),
     r"PlacementSample.dec_seqlen holds 0: every micro-batch of encoder-decoder model 't5-11b'"),
    (lambda: enumerate_layouts(GPT, "4"), r"gpus='4': need a whole number of GPUs"),
    # Compute floor and shapes
    (lambda: compute_floor_ms(CM, [10 ** 6]), r"a sample length 1000000 exceeds the model's max_seq_length 1024"),
    (lambda: compute_floor_ms(CM, [63.5]), r"are not whole numbers of tokens"),
    (lambda: shapes_compute_ms(CM, [(1, -64)]), r"shape \(1, -64\): give \(rows, seqlen\)"),
    (lambda: shapes_compute_ms(CM, [(1,)]), r"shape \(1,\): give \(rows, seqlen\)"),
    # Schedules
    (lambda: one_f_one_b(2.0, 3), r"1f1b: num_stages=2.0"),
    (lambda: zb_h1("2", 3), r"zb-h1: num_stages='2'"),
    (lambda: adaptive_schedule(TIMES, [np.nan, np.nan]), r"capacity_mib .*: give one limit per stage \(2\)"),
    (lambda: adaptive_schedule(TIMES, [10.0]), r"give one limit per stage \(2\)"),
    (lambda: adaptive_schedule(TIMES, max_in_flight=[0, 0]), r"max_in_flight \[0, 0\]: give one whole number"),
    # Planner settings: refused before any worker starts, not by the first worker's first plan.
    (lambda: check_planner_settings(PlannerSettings(model=GPT, device=CPU, num_stages=2, dp=1, schedule="zb-h1",
                                                    split_backward=False)),
     r"schedule 'zb-h1' splits every backward, and split_backward=False"),
]


@pytest.mark.parametrize("call, match", CASES, ids=[str(i) for i in range(len(CASES))])
def test_bad_input_is_refused_by_name(call, match):
    with pytest.raises(DynaPipeError, match=match):
        call()


def test_the_same_calls_with_good_input_run():
    # The refusals above are of the input, not of the call: with good values each one works.
    assert plan_iteration(LENS, CM, memory_limit_mib=4000.0, zero=False, iteration=2).plans
    tp2 = build_cost_model(GPT, CPU, 2, tp=TensorParallelConfig(2))
    assert plan_iteration(LENS, tp2, tp=2).plans[0][0].meta["tp"] == 2
    assert plan_iteration(LENS, tp2).plans[0][0].meta["tp"] == 2  # tp left out: the cost model's
    # An explicit tp=1 is a size too: against a TP2 cost model it is refused, not read as "left out".
    with pytest.raises(DynaPipeError, match=r"^tp 1: the cost model prices tensor-parallel size 2"):
        plan_iteration(LENS, tp2, tp=1)
    with pytest.raises(DynaPipeError, match=r"^tp True: the tensor-parallel size is a whole number"):
        plan_iteration(LENS, CM, tp=True)
    assert search_schedules(MBS, CM, dp=1, capacity_mib=float("inf")).best is not None
    assert StagePlacement.from_json({"layers": [1, 3]}, GPT) == StagePlacement((0, 0), (1, 3))
    assert str(plan_placement(CM, PlacementSample.of(MBS[0]), 2, capacity_mib=8000.0).placement)
    assert compute_floor_ms(CM, [64, 32]) > 0 and shapes_compute_ms(CM, [(1, 64)]) > 0
    check_planner_settings(PlannerSettings(model=GPT, device=CPU, num_stages=2, dp=1, schedule="auto",
                                           split_backward=False))
    assert adaptive_schedule(TIMES, [np.inf, 50.0], max_in_flight=[2, 1])[1].makespan_ms > 0
    assert plan_micro_batches([5, 6], CM, micro_batch_share=0.5).extra["micro_batch_share"] == 0.5
    assert compile_plans("1f1b", MBS[0], GPT, num_stages=2, recompute="full")[0].recompute == "full"


def _cases_of_the_api_review():
    import math
    from dataclasses import replace

    from dynapipe.advise import advise
    from dynapipe.method_compare import compare_over_batches, simulate_method, tune_baseline
    from dynapipe.plan import validate_plans
    from dynapipe.runtime import ExecutorConfig

    L = [100, 200, 300, 50]
    return [
        # Hand-built configs: the YAML loaders' type and finiteness checks.
        (lambda: build_cost_model(replace(GPT, num_layers=2.5), CPU, 2), "num_layers=2.5 must be an integer"),
        (lambda: build_cost_model(replace(GPT, hidden_size="64"), CPU, 2), "hidden_size='64' must be an integer"),
        (lambda: build_cost_model(GPT, replace(CPU, op_overhead_ms=math.inf), 2), "op_overhead_ms=inf must be a "
                                                                                  "finite number"),
        (lambda: build_cost_model(GPT, CPU, 2, tp=TensorParallelConfig(2, link=LinkConfig(10, math.inf))),
         "latency_ms=inf must be a finite number"),
        (lambda: TensorParallelConfig(2, sequence_parallel="yes").validate(GPT), "sequence_parallel='yes'"),
        # An int profile would be opened as a file descriptor, and closed.
        (lambda: build_cost_model(GPT, CPU, 2, profile=True), "profile True: give the path of a profile JSON"),
        (lambda: build_cost_model(GPT, CPU, 2, placement="even"), "placement 'even': give a StagePlacement"),
        # Lengths, cost models, stage counts and the True/False options.
        (lambda: plan_iteration(None, CM), "lengths None: give a sequence of sample lengths"),
        (lambda: plan_iteration(100, CM), "lengths 100: give a sequence"),
        (lambda: plan_iteration(L, None), "cost_model None: give a CostModel"),
        (lambda: plan_iteration(L, CM, stages=2.0), "stages 2.0: the cost model was built for 2 stages"),
        (lambda: plan_iteration(L, CM, split_backward="False"), "split_backward='False': must be True or False"),
        (lambda: plan_micro_batches(L, CM, zero="no"), "zero='no': must be True or False"),
        (lambda: search_schedules(MBS, CM, per_stage="yes"), "per_stage='yes': must be True or False"),
        (lambda: validate_plans(None), "plans None: give a sequence of ExecutionPlans"),
        # Comparisons: input errors named as such, not as sizes no memory fits.
        (lambda: simulate_method([-5, 4], "padding", CM, micro_batch_size=1), "sample 0: length -5 must be a "
                                                                               "positive"),
        (lambda: tune_baseline(L, "packing", CM, seq_length=0), "seq_length=0: must be a whole number"),
        (lambda: simulate_method(L, "dynapipe", CM, cluster="x"), "cluster 'x': give a ClusterConfig"),
        (lambda: compare_over_batches(L, "dynapipe", CM), "a single batch goes in a list: [lengths]"),
        (lambda: advise([L], GPT, CPU, 2, seq_length=5000), "seq_length 5000 exceeds the max_seq_length 1024"),
        (lambda: advise([L], GPT, CPU, 2, layouts=[]), "layouts is empty"),
        (lambda: advise([L], "gpt-tiny", CPU, 2), "model 'gpt-tiny': give a ModelConfig"),
        # The executor's settings.
        # 0 is refused too, and the refusal of a negative value says so.
        (lambda: ExecutorConfig(timeout_s=-1), "ExecutorConfig timeout_s=-1: must be a finite number of s above 0."),
        (lambda: ExecutorConfig(timeout_s=0), "ExecutorConfig timeout_s=0: must be a finite number of s above 0."),
        (lambda: ExecutorConfig(poll_s=0), "ExecutorConfig poll_s=0: must be a finite number of s above 0."),
        (lambda: ExecutorConfig(trace=1), "ExecutorConfig trace=1: must be True or False"),
        (lambda: ExecutorConfig.of({"timeout_s": 30}), "give an ExecutorConfig"),
        (lambda: tune_baseline([[1, 2], [3]], "packing", build_cost_model(T5, load_device_config("a100-40gb"), 4)),
         "lengths are not one row per sample of equal size"),
    ]


@pytest.mark.parametrize("case", range(28))
def test_the_api_refuses_by_name_what_it_took_silently_or_raised_deep_inside(case):
    call, needle = _cases_of_the_api_review()[case]
    with pytest.raises(DynaPipeError) as e:
        call()
    assert needle in str(e.value), str(e.value)


def test_numpy_values_a_config_built_in_code_holds_are_taken():
    from dataclasses import replace

    build_cost_model(replace(GPT, hidden_size=np.int64(64), tie_embeddings=np.bool_(False)), CPU, 2)
    TensorParallelConfig(2, np.True_).validate(GPT)
