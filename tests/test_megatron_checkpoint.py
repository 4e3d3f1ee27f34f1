"""Checkpoints: a run resumed from iteration k continues exactly as the uninterrupted run."""
import io
import json
import os
import re
import shutil
import subprocess
import sys

import pytest

from dynapipe.errors import DynaPipeError
from megatron_integration.checkpoint_dist import common_state_file
from megatron_integration.jobs import run_training, run_trainings
from megatron_integration.launch import free_port, spawn

# Dropout on: the resumed run must also restore every RNG to draw the same masks.
TINY = ("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --ffn-hidden-size 128 --seq-length 128 "
        "--vocab-size 256 --micro-batch-size 2 --global-batch-size 4 --lr 1e-2 --mock-data "
        "--hidden-dropout 0.1 --attention-dropout 0.1 --log-interval 1 --seed 11 --pipeline-model-parallel-size 2")
TIMEOUT = 240


def test_resume_continues_identically(tmp_path):
    save = str(tmp_path / "ckpt")
    # The four runs train one after the other in one job of 2 ranks (the start-up of a job costs more
    # than a run); the third and fourth load what the second saved.
    argvs = [f"{TINY} --train-iters 4",
             # Interrupted as Megatron-LM runs are: same --train-iters (the learning-rate decay spans it),
             # --exit-interval.
             f"{TINY} --train-iters 4 --exit-interval 2 --save {save}",
             f"{TINY} --train-iters 4 --load {save}",
             # Without restoring RNG states.
             f"{TINY} --train-iters 4 --load {save} --no-load-rng",
             # Resumed at --train-iters: nothing to train, and DynaPipe's planners are not started.
             f"{TINY} --train-iters 2 --load {save} --use-checkpoint-opt_param-scheduler --use-dynapipe",
             # Resumed past --train-iters: the final evaluation is the checkpoint's iteration's.
             f"{TINY} --train-iters 1 --load {save} --use-checkpoint-opt_param-scheduler --split 90,5,5 "
             f"--eval-interval 1 --eval-iters 1"]
    # --save-retain-interval, in both formats: saved at 1..5, the multiples of 2 kept, and the newest.
    retained = {fmt: str(tmp_path / f"retain-{fmt}") for fmt in ("torch_dist", "dynapipe")}
    argvs += [f"{TINY} --train-iters 5 --save {d} --save-interval 1 --save-retain-interval 2 --ckpt-format {fmt}"
              for fmt, d in retained.items()]
    full, first, resumed, no_rng, done, past, *thinned = (
        ranks[0] for ranks in run_trainings([a.split() for a in argvs], 2, timeout_s=TIMEOUT * len(argvs)))
    for run, d in zip(thinned, retained.values()):
        assert sorted(f for f in os.listdir(d) if f.startswith("iter_")) == ["iter_0000002", "iter_0000004",
                                                                             "iter_0000005"]
        assert [line.split("] ")[-1] for line in run["checkpoint_lines"] if "deleting" in line] == [
            f"  deleting checkpoint from iteration       {i} at {d} (--save-retain-interval)" for i in (1, 3)]
    assert past["losses"] == [] and any("validation loss at iteration 2 on validation set" in line
                                        for line in past["eval_lines"]), past["eval_lines"]
    assert done["losses"] == [] and done["checkpoint_lines"][-1] == (
        "checkpoint at iteration 2 has reached --train-iters 2: nothing to train (raise --train-iters to train "
        "further)")
    full = full["losses"]
    assert first["losses"] == full[:2]
    with open(os.path.join(save, "latest_checkpointed_iteration.txt")) as f:
        assert f.read().strip() == "2"
    # Megatron's torch_dist layout (the default --ckpt-format), every file with its checksum.
    iter_dir = os.path.join(save, "iter_0000002")
    files = sorted(os.listdir(iter_dir))
    assert {"metadata.json", ".metadata"} <= set(files)
    # The common part: common.pt (megatron-core 0.16) or an object in rank 0's shards (0.19).
    common = os.path.basename(common_state_file(iter_dir))
    assert common == ("common.pt" if "common.pt" in files else "__0_0.distcp"), files
    assert any(f.startswith("__1_") and f.endswith(".distcp") for f in files)  # the second stage's shards
    assert all(f + ".sha256" in files for f in files if not f.endswith(".sha256"))
    saving, saved = first["checkpoint_lines"]
    assert re.fullmatch(rf"\[[-0-9: .]+\] saving checkpoint at iteration       2 to {save} in torch_dist format",
                        saving)
    assert re.fullmatch(rf"  \[[-0-9: .]+\] successfully saved checkpoint from iteration       2 to {save} "
                        rf"\[ t 1/1, p 1/2 \]", saved)
    assert resumed["start_iteration"] == 2
    assert resumed["losses"] == full[2:]  # bitwise: same weights, optimizer state, data position and RNG
    assert resumed["checkpoint_lines"][:2] == [f" loading distributed checkpoint from {save} at iteration 2",
                                               f"  successfully loaded checkpoint from {save} [ t 1/1, p 1/2 ] "
                                               f"at iteration 2"]
    # Without restoring RNG states the dropout masks differ, so the check above has teeth.
    assert abs(no_rng["losses"][0] - full[2]) > 1e-6
    _verifier_catches_damage(iter_dir, tmp_path / "damaged")


def test_resume_without_the_optimizer_keeps_the_weights_and_an_override_takes_the_new_rate(tmp_path):
    """bf16 keeps fp32 main weights in the optimizer. Resumed without its state (--no-load-optim)
    they must come from the loaded weights, not the random start; resumed with it under
    --override-opt_param-scheduler, the groups take this run's --lr, not the saved one. At --lr 0
    both keep the loaded weights, so both log the same losses (under either bug one of them
    trains on other weights)."""
    save = str(tmp_path / "ckpt")
    base = (TINY.replace("--hidden-dropout 0.1 --attention-dropout 0.1", "--hidden-dropout 0 --attention-dropout 0")
            + " --bf16 --lr-decay-style constant --train-iters 4 --ckpt-format dynapipe")
    argvs = [f"{base} --exit-interval 2 --save {save}",
             f"{base} --load {save} --no-load-optim --lr 0",
             f"{base} --load {save} --override-opt_param-scheduler --lr 0"]
    _, fresh_optimizer, override = (ranks[0] for ranks in run_trainings([a.split() for a in argvs], 2,
                                                                         timeout_s=TIMEOUT * len(argvs)))
    assert fresh_optimizer["start_iteration"] == override["start_iteration"] == 2
    assert fresh_optimizer["losses"] == override["losses"] and len(override["losses"]) == 2
    rates = [ln for ln in override["log_lines"] if "learning rate:" in ln]
    assert rates and all("learning rate: 0.000000E+00" in ln for ln in rates), rates


