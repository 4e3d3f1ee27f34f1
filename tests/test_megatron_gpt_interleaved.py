"""Megatron's interleaved pipeline for GPT: every rank holds several model chunks.

``--num-virtual-stages-per-pipeline-rank`` / ``--num-layers-per-virtual-pipeline-stage`` build
megatron-core ``GPTModel`` chunks at their global layer offsets. DynaPipe runs its interleaved
plans through the executor (2 stages x 2 chunks here), the baselines megatron-core's
interleaved 1F1B (3 stages x 2 chunks: over gloo it needs 3 or more), and DynaPipe on
TP2 x PP2 x 2 chunks with sequence parallelism. Every run gives the losses of the plain
pipeline of the same model and seed (fp32, dropout 0, 1e-5), evaluation included. Each
layout's runs share one spawned job.
"""
import json
import os

import pytest

from dynapipe.errors import DynaPipeError
from megatron_integration.arguments import parse_training_args
from megatron_integration.jobs import run_trainings

BASE = ("--hidden-size 64 --num-attention-heads 4 --ffn-hidden-size 128 --vocab-size 256 --micro-batch-size 2 "
        "--lr 1e-2 --mock-data --hidden-dropout 0 --attention-dropout 0 --log-interval 1 --seed 7 --train-iters 3")
EVAL = " --split 80,10,10 --eval-interval 2 --eval-iters 1"
PP2 = BASE + " --num-layers 4 --seq-length 256 --global-batch-size 8 --pipeline-model-parallel-size 2"
PP3 = BASE + EVAL + " --num-layers 6 --seq-length 128 --global-batch-size 12 --pipeline-model-parallel-size 3"
V2 = " --num-virtual-stages-per-pipeline-rank 2"
PACKING = " --dynapipe-batching packing --reset-position-ids --reset-attention-mask"
TIMEOUT = 300


def parse(extra: str, world: int = 2, base: str = PP2, cuda: bool = False):
    return parse_training_args(f"{base} {extra}".split(), world, cuda=cuda)


def close(a: list, b: list, tol: float = 1e-5) -> bool:
    return len(a) == len(b) and all(abs(x - y) <= tol * max(1.0, abs(y)) for x, y in zip(a, b))


def eval_values(run: dict) -> list[str]:
    return [line.split("lm loss value: ")[1].split(" ")[0] for line in run["eval_lines"] if "lm loss value" in line]


@pytest.fixture(scope="module")
def pp2(tmp_path_factory):
    """One 2-rank job: padding on the plain pipeline, then DynaPipe on 2 chunks a rank (its
    executor traces kept), both evaluating; DynaPipe on 2 chunks under interleaved 1F1B,
    storing and recomputing every layer; then
    DynaPipe on 2 chunks cut after 2 iterations
    with a torch_dist checkpoint, resumed on 2 chunks and on the plain pipeline; then
    interleaved-zb (``zb-h1`` on chunks; traces kept), alone and with the overlapped reduction."""
    traces = tmp_path_factory.mktemp("gpt-interleaved-traces")
    zb_traces = tmp_path_factory.mktemp("gpt-interleaved-zb-traces")
    ckpt = tmp_path_factory.mktemp("gpt-interleaved-ckpt")
    dyn = PP2 + " --use-dynapipe"
    zb = dyn + V2 + " --dynapipe-schedule zb-h1"
    names = ("padding", "dynapipe", "no-recompute", "full-recompute", "cut", "resumed", "resumed-plain", "zb",
             "zb-overlap")
    whole = dyn + V2 + " --dynapipe-schedule 1f1b"
    runs = [PP2 + EVAL, dyn + EVAL + V2 + f" --dynapipe-trace-dir {traces}", whole + " --dynapipe-recompute none",
            whole + " --dynapipe-recompute full",
            dyn + V2 + f" --exit-interval 2 --save {ckpt / 'dist'}", dyn + V2 + f" --load {ckpt / 'dist'}",
            dyn + f" --load {ckpt / 'dist'}", zb + f" --dynapipe-trace-dir {zb_traces}",
            zb + " --overlap-grad-reduce --ddp-bucket-size 20000"]
    ranks = run_trainings([r.split() for r in runs], 2, timeout_s=TIMEOUT)
    out = dict(zip(names, ranks))
    out["zb-traces"] = zb_traces
    return out, traces


