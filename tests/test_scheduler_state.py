"""Resuming with another learning-rate schedule: refused as Megatron-LM refuses it, unless a flag says
which schedule wins (megatron-core's OptimizerParamScheduler, this project's one-line error)."""
import pytest
import torch

from dynapipe.errors import DynaPipeError
from megatron_integration.arguments import parse_training_args
from megatron_integration.scheduler_state import load_scheduler_state

BASE = ("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 128 --micro-batch-size 2 "
        "--global-batch-size 8 --lr 1e-3 --mock-data")


def _scheduler(decay_steps: int, **flags):
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=1e-3)
    return OptimizerParamScheduler(opt, init_lr=0.0, max_lr=1e-3, min_lr=1e-4, lr_warmup_steps=0,
                                   lr_decay_steps=decay_steps, lr_decay_style="linear", start_wd=0.01, end_wd=0.01,
                                   wd_incr_steps=decay_steps, wd_incr_style="constant", **flags)


def test_a_different_schedule_is_refused_unless_a_flag_picks_one():
    stepped = _scheduler(10)
    for _ in range(3):
        stepped.step(increment=1)
    saved = stepped.state_dict()
    with pytest.raises(DynaPipeError, match=r"ckpt/iter_0000002: the checkpoint's learning-rate schedule differs "
                                            r".*20 and checkpoint value 10.*--override-opt_param-scheduler"):
        load_scheduler_state(_scheduler(20, override_opt_param_scheduler=False,
                                        use_checkpoint_opt_param_scheduler=False), saved, "ckpt/iter_0000002")
    same = _scheduler(10, override_opt_param_scheduler=False, use_checkpoint_opt_param_scheduler=False)
    load_scheduler_state(same, saved, "ckpt")  # the same schedule loads
    # Either flag still resumes the checkpoint's position in the schedule.
    ours = _scheduler(20, override_opt_param_scheduler=True, use_checkpoint_opt_param_scheduler=False)
    load_scheduler_state(ours, saved, "ckpt")
    assert (ours.lr_decay_steps, ours.num_steps) == (20, 3)
    theirs = _scheduler(20, override_opt_param_scheduler=False, use_checkpoint_opt_param_scheduler=True)
    load_scheduler_state(theirs, saved, "ckpt")
    assert (theirs.lr_decay_steps, theirs.num_steps) == (10, 3)


def test_scheduler_flags_reach_the_optimizer_config(tmp_path):
    o = parse_training_args(f"{BASE} --train-iters 4".split(), 1).optimizer
    assert (o.override_scheduler, o.use_checkpoint_scheduler) == (False, False)  # Megatron-LM's defaults
    o = parse_training_args(f"{BASE} --train-iters 4 --load {tmp_path} --override-opt_param-scheduler".split(),
                            1).optimizer
    assert o.override_scheduler and not o.use_checkpoint_scheduler
    with pytest.raises(DynaPipeError, match="contradict each other"):
        parse_training_args(f"{BASE} --train-iters 4 --override-opt_param-scheduler "
                            f"--use-checkpoint-opt_param-scheduler".split(), 1)


def _megatron_lm_scheduler(warmup: float, decay: float, gbs: int):
    """The scheduler Megatron-LM's training.py builds for a run of global batch ``gbs``: steps in samples."""
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=1e-3)
    return OptimizerParamScheduler(opt, init_lr=0.0, max_lr=1e-3, min_lr=1e-4, lr_warmup_steps=warmup * gbs,
                                   lr_decay_steps=decay * gbs, lr_decay_style="cosine", start_wd=0.01, end_wd=0.01,
                                   wd_incr_steps=decay * gbs, wd_incr_style="constant",
                                   override_opt_param_scheduler=False, use_checkpoint_opt_param_scheduler=False)