def test_a_decoupled_lr_run_resumes_exactly_in_both_formats(tmp_path):
    # megatron-core left its --decoupled-lr groups flagged as ordinary ones: one saved group
    # shadowed the other, and no such run could load its own optimizer state.
    base = f"{TINY} --decoupled-lr 1e-3 --lr-decay-style constant --train-iters 4"
    argvs = [base]
    for fmt in ("torch_dist", "dynapipe"):
        save = tmp_path / fmt
        argvs += [f"{base} --ckpt-format {fmt} --exit-interval 2 --save {save}", f"{base} --load {save}"]
    # How torch_dist checkpoints are read does not apply to a dynapipe one: refused, not dropped.
    argvs.append(f"{base} --load {tmp_path / 'dynapipe'} --no-load-optim --dist-ckpt-strictness raise_all")
    full, _, dist_resumed, _, own_resumed, strict = spawn(_runs_in_one_job, 2, (argvs,),
                                                          timeout_s=TIMEOUT * len(argvs))[0]
    assert dist_resumed["losses"] == own_resumed["losses"] == full["losses"][2:], (full, dist_resumed, own_resumed)
    # Both formats record the model FLOPs trained (Megatron-LM's num_floating_point_operations_so_far),
    # and a resumed run counts on from them.
    from dynapipe.cost.model_flops import model_flops
    from megatron_integration.arguments import parse_training_args
    from megatron_integration.checkpoint_dist import read_common

    model = parse_training_args(base.split(), 2).model.to_model_config()
    per_iteration = [model_flops(model, w) for w in full["executed_work"]]
    assert all(f > 0 for f in per_iteration) and full["flops_so_far"] == pytest.approx(sum(per_iteration))
    recorded = read_common(str(tmp_path / "torch_dist" / "iter_0000002"))["num_floating_point_operations_so_far"]
    assert recorded == pytest.approx(sum(per_iteration[:2]))
    assert dist_resumed["flops_so_far"] == own_resumed["flops_so_far"] == pytest.approx(full["flops_so_far"])
    assert strict["error"].startswith("--dist-ckpt-strictness raise_all: ") and \
        "is a dynapipe-format checkpoint" in strict["error"], strict


def test_fp16_resumes_exactly_across_iterations_its_loss_scaling_skipped(tmp_path):
    """fp16 from a high loss scale: the first iterations overflow and skip the optimizer step (and
    the scheduler's, as in Megatron-LM). A checkpoint saved before any step holds no Adam moments
    (megatron-core's loading state asked for them: a KeyError); one saved after some skips must
    resume the schedule at its steps, not at its iterations. Both resume the uninterrupted run."""
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    base = (TINY.replace("--hidden-dropout 0.1 --attention-dropout 0.1", "--hidden-dropout 0 --attention-dropout 0")
            + " --fp16 --initial-loss-scale 4194304 --train-iters 8")
    argvs = [base, f"{base} --save {a} --exit-interval 3", f"{base} --load {a} --save {b} --exit-interval 7",
             f"{base} --load {b}"]
    full, first, middle, last = (ranks[0] for ranks in run_trainings([x.split() for x in argvs], 2,
                                                                      timeout_s=TIMEOUT * len(argvs)))

    def rates(run):
        return [re.search(r"learning rate: (\S+)", ln).group(1) for ln in run["log_lines"] if "learning rate" in ln]

    def skipped(run):  # summed over the log lines (one an iteration)
        return sum(int(m.group(1)) for ln in run["log_lines"]
                   for m in [re.search(r"number of skipped iterations: +(\d+)", ln)] if m)

    assert skipped(first) == 3 and rates(full)[:3] == [rates(full)[0]] * 3  # no step yet at the save
    assert 0 < skipped(full) < 7, "the run should skip some iterations, then step"
    assert (middle["start_iteration"], last["start_iteration"]) == (3, 7)
    assert middle["losses"] == full["losses"][3:7] and last["losses"] == full["losses"][7:]
    assert rates(middle) == rates(full)[3:7] and rates(last) == rates(full)[7:]


def _flip_middle_byte(path):
    with open(path, "r+b") as f:
        f.seek(os.path.getsize(path) // 2)
        byte = f.read(1)[0]
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte ^ 0x01]))