@pytest.fixture(scope="module")
def pp3():
    """One 3-rank job: padding on the plain pipeline; padding, packing and padding-mb (its
    micro-batches of different lengths) through megatron-core's interleaved 1F1B on 2 chunks a rank."""
    v2 = V2 + " --no-overlap-p2p-communication"  # megatron-core's overlapped sends are not safe on gloo
    runs = [PP3, PP3 + v2, PP3 + v2 + PACKING, PP3 + v2 + " --dynapipe-batching padding-mb"]
    ranks = run_trainings([r.split() for r in runs], 3, timeout_s=TIMEOUT)
    return dict(zip(("padding", "padding-interleaved", "packing-interleaved", "padding-mb-interleaved"), ranks))


def test_dynapipe_on_chunks_trains_and_evaluates_as_the_plain_pipeline(pp2):
    runs, _ = pp2
    ref = runs["padding"][0]
    got = runs["dynapipe"]
    assert got[0]["losses"] == got[1]["losses"]  # every rank reports the same global loss
    assert close(got[0]["losses"], ref["losses"]), (got[0]["losses"], ref["losses"])
    assert close([float(v) for v in eval_values(got[0])], [float(v) for v in eval_values(ref)])
    assert eval_values(ref) and got[0]["eval_path"].startswith("dynapipe-plans:")


def test_interleaved_zero_bubble_trains_the_plain_pipeline_losses_and_splits_every_chunk(pp2):
    # zb-h1 on 2 chunks a rank runs interleaved-zb: every backward of both chunks split into
    # its input part and, later, its weight part, at the plain pipeline's losses; with
    # --overlap-grad-reduce each chunk's buckets reduce from its last input and weight parts.
    runs, _ = pp2
    ref = runs["padding"][0]["losses"]
    for name in ("zb", "zb-overlap"):
        got = runs[name][0]
        assert got["schedules"] == ["interleaved-zb"] * 3, (name, got["schedules"])
        assert close(got["losses"], ref), (name, got["losses"], ref)
        # What pending weight parts keep is counted, and stays within what the plans promised,
        # which is close to it: the plan walk counts each input part's weight stash until its
        # weight part (it once freed everything at the input part, and the 5-byte scores of a
        # dropout-everywhere model hid the difference).
        for rank in range(2):
            measured, planned = runs[name][rank]["activation_measured_mib"], runs[name][rank]["activation_planned_mib"]
            assert all(m <= p <= 1.05 * m for m, p in zip(measured, planned)), (name, rank, measured, planned)
    for rank in range(2):
        with open(os.path.join(runs["zb-traces"], f"rank{rank:03d}.json")) as f:
            events = json.load(f)
        events = events["traceEvents"] if isinstance(events, dict) else events
        ops = [(e["args"]["iteration"], e["name"].split()[0], e["args"].get("chunk", 0)) for e in events
               if e.get("ph") == "X" and e.get("cat", "").startswith(("forward", "backward"))]
        for it in {i for i, _, _ in ops}:
            seq = [(n, c) for i, n, c in ops if i == it]
            kinds = {n[:2] if n.startswith("B") else "F" for n, _ in seq}
            assert kinds == {"F", "BI", "BW"}, (rank, it, seq[:6])
            forwards = sorted((n[1:], c) for n, c in seq if n.startswith("F"))
            assert {c for _, c in forwards} == {0, 1}
            assert sorted((n[2:], c) for n, c in seq if n.startswith("BI")) == forwards
            assert sorted((n[2:], c) for n, c in seq if n.startswith("BW")) == forwards
            assert all(seq.index(("BI" + m, c)) < seq.index(("BW" + m, c)) for m, c in forwards)