def test_checkpoints_hold_megatron_lms_units_and_either_side_resumes_the_others_schedule():
    from megatron_integration.scheduler_state import in_samples

    gbs = 8
    ours = _megatron_lm_scheduler(2.5, 10, 1)  # this project's: one step an iteration
    theirs = _megatron_lm_scheduler(2.5, 10, gbs)
    for _ in range(4):
        ours.step(increment=1)
        theirs.step(increment=gbs)
    # What a torch_dist checkpoint records is Megatron-LM's state...
    assert in_samples(ours.state_dict(), gbs) == theirs.state_dict()
    # ...and Megatron-LM's state (its step count is the consumed samples) resumes here with the
    # same learning rate from then on, under the refusal of any real difference.
    resumed = _megatron_lm_scheduler(2.5, 10, 1)
    load_scheduler_state(resumed, theirs.state_dict(), "ckpt", iteration=4, consumed_samples=4 * gbs)
    for _ in range(5):
        resumed.step(increment=1)
        theirs.step(increment=gbs)
        assert resumed.get_lr(resumed.optimizer.param_groups[0]) == pytest.approx(
            theirs.get_lr(theirs.optimizer.param_groups[0]), rel=1e-12)
    with pytest.raises(DynaPipeError, match="schedule differs"):
        load_scheduler_state(_megatron_lm_scheduler(2.5, 12, 1), _megatron_lm_scheduler(2.5, 10, gbs).state_dict()
                             | {"num_steps": 4 * gbs}, "ckpt", iteration=4, consumed_samples=4 * gbs)
    # A state in iterations (this project's dynapipe format, older torch_dist ones) loads as it is.
    again = _megatron_lm_scheduler(2.5, 10, 1)
    load_scheduler_state(again, ours.state_dict(), "ckpt", iteration=4, consumed_samples=4 * gbs)
    assert again.num_steps == 4


def test_a_checkpoint_after_a_global_batch_change_resumes_at_its_steps():
    # A checkpoint whose 4 steps at 8 a batch (32 samples) are not its consumed samples (24, an
    # earlier part at 4 a batch): recorded as samples, read back by the batch it was saved with,
    # not by the mean batch the consumed samples would suggest.
    from megatron_integration.scheduler_state import in_samples

    ours = _megatron_lm_scheduler(1, 6, 1)
    for _ in range(4):
        ours.step(increment=1)
    saved = in_samples(ours.state_dict(), 8)
    assert (saved["num_steps"], saved["lr_decay_steps"], saved["lr_warmup_steps"]) == (32, 48, 8)
    resumed = _megatron_lm_scheduler(1, 6, 1)
    load_scheduler_state(resumed, saved, "ckpt", iteration=4, consumed_samples=24, samples_per_iteration=8,
                         units="samples")
    assert resumed.num_steps == 4 and resumed.lr_decay_steps == 6
    for _ in range(2):
        resumed.step(increment=1)
        ours.step(increment=1)
        assert resumed.get_lr(resumed.optimizer.param_groups[0]) == ours.get_lr(ours.optimizer.param_groups[0])
    # Divided by the mean batch (24 / 4 = 6 a batch) the bounds would have been 8 iterations.
    with pytest.raises(DynaPipeError, match="schedule differs"):
        load_scheduler_state(_megatron_lm_scheduler(1, 6, 1), saved, "ckpt", iteration=4, consumed_samples=24,
                             units="samples")


def test_iterations_skipped_by_fp16_overflows_are_not_scheduler_steps_either_side():
    # 10 iterations of 8 samples, 3 skipped (loss-scale overflows): 7 steps. Megatron-LM steps its
    # scheduler only on a successful update too, so its count is 56 samples, not the 80 consumed.
    from megatron_integration.scheduler_state import in_samples

    ours = _megatron_lm_scheduler(2, 20, 1)
    theirs = _megatron_lm_scheduler(2, 20, 8)
    for _ in range(7):
        ours.step(increment=1)
        theirs.step(increment=8)
    assert in_samples(ours.state_dict(), 8) == theirs.state_dict()
    # Read back (in samples, as recorded, and as Megatron-LM's own checkpoints are read): 7 steps,
    # so the next iteration's rate is the one after 7 steps, not after 10.
    resumed = _megatron_lm_scheduler(2, 20, 1)
    load_scheduler_state(resumed, theirs.state_dict(), "ckpt", iteration=10, consumed_samples=80,
                         samples_per_iteration=8, units="samples")
    assert resumed.num_steps == 7
    assert resumed.get_lr(resumed.optimizer.param_groups[0]) == ours.get_lr(ours.optimizer.param_groups[0])
    # A checkpoint whose units are recorded as iterations (token-budget batches) is read as it is.
    kept = _megatron_lm_scheduler(2, 20, 1)
    load_scheduler_state(kept, ours.state_dict(), "ckpt", iteration=10, consumed_samples=80, units="iterations")
    assert kept.num_steps == 7