def _verifier_catches_damage(iter_dir, scratch):
    """The checksums of a real torch_dist checkpoint catch a flipped byte and a lost sidecar."""
    from megatron_integration.checkpoint_dist import verify_dist_checkpoint

    shutil.copytree(iter_dir, scratch)
    assert verify_dist_checkpoint(str(scratch), 0, 1) is True
    shard = sorted(str(p) for p in scratch.glob("__1_*.distcp"))[0]
    _flip_middle_byte(shard)
    # Every rank checks its share of the files; together they check all.
    errors = []
    for rank in range(3):
        try:
            verify_dist_checkpoint(str(scratch), rank, 3)
        except DynaPipeError as e:
            errors.append(str(e))
    assert errors == [f"checkpoint file {shard} is corrupted: its SHA-256 differs from the one recorded at save "
                      f"time; resume from another checkpoint."]
    _flip_middle_byte(shard)  # repaired
    common = common_state_file(str(scratch))
    os.remove(common + ".sha256")
    with pytest.raises(DynaPipeError, match=f"{re.escape(os.path.basename(common))} has no checksum"):
        verify_dist_checkpoint(str(scratch), 0, 1)
    for sidecar in scratch.glob("*.sha256"):
        sidecar.unlink()
    assert verify_dist_checkpoint(str(scratch), 0, 1) is False  # as Megatron-LM writes them: unverified
    # Unverified, a shard shorter than the index's places is still named (megatron-core: EOFError).
    size = os.path.getsize(shard)
    with open(shard, "r+b") as f:
        f.truncate(size - 7)
    with pytest.raises(DynaPipeError, match=f"checkpoint file {re.escape(shard)} is truncated "
                                            f"\\({size - 7:,} bytes, its index needs {size:,}\\)"):
        verify_dist_checkpoint(str(scratch), 0, 1)
    shutil.copy(os.path.join(iter_dir, os.path.basename(shard)), shard)
    assert verify_dist_checkpoint(str(scratch), 0, 1) is False
    # Unverified, a damaged part is still named: a garbled metadata.json (read first), a lost
    # common part (megatron-core 0.16 fails with an AttributeError of its own there).
    from megatron_integration.checkpoint_dist import read_common

    assert read_common(str(scratch))["iteration"] == 2
    meta = scratch / "metadata.json"
    good = meta.read_bytes()
    meta.write_text("{bad")
    with pytest.raises(DynaPipeError, match=f"checkpoint {re.escape(str(meta))} cannot be loaded \\(JSONDecodeError"):
        read_common(str(scratch))
    meta.write_bytes(good)
    if os.path.basename(common) == "common.pt":
        os.remove(common)
        with pytest.raises(DynaPipeError, match=f"checkpoint {re.escape(str(scratch))} is incomplete: it holds no "
                                                f"common state"):
            read_common(str(scratch))
        # megatron-core 0.19's layout (no common.pt: a common_state object in the shards), which
        # 0.16 cannot read: the error says which release wrote it and what resumes it.
        from dynapipe.megatron_core import installed_release

        release = installed_release()
        assert release is not None
        if release < (0, 19):
            import torch
            import torch.distributed.checkpoint as dcp

            newer = scratch.parent / f"{scratch.name}-0.19"
            newer.mkdir()
            (newer / "metadata.json").write_bytes(good)
            state = io.BytesIO()
            torch.save({"iteration": 2}, state)
            state.seek(0)
            dcp.save({"common_state": state}, checkpoint_id=str(newer), no_dist=True)
            with pytest.raises(DynaPipeError, match=f"checkpoint {re.escape(str(newer))} keeps its common state "
                                                    f".* as megatron-core 0.19 and newer write it; the installed "
                                                    f"megatron-core 0\\.\\d+ reads only common.pt"):
                read_common(str(newer))


PEER = os.path.join(os.path.dirname(__file__), "mcore_checkpoint_peer.py")


def _peer(command: str, root: str) -> str:
    """Run the megatron-core-only peer script (a process without this project's code)."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    done = subprocess.run([sys.executable, PEER, command, root], capture_output=True, text=True, timeout=TIMEOUT,
                          env=env, cwd=os.path.dirname(root))
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


def test_checkpoints_interoperate_with_megatron_core(tmp_path):
    """megatron-core's own save -> this project's run at PP2 -> megatron-core's own load at PP1; the PP2
    checkpoint also resumes this project's PP1 run, and a model of another shape is refused."""
    theirs, ours = str(tmp_path / "mcore"), str(tmp_path / "ours")
    _peer("write", theirs)
    # --finetune: weights only, from iteration 0 (the peer saved no optimizer or RNG state).
    # --lr 0: one real training step that leaves every weight as loaded, then a torch_dist save.
    run = run_training(f"{TINY} --hidden-dropout 0 --attention-dropout 0 --train-iters 1 --lr 0 --load {theirs} "
                       f"--finetune --save {ours}".split(), 2, timeout_s=TIMEOUT)[0]
    assert run["start_iteration"] == 0 and len(run["losses"]) == 1
    assert run["checkpoint_lines"][:2] == [f" loading distributed checkpoint from {theirs} at iteration 5",
                                           f" {theirs}/iter_0000005 has no checksums (not written by "
                                           f"dynapipe-megatron): loading it unverified"]
    report = json.loads(_peer("check", ours).strip().splitlines()[-1])
    assert report["tensors"] > 10 and report["differ"] == []
    assert report["iteration"] == 1 and report["checkpoint_version"] == 3.0
    assert report["pipeline_model_parallel_size"] == 2 and report["consumed_train_samples"] == 4
    assert {"args", "iteration", "checkpoint_version", "opt_param_scheduler"} <= set(report["keys"])
    # The PP2 checkpoint, optimizer state included, resumes at PP1 (RNG states are per stage: skipped);
    # a model of another shape is refused before any tensor is read. One process runs both.
    one_stage = TINY.replace(" --pipeline-model-parallel-size 2", "")
    wider = one_stage.replace("--ffn-hidden-size 128", "--ffn-hidden-size 192")
    pp1, refused = spawn(_runs_in_one_job, 1, ([f"{one_stage} --hidden-dropout 0 --attention-dropout 0 "
                                                 # A longer run than the saved one: its own schedule,
                                                 # said as Megatron-LM asks for it.
                                                 f"--train-iters 2 --lr 0 --load {ours} "
                                                 f"--override-opt_param-scheduler",
                                                 f"{wider} --train-iters 2 --load {ours}"],), timeout_s=TIMEOUT)[0]
    assert pp1["start_iteration"] == 1 and len(pp1["losses"]) == 1
    assert pp1["checkpoint_lines"] == [f" loading distributed checkpoint from {ours} at iteration 1",
                                       "(TP, PP) mismatch after resume ((1, 1) vs (1, 2) from checkpoint): RNG state "
                                       "will be ignored",
                                       f"  successfully loaded checkpoint from {ours} [ t 1/1, p 1/1 ] at iteration 1"]
    assert refused["error"] == (f"{ours}/iter_0000001: the checkpoint does not fit this model (--ffn-hidden-size "
                                f"128 in the checkpoint, 192 here); use the model arguments it was saved with.")


def _runs_in_one_job(argvs: list) -> list:
    """Rank body: one training run per command line, in the same process group (saves the start-up
    of a job per run); each run's start, losses and checkpoint lines, or its one-line error."""
    from megatron_integration.arguments import parse_training_args
    from megatron_integration.initialize import destroy
    from megatron_integration.training import pretrain

    out = []
    try:
        for argv in argvs:
            try:
                run = pretrain(parse_training_args(argv.split(), int(os.environ["WORLD_SIZE"])), stream=io.StringIO())
                out.append({"start_iteration": run.start_iteration, "losses": run.losses,
                            "checkpoint_lines": run.checkpoint_lines, "flops_so_far": run.flops_so_far,
                            "executed_work": [r.executed_work for r in run.results]})
            except DynaPipeError as e:
                out.append({"error": str(e)})
    finally:
        destroy()
    return out