def test_recompute_reaches_every_chunk(pp2):
    # One TransformerConfig for all of a rank's chunks: the level the plan sets applies to each,
    # so full recompute keeps only layer inputs on every rank (within what the plans promised),
    # at the same losses. With a config per chunk, chunk 1 kept its activations. Both runs are
    # interleaved 1F1B: under a split backward the pending weight parts keep the linear
    # layers' inputs and output gradients at any level.
    runs, _ = pp2
    none, full = runs["no-recompute"], runs["full-recompute"]
    assert close(full[0]["losses"], none[0]["losses"])
    for rank in range(2):
        measured, planned = full[rank]["activation_measured_mib"], full[rank]["activation_planned_mib"]
        assert all(m <= p <= 1.1 * m for m, p in zip(measured, planned)), (rank, measured, planned)
        assert max(measured) < 0.4 * max(none[rank]["activation_measured_mib"]), rank


def test_dynapipe_plans_run_the_second_chunk_on_every_rank(pp2):
    # Without the chunks, every op would be chunk 0 and the losses above could not match; the
    # traces show each rank ran forwards and backwards of its chunk 1.
    _, traces = pp2
    for rank in range(2):
        with open(os.path.join(traces, f"rank{rank:03d}.json")) as f:
            events = json.load(f)
        events = events["traceEvents"] if isinstance(events, dict) else events
        chunks = {e.get("args", {}).get("chunk", 0) for e in events if e.get("ph") == "X"}
        assert 1 in chunks, (rank, chunks)
        # The evaluation batches' forward-only plans are in the trace too, labelled apart.
        ops = [e for e in events if e.get("ph") == "X" and e["cat"] in ("forward", "backward")]
        evaluated = [e for e in ops if e["args"].get("phase", "").startswith("evaluation batch ")]
        assert evaluated and {e["cat"] for e in evaluated} == {"forward"}, rank
        assert {e["args"]["iteration"] for e in ops if "phase" not in e["args"]} == set(range(3)), rank


def test_checkpoints_of_chunks_resume_exactly_and_torch_dist_ones_on_the_plain_pipeline(pp2):
    runs, _ = pp2
    full = runs["dynapipe"][0]["losses"]
    assert runs["cut"][0]["losses"] == full[:2]
    got = runs["resumed"][0]
    assert got["start_iteration"] == 2 and got["losses"] == full[2:], (got["losses"], full)
    # torch_dist keys are the model's global ones: the chunks' checkpoint loads one chunk a rank.
    plain = runs["resumed-plain"][0]
    assert plain["start_iteration"] == 2 and close(plain["losses"], full[2:])


def test_a_per_rank_checkpoint_of_other_chunking_is_refused_with_the_fix():
    from megatron_integration.training import check_split

    check_split(2, None, {"virtual_stages_per_rank": 2}, "ckpt.pt")
    check_split(1, None, {}, "ckpt.pt")  # saved before chunks were recorded: one a rank
    with pytest.raises(DynaPipeError, match="saved with 2 model chunk.*--num-virtual-stages-per-pipeline-rank 2"):
        check_split(1, None, {"virtual_stages_per_rank": 2}, "ckpt.pt")
    with pytest.raises(DynaPipeError, match="saved with 1 model chunk"):
        check_split(2, None, {}, "ckpt.pt")
    # An uneven split is recorded too: the same layers load, other ones are refused.
    check_split(1, [3, 1], {"stage_layers": [3, 1]}, "ckpt.pt")
    with pytest.raises(DynaPipeError, match=r"saved on the even split, this run builds layers \[3, 1\]"):
        check_split(1, [3, 1], {}, "ckpt.pt")
    with pytest.raises(DynaPipeError, match=r"saved on layers \[1, 3\] a \(virtual\) stage.*torch_dist"):
        check_split(1, [3, 1], {"stage_layers": [1, 3]}, "ckpt.pt")


def test_training_hooks_give_megatron_core_one_no_sync_per_chunk():
    import types

    from megatron_integration.model import attach_training_hooks

    modules = [types.SimpleNamespace(no_sync=object()) for _ in range(2)]
    stage = types.SimpleNamespace(config=types.SimpleNamespace(fp16=False, bf16=False), modules=modules, chunked=True)
    attach_training_hooks(stage, types.SimpleNamespace(scale_loss=None))
    assert stage.config.no_sync_func == [m.no_sync for m in modules]