def test_a_checkpoint_says_its_scheduler_units_or_they_are_megatron_lms():
    from types import SimpleNamespace

    from megatron_integration.checkpoint_compat import scheduler_units

    assert scheduler_units(SimpleNamespace(dynapipe_scheduler_units="iterations", dynapipe_batching="x")) == "iterations"
    assert scheduler_units(SimpleNamespace(num_layers=2, consumed_train_samples=8)) == "samples"  # Megatron-LM's
    assert scheduler_units(SimpleNamespace(num_layers=2, dynapipe_batching="padding")) is None  # an older build's


def test_warmup_fraction_is_not_rounded():
    o = parse_training_args(f"{BASE} --train-iters 10 --lr-warmup-fraction 0.25".split(), 1).optimizer
    assert o.lr_warmup_iters == 2.5  # Megatron-LM: 0.25 x 10 iterations' samples, unrounded


def test_warmup_starts_from_lr_warmup_init_as_in_megatron_lm():
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    from megatron_integration.optimizer import scheduler_arguments

    cfg = parse_training_args(f"{BASE} --train-iters 10 --lr-warmup-iters 4 --lr-warmup-init 2e-4".split(), 1)
    assert cfg.optimizer.lr_warmup_init == 2e-4
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=1e-3)
    sched = OptimizerParamScheduler(opt, **scheduler_arguments(cfg))
    # Megatron-LM's warm-up: init + (max - init) x step / warm-up steps.
    assert sched.get_lr(opt.param_groups[0]) == pytest.approx(2e-4)
    sched.step(2)
    assert sched.get_lr(opt.param_groups[0]) == pytest.approx(2e-4 + (1e-3 - 2e-4) * 2 / 4)
    default = parse_training_args(f"{BASE} --train-iters 10 --lr-warmup-iters 4".split(), 1)
    assert scheduler_arguments(default)["init_lr"] == 0.0
    for bad, needle in (("--lr-warmup-init -0.0001 --lr-warmup-iters 4", "cannot be negative"),
                        ("--lr-warmup-init 0.002 --lr-warmup-iters 4", "exceeds --lr 0.001"),
                        ("--lr-warmup-init 1e-4", "there is none")):
        with pytest.raises(DynaPipeError, match=needle):
            parse_training_args(f"{BASE} --train-iters 10 {bad}".split(), 1)


# Megatron-LM's scheduler arguments for each command line (global batch 8), written from the
# command line's numbers (iterations x 8), not from the parsed config under test.
@pytest.mark.parametrize("flags, warmup, style, wsd, wsd_style", [
    ("--train-iters 20 --lr-decay-style WSD --lr-wsd-decay-iters 6 --lr-warmup-iters 2", 16, "WSD", 48,
     "exponential"),
    ("--train-iters 20 --lr-decay-style WSD --lr-wsd-decay-iters 5 --lr-wsd-decay-style cosine", 0, "WSD", 40,
     "cosine"),
    ("--train-samples 160 --lr-decay-style WSD --lr-wsd-decay-samples 44 --lr-wsd-decay-style minus_sqrt", 0, "WSD",
     44, "minus_sqrt"),
    ("--train-iters 20 --lr-decay-style inverse-square-root --lr-warmup-iters 3", 24, "inverse-square-root", None,
     "exponential"),
])
def test_wsd_and_inverse_square_root_rates_are_megatron_lms(flags, warmup, style, wsd, wsd_style):
    # Megatron-LM's get_optimizer_param_scheduler: steps in samples (global batch 8), stepped by
    # each iteration's samples; this project's steps once an iteration. Same rate every iteration.
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    from megatron_integration.optimizer import scheduler_arguments

    cfg = parse_training_args(f"{BASE} --min-lr 1e-5 {flags}".split(), 1)
    ours = OptimizerParamScheduler(torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=1e-3),
                                   **scheduler_arguments(cfg))
    gbs, decay = 8, 160  # 20 iterations (or 160 samples) of decay and weight-decay increment
    theirs = OptimizerParamScheduler(
        torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=1e-3), init_lr=0.0, max_lr=1e-3, min_lr=1e-5,
        lr_warmup_steps=warmup, lr_decay_steps=decay, lr_decay_style=style, start_wd=0.01, end_wd=0.01,
        wd_incr_steps=decay, wd_incr_style="constant", wsd_decay_steps=wsd, lr_wsd_decay_style=wsd_style)
    for _ in range(20):
        ours.step(increment=1)
        theirs.step(increment=gbs)
        assert ours.get_lr(ours.optimizer.param_groups[0]) == pytest.approx(
            theirs.get_lr(theirs.optimizer.param_groups[0]), rel=1e-12, abs=1e-15)