def _parse(extra: str):
    from megatron_integration.arguments import parse_training_args

    return parse_training_args(f"{TINY} --train-iters 2 {extra}".split(), 2, cuda=False)


def test_checkpoint_flags_have_megatrons_meaning(tmp_path):
    cfg = _parse("")
    assert cfg.ckpt_format == "torch_dist" and not cfg.finetune  # Megatron-LM's default
    assert cfg.megatron_args["seq_length"] == 128 and cfg.megatron_args["global_batch_size"] == 4
    assert _parse(f"--ckpt-format dynapipe --load {tmp_path} --finetune").finetune
    assert _parse("--use-dist-ckpt --auto-detect-ckpt-format").ckpt_format == "torch_dist"  # accepted, no effect
    d = cfg.dist_ckpt  # Megatron-LM's defaults: fully parallel save, plain load, unexpected keys assumed fine
    assert (d.fully_parallel_save, d.fully_parallel_load, d.strictness) == (True, False, "assume_ok_unexpected")
    assert _parse("--ckpt-fully-parallel-save").dist_ckpt.fully_parallel_save  # deprecated spelling of the default
    # The value is refused, not the flag (torch_dist and dynapipe are supported).
    with pytest.raises(DynaPipeError, match="^--ckpt-format torch is not supported by dynapipe-megatron: Megatron's "
                                            "legacy per-rank files are not written; use torch_dist"):
        _parse("--ckpt-format torch")
    # A refused run leaves no directory behind: --save and the others are created once all else passed.
    for refused, said in (("--ckpt-format torch", "--ckpt-format torch is not supported"),
                          ("--rerun-mode report_stats --error-injection-rate 3",
                           "--error-injection-rate 3 with --rerun-mode report_stats: injected errors")):
        dirs = {flag: tmp_path / f"refused{flag}" for flag in ("--save", "--tensorboard-dir")}
        with pytest.raises(DynaPipeError, match=f"^{said}"):
            _parse(" ".join(f"{flag} {path}" for flag, path in dirs.items()) + f" {refused}")
        assert not any(path.exists() for path in dirs.values()), refused
    assert _parse(f"--save {tmp_path / 'accepted'}").save and (tmp_path / "accepted").is_dir()
    with pytest.raises(DynaPipeError, match="--finetune needs --load"):
        _parse("--finetune")
    # --save-retain-interval as Megatron-LM asserts it: with --save and --save-interval, a multiple of it.
    assert _parse(f"--save {tmp_path} --save-interval 2 --save-retain-interval 6").save_retain_interval == 6
    with pytest.raises(DynaPipeError, match="--save-retain-interval 4 thins the checkpoints --save-interval writes"):
        _parse(f"--save {tmp_path} --save-retain-interval 4")
    for bad in (3, 0):
        with pytest.raises(DynaPipeError, match=f"--save-retain-interval {bad}: must be a positive multiple of "
                                                f"--save-interval 2"):
            _parse(f"--save {tmp_path} --save-interval 2 --save-retain-interval {bad}")
    # The flags that only act on a loaded checkpoint are refused without one, not dropped.
    for flag in ("--no-load-optim", "--no-load-rng", "--override-opt_param-scheduler",
                 "--use-checkpoint-opt_param-scheduler", "--exit-on-missing-checkpoint"):
        with pytest.raises(DynaPipeError, match=f"^{flag} applies to a checkpoint loaded with --load DIR"):
            _parse(flag)
        assert _parse(f"--load {tmp_path} {flag}").load == str(tmp_path)
    s = "--load DIR --exit-on-missing-checkpoint"
    assert _parse(s.replace("DIR", str(tmp_path))).exit_on_missing_checkpoint and not _parse("").exit_on_missing_checkpoint
    # A schedule flag where no schedule is loaded would do nothing.
    for skip in ("--finetune", "--no-load-optim"):
        with pytest.raises(DynaPipeError, match=f"but {skip} loads no schedule"):
            _parse(f"--load {tmp_path} {skip} --override-opt_param-scheduler")


def _shard_bytes(iter_dir, rank: int) -> int:
    return sum(os.path.getsize(os.path.join(iter_dir, f)) for f in os.listdir(iter_dir)
               if f.startswith(f"__{rank}_") and f.endswith(".distcp"))


def test_fully_parallel_save_and_load_and_strictness_on_two_replicas(tmp_path):
    """Two data-parallel replicas: Megatron-LM's default fully parallel save splits the writing of
    what both hold (without it the first writes it all); either checkpoint resumes exactly; ``--dist-ckpt-strictness``
    decides what the optimizer keys a ``--no-load-optim`` run leaves unread do."""
    dp2 = TINY.replace("--pipeline-model-parallel-size 2", "--pipeline-model-parallel-size 1") + " --train-iters 4"
    split, whole = str(tmp_path / "split"), str(tmp_path / "whole")
    argvs = [dp2, f"{dp2} --exit-interval 2 --save {split}",
             f"{dp2} --exit-interval 2 --save {whole} --no-ckpt-fully-parallel-save",
             f"{dp2} --load {split}", f"{dp2} --load {whole}",
             f"{dp2} --load {split} --no-load-optim --dist-ckpt-strictness log_all",
             f"{dp2} --load {split} --dist-ckpt-strictness raise_all"]
    full, _, _, from_split, from_whole, fresh_optim, strict = (
        ranks[0] for ranks in run_trainings([a.split() for a in argvs], 2, timeout_s=TIMEOUT * len(argvs)))
    assert from_split["losses"] == full["losses"][2:] and from_whole["losses"] == full["losses"][2:]
    assert strict["losses"] == full["losses"][2:]  # raise_all: nothing missing when all is read
    assert fresh_optim["start_iteration"] == 2
    for root, rank1_share in ((split, (0.3, 0.7)), (whole, (0.0, 0.05))):
        iter_dir = os.path.join(root, "iter_0000002")
        sizes = [_shard_bytes(iter_dir, r) for r in (0, 1)]
        low, high = rank1_share
        assert low <= sizes[1] / sum(sizes) <= high, (root, sizes)
    # megatron-core's terms: the optimizer keys the run leaves unread are "missing" (raise_all raises on
    # them), keys the run asked for that the checkpoint lacks "unexpected" (none here).
    with pytest.raises(Exception, match="[Mm]issing keys.*optimizer"):
        run_training(f"{dp2} --load {split} --no-load-optim --dist-ckpt-strictness raise_all".split(), 2,
                     timeout_s=TIMEOUT)


