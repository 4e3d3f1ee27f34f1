"""Megatron-LM's logging and weight-decay flags.

Parsed and refused as Megatron-LM validates them; the weight decay moves from
``--start-weight-decay`` to ``--end-weight-decay`` as Megatron-LM's scheduler moves it; and a
one-rank run writes the TensorBoard scalars Megatron-LM writes for ``--log-params-norm``,
``--log-num-zeros-in-grad``, ``--log-timers-to-tensorboard`` and
``--log-validation-ppl-to-tensorboard`` at ``--tensorboard-log-interval``, read back with
TensorBoard's own event reader. (Params norm and zero counts across pipeline splits:
``tests/test_megatron_baselines.py``.)
"""
import math
from types import SimpleNamespace

import pytest

from dynapipe.errors import DynaPipeError
from megatron_integration.arguments import parse_training_args
from megatron_integration.launch import spawn

TINY = ("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --ffn-hidden-size 128 --seq-length 128 "
        "--vocab-size 256 --micro-batch-size 2 --global-batch-size 8 --lr 1e-3 --mock-data --hidden-dropout 0 "
        "--attention-dropout 0 --seed 7")


def parse(extra: str):
    return parse_training_args(f"{TINY} --train-iters 4 {extra}".split(), 1, cuda=False)


@pytest.mark.parametrize("extra, needle", [
    ("--start-weight-decay 0.1", "--start-weight-decay with --weight-decay-incr-style constant"),
    ("--weight-decay-incr-style linear --start-weight-decay 0", "needs --start-weight-decay and --end-weight-decay"),
    ("--weight-decay 0.3 --weight-decay-incr-style linear --start-weight-decay 0 --end-weight-decay 0.1",
     "--weight-decay 0.3 is not used under --weight-decay-incr-style linear"),
    ("--weight-decay-incr-style cosine --start-weight-decay -1 --end-weight-decay 0", "--start-weight-decay -1"),
    ("--bf16 --grad-reduce-in-bf16 --accumulate-allreduce-grads-in-fp32", "were both given"),
    ("--timing-log-level 1", "--dynapipe-trace-dir"),
    ("--log-timers-to-tensorboard", "add --tensorboard-dir"),
    ("--tensorboard-dir /tmp/tb --tensorboard-log-interval 0", "--tensorboard-log-interval 0: must be positive"),
])
def test_bad_values_are_refused_with_the_fix(extra, needle):
    with pytest.raises(DynaPipeError, match=needle):
        parse(extra)


@pytest.mark.parametrize("flag, words", [("--log-progress", "progress.txt"), ("--use-torch-fsdp2", "DDP"),
                                         ("--log-memory-to-tensorboard", "activation peak")])
def test_flags_not_built_are_refused_in_one_line(flag, words, capsys):
    with pytest.raises(SystemExit):
        parse(flag)
    err = capsys.readouterr().err.strip()
    assert flag in err and words in err and err.count("\n") == 0


def test_accepted_flags_reach_the_configs():
    cfg = parse("--tensorboard-dir /tmp/tb --tensorboard-log-interval 2 --tensorboard-queue-size 10 "
                "--log-timers-to-tensorboard --log-validation-ppl-to-tensorboard --log-params-norm "
                "--log-num-zeros-in-grad --timing-log-option max --attention-softmax-in-fp32 "
                "--accumulate-allreduce-grads-in-fp32 --no-masked-softmax-fusion --no-bias-gelu-fusion "
                "--no-bias-dropout-fusion --no-gradient-accumulation-fusion --no-persist-layer-norm --no-rope-fusion "
                "--weight-decay-incr-style linear --start-weight-decay 0 --end-weight-decay 0.1")
    tb = cfg.tensorboard
    assert (tb.log_interval, tb.queue_size, tb.log_timers, tb.log_validation_ppl) == (2, 10, True, True)
    assert cfg.log_params_norm and cfg.optimizer.log_num_zeros_in_grad
    assert tb.log_loss_scale and not tb.log_world_size
    assert not parse("--tensorboard-dir /tmp/tb --no-log-loss-scale-to-tensorboard").tensorboard.log_loss_scale
    assert cfg.optimizer.weight_decay_range == (0.0, 0.1) and cfg.optimizer.weight_decay_incr_style == "linear"
    assert parse("").optimizer.weight_decay_range == (0.01, 0.01)
    from megatron_integration.optimizer import optimizer_config

    assert optimizer_config(cfg).log_num_zeros_in_grad