def test_wsd_and_inverse_square_root_flags_are_refused_where_they_would_be_dropped():
    for bad, needle in (
            ("--train-iters 20 --lr-decay-style WSD", "needs the length of its final anneal"),
            ("--train-iters 20 --lr-wsd-decay-iters 4", "--lr-wsd-decay-iters shapes the anneal of --lr-decay-style WSD"),
            ("--train-iters 20 --lr-wsd-decay-style cosine", "add --lr-decay-style WSD or drop"),
            ("--train-iters 20 --lr-decay-style WSD --lr-wsd-decay-iters 30", "longer than the decay span"),
            ("--train-iters 20 --lr-decay-style WSD --lr-wsd-decay-samples 40", "needs --train-samples"),
            ("--train-iters 20 --lr-decay-style inverse-square-root", "needs a warm-up")):
        with pytest.raises(DynaPipeError, match=needle):
            parse_training_args(f"{BASE} {bad}".split(), 1)


# megatron-core 0.19's identifier of a parameter group: its schedule bounds are part of it.
CORE_019_KEYS = ("end_wd", "max_lr", "min_lr", "optimizer", "start_wd", "wd_mult", "lr_mult", "is_expert_parallel",
                 "is_decoupled_lr")


def _groups(max_lr: float, decoupled_lr: float) -> list:
    common = dict(end_wd=None, min_lr=0.0, optimizer=None, start_wd=None, lr_mult=1.0, is_expert_parallel=False)
    return [dict(common, params=[0, 1], max_lr=max_lr, wd_mult=1.0, is_decoupled_lr=False),
            dict(common, params=[2], max_lr=max_lr, wd_mult=0.0, is_decoupled_lr=False),
            dict(common, params=[3], max_lr=decoupled_lr, wd_mult=1.0, is_decoupled_lr=True)]


@pytest.mark.parametrize("keep_checkpoint", [False, True])
def test_saved_groups_pair_with_this_runs_under_another_rate(monkeypatch, keep_checkpoint):
    # A resume under another --lr: megatron-core 0.19 pairs groups by their bounds too and finds none
    # (emulated here on whichever release is installed, with 0.19's identifier).
    from types import SimpleNamespace

    from megatron.core.optimizer import optimizer as core
    from megatron_integration.scheduler_state import align_schedule_bounds

    monkeypatch.setattr(core, "param_group_identifier_keys", CORE_019_KEYS)
    reorder = core.MegatronOptimizer._filter_and_reorder_param_groups
    with pytest.raises(ValueError, match="Could not find parameter group"):
        reorder(_groups(0.0, 0.5), _groups(0.01, 0.02))
    for mixed_precision in (False, True):
        saved = {"param_groups": _groups(0.01, 0.02), "state": {}}
        state = {"optimizer": saved, "grad_scaler": None} if mixed_precision else saved
        run = SimpleNamespace(param_groups=_groups(0.0, 0.5))
        align_schedule_bounds(state, run, keep_checkpoint)
        paired = reorder(run.param_groups, saved["param_groups"])
        want = (0.01, 0.01, 0.02) if keep_checkpoint else (0.0, 0.0, 0.5)
        assert tuple(g["max_lr"] for g in paired) == want
        assert [g["wd_mult"] for g in paired] == [1.0, 0.0, 1.0]  # each still its own group


def test_saved_groups_told_apart_only_by_their_bounds_are_left_alone():
    # Given one set of bounds, two such groups would merge in megatron-core's pairing.
    from types import SimpleNamespace

    from megatron_integration.scheduler_state import align_schedule_bounds

    saved = {"param_groups": _groups(0.01, 0.02)[:1] + [dict(_groups(0.03, 0.02)[0], params=[9])]}
    align_schedule_bounds(saved, SimpleNamespace(param_groups=_groups(0.0, 0.5)), False)
    assert [g["max_lr"] for g in saved["param_groups"]] == [0.01, 0.03]