@pytest.mark.parametrize("extra, needle", [
    ("--dist-ckpt-strictness return_all", "use log_all or raise_all"),
    ("--ckpt-fully-parallel-save --no-ckpt-fully-parallel-save", "contradict each other"),
    ("--ckpt-format dynapipe --no-ckpt-fully-parallel-save", "--no-ckpt-fully-parallel-save applies to torch_dist"),
    ("--ckpt-fully-parallel-load", "--ckpt-fully-parallel-load sets how a checkpoint is loaded; add --load"),
    ("--ckpt-fully-parallel-load --load {tmp}", "--ckpt-fully-parallel-load needs GPUs"),
])
def test_dist_checkpoint_flags_that_change_nothing_are_refused(extra, needle, tmp_path):
    with pytest.raises(DynaPipeError, match=needle):
        _parse(extra.replace("{tmp}", str(tmp_path)))


def test_checkpoint_flags_not_honoured_are_one_line(capsys, monkeypatch):
    from megatron_integration.arguments import build_parser

    monkeypatch.setenv("RANK", "0")
    with pytest.raises(SystemExit) as e:
        build_parser("pretrain_gpt.py").parse_args(f"{TINY} --train-iters 2 --no-save-optim".split())
    assert e.value.code == 2
    assert capsys.readouterr().err == ("error: --no-save-optim is a Megatron-LM flag that dynapipe-megatron does not "
                                       "support: checkpoints always hold the optimizer state; drop it (load with "
                                       "--no-load-optim or --finetune to leave it out)\n")


def test_wrapped_read_errors_become_one_line():
    """torch.distributed.checkpoint wraps each rank's read error in a BaseException whose text is a
    multi-line traceback (megatron-core 0.19 reads the common part through it); the line names the
    file and the rank's own error."""
    from torch.distributed.checkpoint.api import CheckpointException

    from megatron_integration.checkpoint_dist import _LOAD_ERRORS, _checkpoint_error

    wrapped = CheckpointException("read", {0: (EOFError("Ran out of input"), None)})
    assert isinstance(wrapped, _LOAD_ERRORS) and not isinstance(wrapped, Exception)
    err = _checkpoint_error("ckpt/iter_0000001/__0_0.distcp", wrapped)
    assert str(err) == "checkpoint ckpt/iter_0000001/__0_0.distcp cannot be loaded (EOFError: Ran out of input)."


def test_recorded_args_have_megatron_lms_names_and_meanings():
    # Megatron-LM's check_checkpoint_args compares add_position_embedding with the resuming run's
    # flag (on unless --no-position-embedding, for RoPE too), and --use-checkpoint-args reads
    # add_bias_linear; the model check compares the position type itself.
    from types import SimpleNamespace

    from megatron_integration.checkpoint_compat import model_mismatch
    from megatron_integration.checkpoint_dist import megatron_args

    def recorded(extra):
        cfg = _parse(extra)
        return cfg, megatron_args(cfg.megatron_args, cfg, None, 1, 4)

    cfg, args = recorded("--position-embedding-type rope")
    assert args.add_position_embedding is True and args.add_bias_linear is True
    _, args = recorded("--position-embedding-type rope --no-position-embedding --disable-bias-linear")
    assert args.add_position_embedding is False and args.add_bias_linear is False
    assert recorded("")[1].add_position_embedding is True
    # Megatron-LM's names and resolved values beside this parser's own.
    _, args = recorded("--no-masked-softmax-fusion --norm-epsilon 1e-6")
    assert args.masked_softmax_fusion is False and args.bias_dropout_fusion is True
    assert args.layernorm_epsilon == args.norm_epsilon == 1e-6
    assert (args.eval_iters, args.distributed_backend, args.rerun_mode) == (100, "gloo", "validate_results")
    # Megatron-LM resumes its validation loader from consumed_valid_samples: the evaluations run by
    # the save, --eval-iters global batches (4 samples) each.
    assert args.consumed_valid_samples == 0  # no --eval-interval: none during training
    evaluated = _parse("--eval-interval 2 --eval-iters 3 --split 90,5,5")
    assert megatron_args(evaluated.megatron_args, evaluated, None, 5, 20).consumed_valid_samples == 2 * 3 * 4
    # A Megatron-LM RoPE checkpoint (add_position_embedding True) fits a RoPE model here.
    theirs = SimpleNamespace(position_embedding_type="rope", add_position_embedding=True, add_bias_linear=True)
    assert model_mismatch(theirs, cfg) is None
    assert model_mismatch(SimpleNamespace(position_embedding_type="learned_absolute"), cfg) == (
        "--position-embedding-type learned_absolute in the checkpoint, rope here")
    assert model_mismatch(SimpleNamespace(add_bias_linear=False), cfg) == (
        "add_bias_linear False in the checkpoint, True here: --disable-bias-linear")
    # The GeLU: Megatron-LM's default bias-GeLU fusion is the tanh approximation, which this run
    # computes; a checkpoint of the exact GeLU (--no-bias-gelu-fusion, or an earlier build of this
    # project, which recorded no_bias_gelu_fusion and computed the exact GeLU) is refused with the fix.
    assert recorded("")[1].bias_gelu_fusion is True
    assert model_mismatch(SimpleNamespace(bias_gelu_fusion=True), cfg) is None
    for old in (SimpleNamespace(bias_gelu_fusion=False), SimpleNamespace(no_bias_gelu_fusion=False)):
        assert model_mismatch(old, cfg).endswith(": --no-bias-gelu-fusion")
        assert model_mismatch(old, _parse("--no-bias-gelu-fusion")) is None
    assert model_mismatch(SimpleNamespace(bias_gelu_fusion=False), _parse("--swiglu")) is None  # no GeLU
    # Shapes the loaded tensors would refuse only by key name are named by their flag first.
    learned = _parse("")
    assert model_mismatch(SimpleNamespace(max_position_embeddings=256, position_embedding_type="learned_absolute"),
                          learned) == f"--max-position-embeddings 256 in the checkpoint, " \
                                      f"{learned.model.max_position_embeddings} here"
    assert model_mismatch(SimpleNamespace(max_position_embeddings=256, position_embedding_type="rope"), cfg) is None
    heads = learned.model.num_attention_heads
    assert model_mismatch(SimpleNamespace(group_query_attention=True, num_query_groups=1), learned) == (
        f"1 key/value heads in the checkpoint, {heads} here: --group-query-attention --num-query-groups")
    assert model_mismatch(SimpleNamespace(group_query_attention=False, num_query_groups=1,
                                          num_attention_heads=heads), learned) is None
    # A T5 run tells a GPT's checkpoint by its missing encoder (torch_dist keys; the dynapipe
    # format's recorded decoder layers).
    t5_values = {"encoder_num_layers": 2, "decoder_num_layers": 2}
    assert model_mismatch(SimpleNamespace(), cfg, t5_values, ["decoder.layers.x", "embedding.y"]).startswith(
        "it holds no encoder: a decoder-only (GPT) model's checkpoint")
    assert model_mismatch(SimpleNamespace(), cfg, t5_values, ["encoder.layers.x", "decoder.layers.x"]) is None
    assert model_mismatch(SimpleNamespace(decoder_num_layers=2), cfg, t5_values) is None
    # A T5's checkpoint (its decoder keys are GPT's, its num_layers the encoder's) is refused by a
    # GPT run by what it records, as its own runs record it; a GPT's records no decoder.
    assert getattr(recorded("")[1], "decoder_num_layers", None) is None
    t5_like = SimpleNamespace(**{**vars(args), "num_layers": cfg.model.num_layers, "decoder_num_layers": 2})
    assert model_mismatch(t5_like, cfg) == ("it records --decoder-num-layers 2: an encoder-decoder (T5) model's "
                                            "checkpoint, and this run trains a GPT; resume it with "
                                            "scripts/pretrain_t5.py")