@pytest.fixture(scope="module")
def tp2():
    """One 4-rank job: DynaPipe on TP2 x PP2 x 2 chunks with sequence parallelism, 2 iterations
    (megatron-core's interleaved baselines on TP2 x PP3 need 6 ranks: measured once, not in the
    suite)."""
    tp = PP2.replace("--train-iters 3", "--train-iters 2") + " --tensor-model-parallel-size 2"
    return run_trainings([(tp + V2 + " --use-dynapipe --sequence-parallel").split()], 4, timeout_s=TIMEOUT)[0]


def test_chunks_split_over_tensor_parallel_ranks_train_as_the_plain_pipeline(tp2, pp2):
    assert all(r["losses"] == tp2[0]["losses"] for r in tp2)
    # TP and SP change the split, not the model: the plain PP2 padding run's first two losses.
    assert close(tp2[0]["losses"], pp2[0]["padding"][0]["losses"][:2])


def test_megatron_cores_interleaved_schedule_gives_the_plain_pipelines_losses(pp3):
    ref = pp3["padding"][0]
    assert len(set(pp3["padding-mb-interleaved"][0]["padded_tokens"])) > 1  # micro-batches of other lengths
    for name in ("padding-interleaved", "packing-interleaved", "padding-mb-interleaved"):
        got = pp3[name][0]
        assert close(got["losses"], ref["losses"]), (name, got["losses"], ref["losses"])
        assert close([float(v) for v in eval_values(got)], [float(v) for v in eval_values(ref)])
        assert got["eval_path"] == "megatron-forward-only"


def test_virtual_stage_flags_mean_what_they_mean_in_megatron(gpu_with_te):
    assert parse("--num-virtual-stages-per-pipeline-rank 2 --use-dynapipe").parallel \
        .virtual_pipeline_model_parallel_size == 2
    # Layers per virtual stage: 4 layers over 2 stages, 1 a chunk -> 2 chunks a rank.
    assert parse("--num-layers-per-virtual-pipeline-stage 1 --use-dynapipe").parallel \
        .virtual_pipeline_model_parallel_size == 2
    # One chunk a rank is the plain pipeline, as Megatron-LM sets no virtual size for it.
    assert parse("--num-layers-per-virtual-pipeline-stage 2").parallel.virtual_pipeline_model_parallel_size is None
    assert parse("").parallel.virtual_pipeline_model_parallel_size is None
    # Megatron-LM's default: the interleaved schedule overlaps its transfers (on GPUs, at 2 stages,
    # it must); --no-overlap-p2p-communication turns it off; without chunks it is off.
    assert parse("--num-virtual-stages-per-pipeline-rank 2", cuda=True).parallel.overlap_p2p_comm
    assert not parse("--num-virtual-stages-per-pipeline-rank 2 --no-overlap-p2p-communication", 3, PP3,
                     cuda=True).parallel.overlap_p2p_comm
    assert not parse("", cuda=True).parallel.overlap_p2p_comm
    assert not parse("--no-overlap-p2p-communication").parallel.overlap_p2p_comm
    assert parse("--num-virtual-stages-per-pipeline-rank 2 --use-dynapipe").parallel.overlap_p2p_comm