def _weight_decays(argv: list) -> list:
    """Every optimizer group's (wd_mult, weight decay) after 0, 1, ... --train-iters scheduler steps
    of a one-rank GPT stage."""
    from megatron_integration.initialize import initialize_megatron
    from megatron_integration.model import build_stage
    from megatron_integration.optimizer import build_optimizer

    cfg = parse_training_args(argv, 1)
    info = initialize_megatron(cfg.parallel, cfg.seed)
    optimizer, scheduler = build_optimizer(cfg, build_stage(cfg, info))
    out = []
    for _ in range(cfg.train_iters + 1):
        out.append([(g.get("wd_mult", 1.0), g["weight_decay"]) for g in optimizer.param_groups])
        scheduler.step(increment=1)
    return out


@pytest.mark.parametrize("style", ["linear", "cosine"])
def test_weight_decay_moves_from_start_to_end_as_megatron_schedules_it(style):
    argv = f"{TINY} --train-iters 4 --weight-decay-incr-style {style} --start-weight-decay 0.02 --end-weight-decay 0.1"
    steps = spawn(_weight_decays, 1, (argv.split(),), timeout_s=120)[0]
    for k, groups in enumerate(steps):
        ratio = k / 4
        coeff = ratio if style == "linear" else 0.5 * (math.cos(math.pi * (1 - ratio)) + 1.0)
        want = 0.02 + coeff * (0.1 - 0.02)
        assert any(m == 1.0 for m, _ in groups) and any(m == 0.0 for m, _ in groups)
        for mult, wd in groups:  # biases and norms (wd_mult 0) never decay
            assert wd == pytest.approx(want * mult, abs=1e-12), (k, groups)


def _tensorboard_run(argv: list, tb_dir: str) -> dict:
    """Train on one rank, then read the TensorBoard events back: {tag: [(step, value), ...]}."""
    import io

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from megatron_integration.training import pretrain

    run = pretrain(parse_training_args(argv, 1), stream=io.StringIO())
    events = EventAccumulator(tb_dir)
    events.Reload()
    scalars = {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}
    return {"scalars": scalars, "params_norm": [r.params_norm for r in run.results],
            "num_zeros": [r.num_zeros_in_grad for r in run.results], "eval_lines": run.eval_lines}


def test_tensorboard_gets_megatrons_scalars_at_its_interval(tmp_path):
    pytest.importorskip("tensorboard")
    tb = str(tmp_path / "tb")
    argv = (f"{TINY} --train-iters 4 --log-interval 2 --tensorboard-dir {tb} --tensorboard-log-interval 2 "
            f"--log-params-norm --log-num-zeros-in-grad --log-timers-to-tensorboard "
            f"--log-validation-ppl-to-tensorboard --log-world-size-to-tensorboard --split 80,10,10 --eval-interval 2 "
            f"--eval-iters 1").split()
    got = spawn(_tensorboard_run, 1, (argv, tb), timeout_s=180)[0]
    s = got["scalars"]
    # Every --tensorboard-log-interval (2) iterations, not every iteration.
    assert [step for step, _ in s["lm loss"]] == [2, 4]
    assert [v for _, v in s["params-norm"]] == pytest.approx([got["params_norm"][1], got["params_norm"][3]])
    assert [v for _, v in s["num-zeros"]] == [got["num_zeros"][1], got["num_zeros"][3]]
    assert s["loss-scale"] == [(2, 1.0), (4, 1.0)] and s["world-size"] == [(2, 1.0), (4, 1.0)]  # fp32, one rank
    # The measured time split of megatron-core's schedule, in ms.
    for tag in ("forward-time (ms)", "backward-time (ms)", "optimizer-time (ms)"):
        assert [step for step, _ in s[tag]] == [2, 4] and all(v > 0 for _, v in s[tag]), tag
    # Validation after iterations 2 and 4, with its perplexity; then, as Megatron-LM writes them under
    # the same tags, the final validation and test sets at iteration 4; each by consumed samples too.
    losses, ppls = s["lm loss validation"], s["lm loss validation ppl"]
    assert [step for step, _ in ppls] == [2, 4, 4, 4]
    assert all(p == pytest.approx(math.exp(v), rel=1e-5) for (_, v), (_, p) in zip(losses, ppls))
    assert [step for step, _ in s["lm loss validation vs samples"]] == [16, 32, 32, 32]  # global batch 8
    assert [v for _, v in s["lm loss validation ppl vs samples"]] == [v for _, v in ppls]