def test_a_distributed_optimizer_state_in_buffer_layout_loads_only_at_its_tp_and_pp():
    # Megatron-LM's rule (its load_checkpoint raises the same): dp_reshardable state is keyed by
    # each model-parallel rank's flat buffers; the parameter-keyed formats reshard anywhere.
    from megatron_integration.checkpoint_compat import check_optimizer_resharding

    check_optimizer_resharding("dp_reshardable", (1, 2), (1, 2), "ckpt")
    check_optimizer_resharding(None, (1, 2), (2, 1), "ckpt")  # no distributed optimizer
    check_optimizer_resharding("fully_reshardable", (1, 2), (2, 1), "ckpt")
    with pytest.raises(DynaPipeError, match=r"ckpt: \(TP, PP\) \(1, 4\) here, \(1, 2\) in the checkpoint: .* "
                                            r"dp_reshardable.* add --no-load-optim"):
        check_optimizer_resharding("dp_reshardable", (1, 2), (1, 4), "ckpt")


def test_any_error_of_a_rank_becomes_its_one_line_with_the_fix():
    from megatron_integration.agreement import attempt

    def fails():
        raise RuntimeError("size mismatch for\n  embedding.weight")

    assert attempt(lambda: 3, "loading x") == (3, None)
    assert attempt(fails, "loading ckpt/model.pt (rank 1)", "resume with the arguments it was saved with") == (
        None, "loading ckpt/model.pt (rank 1) failed: RuntimeError: size mismatch for embedding.weight; resume with "
              "the arguments it was saved with")
    assert attempt(lambda: (_ for _ in ()).throw(DynaPipeError("refused")), "x")[1] == "refused"


def test_a_save_replaces_an_earlier_one_of_the_same_iteration_whole(tmp_path):
    # An earlier iter_N at DP 3 with the distributed optimizer, saved again at DP 2 without it: none
    # of the earlier files (rng_dp_002, distrib_optim.pt) may be left for a later resume to read.
    from megatron_integration.checkpoint_files import fresh_dir, move_into_place

    old, staging = tmp_path / "iter_0000002", tmp_path / "iter_0000002.saving"
    (old / "mp_rank_00_000").mkdir(parents=True)
    for name in ["rng_dp_000.pt", "rng_dp_001.pt", "rng_dp_002.pt", "distrib_optim.pt", "model_optim_rng.pt"]:
        (old / "mp_rank_00_000" / name).write_bytes(b"old")
    (staging / "leftover").mkdir(parents=True)  # what a killed save left
    fresh_dir(str(staging))
    assert os.listdir(staging) == []
    (staging / "mp_rank_00_000").mkdir()
    for name in ["rng_dp_000.pt", "rng_dp_001.pt", "model_optim_rng.pt"]:
        (staging / "mp_rank_00_000" / name).write_bytes(b"new")
    move_into_place(str(staging), str(old))
    assert sorted(os.listdir(tmp_path)) == ["iter_0000002"]
    files = sorted(os.listdir(old / "mp_rank_00_000"))
    assert files == ["model_optim_rng.pt", "rng_dp_000.pt", "rng_dp_001.pt"]
    assert all((old / "mp_rank_00_000" / f).read_bytes() == b"new" for f in files)


def test_a_save_that_cannot_start_says_what_is_kept_and_what_to_do(tmp_path):
    from megatron_integration.checkpoint_files import StagedSave

    blocked = tmp_path / "not-a-directory"
    blocked.write_text("x")
    with pytest.raises(DynaPipeError, match=f"^creating {re.escape(str(blocked))}/iter_0000002.saving failed: .*; "
                                            f"nothing of this save was kept, and the checkpoints already in "
                                            f"{re.escape(str(blocked))} are untouched .* make --save writable"):
        StagedSave(str(blocked / "iter_0000002"), 0).begin()


