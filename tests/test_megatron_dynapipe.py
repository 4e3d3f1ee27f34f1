"""DynaPipe through megatron-core: same losses as megatron's own padding 1F1B, and resumable.

Same model, seed and global batches; DynaPipe plans variable-shape micro-batches, the
executor runs them on the megatron-core stages; the per-iteration ``lm loss`` equals the
padding baseline's (fp32, ~1e-5) on PP2 and on PP2 x DP2, the latter with a Llama-style
model (SwiGLU, grouped-query attention, no linear biases, RMSNorm, RoPE base 500000 with Llama
3.x's frequency scaling, untied output layer) that the planner prices as built, and on PP2 with
Qwen3's layer (the same plus a QKV bias and per-head query/key norms); on PP2 so do the validation and test
losses (forward-only plans vs megatron-core's forward-only schedule); in bf16 and fp16 within
their rounding.
"""
import math
import os

import pytest

from megatron_integration.jobs import run_trainings

TINY = ("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --ffn-hidden-size 128 --seq-length 256 "
        "--vocab-size 256 --micro-batch-size 2 --global-batch-size 8 --train-iters 3 --lr 1e-2 --mock-data "
        "--hidden-dropout 0 --attention-dropout 0 --log-interval 1 --seed 7 --pipeline-model-parallel-size 2")
TIMEOUT = 300


# Runs by command line, shared by the test modules that need the same run (the PP2 padding
# baseline), and trained together: the suite's time budget is mostly process start-up, so the
# first test that needs a run of ``world`` ranks starts one job that trains, one after the other,
# every run of that world size the collected tests declare with ``@pytest.mark.megatron_runs``.
# A job that fails fails every test of its runs with its error (kept, not retried). ``{tmp}`` in
# a run's flags stands for the session's temporary directory (known before any test runs).
_RUNS: dict = {}


def _key(extra: str, world: int) -> tuple:
    return " ".join(extra.split()), world


def _argv(extra: str, tmp: str) -> list[str]:
    # A broken DynaPipe run fails in a minute, not at the default timeout (the baselines, on
    # megatron-core's schedules, refuse the executor's flag).
    timeout = " --dynapipe-timeout-s 60" if "--use-dynapipe" in extra else ""
    return (TINY + timeout + " " + extra.replace("{tmp}", tmp)).split()


def run(extra: str, world: int, request) -> dict:
    """Rank 0's summary of one training job of TINY + ``extra`` on ``world`` ranks (cached);
    ``request``: the calling test's, to find the other runs its job can train."""
    key = _key(extra, world)
    if key not in _RUNS:
        batch = [key]
        for item in request.session.items:
            for mark in item.iter_markers("megatron_runs"):
                for k in (_key(*a) for a in mark.args):
                    if k[1] == world and k not in _RUNS and k not in batch:
                        batch.append(k)
        tmp = str(request.getfixturevalue("tmp_path_factory").getbasetemp())
        try:
            jobs = run_trainings([_argv(e, tmp) for e, _ in batch], world,
                                 timeout_s=TIMEOUT * len(batch))
        except Exception as e:
            _RUNS.update((k, e) for k in batch)
        else:
            for k, ranks in zip(batch, jobs):
                try:
                    _RUNS[k] = _summary(ranks)
                except AssertionError as e:
                    _RUNS[k] = e
    got = _RUNS[key]
    if isinstance(got, Exception):
        raise got
    return got


def _summary(ranks: list) -> dict:
    for r in ranks[1:]:
        assert r["losses"] == ranks[0]["losses"] and r["eval_lines"] == ranks[0]["eval_lines"]
    return dict(ranks[0], printed_first=ranks[0]["printed"], printed_last=ranks[-1]["printed"])


# Megatron's evaluation: validation after iteration 2, validation and test after training; these
# runs also log Megatron-LM's throughput.
EVAL = "--split 80,10,10 --eval-interval 2 --eval-iters 2 --log-throughput"


def _eval_values(r: dict) -> list[tuple[str, float, float]]:
    """(where, lm loss value, PPL) of each validation line."""
    out = []
    for line in r["eval_lines"][1::3]:
        where, loss, ppl = (p.strip() for p in line.split("|")[:3])
        out.append((where, float(loss.split(":")[1]), float(ppl.split(":")[1])))
    return out


LLAMA = ("--swiglu --disable-bias-linear --group-query-attention --num-query-groups 2 --normalization RMSNorm "
         "--position-embedding-type rope --rotary-base 500000 --use-rope-scaling --untie-embeddings-and-output-weights")


# Qwen3's layer as Megatron-LM's Qwen scripts write it (legacy RoPE spellings included).
QWEN = ("--swiglu --disable-bias-linear --add-qkv-bias --qk-layernorm --group-query-attention --num-query-groups 2 "
        "--normalization RMSNorm --use-rotary-position-embeddings --no-position-embedding --rotary-base 1000000 "
        "--untie-embeddings-and-output-weights --apply-wd-to-qk-layernorm")


