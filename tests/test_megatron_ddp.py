"""Megatron-LM's ``--overlap-grad-reduce`` and DDP bucket flags, on every method.

One 2-rank gloo job: GPT on two data-parallel replicas (megatron-core's schedule for padding,
DynaPipe's executor on 1F1B and on zb-h1; packing that leaves a replica without micro-batches),
GPT interleaved on two stages (DynaPipe, a DDP per chunk), T5 on two stages (every method through the executor; DynaPipe on zb-h1 too). With the
overlap each run gives the same losses as without it, and after the first iteration (where
megatron-core's DDP learns how many gradients each parameter gets) every bucket's reduction
starts inside the backward, once an iteration; without it, after the backward.
"""
import pytest

from dynapipe.errors import DynaPipeError
from dynapipe.plan.grad_sync import grad_sync_points
from dynapipe.plan.instructions import BackwardPass, ForwardPass
from megatron_integration.launch import spawn
from t5_job import TINY as T5

GPT = ("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --ffn-hidden-size 128 --seq-length 256 "
       "--vocab-size 256 --micro-batch-size 2 --global-batch-size 8 --train-iters 3 --lr 1e-2 --mock-data "
       "--hidden-dropout 0 --attention-dropout 0 --log-interval 1 --seed 7")
OVERLAP = " --overlap-grad-reduce --ddp-bucket-size 20000"
DYN = " --use-dynapipe --dynapipe-timeout-s 60"
CHUNKED = (GPT.replace("--num-layers 2", "--num-layers 4") +
           " --pipeline-model-parallel-size 2 --num-virtual-stages-per-pipeline-rank 2" + DYN)
ZB = " --dynapipe-schedule zb-h1"
GPT_RUNS = ["", OVERLAP, DYN, DYN + OVERLAP, DYN + ZB + OVERLAP]
# Packing 8 mock samples into rows of 512 tokens, 4 rows a micro-batch: some global batches make
# one micro-batch, and the other replica has none to run.
PACKED = (GPT.replace("--micro-batch-size 2", "--micro-batch-size 4").replace("--seq-length 256", "--seq-length 512")
          + DYN + " --dynapipe-batching packing --reset-position-ids --reset-attention-mask")
# Buckets of about 100 parameters: 1F1B's backward finishes an attention projection before the
# QKV weights listed ahead of it, so a busy replica's hooks finish buckets out of list order.
SMALL_BUCKETS = " --dynapipe-schedule 1f1b --overlap-grad-reduce --ddp-bucket-size 100"
T5_RUNS = ["", OVERLAP, " --use-dynapipe" + OVERLAP, " --use-dynapipe" + ZB + OVERLAP]


@pytest.fixture(scope="module")
def job():
    from ddp_probe import probed_runs

    gpt = [(GPT + e).split() for e in GPT_RUNS] + [CHUNKED.split(), (CHUNKED + " --ddp-num-buckets 3 "
                                                                    "--overlap-grad-reduce").split()]
    gpt += [PACKED.split(), (PACKED + OVERLAP).split(), (PACKED + SMALL_BUCKETS).split()]
    t5 = [(T5 + e).split() for e in T5_RUNS]
    ranks = spawn(probed_runs, 2, (gpt, t5), timeout_s=600)
    return dict(zip(["padding", "padding+overlap", "dynapipe", "dynapipe+overlap", "zb+overlap", "chunks",
                     "chunks+overlap", "packed", "packed+overlap", "packed+small-buckets", "t5", "t5+overlap", "t5-dynapipe+overlap", "t5-zb+overlap"], zip(*ranks)))


