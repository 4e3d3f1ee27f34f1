"""Tensor (and sequence) parallelism through DynaPipe: same losses as megatron-core's padding 1F1B.

One spawned job of 4 gloo ranks trains TP2 x PP2 and TP2 x PP1 x DP2, each with and
without ``--sequence-parallel``, each once with DynaPipe and once with the padding
baseline (TP2 x PP2 also with DynaPipe on the zero-bubble schedule) (the model and process groups rebuilt per run, 2 iterations, fp32, dropout 0).
The same job checks that pipeline transfers pair matching TP ranks, that the ranks of a
TP group received equal payloads, and (in a third iteration of the last run) that a TP
rank holding a different payload stops every rank with the same one line, not a hang.
"""
import pytest

from megatron_integration.launch import spawn

TINY = ("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --ffn-hidden-size 128 --seq-length 256 "
        "--vocab-size 256 --micro-batch-size 2 --global-batch-size 8 --train-iters 2 --lr 1e-2 --mock-data "
        "--hidden-dropout 0 --attention-dropout 0 --lr-decay-style constant --log-interval 1 --seed 7 "
        "--tensor-model-parallel-size 2")
LAYOUTS = {"tp2xpp2": "--pipeline-model-parallel-size 2", "tp2xdp2": ""}
SP = {"": "", "sp": "--sequence-parallel"}
WORLD = 4


METHODS = {"padding": "", "dynapipe": "--use-dynapipe --dynapipe-timeout-s 60",
           # The backward split into input and weight parts: the deferred weight gradients of
           # column- and row-parallel layers, their reductions and SP all-gathers.
           "zb-h1": "--use-dynapipe --dynapipe-timeout-s 60 --dynapipe-schedule zb-h1"}


def _runs():
    return [(layout, sp, method) for layout in LAYOUTS for sp in SP for method in METHODS
            if method != "zb-h1" or layout == "tp2xpp2"]


def tp_job():
    """Rank body: {(layout, sp, method): losses and token counts}, plus the pairing, digest and
    mismatch checks (see the module docstring)."""
    import io

    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    import megatron_integration.dynapipe_step as dynapipe_step
    from dynapipe.errors import DynaPipeError
    from megatron_integration.arguments import parse_training_args
    from megatron_integration.initialize import destroy
    from megatron_integration.training import pretrain

    seen: list = []  # (iteration, digest, tp rank, pp rank, dp rank) the step compared, on this rank
    corrupt = {"at": None}
    real_check = dynapipe_step.check_tp_plans_agree

    def recording_check(iteration, digest, info, device=None):
        if corrupt["at"] == iteration:
            if dist.get_rank() == 1:
                digest ^= 1  # this TP rank now claims another payload than its peer
        else:
            seen.append((iteration, digest, info.tp_rank, info.pp_rank, info.dp_rank))
        return real_check(iteration, digest, info, device)

    dynapipe_step.check_tp_plans_agree = recording_check
    out = {"runs": {}, "pairing": {}, "mismatch": None}
    runs = _runs()
    try:
        for layout, sp, method in runs:
            argv = f"{TINY} {LAYOUTS[layout]} {SP[sp]} {METHODS[method]}"
            last = (layout, sp, method) == runs[-1]
            if last:
                # The last run goes on to a third iteration, at which rank 1 claims another payload
                # than its TP peer: every rank must stop with the same line (the LR is constant, so
                # the first two iterations are those of a 2-iteration run).
                argv = argv.replace("--train-iters 2", "--train-iters 3")
                corrupt["at"] = 2
            cfg = parse_training_args(argv.split(), WORLD)
            results = []
            try:
                pretrain(cfg, stream=io.StringIO(), on_iteration=lambda i, r: results.append(r))
            except DynaPipeError as e:
                if not last:
                    raise
                out["mismatch"] = f"{type(e).__name__}: {e}"
            # Pipeline peers of this rank (megatron's pipeline group, the executor's) and their TP ranks.
            peers = dist.get_process_group_ranks(ps.get_pipeline_model_parallel_group())
            tp_ranks = [None] * WORLD
            dist.all_gather_object(tp_ranks, ps.get_tensor_model_parallel_rank())
            out["pairing"][layout] = sorted({tp_ranks[g] for g in peers}), len(peers)
            out["runs"][(layout, sp, method)] = {
                "losses": [r.loss for r in results], "loss_tokens": [r.loss_tokens for r in results],
                "real_tokens": [r.real_tokens for r in results],
                "padded_tokens": [r.padded_tokens for r in results]}
            ps.destroy_model_parallel()
        out["digests"] = list(seen)
    finally:
        dynapipe_step.check_tp_plans_agree = real_check
        destroy()
    return out