def test_a_move_that_fails_halfway_puts_the_earlier_checkpoint_back(tmp_path, monkeypatch):
    # The earlier iter_N is what latest_checkpointed_iteration.txt names: it must stay readable.
    from megatron_integration.checkpoint_files import move_into_place

    old, staging = tmp_path / "iter_0000002", tmp_path / "iter_0000002.saving"
    old.mkdir()
    (old / "model_optim_rng.pt").write_text("old")
    staging.mkdir()
    real, calls = os.rename, []

    def second_fails(src, dst):
        calls.append(dst)
        if len(calls) == 2:
            raise OSError(28, "No space left on device")
        real(src, dst)

    monkeypatch.setattr(os, "rename", second_fails)
    with pytest.raises(OSError):
        move_into_place(str(staging), str(old))
    assert (old / "model_optim_rng.pt").read_text() == "old" and staging.is_dir()


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_STUCK_WRITER = """
import io, os, sys, time
from megatron.core.dist_checkpointing.strategies.filesystem_async import FileSystemWriterAsync

def stuck(*args, **kwargs):  # a shard writer that takes its time (a slow file system)
    with open(sys.argv[1] + ".tmp", "w") as f:
        f.write(str(os.getpid()))
    os.replace(sys.argv[1] + ".tmp", sys.argv[1])
    time.sleep(120)

FileSystemWriterAsync.write_preloaded_data = staticmethod(stuck)
from megatron_integration.arguments import parse_training_args
from megatron_integration.training import pretrain
pretrain(parse_training_args(sys.argv[2].split(), 1), stream=io.StringIO())
"""


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")  # a zombie is dead
    except FileNotFoundError:
        return False


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the parent-death signal is Linux's")
def test_a_rank_killed_mid_save_takes_its_shard_writers_with_it(tmp_path):
    # megatron-core 0.16 forks the shard writers; a rank killed during a save (kill -9, a scheduler's
    # preemption) must not leave them running with a copy of its memory. (0.19 writes from threads
    # of the rank itself, which die with it.)
    import signal
    import time

    marker = str(tmp_path / "writer.pid")
    argv = ("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 64 --max-position-embeddings 64 "
            f"--vocab-size 128 --micro-batch-size 2 --global-batch-size 4 --lr 1e-3 --train-iters 1 --mock-data "
            f"--save {tmp_path / 'ckpt'}")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    env.pop("RANK", None)
    env["MASTER_PORT"] = str(free_port())  # the one-rank job's store, not the default port
    rank = subprocess.Popen([sys.executable, "-c", _STUCK_WRITER, marker, argv], env=env, cwd=ROOT,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    writer = None
    try:
        deadline = time.monotonic() + 120
        while not os.path.exists(marker) and rank.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert os.path.exists(marker), rank.stderr.read().decode()[-2000:] if rank.poll() is not None else "no writer"
        with open(marker) as f:
            writer = int(f.read())
        assert _alive(writer)
        from megatron.core import package_info

        # 0.16 forks its shard writers (the case this guards); 0.19 writes from the rank's threads.
        assert (writer != rank.pid) == (tuple(int(x) for x in package_info.__version__.split(".")[:2]) < (0, 19))
        rank.send_signal(signal.SIGKILL)
        rank.wait(30)
        deadline = time.monotonic() + 10
        while _alive(writer) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _alive(writer), f"writer {writer} outlived its rank"
    finally:
        if rank.poll() is None:
            rank.kill()
        if writer is not None and _alive(writer):
            os.kill(writer, signal.SIGKILL)


def test_a_resume_with_longer_train_iters_continues_the_weighted_blend_it_trained_on(tmp_path):
    # The blend is sized by --train-iters (64 samples here, 128 at 16 iterations: both between
    # what the paths hold and one whole pass of every path), so without the record the resumed
    # run would read another order of samples. Constant LR: the losses then depend on the data alone.
    import numpy as np

    from dynapipe.data.indexed import write_indexed_dataset

    rng = np.random.default_rng(4)
    short, long_ = str(tmp_path / "short"), str(tmp_path / "long")
    write_indexed_dataset(short, [rng.integers(2, 250, rng.integers(3, 11)) for _ in range(30)])
    write_indexed_dataset(long_, [rng.integers(2, 250, rng.integers(30, 41)) for _ in range(10)])
    base = ("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --ffn-hidden-size 128 --seq-length 64 "
            "--vocab-size 256 --micro-batch-size 2 --global-batch-size 8 --lr 1e-2 --lr-decay-style constant "
            f"--log-interval 1 --seed 3 --split 100,0,0 --use-dynapipe --data-path 0.75 {short} 0.25 {long_}")
    runs, saves = [f"{base} --train-iters 8"], {}
    for fmt in ("torch_dist", "dynapipe"):
        saves[fmt] = str(tmp_path / fmt)
        runs += [f"{base} --train-iters 8 --exit-interval 4 --save {saves[fmt]} --ckpt-format {fmt}",
                 f"{base} --train-iters 16 --exit-interval 8 --load {saves[fmt]} --ckpt-format {fmt} "
                 "--override-opt_param-scheduler"]
    # One thread, as each rank of the two-rank resume tests has. What is checked here is the order of
    # the samples: other samples move an iteration's loss by far more than 1e-4 (consecutive
    # iterations here differ by 0.07-0.16), so the comparison allows the fifth digit. A two-thread rank once resumed
    # 1e-5 away from the uninterrupted run (the same samples, summed in another order); bitwise
    # resumption is test_resume_continues_identically's.
    full, _, resumed_dist, _, resumed_own = (ranks[0] for ranks in run_trainings(
        [a.split() for a in runs], 1, timeout_s=TIMEOUT * 2, threads_per_rank=1))
    kept = (" > keeping the weighted blend as the checkpoint sized it (64 samples; this run's --train-iters 16 "
            "would size it for 128 samples), so the consumed samples continue its order")
    for resumed in (resumed_dist, resumed_own):
        assert resumed["start_iteration"] == 4
        assert resumed["losses"] == pytest.approx(full["losses"][4:8], abs=1e-4)
        assert kept in resumed["checkpoint_lines"]
        # Read before the data: the start-up line counts the kept blend, not one of 128 samples.
        assert " > train data: 40 documents -> 64 samples (blended), 552 tokens, 0 truncated" in resumed["printed"]


def test_the_blend_record_is_read_before_the_model_and_an_unreadable_file_leaves_it_to_the_load(tmp_path):
    # A dynapipe-format rank file, memory-mapped for its record alone; what cannot be read
    # (another layout's file names, damage) gives no record, so the load proper names the problem.
    import types

    import torch

    from megatron_integration.checkpoint import BLEND_RECORD_KEY
    from megatron_integration.checkpoint_formats import recorded_training_blend
    from megatron_integration.initialize import RankInfo

    rank_dir = tmp_path / "ckpt" / "iter_0000004" / "mp_rank_00_000"
    rank_dir.mkdir(parents=True)
    torch.save({"extra": {BLEND_RECORD_KEY: ["samples", 64]}, "model": {"w": torch.zeros(3)}},
               rank_dir / "model_optim_rng.pt")
    (rank_dir / "model_optim_rng.pt.sha256").write_text("not checked here")
    (tmp_path / "ckpt" / "latest_checkpointed_iteration.txt").write_text("4")
    info = RankInfo(0, 1, 0, 1, 0, 1, 0, 1, torch.device("cpu"))
    cfg = types.SimpleNamespace(load=str(tmp_path / "ckpt"), finetune=False)
    assert recorded_training_blend(cfg, info) == ["samples", 64]
    assert recorded_training_blend(types.SimpleNamespace(load=str(tmp_path / "ckpt"), finetune=True), info) is None
    assert recorded_training_blend(types.SimpleNamespace(load=None, finetune=False), info) is None
    other_layout = RankInfo(0, 1, 1, 2, 0, 1, 0, 1, torch.device("cpu"))  # pipeline rank 1: no such file
    assert recorded_training_blend(cfg, other_layout) is None
    (rank_dir / "model_optim_rng.pt").write_bytes(b"damaged")
    assert recorded_training_blend(cfg, info) is None


def test_a_random_state_saved_on_the_other_kind_of_device_is_refused_naming_no_load_rng(monkeypatch):
    # A GPU's generator states (16 bytes) loaded into a CPU rank's tracker "succeeded", then the
    # first dropout failed with torch's size error; and the other way round.
    import torch
    from megatron.core import tensor_parallel

    from megatron_integration.checkpoint import check_rng_fits

    sizes = {"CPU": 5056, "GPU": 16}

    class Tracker:
        here = "CPU"

        def get_states(self):
            return {"model-parallel-rng": torch.zeros(sizes[Tracker.here], dtype=torch.uint8)}

    monkeypatch.setattr(tensor_parallel, "get_cuda_rng_tracker", Tracker)
    saved = {kind: {"model-parallel-rng": torch.zeros(n, dtype=torch.uint8)} for kind, n in sizes.items()}
    with pytest.raises(DynaPipeError, match="saved on GPU ranks and this run is on CPU ranks.*--no-load-rng"):
        check_rng_fits(saved["GPU"])
    check_rng_fits(saved["CPU"])
    check_rng_fits({"another-tracker-rng": torch.zeros(16, dtype=torch.uint8)})  # not this run's: not compared
    Tracker.here = "GPU"
    with pytest.raises(DynaPipeError, match="saved on CPU ranks and this run is on GPU ranks"):
        check_rng_fits(saved["CPU"])
    check_rng_fits(saved["GPU"])


def test_a_dynapipe_checkpoint_records_the_key_value_heads_and_the_position_table():
    # They were compared for torch_dist checkpoints only: a dynapipe-format one loaded into
    # another GQA or table size failed in torch's load_state_dict, naming no flag.
    from types import SimpleNamespace

    from megatron_integration.arguments import parse_training_args
    from megatron_integration.checkpoint_compat import model_mismatch, recorded_model_args

    base = ("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 128 --micro-batch-size 2 "
            "--global-batch-size 4 --train-iters 2 --lr 1e-3 --mock-data")
    cfg = parse_training_args(base.split(), 1, cuda=False)
    gqa = parse_training_args((base + " --group-query-attention --num-query-groups 2").split(), 1, cuda=False)
    longer = parse_training_args((base + " --max-position-embeddings 256").split(), 1, cuda=False)
    saved = SimpleNamespace(**recorded_model_args(gqa))
    assert model_mismatch(saved, cfg) == "2 key/value heads in the checkpoint, 4 here: --group-query-attention " \
                                         "--num-query-groups"
    assert model_mismatch(saved, gqa) is None
    assert model_mismatch(SimpleNamespace(**recorded_model_args(cfg)), longer) == \
        "--max-position-embeddings 128 in the checkpoint, 256 here"
    # And its layer implementation: a CPU run's local layers do not load into Transformer Engine's.
    from megatron_integration.checkpoint_compat import impl_mismatch

    assert impl_mismatch(recorded_model_args(cfg), cfg) is None and impl_mismatch({}, cfg) is None
    assert impl_mismatch({**recorded_model_args(cfg), "transformer_impl": "transformer_engine"}, cfg) == \
        "--transformer-impl transformer_engine in the checkpoint, local here"


def test_a_missing_rng_file_is_blamed_on_fewer_replicas_only_when_it_was(tmp_path):
    from megatron_integration.checkpoint import _missing_rng

    rank_dir = tmp_path / "mp_rank_00_001"
    rank_dir.mkdir()
    (rank_dir / "rng_dp_000.pt").write_bytes(b"x")
    # Saved at DP1, resumed at DP2: rank 1 has no file of its own.
    grown = _missing_rng(str(rank_dir / "rng_dp_001.pt"), str(rank_dir), 1)
    assert "saved with 1 data-parallel rank(s), this run has more; resume with --no-load-rng" in grown
    # Saved at DP2, rank 0's file deleted: not a change of size, a damaged checkpoint.
    (rank_dir / "rng_dp_000.pt").unlink()
    (rank_dir / "rng_dp_001.pt").write_bytes(b"x")
    lost = _missing_rng(str(rank_dir / "rng_dp_000.pt"), str(rank_dir), 0)
    assert "while the directory's other RNG files are there (rng_dp_001.pt): the checkpoint is incomplete" in lost
    # Saved at DP1, its only file deleted: nothing says the size changed.
    (rank_dir / "rng_dp_001.pt").unlink()
    assert "and so is every RNG file of its directory: the checkpoint is incomplete" in _missing_rng(str(rank_dir / "rng_dp_000.pt"),
                                                                             str(rank_dir), 0)