def _overlapped(runs) -> None:
    """After the first iteration every reduction of every rank starts inside the backward,
    the same number each iteration (one per bucket group)."""
    for r in runs:
        assert all(r["syncs"][len(r["syncs"]) // r["iterations"]:]), r["syncs"]
        assert len(r["syncs"]) % r["iterations"] == 0


def test_overlapped_reduction_gives_the_same_losses_and_starts_inside_the_backward(job):
    # The zero-bubble schedule too: its buckets' reductions start in the last weight part.
    for plain, overlapped in [("padding", "padding+overlap"), ("dynapipe", "dynapipe+overlap"),
                              ("dynapipe", "zb+overlap"), ("chunks", "chunks+overlap"), ("t5", "t5+overlap"),
                              ("t5", "t5-dynapipe+overlap"), ("t5", "t5-zb+overlap")]:
        ref = job[plain][0]["losses"]
        for r in job[overlapped]:
            assert r["losses"] == pytest.approx(ref, abs=1e-6, rel=1e-6), (plain, overlapped)
        _overlapped(job[overlapped])
        assert not any(s for r in job[plain] for s in r["syncs"]), plain  # after the backward
    # DynaPipe and padding agree (same samples), and the replicas' gradients were summed.
    assert job["dynapipe+overlap"][0]["losses"] == pytest.approx(job["padding"][0]["losses"], abs=1e-5)
    # --ddp-bucket-size 20000 cuts a 2-layer GPT (about 100k parameters) into several buckets.
    gpt = job["padding+overlap"][0]
    assert len(gpt["syncs"]) // gpt["iterations"] >= 4
    # Interleaved, --ddp-num-buckets 3 (the rank's parameters over 3): the first stage cuts its
    # first chunk into buckets and keeps its second whole (Megatron-LM's rule), the second stage
    # keeps each chunk whole (megatron-core's).
    per_iteration = {r["pp_rank"]: len(r["syncs"]) // r["iterations"] for r in job["chunks+overlap"]}
    assert per_iteration[0] >= 3 and per_iteration[1] == 2, per_iteration


def test_a_replica_without_micro_batches_still_reduces_under_the_overlap(job):
    # megatron-core's finish_grad_sync refused the empty replica's buckets from the second
    # iteration on ("Communication call has not been issued for this bucket").
    padded = job["packed+overlap"][0]["padded_tokens"]
    assert min(padded) <= 4 * 512, padded  # some global batch made one micro-batch: a replica had none
    for r in job["packed+overlap"]:
        assert r["losses"] == pytest.approx(job["packed"][0]["losses"], abs=1e-6, rel=1e-6)
        assert len(r["losses"]) == 3


def test_every_replica_launches_its_bucket_reductions_in_one_order(job):
    # A busy replica's hooks finish buckets in its backward's order, an idle one (or one in
    # megatron-core's first batch) launched them in list order: paired out of order, buckets of
    # different sizes aborted the job and buckets of equal sizes were summed into each other.
    runs = job["packed+small-buckets"]
    assert len(set(runs[0]["sync_sizes"])) > 3, runs[0]["sync_sizes"]  # many buckets, of several sizes
    assert runs[0]["sync_sizes"] == runs[1]["sync_sizes"], [r["sync_sizes"] for r in runs]
    for r in runs:
        assert r["losses"] == pytest.approx(job["packed"][0]["losses"], abs=1e-6, rel=1e-6)


class _FakeDDP:
    """What BackwardSyncs reads of a megatron-core DDP module, recording its reductions."""

    def __init__(self, overlap=True):
        from types import SimpleNamespace

        self.ddp_config = SimpleNamespace(overlap_grad_reduce=overlap)
        self.started = 0

    def start_grad_sync(self):
        self.started += 1


def test_only_a_module_no_backward_reduced_is_started_after_the_plan():
    from megatron_integration.ddp import BackwardSyncs

    ran = [ForwardPass(0, 0), BackwardPass(0, 0)]
    one = _FakeDDP()
    BackwardSyncs([one], ran).start_unreduced()  # its last backward started the reduction
    BackwardSyncs([one], []).start_unreduced()  # an empty replica's plan
    plain = _FakeDDP(overlap=False)
    BackwardSyncs([plain], []).start_unreduced()  # without the overlap finish_grad_sync reduces
    assert (one.started, plain.started) == (1, 0)
    # Several chunks a rank: the other replicas' order (hooks, last chunk first; or megatron-core's
    # first batch, chunk 0 first) is not known here, so the empty replica stops with the reason.
    chunks = [_FakeDDP(), _FakeDDP()]
    BackwardSyncs(chunks, ran + [ForwardPass(0, 1), BackwardPass(0, 1)]).start_unreduced()
    with pytest.raises(DynaPipeError, match=r"no micro-batch to run on 2 of its 2 model chunks"):
        BackwardSyncs(chunks, []).start_unreduced()
    assert [c.started for c in chunks] == [0, 0]


def test_grad_sync_points_are_each_chunks_last_backward_of_each_kind():
    ins = [ForwardPass(0, 0), ForwardPass(1, 0), BackwardPass(0, 0), ForwardPass(0, 1), BackwardPass(1, 0),
           BackwardPass(0, 1), BackwardPass(1, 1)]
    assert grad_sync_points(ins) == {(0, 1, "full"), (1, 1, "full")}  # (chunk, micro-batch, part)
    assert grad_sync_points(ins, lambda chunk: 0) == {(1, 1, "full")}  # one gradient buffer for both chunks
    assert grad_sync_points([ForwardPass(0, 0)]) == frozenset()
    # Split (zb-h1's last stage of two): the last input part, then an earlier micro-batch's weight
    # part (under no_sync), then the last weight part.
    split = [BackwardPass(0, 0, part="input"), BackwardPass(1, 0, part="input"), BackwardPass(0, 0, part="weight"),
             BackwardPass(2, 0, part="input"), BackwardPass(1, 0, part="weight"), BackwardPass(2, 0, part="weight")]
    assert grad_sync_points(split) == {(0, 2, "input"), (0, 2, "weight")}
    with pytest.raises(DynaPipeError, match=r"mixes whole and split backwards in .* chunk\(s\) \[0\]"):
        grad_sync_points(split + [BackwardPass(3, 0)])


def _parse(extra: str, world: int = 2):
    from megatron_integration.arguments import parse_training_args

    return parse_training_args((GPT + " " + extra).split(), world, cuda=False)


def test_bucket_flags_reach_megatron_cores_config():
    pytest.importorskip("megatron.core")
    from megatron_integration.ddp import ddp_config

    cfg = _parse("--overlap-grad-reduce --ddp-num-buckets 4")
    c = ddp_config(cfg, 1000)
    assert (c.overlap_grad_reduce, c.bucket_size, c.grad_reduce_in_fp32) == (True, 250, True)
    assert ddp_config(_parse("--overlap-grad-reduce --ddp-bucket-size 777"), 1000).bucket_size == 777
    plain = ddp_config(_parse(""), 1000)
    assert (plain.overlap_grad_reduce, plain.bucket_size) == (False, None)


@pytest.mark.parametrize("extra, words", [
    ("--ddp-bucket-size 1000", "--ddp-bucket-size 1000 without --overlap-grad-reduce"),
    ("--ddp-num-buckets 2", "--ddp-num-buckets 2 without --overlap-grad-reduce"),
    ("--overlap-grad-reduce --ddp-bucket-size 10 --ddp-num-buckets 2", "were both given"),
    ("--overlap-grad-reduce --ddp-bucket-size 0", "--ddp-bucket-size 0: must be positive"),
    ("--ddp-pad-buckets-for-high-nccl-busbw", "add --use-distributed-optimizer"),
])
def test_bucket_flags_that_would_change_nothing_are_refused(extra, words):
    with pytest.raises(DynaPipeError, match=words):
        _parse(extra)


def test_t5_interleaved_placement_refuses_the_overlap_and_auto_stays_contiguous():
    from megatron_integration.t5_arguments import parse_t5_args

    with pytest.raises(DynaPipeError, match="share one gradient buffer"):
        parse_t5_args((T5 + " --dynapipe-placement interleaved --overlap-grad-reduce").split(), 2, cuda=False)
    cfg = parse_t5_args((T5 + " --dynapipe-placement auto --overlap-grad-reduce").split(), 2, cuda=False)
    from megatron_integration.t5_placement import choose_t5_placement

    plan = choose_t5_placement(cfg, 2, 1)
    assert plan.chosen.placement.chunks == 1 and "interleaved_ms" not in plan.compared