@pytest.mark.parametrize("world, model", [
    pytest.param(2, "", marks=pytest.mark.megatron_runs(("", 2), (f"--use-dynapipe {EVAL}", 2), (EVAL, 2))),
    pytest.param(4, LLAMA, marks=pytest.mark.megatron_runs((LLAMA, 4), (f"{LLAMA} --use-dynapipe", 4))),
    pytest.param(2, QWEN, marks=pytest.mark.megatron_runs((QWEN, 2), (f"{QWEN} --use-dynapipe", 2))),
], ids=["pp2", "pp2xdp2-llama", "pp2-qwen"])
def test_dynapipe_loss_equals_padding(world, model, request):
    padding = run(model, world, request)
    # PP2: DynaPipe also evaluates (forward-only plans), and the padding baseline once more with
    # evaluation (megatron-core's forward-only schedule): same training losses, same validation losses.
    evaluated = not model  # the plain PP2 model also evaluates
    dynapipe = run(f"{model} --use-dynapipe" + (" " + EVAL if evaluated else ""), world, request)
    if evaluated:
        padding_eval = run(EVAL, world, request)
        assert padding_eval["losses"] == padding["losses"]  # forward only: training untouched, bit for bit
        # 2 batches at iteration 2, then 2 of validation and 2 of test: all through forward-only plans.
        assert (dynapipe["eval_path"], padding_eval["eval_path"]) == ("dynapipe-plans:6", "megatron-forward-only")
        mine, ref = _eval_values(dynapipe), _eval_values(padding_eval)
        assert [w for w, _, _ in ref] == ["validation loss at iteration 2",
                                          "validation loss at iteration 3 on validation set",
                                          "validation loss at iteration 3 on test set"]
        assert [w for w, _, _ in mine] == [w for w, _, _ in ref]
        assert [v for _, v, _ in mine] == pytest.approx([v for _, v, _ in ref], abs=1e-5, rel=1e-5)
        assert all(ppl == pytest.approx(math.exp(v), rel=1e-6) for _, v, ppl in ref)
        assert ref[0][1] != ref[1][1]  # the second validation read the next batches of the stream
        # Printed by the last stage only, between rules of dashes, as Megatron-LM prints them.
        assert "validation loss at iteration 2 |" in dynapipe["printed_last"]
        assert "validation loss" not in dynapipe["printed_first"]
        assert set(padding_eval["eval_lines"][0]) == {"-"} and len(padding_eval["eval_lines"][0]) == \
            len(padding_eval["eval_lines"][1]) + 1
        _check_throughput(dynapipe, padding_eval)
    assert dynapipe["method"] == "dynapipe" and padding["method"] == "padding"
    assert len(dynapipe["losses"]) == 3
    assert dynapipe["losses"] == pytest.approx(padding["losses"], abs=1e-5, rel=1e-5)
    # Same samples: same real and loss tokens; DynaPipe computes far fewer padded tokens.
    assert dynapipe["real_tokens"] == padding["real_tokens"]
    assert dynapipe["loss_tokens"] == padding["loss_tokens"]
    assert sum(dynapipe["padded_tokens"]) < 0.9 * sum(padding["padded_tokens"])


@pytest.mark.megatron_runs(("", 2), ("--deterministic-mode", 2), ("--deterministic-mode --use-dynapipe", 2))
def test_deterministic_mode_trains_the_same_losses(request):
    """Megatron-LM's --deterministic-mode (torch's deterministic algorithms on, which a CPU op
    without one would refuse) trains the same losses on padding and DynaPipe (1e-5: torch's
    deterministic CPU kernels round differently, about 1e-7 here)."""
    plain = run("", 2, request)["losses"]
    for extra in ("--deterministic-mode", "--deterministic-mode --use-dynapipe"):
        assert run(extra, 2, request)["losses"] == pytest.approx(plain, abs=1e-5, rel=1e-5), extra


def _logged(line: str, field: str) -> float:
    return float(line.split(field + ":")[1].split("|")[0])