def test_a_checkpoint_whose_decoupled_group_was_not_flagged_pairs_by_position():
    # Saved before the --decoupled-lr groups were flagged: two saved groups of one identity.
    from types import SimpleNamespace

    from megatron.core.optimizer.optimizer import MegatronOptimizer
    from megatron_integration.scheduler_state import align_schedule_bounds

    unflagged = [dict(g, is_decoupled_lr=False) for g in _groups(0.01, 0.02)]
    unflagged[2]["params"] = [3, 4]  # another size than the ordinary weights' group
    saved = {"param_groups": unflagged}
    run = SimpleNamespace(param_groups=_groups(0.01, 0.02))
    run.param_groups[2]["params"] = [3, 4]
    align_schedule_bounds(saved, run, keep_checkpoint=True)
    assert [g["is_decoupled_lr"] for g in saved["param_groups"]] == [False, False, True]
    paired = MegatronOptimizer._filter_and_reorder_param_groups(run.param_groups, saved["param_groups"])
    assert [len(g["params"]) for g in paired] == [2, 1, 2] and paired[2]["max_lr"] == 0.02


def test_a_resume_at_another_global_batch_reads_the_schedule_in_samples_as_megatron_lm():
    # 3 iterations of 8 samples toward 6 (Megatron-LM: 24 of 48 samples). Resumed at 16 a batch,
    # Megatron-LM's schedule is 96 samples: refused without a flag, naming both batches.
    saved = _megatron_lm_scheduler(0, 6, 1)
    for _ in range(3):
        saved.step(increment=1)
    state = saved.state_dict()
    with pytest.raises(DynaPipeError, match=r"schedule differs .*--global-batch-size 16, its own 8, as Megatron-LM "
                                            r"counts the schedule in samples.*--override-opt_param-scheduler"):
        load_scheduler_state(_megatron_lm_scheduler(0, 6, 1), state, "ckpt", checkpoint_batch=8, run_batch=16)
    # The same batch, or a batch not recorded (older checkpoints, token budgets), loads as before.
    load_scheduler_state(_megatron_lm_scheduler(0, 6, 1), state, "ckpt", checkpoint_batch=8, run_batch=8)
    load_scheduler_state(_megatron_lm_scheduler(0, 6, 1), state, "ckpt", checkpoint_batch=None, run_batch=16)
    # Either flag follows Megatron-LM's rates from then on: its own scheduler in samples, stepped by 16.
    for flag, decay_samples in (("override_opt_param_scheduler", 96), ("use_checkpoint_opt_param_scheduler", 48)):
        from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

        ours = _megatron_lm_scheduler(0, 6, 1)
        setattr(ours, flag, True)
        load_scheduler_state(ours, state, "ckpt", checkpoint_batch=8, run_batch=16)
        opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=1e-3)
        theirs = OptimizerParamScheduler(opt, init_lr=0.0, max_lr=1e-3, min_lr=1e-4, lr_warmup_steps=0,
                                         lr_decay_steps=decay_samples, lr_decay_style="cosine", start_wd=0.01,
                                         end_wd=0.01, wd_incr_steps=decay_samples, wd_incr_style="constant")
        theirs.num_steps = 24
        for _ in range(3):
            ours.step(increment=1)
            theirs.step(increment=16)
            assert ours.get_lr(ours.optimizer.param_groups[0]) == pytest.approx(
                theirs.get_lr(theirs.optimizer.param_groups[0]), rel=1e-12), flag


def test_override_resumes_at_megatron_lms_step_count_in_this_runs_batches():
    from types import SimpleNamespace

    from megatron_integration.checkpoint_formats import override_group_lrs

    bounds = SimpleNamespace(lr=1e-3, min_lr=None, decoupled_lr=None, decoupled_min_lr=None)
    sched = _megatron_lm_scheduler(0, 6, 1)
    # 3 iterations of 8 samples resumed at 16 a batch: Megatron-LM's 24 samples, 1.5 of this run's steps.
    override_group_lrs(sched.optimizer, sched, bounds, 3, consumed_samples=24, run_batch=16)
    assert sched.num_steps == 1.5
    override_group_lrs(sched.optimizer, sched, bounds, 3, consumed_samples=24, run_batch=None)  # a token budget
    assert sched.num_steps == 3
    override_group_lrs(sched.optimizer, sched, bounds, 3, consumed_samples=24, run_batch=8)  # the same batch
    assert sched.num_steps == 3 and isinstance(sched.num_steps, int)