@pytest.mark.parametrize("extra, world, base, needle", [
    ("--num-virtual-stages-per-pipeline-rank 2 --num-layers-per-virtual-pipeline-stage 1 --use-dynapipe", 2, PP2,
     "give one"),
    ("--num-layers-per-virtual-pipeline-stage 3 --use-dynapipe", 2, PP2, "use a divisor of 2"),
    ("--num-virtual-stages-per-pipeline-rank 3 --use-dynapipe", 2, PP2, "do not split into 3 equal chunks"),
    ("--num-virtual-stages-per-pipeline-rank 2 --use-dynapipe --pipeline-model-parallel-size 1", 1, PP2,
     "2 or more"),
    ("--num-virtual-stages-per-pipeline-rank 2 --no-overlap-p2p-communication", 2, PP2, "3 or more stages there"),
    # Without the flag too: the stage count is named first, with everything the baseline needs.
    ("--num-virtual-stages-per-pipeline-rank 2", 2, PP2, "3 or more stages there, with --no-overlap-p2p-comm"),
    ("--num-virtual-stages-per-pipeline-rank 2", 3, PP3, "add --no-overlap-p2p-communication"),
    ("--num-virtual-stages-per-pipeline-rank 2 --use-dynapipe --no-overlap-p2p-communication", 2, PP2, "Drop it"),
    ("--num-virtual-stages-per-pipeline-rank 2 --no-overlap-p2p-communication --dynapipe-batching padding-mb "
     "--global-batch-size 8", 3, PP3, "multiple of 6 samples"),
    ("--num-virtual-stages-per-pipeline-rank 2 --no-overlap-p2p-communication --global-batch-size 8", 3, PP3,
     "multiple of 6 samples"),
])
def test_virtual_stage_combinations_this_build_cannot_run_are_refused(extra, world, base, needle):
    with pytest.raises(DynaPipeError, match=needle):
        parse(extra, world, base)


def test_gpu_rule_at_two_stages_is_megatrons(gpu_with_te):
    with pytest.raises(DynaPipeError, match="needs its transfers overlapped"):
        parse("--num-virtual-stages-per-pipeline-rank 2 --no-overlap-p2p-communication", cuda=True)


@pytest.mark.parametrize("flag", ["--overlap-p2p-communication", "--overlap-p2p-comm"])
def test_the_old_overlap_flags_are_named_as_the_default_now(flag, capsys):
    with pytest.raises(SystemExit):
        parse(f"--num-virtual-stages-per-pipeline-rank 2 {flag}", cuda=True)
    err = capsys.readouterr().err
    assert "--no-overlap-p2p-communication" in err
    # This build's own old spelling is not called one of Megatron-LM's flags.
    assert ("is a Megatron-LM flag" in err) == (flag == "--overlap-p2p-communication"), err


def test_t5_takes_its_chunks_as_a_placement():
    from megatron_integration.t5_arguments import parse_t5_args

    argv = ("--encoder-num-layers 2 --decoder-num-layers 2 --hidden-size 64 --num-attention-heads 4 "
            "--encoder-seq-length 128 --decoder-seq-length 32 --micro-batch-size 2 --global-batch-size 8 "
            "--train-iters 2 --lr 1e-3 --mock-data --pipeline-model-parallel-size 2 "
            "--num-virtual-stages-per-pipeline-rank 2").split()
    with pytest.raises(DynaPipeError, match="--dynapipe-placement interleaved"):
        parse_t5_args(argv, 2)


def test_the_interleaved_bench_script_times_each_run_on_its_slowest_rank():
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts"))
    from bench_gpt_interleaved import main, tokens_per_s

    ranks = [{"iteration_ms": [900.0, 100.0, 300.0], "real_tokens": [50, 100, 200]},
             {"iteration_ms": [950.0, 200.0, 100.0], "real_tokens": [50, 100, 200]}]
    # The first iteration is left out; 300 tokens over 200 + 300 ms.
    assert tokens_per_s(ranks) == pytest.approx(300 / 0.5)
    with pytest.raises(SystemExit):
        main(["--chunks", "1"])


def test_adaptive_on_chunks_is_planned_as_the_interleaved_adaptive_schedule():
    # As 1f1b and zb-h1 plan their interleaved forms on chunks, --dynapipe-schedule adaptive does.
    import torch

    from megatron_integration.dynapipe_step import planner_settings
    from megatron_integration.initialize import RankInfo

    info = RankInfo(0, 2, 0, 2, 0, 1, 0, 1, torch.device("cpu"))
    for extra, expected in ((" --num-virtual-stages-per-pipeline-rank 2", "interleaved-adaptive"), ("", "adaptive")):
        argv = (PP2 + " --use-dynapipe --dynapipe-schedule adaptive" + extra).split()
        assert planner_settings(parse_training_args(argv, 2, cuda=False), info).schedule == expected