def _check_throughput(dynapipe: dict, padding: dict) -> None:
    """--log-throughput: each log line's TFLOP/s are the model FLOPs of its iteration (executed
    shapes; the samples' own) over its time and the 2 ranks; padding executes every sample at
    --seq-length, DynaPipe less, and both hold the same samples."""
    from dynapipe.cost.model_flops import model_flops, rows_work
    from megatron_integration.arguments import parse_training_args

    model = parse_training_args(TINY.split(), 2, cuda=False).model.to_model_config()
    for r in (dynapipe, padding):
        assert len(r["log_lines"]) == 3
        for line, executed, real in zip(r["log_lines"], r["executed_work"], r["real_work"]):
            seconds = _logged(line, "elapsed time per iteration (ms)") / 1e3
            for field, work in (("throughput per GPU (TFLOP/s/GPU)", executed),
                                ("real-token throughput per GPU (TFLOP/s/GPU)", real)):
                assert _logged(line, " " + field) == pytest.approx(model_flops(model, work) / (seconds * 2e12),
                                                                   rel=0.01), (field, line)
    assert padding["executed_work"] == [rows_work(8, 256)] * 3
    assert dynapipe["real_work"] == padding["real_work"]
    assert [w.tokens for w in padding["real_work"]] == padding["real_tokens"]
    assert all(model_flops(model, d) < 0.9 * model_flops(model, p)
               for d, p in zip(dynapipe["executed_work"], padding["executed_work"]))
    assert all(model_flops(model, r) <= model_flops(model, d)
               for r, d in zip(dynapipe["real_work"], dynapipe["executed_work"]))


@pytest.mark.megatron_runs(("", 2), ("--bf16", 2), ("--bf16 --use-dynapipe --loss-scale 1024", 2), ("--fp16", 2),
                           ("--fp16 --use-dynapipe", 2), ("--fp16 --loss-scale 65536", 2))
def test_half_precision_dynapipe_trains_like_padding(request):
    """bf16 and fp16 (megatron-core's Float16Module and fp32 main copies, on CPUs too): DynaPipe's
    losses are the padding baseline's within the rounding of other micro-batch shapes; fp16's
    loss scale (2**32 at first) overflows, and the same iterations are skipped, not failed. bf16's
    DynaPipe run has a static --loss-scale (a power of two, so the same numbers), as Megatron-LM
    allows."""
    fp32 = run("", 2, request)
    for dtype, scale in (("bf16", " --loss-scale 1024"), ("fp16", "")):
        padding, dynapipe = run(f"--{dtype}", 2, request), run(f"--{dtype} --use-dynapipe{scale}", 2, request)
        scales = {float(line.split("loss scale:")[1].split("|")[0]) for line in dynapipe["log_lines"]}
        assert scales == {1024.0} if scale else scales != {1.0}, (dtype, scales)
        assert padding["losses"] != fp32["losses"]  # half-precision weights and activations, not fp32's numbers
        # fp16 skips overflowing steps, so only its first loss (the initial weights) is fp32's.
        same = 3 if dtype == "bf16" else 1
        assert padding["losses"][:same] == pytest.approx(fp32["losses"][:same], rel=5e-3), dtype
        assert dynapipe["losses"] == pytest.approx(padding["losses"], rel=5e-4), dtype
        assert dynapipe["loss_tokens"] == padding["loss_tokens"] and dynapipe["real_tokens"] == padding["real_tokens"]
        assert sum(dynapipe["padded_tokens"]) < 0.9 * sum(padding["padded_tokens"])
        skipped = [[int(line.split("number of skipped iterations:")[1].split("|")[0]) for line in r["log_lines"]]
                   for r in (padding, dynapipe)]
        assert skipped[0] == skipped[1] and len(skipped[0]) == 3
        assert (sum(skipped[0]) >= 1) == (dtype == "fp16"), (dtype, skipped)
    # The baseline's loss is averaged before fp16's scale multiplies it, as the executor's is (and
    # Megatron-LM's): a scale Megatron-LM trains at does not overflow a sum of token losses.
    static = run("--fp16 --loss-scale 65536", 2, request)
    assert static["losses"] == pytest.approx(fp32["losses"], rel=5e-3)
    assert all("number of skipped iterations:   0 |" in line for line in static["log_lines"]), static["log_lines"]


RESUME = "--use-dynapipe --train-iters 4"
# The uninterrupted run trains in the PP2 job, saving under the session's temporary directory.
RESUME_FULL = f"{RESUME} --save {{tmp}}/dynapipe-resume --save-interval 2"


@pytest.mark.megatron_runs((RESUME_FULL, 2))
def test_dynapipe_resume_continues_identically(request, tmp_path_factory):
    save = str(tmp_path_factory.getbasetemp() / "dynapipe-resume")
    # The uninterrupted run also saves after iteration 2; the resumed one starts from that
    # checkpoint (the tracker file pointed back at it, as when the job had been stopped there:
    # test_megatron_flags.py stops a run with --exit-interval).
    full = run(RESUME_FULL, 2, request)
    assert sorted(os.listdir(save)) == ["iter_0000002", "iter_0000004", "latest_checkpointed_iteration.txt"]
    with open(os.path.join(save, "latest_checkpointed_iteration.txt"), "w") as f:
        f.write("2")
    resumed = run(f"{RESUME} --load {save}", 2, request)
    assert resumed["start_iteration"] == 2
    assert resumed["losses"] == pytest.approx(full["losses"][2:], abs=1e-6, rel=1e-6)