@pytest.fixture(scope="module")
def ranks():
    return spawn(tp_job, WORLD, timeout_s=400)


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("sp", list(SP))
def test_dynapipe_loss_equals_padding_under_tp(ranks, layout, sp):
    runs = ranks[0]["runs"]
    for r in ranks[1:]:  # every rank reports the same global figures
        assert r["runs"] == runs
    dyn, pad = runs[(layout, sp, "dynapipe")], runs[(layout, sp, "padding")]
    assert len(dyn["losses"]) == 2
    assert dyn["losses"] == pytest.approx(pad["losses"], abs=1e-5, rel=1e-5)
    # The same samples, counted once (not once per TP rank); DynaPipe computes fewer pad tokens.
    assert dyn["real_tokens"] == pad["real_tokens"] and dyn["loss_tokens"] == pad["loss_tokens"]
    assert sum(dyn["padded_tokens"]) < sum(pad["padded_tokens"])
    # Sequence parallelism and the layout change the split, not the model: the same losses.
    ref = runs[("tp2xpp2", "", "padding")]["losses"]
    assert dyn["losses"] == pytest.approx(ref, abs=1e-5, rel=1e-5)


@pytest.mark.parametrize("sp", list(SP))
def test_zero_bubble_loss_equals_padding_under_tp(ranks, sp):
    runs = ranks[0]["runs"]
    zb, pad = runs[("tp2xpp2", sp, "zb-h1")], runs[("tp2xpp2", sp, "padding")]
    assert len(zb["losses"]) == 2
    assert zb["losses"] == pytest.approx(pad["losses"], abs=1e-5, rel=1e-5)
    assert zb["loss_tokens"] == pad["loss_tokens"]


def test_transfers_pair_matching_tp_ranks(ranks):
    for r in ranks:
        tp_ranks, size = r["pairing"]["tp2xpp2"]
        assert size == 2 and len(tp_ranks) == 1  # both stages of this rank's pipeline: one TP rank
        assert r["pairing"]["tp2xdp2"][1] == 1


def test_tp_ranks_of_a_stage_receive_equal_payloads(ranks):
    # Every DynaPipe iteration compared real payload digests: equal within a stage's TP pair,
    # different between the stages of a pipeline (different plans and tensors).
    by_rank = [r["digests"] for r in ranks]
    assert all(len(d) == 6 * 2 for d in by_rank)  # 6 DynaPipe runs (2 on zb-h1) x 2 iterations
    for i in range(12):
        rows = [d[i] for d in by_rank]
        digests = {(dp, pp, tp): dg for _, dg, tp, pp, dp in rows}
        assert len(digests) == 4 and all(digests.values())
        for dp, pp, _ in digests:
            assert digests[(dp, pp, 0)] == digests[(dp, pp, 1)]
        # Another stage (TP2 x PP2, the first runs) or replica (TP2 x DP2) has another payload.
        other = (0, 1, 0) if i < 8 else (1, 0, 0)
        assert digests[(0, 0, 0)] != digests[other]


def test_tp_payload_mismatch_stops_every_rank_with_one_line(ranks):
    lines = [r["mismatch"] for r in ranks]
    assert all(line is not None for line in lines)
    assert len(set(lines)) == 1, lines
    assert lines[0].startswith("PlanError: iteration 3: the tensor-parallel ranks [0, 1] received different plans")
    assert "\n" not in lines[0]