def test_logging_level_sets_the_root_logger_with_a_handler_as_megatron_lm():
    import logging

    from megatron_integration.initialize import set_logging_level

    assert parse("").logging_level is None
    assert parse("--logging-level 20").logging_level == 20
    with pytest.raises(DynaPipeError, match="--logging-level -1: must be non-negative"):
        parse("--logging-level -1")
    root = logging.getLogger()
    level, handlers = root.level, list(root.handlers)
    try:
        root.handlers = []
        set_logging_level(None)
        assert root.handlers == [] and root.level == level
        set_logging_level(10)
        assert root.level == 10 and root.handlers, "records at DEBUG and above need a handler to be printed"
    finally:
        root.handlers = handlers
        root.setLevel(level)


def test_disable_bf16_reduced_precision_matmul_reaches_megatron_cores_config():
    import torch

    from megatron_integration.model import transformer_config

    cfg = parse("--bf16 --disable-bf16-reduced-precision-matmul")
    assert cfg.model.disable_bf16_reduced_precision_matmul
    before = torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction
    try:
        tc = transformer_config(cfg.model, cfg.parallel, cuda=False)
        assert tc.disable_bf16_reduced_precision_matmul is True
        # What megatron-core does with it when it builds the config (a CUDA setting; settable anywhere).
        assert torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction is False
    finally:
        torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = before
    assert not transformer_config(parse("--bf16").model, cfg.parallel, cuda=False).disable_bf16_reduced_precision_matmul
    with pytest.raises(DynaPipeError, match="applies to bf16 matmuls; add --bf16 or drop it"):
        parse("--disable-bf16-reduced-precision-matmul")


def test_override_opt_param_scheduler_resumes_the_schedule_at_the_iterations_done():
    # The saved step count leaves out iterations an fp16 overflow skipped; Megatron-LM's override
    # sets it to the data consumed, so the new schedule does not start behind the data.
    import torch
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    from megatron_integration.checkpoint_formats import override_group_lrs

    def scheduler(max_lr):
        opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=max_lr)
        return opt, OptimizerParamScheduler(opt, init_lr=max_lr, max_lr=max_lr, min_lr=0.0, lr_warmup_steps=0,
                                            lr_decay_steps=10, lr_decay_style="linear", start_wd=0.0, end_wd=0.0,
                                            wd_incr_steps=10, wd_incr_style="constant",
                                            override_opt_param_scheduler=True,
                                            use_checkpoint_opt_param_scheduler=False)

    opt, sched = scheduler(1.0)
    sched.step(increment=5)  # saved after 8 iterations, 3 of them skipped
    override_group_lrs(opt, sched, SimpleNamespace(lr=2.0, min_lr=0.0, decoupled_lr=None, decoupled_min_lr=None), 8)
    ref_opt, ref = scheduler(2.0)
    ref.step(increment=8)
    assert sched.num_steps == 8 and opt.param_groups[0]["lr"] == pytest.approx(ref_opt.param_groups[0]["lr"])
    assert opt.param_groups[0]["lr"] == pytest.approx(0.4)
