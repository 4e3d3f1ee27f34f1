"""Fail-safety battery, training faults: NaN losses, one rank's corrupted checkpoint files,
out-of-vocabulary data, a Redis restart mid-run; then the Redis store alone (an fp16 overflow,
a skipped step, is checked in ``test_megatron_dynapipe.py``).

A fault must stop every rank with the same one line, or, for a fault the job is meant to
survive, change nothing: a Redis restart within the retry window gives the losses of an
undisturbed run. The training faults share one spawned
two-rank job (a spawn costs tens of seconds); the Redis cases use a real ``redis-server``
started on a free port, since only a real server loses what a restart loses.
"""
from __future__ import annotations

import contextlib
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from functools import partial

import numpy as np
import pytest

from dynapipe.errors import DynaPipeError

from failsafe_common import flip_byte, truncate_file, write_indexed


# ---- training faults: one spawned two-rank job runs them all ------------------------------------

TINY = ("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --ffn-hidden-size 128 --seq-length 64 "
        "--max-position-embeddings 64 --vocab-size 128 --micro-batch-size 2 --global-batch-size 4 "
        "--log-interval 1 --seed 7 --pipeline-model-parallel-size 2 --hidden-dropout 0 --attention-dropout 0")
MOCK = " --mock-data --dynapipe-mock-samples 64"
NP = "--non-persistent-save-interval 1 --non-persistent-ckpt-type global"
DP2 = TINY.replace("--pipeline-model-parallel-size 2", "--pipeline-model-parallel-size 1")  # two replicas
# CPython 3.12.0 and 3.12.1 crash in the garbage collector on the reference cycle a failed write
# leaves where megatron-core 0.19 writes torch_dist shards from the rank's own threads (CPython
# gh-111049, fixed in 3.12.2): the rank dies, and with it the job every test here shares, so
# those steps are left out there.
GC_CRASHES_ON_A_FAILED_WRITE = (3, 12, 0) <= sys.version_info[:3] < (3, 12, 2)
TORCH_DIST_FULL_DISK = ("fill_rank1_disk", "full_save_fails", "free_rank1_disk", "fill_rank1_disk_again",
                        "resave_fails", "free_rank1_disk_again", "load_after_failed_resave")


def fault_job(steps: list) -> list:
    """Rank body: run ``steps`` in order in one process group; each step's outcome.

    ``("train", argv)`` trains (a DynaPipeError is an outcome, not a failure of the job; ``argv``
    may be a list, one command line a rank);
    ``("train", argv, (iteration, marker))`` also pauses rank 0 after that iteration until
    the test removes the file ``marker`` it creates (a fault is injected meanwhile);
    ``("train", argv, ("signal", iteration))`` sends SIGTERM to rank 0 and its planner workers
    after that iteration (0-based), as torchrun forwards a scheduler's SIGTERM to a rank's group;
    ``("train", argv, None, (rank, iteration))`` makes that rank raise a RuntimeError in that
    iteration after its plan arrived, outside the pipeline executor;
    ``("rank0", fn, args)`` runs a file operation on rank 0 between runs (``"rank1"``: on rank 1,
    ``"all"``: on every rank).
    """
    import io

    import torch.distributed as dist

    from megatron_integration.arguments import parse_training_args
    from megatron_integration.initialize import destroy, end_run
    from megatron_integration.training import pretrain

    world = int(os.environ["WORLD_SIZE"])
    out = []
    try:
        for step in steps:
            if step[0] in ("rank0", "rank1", "all"):
                if step[0] == "all" or dist.get_rank() == int(step[0][-1]):
                    step[1](*step[2])
                dist.barrier()
                out.append(None)
                continue
            argv = step[1] if isinstance(step[1], str) else step[1][dist.get_rank()]  # or one a rank
            hook, raises = None, len(step) > 2 and step[2] is not None and step[2][0] == "raise"
            if len(step) > 2 and step[2] is not None and dist.get_rank() == 0:
                hook = (partial(_raise_after, step[2][1]) if raises else
                        partial(_signal_after, step[2][1]) if step[2][0] == "signal" else partial(_pause_at, *step[2]))
            fault = step[3] if len(step) > 3 and step[3][0] == dist.get_rank() else None
            t0 = time.monotonic()
            stream = io.StringIO()
            try:
                cfg = parse_training_args(argv.split(), world)  # its refusals are outcomes too
                with _fault_outside_the_executor(fault):
                    run = pretrain(cfg, stream=stream, on_iteration=hook)
                out.append({"losses": run.losses, "skipped": [r.skipped for r in run.results],
                            "start": run.start_iteration, "log": stream.getvalue()})
            except DynaPipeError as e:
                out.append({"error": str(e), "type": type(e).__name__, "elapsed": time.monotonic() - t0,
                            "exit_code": getattr(e, "exit_code", 2), "log": stream.getvalue()})
            except RuntimeError as e:
                if fault is None and not raises:
                    raise
                out.append({"error": str(e), "type": type(e).__name__, "elapsed": time.monotonic() - t0})
            if not dist.is_initialized():
                break
            end_run()  # each run sets up its own layout, as a fresh job would
    finally:
        destroy()
    return out


@contextlib.contextmanager
def _fault_outside_the_executor(fault):
    """Within the block, this rank raises in iteration ``fault[1]`` once its plan arrived (the
    tensor-parallel plan check, which runs before the executor); no fault when None."""
    if fault is None:
        yield
        return
    from megatron_integration import dynapipe_step

    real = dynapipe_step.check_plan_tensor_parallel

    def faulty(plan, *args):
        if plan.iteration == fault[1]:
            raise RuntimeError(f"injected fault in iteration {plan.iteration}")
        return real(plan, *args)

    dynapipe_step.check_plan_tensor_parallel = faulty
    try:
        yield
    finally:
        dynapipe_step.check_plan_tensor_parallel = real


def _limit_file_size(size):
    """Writes of this process (and of the writers it forks) past ``size`` bytes fail with EFBIG, as
    on a full disk (None: no limit again)."""
    import resource
    import signal

    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # an error from write(), not a kill
    resource.setrlimit(resource.RLIMIT_FSIZE, (resource.RLIM_INFINITY if size is None else size,
                                               resource.getrlimit(resource.RLIMIT_FSIZE)[1]))


def _spike_scale(samples: int, factor: float) -> None:
    """Set how many values set the spike checks' scale, and the factor over it that is large."""
    import megatron_integration.rerun_stats as rerun_stats

    rerun_stats.LARGE_VALUE_SAMPLES, rerun_stats.SPIKE_FACTOR = samples, factor


def _move_record(iter_dir: str) -> None:
    """Rewrite a checkpoint's rerun record as if its result had been rejected on another node (a
    resumed job here runs where the first one did), with its checksum."""
    import json

    from megatron_integration.checkpoint_files import write_checksum, write_text_synced

    path = os.path.join(iter_dir, "rerun_state.json")
    with open(path) as f:
        record = json.load(f)
    record["places"] = [["another-node", device] for _, device in record["places"]]
    write_text_synced(path, json.dumps(record))
    write_checksum(path)


def _as_release(iter_dir, root):
    """``root`` holding ``iter_dir`` as Megatron-LM's release checkpoint (tracker "release")."""
    shutil.copytree(iter_dir, os.path.join(root, "release"))
    with open(os.path.join(root, "latest_checkpointed_iteration.txt"), "w") as f:
        f.write("release")


def _strip_checksums_and_cut_common(iter_dir):
    from megatron_integration.checkpoint_dist import common_state_file

    for name in os.listdir(iter_dir):
        if name.endswith(".sha256"):
            os.remove(os.path.join(iter_dir, name))
    truncate_file(common_state_file(iter_dir), 100)  # common.pt (megatron-core 0.16) or rank 0's shards (0.19)


def _raise_after(iteration, it, result):
    """An on-iteration callback that fails after iteration ``iteration`` (0-based): a failure
    between steps, outside the stepper."""
    if it == iteration:
        raise RuntimeError(f"injected fault after iteration {it + 1}")


def _lose_checkpoint(root, iteration, latest):
    """``root`` as a job that died before saving ``iteration`` leaves it: that checkpoint gone,
    the tracker naming ``latest``."""
    shutil.rmtree(os.path.join(root, f"iter_{iteration:07d}"))
    with open(os.path.join(root, "latest_checkpointed_iteration.txt"), "w") as f:
        f.write(str(latest))


def _signal_after(iteration, it, result):
    """An on-iteration callback that sends SIGTERM after iteration ``iteration`` (0-based) to this
    rank's child processes (DynaPipe's planner workers) and to this rank."""
    import multiprocessing
    import signal

    if it == iteration:
        for child in multiprocessing.active_children():
            os.kill(child.pid, signal.SIGTERM)
        os.kill(os.getpid(), signal.SIGTERM)


def _pause_at(iteration, marker, it, result):
    if it != iteration:
        return
    open(marker, "w").close()
    deadline = time.monotonic() + 60
    while os.path.exists(marker) and time.monotonic() < deadline:
        time.sleep(0.02)


def _restart_on_marker(marker, procs, port, stop, seen):
    """Test-side thread: when rank 0 pauses and a payload waits unread on the server, kill
    Redis, bring it back empty, and let rank 0 go on."""
    from dynapipe.runtime.kv_store import KVStoreSpec

    probe = KVStoreSpec("redis", "127.0.0.1", port, connect_timeout_s=10.0).connect()
    while not stop.is_set():
        if os.path.exists(marker):
            deadline = time.monotonic() + 30
            while not any(k.endswith("/it5/r0/s0") for k in probe.keys("")) and time.monotonic() < deadline:
                time.sleep(0.02)
            seen.append(any(k.endswith("/it5/r0/s0") for k in probe.keys("")))
            probe.close()
            _restart(procs, port, 0.5)
            os.remove(marker)
            return
        time.sleep(0.02)
    probe.close()


@pytest.fixture(scope="module")
def fault_outcomes(tmp_path_factory):
    """Every training fault of this module, in one spawned job of two pipeline stages."""
    from megatron_integration.launch import spawn

    d = tmp_path_factory.mktemp("faults")
    save, nan_save, data = str(d / "ckpt"), str(d / "nan-ckpt"), d / "data"
    dist_save, full = str(d / "dist-ckpt"), str(d / "full-ckpt")
    save2, empty, release = str(d / "ckpt2"), str(d / "empty"), str(d / "release")
    inj_t, inj_p = str(d / "inject-transient"), str(d / "inject-persistent")
    tracker = str(d / "rejected.log")  # --result-rejected-tracker-filename
    sig_p, sig_d = str(d / "signal-padding"), str(d / "signal-dynapipe")
    np_save = str(d / "np-ckpt")  # --non-persistent-save-interval
    np_dyn, np_dir = str(d / "np-dyn-ckpt"), str(d / "np-elsewhere")
    # Trackers that differ by rank (a node-local path): rank 1's names iteration 2 to skip.
    trackers = [str(d / "rank0-rejected.log"), str(d / "rank1-rejected.log")]
    with open(trackers[1], "w") as f:
        f.writelines(f"ts=2026-12-01 00:00:00 node=n device=0 jobID={job} rank=0 iteration=2 "
                     f"status=RerunValidationStatus.RERUN_DISABLED result=nan message='loss'\n" for job in (1, 2))
    os.makedirs(empty)
    data.mkdir()
    out_of_vocab = write_indexed(data / "vocab", [[5, 6, 7, 8]] * 6 + [[5, 200, 7]] + [[9, 10]] * 5)
    good = write_indexed(data / "good", [list(range(5, 9 + 3 * (i % 7))) for i in range(32)])
    # Documents of one token (preprocess_data.py --append-eod writes one for every empty text):
    # nothing to predict, so a global batch of them has no loss tokens.
    one_token = write_indexed(data / "one-token", [[3]] * 32)
    cut = write_indexed(data / "cut", [[5, 6, 7, 8]] * 8)
    truncate_file(cut + ".idx", -5)
    steps = {
        # --rerun-mode validate_results (the default): iteration 2 diverges, is computed again in
        # place and reproduced; the weights of iteration 1 are saved with the record (exit 16). The
        # tracker file gets the initial run's and the rerun's lines.
        "nan_padding": ("train", f"{TINY}{MOCK} --train-iters 3 --lr 1e20 --save {nan_save} "
                                 f"--result-rejected-tracker-filename {tracker}"),
        # Resumed on the same node and devices: resume elsewhere (16 again); moved (the record's
        # places rewritten): reproduced there too, so the run diverged (17); --rerun-mode disabled
        # goes past the record, and its check stops the run.
        "nan_resumed_here": ("train", f"{TINY}{MOCK} --train-iters 3 --lr 1e20 --load {nan_save} "
                                      f"--result-rejected-tracker-filename {tracker}"),
        "move_nan_record": ("rank0", _move_record, (os.path.join(nan_save, "iter_0000001"),)),
        "nan_resumed_elsewhere": ("train", f"{TINY}{MOCK} --train-iters 3 --lr 1e20 --load {nan_save} "
                                           f"--result-rejected-tracker-filename {tracker}"),
        # Reproduced twice on rank 1, the tracker names iteration 2 to skip: the record is not read,
        # iteration 2 is skipped, and iteration 3 (the job's first trained) meets the diverged
        # weights, which the tracker gets too.
        "nan_resumed_skipped": ("train", f"{TINY}{MOCK} --train-iters 3 --lr 1e20 --load {nan_save} "
                                         f"--result-rejected-tracker-filename {tracker}"),
        "nan_resumed_disabled": ("train", f"{TINY}{MOCK} --train-iters 3 --lr 1e20 --load {nan_save} "
                                          "--rerun-mode disabled"),
        # Ranks whose trackers name different iterations would skip different batches: refused.
        "tracker_differs": ("train", [f"{TINY}{MOCK} --train-iters 1 --lr 1e-3 --result-rejected-tracker-filename {t}"
                                      for t in trackers]),
        # --check-weight-hash-across-dp-replicas-interval on two data-parallel replicas: the same
        # weights at the start and after every iteration, on megatron-core's schedule and through
        # DynaPipe's executor (whose replicas train different micro-batches); a replica that steps
        # with another learning rate differs after its first iteration, and every rank stops.
        "hash_padding": ("train", f"{DP2}{MOCK} --train-iters 2 --lr 1e-3 "
                                  "--check-weight-hash-across-dp-replicas-interval 1"),
        "hash_dynapipe": ("train", f"{DP2}{MOCK} --train-iters 2 --lr 1e-3 --use-dynapipe "
                                   "--check-weight-hash-across-dp-replicas-interval 2"),
        "hash_differs": ("train", [f"{DP2}{MOCK} --train-iters 2 --lr {lr} "
                                   "--check-weight-hash-across-dp-replicas-interval 1" for lr in ("1e-3", "2e-3")]),
        # Non-persistent checkpoints every iteration between the persistent ones (2, 4): only the
        # newest (3) is kept. The job "dies" before its final save (the persistent 4 removed), and
        # the resumed one loads the non-persistent 3, newer than --load's 2, and trains the 4th.
        "np_saved": ("train", f"{TINY}{MOCK} --train-iters 4 --lr 1e-3 --split 100,0,0 --save {np_save} "
                              f"--save-interval 2 {NP}"),
        "np_cut": ("rank0", _lose_checkpoint, (np_save, 4, 2)),
        "np_resumed": ("train", f"{TINY}{MOCK} --train-iters 4 --lr 1e-3 --split 100,0,0 --load {np_save} "
                                "--non-persistent-ckpt-type global"),
        # The same in this project's per-rank format, to a directory of its own.
        "np_dyn_saved": ("train", f"{TINY}{MOCK} --train-iters 4 --lr 1e-3 --split 100,0,0 --save {np_dyn} "
                                  f"--save-interval 2 --ckpt-format dynapipe {NP} --non-persistent-global-ckpt-dir {np_dir}"),
        "np_dyn_cut": ("rank0", _lose_checkpoint, (np_dyn, 4, 2)),
        "np_dyn_resumed": ("train", f"{TINY}{MOCK} --train-iters 4 --lr 1e-3 --split 100,0,0 --load {np_dyn} "
                                    f"--ckpt-format dynapipe --non-persistent-ckpt-type global "
                                    f"--non-persistent-global-ckpt-dir {np_dir}"),
        # --exit-signal-handler: SIGTERM after the first iteration (to rank 0 and its planner
        # workers) ends the run there with a checkpoint and no error; resumed, it trains the rest as
        # the uninterrupted run (skip_none) does.
        "signal_padding": ("train", f"{TINY}{MOCK} --train-iters 3 --lr 1e-3 --split 100,0,0 --save {sig_p} "
                                    "--exit-signal-handler", ("signal", 0)),
        "signal_resumed": ("train", f"{TINY}{MOCK} --train-iters 3 --lr 1e-3 --split 100,0,0 --load {sig_p}"),
        "signal_dynapipe": ("train", f"{TINY}{MOCK} --train-iters 3 --lr 1e-3 --split 100,0,0 --save {sig_d} "
                                     "--use-dynapipe --exit-signal-handler --exit-signal SIGTERM", ("signal", 0)),
        "signal_dynapipe_resumed": ("train", f"{TINY}{MOCK} --train-iters 3 --lr 1e-3 --split 100,0,0 --load {sig_d} "
                                             "--use-dynapipe"),
        # Indexed data through the planner workers: the data checks pass, then the loss diverges.
        "nan_dynapipe": ("train", f"{TINY} --data-path {good} --train-iters 3 --lr 1e20 --use-dynapipe"),
        "nan_disabled": ("train", f"{TINY}{MOCK} --train-iters 3 --lr 1e20 --rerun-mode disabled"),
        # Injected errors (each validation of every rank injects at rate 1): a transient one differs
        # when computed again (17, no record); a persistent one is reproduced in place (16) and
        # differs on other devices (17).
        "inject_transient": ("train", f"{TINY}{MOCK} --train-iters 3 --lr 1e-3 --save {inj_t} "
                                      "--error-injection-rate 1"),
        "inject_persistent": ("train", f"{TINY}{MOCK} --train-iters 3 --lr 1e-3 --save {inj_p} --use-dynapipe "
                                       "--error-injection-rate 1 --error-injection-type persistent_error"),
        "move_inj_record": ("rank0", _move_record, (os.path.join(inj_p, "iter_0000001"),)),
        "inject_resumed_elsewhere": ("train", f"{TINY}{MOCK} --train-iters 3 --lr 1e-3 --load {inj_p} "
                                              "--use-dynapipe"),
        # The spike checks through DynaPipe's executor, their scale set by one value and any value
        # of half of it or more "large": every checked iteration is computed again, reproduced, and
        # training goes on with the same losses as without the checks.
        "spike_scale": ("all", _spike_scale, (1, 0.5)),
        "spikes_checked": ("train", f"{TINY}{MOCK} --train-iters 4 --lr 1e-3 --use-dynapipe --check-for-spiky-loss "
                                    "--check-for-large-grads"),
        "spike_scale_back": ("all", _spike_scale, (100, 10.0)),
        "spikes_unchecked": ("train", f"{TINY}{MOCK} --train-iters 4 --lr 1e-3 --use-dynapipe"),
        # --iterations-to-skip 2: the second iteration's batch is consumed untrained, on megatron-core's
        # schedule and through DynaPipe's loader alike.
        "skip_none": ("train", f"{TINY}{MOCK} --train-iters 3 --lr 1e-3 --split 100,0,0"),
        "skip_padding": ("train", f"{TINY}{MOCK} --train-iters 3 --lr 1e-3 --split 100,0,0 --iterations-to-skip 2"),
        "skip_dynapipe": ("train", f"{TINY}{MOCK} --train-iters 3 --lr 1e-3 --split 100,0,0 --iterations-to-skip 2 "
                                   "--use-dynapipe"),
        # Every iteration computed twice: the same losses as one computation, and the differences told.
        "report_stats": ("train", f"{TINY}{MOCK} --train-iters 2 --lr 1e-3 --rerun-mode report_stats"),
        "nan_unchecked": ("train", f"{TINY}{MOCK} --train-iters 3 --lr 1e20 --no-check-for-nan-in-loss-and-grad"),
        # The resumed runs are longer than the saved ones: they take their own learning-rate schedule.
        "saved": ("train", f"{TINY}{MOCK} --train-iters 2 --lr 1e-3 --save {save} --ckpt-format dynapipe"),
        "resumed": ("train", f"{TINY}{MOCK} --train-iters 3 --lr 1e-3 --load {save} "
                           "--override-opt_param-scheduler"),
        "resumed_as_bf16": ("train", f"{TINY}{MOCK} --train-iters 3 --lr 1e-3 --load {save} --bf16 "
                                     "--override-opt_param-scheduler"),
        # The dynapipe format records the model's arguments as torch_dist does: another norm is named.
        "load_dynapipe_other_norm": ("train", f"{TINY}{MOCK} --train-iters 3 --lr 1e-3 --load {save} "
                                              "--override-opt_param-scheduler --normalization RMSNorm"),
        # Adam's betas and epsilon come back with the saved parameter groups: another value is refused.
        "load_other_beta2": ("train", f"{TINY}{MOCK} --train-iters 3 --lr 1e-3 --load {save} "
                                      "--override-opt_param-scheduler --adam-beta2 0.95"),
        # Loading mistakes that must not start from random weights, or resume on the wrong split.
        "finetune_iter_dir": ("train", f"{TINY}{MOCK} --train-iters 2 --lr 1e-3 --load {save}/iter_0000002 "
                              "--finetune"),
        "exit_on_missing": ("train", f"{TINY}{MOCK} --train-iters 2 --lr 1e-3 --load {empty} "
                            "--exit-on-missing-checkpoint"),
        "other_pp": ("train", f"{TINY.replace(' --pipeline-model-parallel-size 2', '')}{MOCK} --train-iters 3 "
                              f"--lr 1e-3 --load {save} --override-opt_param-scheduler"),
        "make_release": ("rank0", _as_release, (os.path.join(save, "iter_0000002"), release)),
        "load_release": ("train", f"{TINY}{MOCK} --train-iters 1 --lr 1e-3 --load {release}"),
        "flip_rank1_rng": ("rank0", flip_byte, (os.path.join(save, "iter_0000002", "mp_rank_00_001", "rng_dp_000.pt"),
                                                99)),
        "load_flipped_rng": ("train", f"{TINY}{MOCK} --train-iters 3 --lr 1e-3 --load {save} "
                           "--override-opt_param-scheduler"),
        "truncate_rank0_model": ("rank0", truncate_file, (os.path.join(save, "iter_0000002", "mp_rank_00_000",
                                                                        "model_optim_rng.pt"), -10)),
        "load_truncated": ("train", f"{TINY}{MOCK} --train-iters 3 --lr 1e-3 --load {save} "
                           "--override-opt_param-scheduler --no-load-rng"),
        # torch_dist: a shard cut short is named by its checksum; without checksums (as Megatron-LM
        # writes them) dist_checkpointing's own error comes back as one line naming the file.
        "saved_dist": ("train", f"{TINY}{MOCK} --train-iters 1 --lr 1e-3 --save {dist_save}"),
        "load_other_norm": ("train", f"{TINY}{MOCK} --train-iters 2 --lr 1e-3 --load {dist_save} "
                                     "--override-opt_param-scheduler --normalization RMSNorm"),
        "load_dist_other_eps": ("train", f"{TINY}{MOCK} --train-iters 2 --lr 1e-3 --load {dist_save} "
                                         "--override-opt_param-scheduler --adam-eps 1e-6"),
        "truncate_dist_shard": ("rank0", truncate_file, (os.path.join(dist_save, "iter_0000001", "__1_0.distcp"), -7)),
        "load_truncated_dist": ("train", f"{TINY}{MOCK} --train-iters 2 --lr 1e-3 --load {dist_save} "
                                  "--override-opt_param-scheduler"),
        "unverified_and_broken": ("rank0", _strip_checksums_and_cut_common, (os.path.join(dist_save, "iter_0000001"),)),
        "load_unverified_broken": ("train", f"{TINY}{MOCK} --train-iters 2 --lr 1e-3 --load {dist_save} "
                                  "--override-opt_param-scheduler"),
        # A node that cannot see --load (here: rank 1 is pointed at an empty directory) must not
        # start from random while the others resume.
        "load_unseen": ("train", [f"{TINY}{MOCK} --train-iters 3 --lr 1e-3 --load {save} --override-opt_param-scheduler",
                                  f"{TINY}{MOCK} --train-iters 3 --lr 1e-3 --load {empty} "
                                  "--override-opt_param-scheduler"]),
        # Rank 1 cannot write its part (its disk fills up): every rank stops with its line, and the
        # previous checkpoint stays the latest.
        "saved_once": ("train", f"{TINY}{MOCK} --train-iters 1 --lr 1e-3 --save {save2} --ckpt-format dynapipe"),
        "block_rank1_writes": ("rank1", _limit_file_size, (20000,)),
        "save_blocked": ("train", f"{TINY}{MOCK} --train-iters 2 --lr 1e-3 --save {save2} --load {save2} "
                                  "--ckpt-format dynapipe --override-opt_param-scheduler"),
        # Iteration 1 saved again over the complete one (fine-tuned from it, so counted from 0 again):
        # it must survive the failure.
        "resave_blocked": ("train", f"{TINY}{MOCK} --train-iters 1 --lr 1e-3 --save {save2} --load {save2} "
                                    "--finetune --ckpt-format dynapipe"),
        "free_rank1_writes": ("rank1", _limit_file_size, (None,)),
        "load_after_blocked_resave": ("train", f"{TINY}{MOCK} --train-iters 2 --lr 1e-3 --load {save2} "
                                               "--ckpt-format dynapipe --override-opt_param-scheduler"),
        # Rank 1 fails before its executor runs iteration 1; rank 0, waiting for it in its plan,
        # must stop with rank 1's cause at once, not at the executor's timeout.
        "outside_fault": ("train", f"{TINY}{MOCK} --train-iters 3 --lr 1e-3 --use-dynapipe", None, (1, 1)),
        "after_outside_fault": ("train", f"{TINY}{MOCK} --train-iters 2 --lr 1e-3 --use-dynapipe"),
        # Rank 0 (the first stage, and the node's planner) fails between iterations 1 and 2, its
        # process alive. Planning one iteration ahead, iteration 2 is never planned: rank 1, awaiting
        # its plan, must stop with the cause, not at the plan timeout.
        "between_steps_fault": ("train", f"{TINY}{MOCK} --train-iters 4 --lr 1e-3 --use-dynapipe "
                                         "--dynapipe-prefetch 1", ("raise", 0)),
        "one_token_padding": ("train", f"{TINY} --data-path {one_token} --split 100,0,0 --train-iters 1 --lr 1e-3"),
        "one_token_dynapipe": ("train", f"{TINY} --data-path {one_token} --split 100,0,0 --train-iters 1 --lr 1e-3 "
                                        f"--use-dynapipe"),
        "data_padding": ("train", f"{TINY} --data-path {out_of_vocab} --train-iters 1 --lr 1e-3"),
        "data_dynapipe": ("train", f"{TINY} --data-path {out_of_vocab} --train-iters 1 --lr 1e-3 --use-dynapipe"),
        "good_data": ("train", f"{TINY} --data-path {good} --train-iters 1 --lr 1e-3"),
        # Rank 1's disk fills up during a torch_dist save: every rank stops with rank 1's cause,
        # and the previous checkpoint stays the latest.
        "full_saved": ("train", f"{TINY}{MOCK} --train-iters 1 --lr 1e-3 --save {full}"),
        "fill_rank1_disk": ("rank1", _limit_file_size, (20000,)),
        "full_save_fails": ("train", f"{TINY}{MOCK} --train-iters 2 --lr 1e-3 --load {full} --save {full} "
                                     "--override-opt_param-scheduler"),
        "free_rank1_disk": ("rank1", _limit_file_size, (None,)),
        # Saving iteration 1 again into the --save that holds it (fine-tuned from it, so counted from
        # 0 again): the failed save must leave the complete iteration 1 in place.
        "fill_rank1_disk_again": ("rank1", _limit_file_size, (20000,)),
        "resave_fails": ("train", f"{TINY}{MOCK} --train-iters 1 --lr 1e-3 --save {full} --load {full} --finetune"),
        "free_rank1_disk_again": ("rank1", _limit_file_size, (None,)),
        "load_after_failed_resave": ("train", f"{TINY}{MOCK} --train-iters 2 --lr 1e-3 --load {full} "
                                              "--override-opt_param-scheduler"),
        "load_fp32_as_bf16": ("train", f"{TINY}{MOCK} --train-iters 2 --lr 1e-3 --load {full} --bf16 "
                                       "--override-opt_param-scheduler"),
        "load_fp32_as_bf16_weights": ("train", f"{TINY}{MOCK} --train-iters 2 --lr 1e-3 --load {full} --bf16 "
                                               "--no-load-optim"),
        # Only rank 0 opens the validation split at start-up (its summary line): rank 1 must stop
        # with rank 0's line, not with a gloo error in its next collective.
        "valid_data": ("train", f"{TINY} --train-data-path {good} --valid-data-path {cut} --train-iters 1 "
                                "--lr 1e-3"),
    }
    from megatron_integration.launch import free_port

    port = free_port()
    procs = [_redis_start(port)]
    marker = str(d / "paused")
    # Six iterations planned ahead: when rank 0 pauses after iteration 1, its payload of
    # iteration 5 waits unread on the server (its fetch thread holds 2 and 3 queued and 4 in
    # hand) and is lost.
    redis = (f" --use-dynapipe --dynapipe-kv-backend redis --dynapipe-redis-port {port} --dynapipe-store-retry-s 20"
             f" --dynapipe-prefetch 6")
    if GC_CRASHES_ON_A_FAILED_WRITE:
        steps = {k: v for k, v in steps.items() if k not in TORCH_DIST_FULL_DISK}
    steps["redis_undisturbed"] = ("train", f"{TINY}{MOCK} --train-iters 7 --lr 1e-3{redis}")
    steps["redis_restarted"] = ("train", f"{TINY}{MOCK} --train-iters 7 --lr 1e-3{redis}", (1, marker))
    stop, lost_unread = threading.Event(), []
    restarter = threading.Thread(target=_restart_on_marker, args=(marker, procs, port, stop, lost_unread),
                                 daemon=True)
    restarter.start()
    try:
        results = spawn(fault_job, 2, (list(steps.values()),), timeout_s=300, threads_per_rank=1)
    finally:
        stop.set()
        restarter.join(10)
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(10)
    outcomes = {name: [r[i] for r in results] for i, name in enumerate(steps)}
    return outcomes, {"save": save, "save2": save2, "nan_save": nan_save, "inj_t": inj_t, "inj_p": inj_p,
                      "tracker": tracker, "trackers": trackers, "sig_p": sig_p, "sig_d": sig_d, "np_save": np_save,
                      "np_dyn": np_dyn, "np_dir": np_dir,
                      "redis_restarts": len(procs) - 1,
                      "lost_unread": lost_unread, "dist_save": dist_save, "full": full}


def test_loading_mistakes_stop_every_rank_in_one_line(fault_outcomes):
    outcomes, paths = fault_outcomes
    save, dist_save = paths["save"], paths["dist_save"]
    expected = {
        # Refused before any work: it would start from random.
        "finetune_iter_dir": f"--load {save}/iter_0000002: is one saved iteration, not the directory that holds "
                             f"latest_checkpointed_iteration.txt; give --load {save} (it resumes",
        "exit_on_missing": "holds no checkpoint (no latest_checkpointed_iteration.txt) and "
                           "--exit-on-missing-checkpoint was given",
        "other_pp": f"{save}/iter_0000002 was saved at --tensor-model-parallel-size 1 --pipeline-model-parallel-size "
                    f"2, this run is 1 x 1; resume at the sizes it was saved at, or save in --ckpt-format torch_dist",
        "load_other_norm": f"{dist_save}/iter_0000001: the checkpoint does not fit this model (--normalization "
                           f"LayerNorm in the checkpoint, RMSNorm here)",
        "load_dynapipe_other_norm": f"{save}/iter_0000002: the checkpoint does not fit this model (--normalization "
                                    f"LayerNorm in the checkpoint, RMSNorm here); use the model arguments it was "
                                    f"saved with.",
        "load_other_beta2": f"{save}/iter_0000002: the optimizer state was saved with --adam-beta2 0.999, this run "
                            f"gives 0.95, which its loaded state would override; resume with --adam-beta2 0.999, or "
                            f"add --no-load-optim to start a fresh optimizer.",
        "load_dist_other_eps": f"{dist_save}/iter_0000001: the optimizer state was saved with --adam-eps 1e-08",
    }
    for name, text in expected.items():
        errors = [o["error"] for o in outcomes[name]]
        assert errors[0] == errors[1] and text in errors[0] and "\n" not in errors[0], (name, errors)
    # Megatron-LM's release checkpoint: the weights, from iteration 0.
    assert [o["start"] for o in outcomes["load_release"]] == [0, 0]
    assert len(outcomes["load_release"][1]["losses"]) == 1


@pytest.mark.parametrize("name", ["nan_disabled", "nan_resumed_disabled"])
def test_nan_stops_every_rank_before_the_step_when_reruns_are_disabled(fault_outcomes, name):
    outcomes, _ = fault_outcomes
    per_rank = outcomes[name]
    texts = [o["error"] for o in per_rank]
    assert texts[0] == texts[1]  # the same line on every rank
    assert texts[0].startswith("iteration 2: ") and "rank 1" in texts[0] and "\n" not in texts[0]
    assert "--no-check-for-nan-in-loss-and-grad" in texts[0]
    assert [o["exit_code"] for o in per_rank] == [2, 2]


def test_a_resumed_run_without_reruns_goes_past_the_record(fault_outcomes):
    outcomes, paths = fault_outcomes
    log = outcomes["nan_resumed_disabled"][0]["log"]
    assert f"ignoring {paths['nan_save']}/iter_0000001/rerun_state.json" in log and "--rerun-mode disabled" in log
    skipped = outcomes["nan_resumed_skipped"]
    assert (f"ignoring {paths['nan_save']}/iter_0000001/rerun_state.json: --iterations-to-skip 2 skips the "
            f"iteration it records") in skipped[0]["log"]
    assert skipped[0]["error"].startswith("iteration 3: the loss is NaN or infinite")
    assert [o["exit_code"] for o in skipped] == [2, 2]


def test_the_tracker_file_records_rejections_and_skips_a_batch_reproduced_twice(fault_outcomes):
    from megatron_integration.rerun_tracker import read_skips

    outcomes, paths = fault_outcomes
    with open(paths["tracker"]) as f:
        lines = f.read().splitlines()
    # The loss began on rank 1 (the last stage), whose NaN reached rank 0's gradients: one line
    # an event, rank 1's, in Megatron-LM's format. Resumed on the same device, nothing is
    # recorded (as Megatron-LM); resumed elsewhere, reproduced; the skipping job's first iteration
    # stops unchecked again.
    events = [(re.search(r"rank=(\d+) iteration=(\d+) status=RerunValidationStatus\.(\w+) result=(\S+) "
                         r"message='(.*)'$", line).groups()) for line in lines]
    assert events == [("1", "2", "INITIAL_RUN", "nan", "loss"), ("1", "2", "FIRST_RERUN_REPRODUCIBLE", "nan", "loss"),
                      ("1", "2", "SECOND_RERUN_REPRODUCIBLE", "nan", "loss"), ("1", "3", "RERUN_DISABLED", "nan", "loss")]
    assert all(line.startswith("ts=") and " jobID=" in line and " node=" in line for line in lines)
    log = outcomes["nan_resumed_skipped"][0]["log"]
    assert (f"--result-rejected-tracker-filename {paths['tracker']}: skipping iterations [2], each rejected twice on "
            f"one rank with a result that reproduced") in log
    # The next job would skip iteration 2 only: iteration 3 was rejected once.
    assert read_skips(paths["tracker"]).skip == (2,)
    differs = outcomes["tracker_differs"]
    assert differs[0]["error"] == differs[1]["error"] and [o["exit_code"] for o in differs] == [2, 2]
    assert (f"rank 0 skips iterations [] ({paths['trackers'][0]}) and rank 1 [2] ({paths['trackers'][1]}); the ranks "
            f"read different files") in differs[0]["error"]


@pytest.mark.parametrize("name", ["nan_padding", "nan_dynapipe"])
def test_a_reproduced_nan_is_computed_again_and_ends_with_status_16(fault_outcomes, name):
    outcomes, _ = fault_outcomes
    per_rank = outcomes[name]
    texts = [o["error"] for o in per_rank]
    assert texts[0] == texts[1] and "\n" not in texts[0]
    assert texts[0].startswith("iteration 2: the loss is NaN or infinite on rank 1")
    assert "computing it again on the same devices reproduced it" in texts[0]
    assert [o["exit_code"] for o in per_rank] == [16, 16]
    assert "result rejected on" in per_rank[0]["log"]  # the rerun is said before it runs


def test_a_reproduced_nan_saves_the_weights_before_it_with_its_record(fault_outcomes):
    import json

    outcomes, paths = fault_outcomes
    iter_dir = os.path.join(paths["nan_save"], "iter_0000001")
    with open(os.path.join(paths["nan_save"], "latest_checkpointed_iteration.txt")) as f:
        assert f.read().strip() == "1"
    with open(os.path.join(iter_dir, "rerun_state.json")) as f:
        record = json.load(f)
    assert record["iteration"] == 2 and 1 in record["rejected"]
    assert os.path.exists(os.path.join(iter_dir, "rerun_state.json.sha256"))
    assert f"{iter_dir}/rerun_state.json" in outcomes["nan_padding"][0]["error"]
    # Resumed on the same node and devices: nothing is learned; resume elsewhere.
    here = outcomes["nan_resumed_here"]
    assert [o["exit_code"] for o in here] == [16, 16]
    assert "run on the node and device that rejected it" in here[0]["error"]
    assert "computing it again on this run's devices" in here[0]["log"]
    # Elsewhere, a NaN of a diverged run comes back: the result is correct, the run diverged.
    elsewhere = outcomes["nan_resumed_elsewhere"]
    assert [o["exit_code"] for o in elsewhere] == [17, 17]
    assert "it is reproduced: the result is correct and the run itself diverged" in elsewhere[0]["error"]
    assert "Resume with --iterations-to-skip 2 to skip its batch" in elsewhere[0]["error"]


def test_injected_errors_are_diagnosed_as_megatron_lm_does(fault_outcomes):
    outcomes, paths = fault_outcomes
    transient = outcomes["inject_transient"]
    assert [o["exit_code"] for o in transient] == [17, 17]
    assert transient[0]["error"].startswith("iteration 2: an injected transient error on ranks 0, 1")
    assert "did not reproduce it: a possible transient fault of ranks 0, 1" in transient[0]["error"]
    # The weights before it are saved, without a record: a resumed run simply retrains it.
    assert os.path.isdir(os.path.join(paths["inj_t"], "iter_0000001"))
    assert not os.path.exists(os.path.join(paths["inj_t"], "iter_0000001", "rerun_state.json"))
    persistent = outcomes["inject_persistent"]
    assert [o["exit_code"] for o in persistent] == [16, 16]
    assert os.path.exists(os.path.join(paths["inj_p"], "iter_0000001", "rerun_state.json"))
    elsewhere = outcomes["inject_resumed_elsewhere"]
    assert [o["exit_code"] for o in elsewhere] == [17, 17]
    assert "it is not reproduced: the devices that gave it (rank 0: node" in elsewhere[0]["error"]


def test_spike_checks_compute_a_large_value_again_and_training_goes_on(fault_outcomes):
    outcomes, _ = fault_outcomes
    checked, plain = outcomes["spikes_checked"][1], outcomes["spikes_unchecked"][1]
    assert len(checked["losses"]) == 4 and checked["losses"] == plain["losses"]
    log = outcomes["spikes_checked"][0]["log"]
    # Iteration 1 is not checked and iteration 2 sets the scale: 3 and 4 are computed again.
    for k in (3, 4):
        assert f"iteration {k}: the loss of rank 1 is " in log and f"iteration {k}: the gradient norm of rank 0 is " in log
        assert f"iteration {k}: the loss of rank 1 is reproduced" in log
    assert "iteration 2: the" not in log and "not reproduced" not in log


def test_a_skipped_iteration_consumes_its_batch_untrained(fault_outcomes):
    outcomes, _ = fault_outcomes
    plain, padding, dynapipe = (outcomes[k][1] for k in ("skip_none", "skip_padding", "skip_dynapipe"))
    assert len(plain["losses"]) == 3 and len(padding["losses"]) == len(dynapipe["losses"]) == 2
    assert padding["losses"][0] == plain["losses"][0]
    # Iteration 3 trains on iteration 3's batch after one optimizer step, not two: both methods
    # skipped the same batch, so they agree with each other and not with the plain run.
    assert np.allclose(dynapipe["losses"], padding["losses"], rtol=0, atol=1e-5)
    assert abs(padding["losses"][1] - plain["losses"][2]) > 1e-4
    for name in ("skip_padding", "skip_dynapipe"):
        log = outcomes[name][1]["log"]  # the last stage logs
        assert "iteration        2/" not in log
        assert "iteration        3/       3 | consumed samples:           12 | skipped samples:            4 |" in log
        assert "skipped samples: 4 (1 iteration of --iterations-to-skip)" in log and "iterations 1-3 (3)" in log


def test_report_stats_computes_every_iteration_twice_and_trains_the_same(fault_outcomes):
    outcomes, _ = fault_outcomes
    stats, plain = outcomes["report_stats"][1], outcomes["saved"][1]
    assert stats["losses"] == plain["losses"] and all(np.isfinite(stats["losses"]))
    log = outcomes["report_stats"][0]["log"]
    assert "Stats on computation determinism" in log
    # Two iterations, the loss of the last stage and the gradient norm of both: all identical on CPU.
    assert "  loss: 2 samples, all identical" in log and "  gradient norm: 4 samples, all identical" in log


def test_nan_check_can_be_disabled(fault_outcomes):
    outcomes, _ = fault_outcomes
    losses = outcomes["nan_unchecked"][0]["losses"]
    assert len(losses) == 3 and np.isfinite(losses[0]) and not np.isfinite(losses[1])


def test_healthy_runs_are_untouched_by_the_checks(fault_outcomes):
    outcomes, _ = fault_outcomes
    saved, resumed = outcomes["saved"][0], outcomes["resumed"][0]
    assert len(saved["losses"]) == 2 and all(np.isfinite(saved["losses"]))
    assert resumed["start"] == 2 and len(resumed["losses"]) == 1 and not any(saved["skipped"])
    good = outcomes["good_data"][0]
    assert len(good["losses"]) == 1 and np.isfinite(good["losses"][0])


def test_a_corrupted_file_of_one_rank_stops_every_rank(fault_outcomes):
    outcomes, _ = fault_outcomes
    for name, kind in (("load_flipped_rng", "corrupted"), ("load_truncated", "truncated")):
        texts = [o["error"] for o in outcomes[name]]
        assert texts[0] == texts[1]
        assert kind in texts[0] and ".pt" in texts[0] and "\n" not in texts[0]
    assert "rank 1: " in outcomes["load_flipped_rng"][0]["error"]
    assert "rank 0: " in outcomes["load_truncated"][0]["error"]


def test_a_broken_torch_dist_checkpoint_stops_every_rank_with_one_line(fault_outcomes):
    from megatron_integration.checkpoint_dist import common_state_file

    outcomes, paths = fault_outcomes
    assert outcomes["saved_dist"][0]["losses"]
    truncated = [o["error"] for o in outcomes["load_truncated_dist"]]
    assert truncated[0] == truncated[1] and "\n" not in truncated[0]
    assert "__1_0.distcp is truncated" in truncated[0]
    # Without checksums (as Megatron-LM writes them) the shards' sizes are still checked against
    # the index: the shard cut above is named before megatron-core fails on it or on the common part.
    broken = [o["error"] for o in outcomes["load_unverified_broken"]]
    assert broken[0] == broken[1] and "\n" not in broken[0]
    common = common_state_file(os.path.join(paths["dist_save"], "iter_0000001"))
    assert os.path.basename(common) in ("common.pt", "__0_0.distcp")
    # megatron-core 0.19 keeps the common part in rank 0's shard, which was cut too: named first.
    cut = "__1_0.distcp" if os.path.basename(common) == "common.pt" else "__0_0.distcp"
    assert f"{cut} is truncated" in broken[0] and "its index needs" in broken[0], broken[0]


def test_a_failure_outside_the_executor_stops_the_waiting_rank_with_its_cause(fault_outcomes):
    outcomes, _ = fault_outcomes
    waiting, failed = outcomes["outside_fault"]
    assert failed["type"] == "RuntimeError" and failed["error"] == "injected fault in iteration 1"
    assert waiting["type"] == "RemoteFailure", waiting
    assert "global rank 1 failed first" in waiting["error"] and "injected fault in iteration 1" in waiting["error"]
    assert waiting["elapsed"] < 60, f"rank 0 waited {waiting['elapsed']:.0f} s"
    # The failed run's reports stay in its executor's namespace: the next run trains.
    assert all(len(o.get("losses", [])) == 2 for o in outcomes["after_outside_fault"]), outcomes["after_outside_fault"]


def test_a_failure_between_steps_stops_the_waiting_rank_with_its_cause(fault_outcomes):
    outcomes, _ = fault_outcomes
    failed, waiting = outcomes["between_steps_fault"]
    assert failed["type"] == "RuntimeError" and failed["error"] == "injected fault after iteration 1", failed
    assert waiting["type"] == "PlannerWorkerError", waiting
    assert waiting["error"].startswith("planner node 0 stopped: iteration 1, global rank 0: RuntimeError: injected "
                                       "fault after iteration 1"), waiting
    assert waiting["elapsed"] < 60, f"rank 1 waited {waiting['elapsed']:.0f} s"


def test_ranks_that_see_different_checkpoints_stop_instead_of_diverging(fault_outcomes):
    outcomes, paths = fault_outcomes
    for o in outcomes["load_unseen"]:  # each rank names its own --load here; the rest is the same line
        text = o.get("error")
        assert text is not None, o
        assert "disagree on the newest checkpoint" in text and "rank 0 sees iteration 2 (dynapipe)" in text
        assert "rank 1 sees no checkpoint" in text and "\n" not in text


def test_a_save_one_rank_cannot_write_stops_every_rank_and_keeps_the_previous(fault_outcomes):
    outcomes, paths = fault_outcomes
    assert outcomes["saved_once"][0]["losses"]
    texts = [o.get("error") for o in outcomes["save_blocked"]]
    assert texts[0] is not None and texts[0] == texts[1], texts
    assert texts[0].startswith("rank 1: saving ") and "mp_rank_00_001" in texts[0] and "\n" not in texts[0]
    with open(os.path.join(paths["save2"], "latest_checkpointed_iteration.txt")) as f:
        assert f.read().strip() == "1"
    assert outcomes["resave_blocked"][0]["error"].startswith("rank 1: saving "), outcomes["resave_blocked"]
    assert not any(n.endswith(".saving") for n in os.listdir(paths["save2"]))
    assert [o.get("start") for o in outcomes["load_after_blocked_resave"]] == [1, 1], outcomes["load_after_blocked_resave"]


@pytest.mark.parametrize("name", ["data_padding", "data_dynapipe"])
def test_out_of_vocabulary_ids_stop_every_batching_path(fault_outcomes, name):
    outcomes, _ = fault_outcomes
    for o in outcomes[name]:
        assert "vocab.bin: sequence 6, token 1 has id 200" in o["error"], o


@pytest.mark.parametrize("name", ["one_token_padding", "one_token_dynapipe"])
def test_a_global_batch_without_loss_tokens_stops_every_method_before_the_step(fault_outcomes, name):
    # The padding baseline once stepped the optimizer on a zero loss (Adam and weight decay
    # still moving the weights); DynaPipe stopped, blaming input-only samples.
    outcomes, _ = fault_outcomes
    for o in outcomes[name]:
        assert "the global batch has no loss tokens: each of its samples is input only, or a document of one " \
               "token" in o["error"], o


@pytest.mark.skipif(GC_CRASHES_ON_A_FAILED_WRITE, reason="CPython 3.12.0-3.12.1 crash collecting a failed write's "
                                                    "buffer (gh-111049); fixed in 3.12.2")
def test_a_full_disk_during_a_torch_dist_save_stops_every_rank_and_keeps_the_last_checkpoint(fault_outcomes):
    outcomes, paths = fault_outcomes
    texts = [o.get("error") for o in outcomes["full_save_fails"]]
    assert texts[0] == texts[1] and "\n" not in texts[0], texts
    assert texts[0].startswith(f"saving {paths['full']}/iter_0000002: writing the shards failed: rank 1: "), texts
    assert "still names the previous checkpoint" in texts[0]
    with open(os.path.join(paths["full"], "latest_checkpointed_iteration.txt")) as f:
        assert f.read().strip() == "1"
    assert "writing the shards failed: rank 1: " in outcomes["resave_fails"][0]["error"]
    assert not any(n.endswith(".saving") for n in os.listdir(paths["full"]))  # no partial shards kept
    assert [o.get("start") for o in outcomes["load_after_failed_resave"]] == [1, 1], outcomes["load_after_failed_resave"]


@pytest.mark.parametrize("name,root,iteration", [("load_fp32_as_bf16", "full", 1), ("resumed_as_bf16", "save", 2)])
def test_a_checkpoint_of_another_precision_is_refused_naming_it(fault_outcomes, name, root, iteration):
    # torch_dist reads the precision from Megatron-LM's args, the dynapipe format from its own record.
    outcomes, paths = fault_outcomes
    texts = [o.get("error") for o in outcomes[name]]
    assert texts[0] == texts[1] and "\n" not in texts[0], texts
    assert texts[0].endswith(f"{paths[root]}/iter_{iteration:07d}: the optimizer state was saved in fp32 (no "
                             f"--bf16/--fp16), this run trains in --bf16; resume at the precision it was saved at, "
                             f"or add --no-load-optim to load the weights and start a fresh optimizer."), texts
    assert outcomes["load_fp32_as_bf16_weights"][0]["start"] == 1  # the weights alone load


def test_a_dynapipe_checkpoint_records_its_optimizer_kind_and_resuming_across_it_is_refused(fault_outcomes):
    # The distributed optimizer keeps its state in distrib_optim.pt, which a checkpoint saved
    # without the flag lacks (a resume with it read that as damage). It needs CUDA, so the
    # refusal itself is checked on the recorded value.
    import torch

    from megatron_integration.checkpoint import check_distributed_optimizer

    _, paths = fault_outcomes
    payload = torch.load(os.path.join(paths["save"], "iter_0000002", "mp_rank_00_001", "model_optim_rng.pt"),
                         map_location="cpu", weights_only=False)
    assert payload["distributed_optimizer"] is False
    with pytest.raises(DynaPipeError, match=r"^ckpt/iter_0000002: the optimizer state was saved without "
                                            r"--use-distributed-optimizer and this run is with it; resume as it "
                                            r"was saved, or add --no-load-optim"):
        check_distributed_optimizer(payload["distributed_optimizer"], True, "ckpt/iter_0000002")
    check_distributed_optimizer(True, True, "x")
    check_distributed_optimizer(None, True, "x")  # earlier builds recorded nothing: not checked


def test_bad_data_read_by_rank_0_alone_stops_every_rank(fault_outcomes):
    outcomes, _ = fault_outcomes
    texts = [o.get("error") for o in outcomes["valid_data"]]
    assert texts[0] == texts[1] and texts[0].startswith("rank 0: ") and "\n" not in texts[0], texts
    assert "cut.idx" in texts[0], texts


def test_training_survives_a_redis_restart_with_the_same_losses(fault_outcomes):
    outcomes, paths = fault_outcomes
    assert paths["redis_restarts"] == 1 and paths["lost_unread"] == [True]  # a payload was lost unread
    undisturbed, restarted = outcomes["redis_undisturbed"][0], outcomes["redis_restarted"][0]
    assert "error" not in restarted, restarted
    assert len(restarted["losses"]) == 7
    assert restarted["losses"] == undisturbed["losses"]


# ---- the Redis store: a restart within the window costs a pause, not the job ----------------------

def _redis_start(port):
    exe = shutil.which("redis-server")
    if exe is None:
        if os.environ.get("DYNAPIPE_REQUIRE_REDIS") == "1":
            pytest.fail("redis-server is not installed but DYNAPIPE_REQUIRE_REDIS=1 requires the Redis tests")
        pytest.skip("redis-server binary not found")
    from dynapipe.runtime.kv_store import KVStoreSpec

    proc = subprocess.Popen([exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    spec = KVStoreSpec("redis", "127.0.0.1", port, connect_timeout_s=10.0)
    spec.connect().close()
    return proc


@pytest.fixture
def redis_port():
    from megatron_integration.launch import free_port

    port = free_port()
    procs = [_redis_start(port)]
    yield port, procs
    for p in procs:
        if p.poll() is None:
            p.kill()
            p.wait(10)


def _restart(procs, port, down_s, on_down=None):
    procs[-1].kill()
    procs[-1].wait(10)
    if on_down is not None:
        on_down()
    time.sleep(down_s)
    procs.append(_redis_start(port))


def test_loader_survives_a_redis_restart_with_the_same_data(redis_port):
    from test_loader import make_loader, reference_iterations, summarize

    from dynapipe.runtime.kv_store import KVStoreSpec

    port, procs = redis_port
    spec = KVStoreSpec("redis", "127.0.0.1", port, connect_timeout_s=10.0)
    iterations = 7
    got = []
    probe = spec.connect()
    with make_loader(kv_backend="redis", redis=spec, train_iters=iterations, store_retry_s=20, prefetch=6) as dl:
        for i, d in enumerate(dl):
            got.append(summarize(d))
            if i == 1:
                # Iterations up to 6 are planned; the fetch thread holds 2 and 3 queued and 4
                # in hand, so 5 waits on the server: the restart loses it, which only planning
                # again recovers.
                deadline = time.monotonic() + 60
                while probe.get(dl.keys.payload(5, 0, 0)) is None and time.monotonic() < deadline:
                    time.sleep(0.02)
                _restart(procs, port, 0.5)
                deadline = time.monotonic() + 10
                while dl._watcher.restarts == 0 and time.monotonic() < deadline:
                    time.sleep(0.02)
        assert dl._watcher.restarts == 1
    probe.close()
    ref = reference_iterations(iterations)
    assert [g["plan"] for g in got] == [r["plan"] for r in ref]
    assert [g["tensors"] for g in got] == [r["tensors"] for r in ref]


def test_a_failed_replanning_after_a_redis_restart_stops_the_loader_with_its_cause(redis_port):
    # Before, the watch thread swallowed it: the lost iteration never came and every rank
    # waited out the plan timeout, blaming the planner.
    from test_loader import make_loader

    from dynapipe.runtime.kv_store import KVStoreSpec

    port, procs = redis_port
    spec = KVStoreSpec("redis", "127.0.0.1", port, connect_timeout_s=10.0)
    probe = spec.connect()

    def broken():
        raise RuntimeError("replanning broke")

    # The restart must lose payloads nobody has read: the fetch thread holds at most iterations
    # 1, 2 (queued) and 3 (in hand), so once 5 is on the server, 4 and 5 are unread and lost,
    # and only the (broken) replanning could bring them back. Restarting earlier lost nothing
    # on some runs, and the loop could then finish before the watcher's report arrived.
    with make_loader(kv_backend="redis", redis=spec, train_iters=14, store_retry_s=20, prefetch=6,
                     plan_timeout_s=60) as dl:
        next(dl)
        dl._watcher.on_restart = broken
        deadline = time.monotonic() + 60
        while probe.get(dl.keys.payload(5, 0, 0)) is None and time.monotonic() < deadline:
            time.sleep(0.02)
        assert probe.get(dl.keys.payload(4, 0, 0)) is not None, "iteration 4 was read before the restart"
        probe.close()
        _restart(procs, port, 0.5)
        t0 = time.monotonic()
        with pytest.raises(DynaPipeError) as e:
            for _ in dl:
                pass
        assert time.monotonic() - t0 < 30
        # Asked again (a caller that retries), the loader gives the same cause, not "stopped".
        with pytest.raises(DynaPipeError) as again:
            next(dl)
        assert str(again.value) == str(e.value)
    assert "replanning the iterations a restarted Redis server lost failed" in str(e.value)
    assert "RuntimeError: replanning broke" in str(e.value)


def test_store_calls_wait_through_a_restart_within_the_window(redis_port):
    from dynapipe.runtime.kv_store import KVStoreSpec

    port, procs = redis_port
    kv = KVStoreSpec("redis", "127.0.0.1", port, connect_timeout_s=5.0, retry_s=10.0).connect()
    kv.set("k", b"v")
    before = kv.server_id()
    down_at, down = [], threading.Event()

    def on_down():
        down_at.append(time.monotonic())
        down.set()

    restarter = threading.Thread(target=_restart, args=(procs, port, 1.0, on_down))
    restarter.start()
    assert down.wait(30), "the server was not killed"
    kv.set("k2", b"v2")  # the server is down: waits for it, then succeeds
    # Timed from the kill, not from this thread's call: however late this thread runs, the
    # server comes back no sooner than 1.0 s after the kill.
    done = time.monotonic()
    restarter.join()
    assert done - down_at[0] >= 1.0
    assert kv.get("k2") == b"v2" and kv.get("k") is None  # the restarted server lost the old key
    assert kv.server_id() != before
    kv.close()


def test_store_gives_up_after_the_window_with_one_line(redis_port):
    from dynapipe.runtime.kv_store import KVStoreSpec, StoreUnreachableError

    port, procs = redis_port
    kv = KVStoreSpec("redis", "127.0.0.1", port, connect_timeout_s=5.0, retry_s=0.8).connect()
    procs[-1].kill()
    procs[-1].wait(10)
    t0 = time.monotonic()
    with pytest.raises(StoreUnreachableError, match=r"store_retry_s=0.8 s") as e:
        kv.get("k")
    assert 0.7 <= time.monotonic() - t0 < 5.0
    assert "\n" not in str(e.value)
    kv.close()




def _killed_peer_job(ctx, argv):
    """Rank body: train ``argv``; rank 1 kills itself (SIGKILL) after iteration 2; rank 0's error."""
    import io
    import signal

    from megatron_integration.arguments import parse_training_args
    from megatron_integration.training import pretrain

    def die(iteration, result):
        if ctx.rank == 1 and iteration == 1:
            os.kill(os.getpid(), signal.SIGKILL)

    try:
        pretrain(parse_training_args(argv.split(), 2), stream=io.StringIO(), on_iteration=die)
    except DynaPipeError as e:
        return str(e)
    return "finished"


def test_a_killed_rank_stops_the_survivor_of_megatron_cores_schedule_in_one_line():
    # The padding baseline runs megatron-core's own 1F1B: its gloo error on the survivor,
    # a traceback through the schedule, becomes one line naming the lost peer.
    from dynapipe.runtime.distributed import spawn_outcomes

    argv = f"{TINY}{MOCK} --train-iters 4 --lr 1e-3 --global-batch-size 8"
    survivor, killed = spawn_outcomes(_killed_peer_job, 2, args=(argv,), pp=2, timeout_s=120)
    assert killed.value is None and survivor.error is None, survivor.error
    assert survivor.value.startswith("iteration 3: rank 0 lost a peer (RuntimeError: ") and "\n" not in survivor.value
    assert survivor.value.endswith("another rank stopped (it crashed, was killed or ran out of memory): its own log "
                                   "holds the cause."), survivor.value


def test_data_parallel_replicas_are_checked_to_hold_the_same_weights(fault_outcomes):
    outcomes, _ = fault_outcomes
    for name, checked in (("hash_padding", (0, 1, 2)), ("hash_dynapipe", (0, 2))):
        log = outcomes[name][0]["log"]
        assert [int(k) for k in re.findall(r">>> Weight hashes match after (\d+) iterations\.\.\.", log)] == list(
            checked), name
        assert len(outcomes[name][0]["losses"]) == 2
    differs = outcomes["hash_differs"]
    assert differs[0]["error"] == differs[1]["error"] and [o["exit_code"] for o in differs] == [2, 2]
    assert differs[0]["error"].startswith("rank 0: after 1 iterations the weights of data-parallel replicas differ "
                                          "(--check-weight-hash-across-dp-replicas-interval): chunk 0: ")
    assert ("module.embedding.word_embeddings.weight disagrees between ranks 0, 1 (no majority tells which is "
            "wrong); ") in differs[0]["error"] and "; and 25 more." in differs[0]["error"]
    assert ">>> Weight hashes match after 0 iterations..." in differs[0]["log"]
    assert ">>> Weight hashes" not in outcomes["hash_padding"][1]["log"]  # rank 0 logs, as print_rank_0


def test_the_exit_signal_ends_the_run_at_the_iteration_with_a_checkpoint(fault_outcomes):
    outcomes, paths = fault_outcomes
    plain = outcomes["skip_none"][1]["losses"]
    for method, root in (("padding", paths["sig_p"]), ("dynapipe", paths["sig_d"])):
        stopped, resumed = outcomes[f"signal_{method}"], outcomes[f"signal_{method}_resumed" if method == "dynapipe"
                                                                 else "signal_resumed"]
        assert all("error" not in o for o in stopped + resumed), method
        assert [len(o["losses"]) for o in stopped] == [1, 1], method
        assert "exiting program after receiving SIGTERM, after iteration 1" in stopped[0]["log"], method
        with open(os.path.join(root, "latest_checkpointed_iteration.txt")) as f:
            assert f.read().strip() == "1", method
        # The checkpoint is the iteration's: resumed, the run trains the rest as without the signal.
        assert [o["start"] for o in resumed] == [1, 1]
        assert np.allclose(stopped[1]["losses"] + resumed[1]["losses"], plain, rtol=0, atol=1e-5), method


def test_a_non_persistent_checkpoint_newer_than_the_persistent_one_is_resumed(fault_outcomes):
    outcomes, paths = fault_outcomes
    saved, resumed = outcomes["np_saved"], outcomes["np_resumed"]
    root = os.path.join(paths["np_save"], "non_persistent")
    assert sorted(os.listdir(root)) == ["iter_0000003", "latest_checkpointed_iteration.txt"]
    log = saved[0]["log"]
    for k in (1, 3):
        assert f"saving checkpoint at iteration       {k} to {root} in torch_dist format" in log
    assert f"deleting {root}/iter_0000001 (non-persistent: only the newest is kept)" in log
    assert f"saving checkpoint at iteration       2 to {paths['np_save']} in" in log
    assert all("error" not in o for o in resumed) and [o["start"] for o in resumed] == [3, 3], resumed
    assert (f"loading the non-persistent checkpoint of iteration 3 from {root} (--load's is of iteration 2)"
            in resumed[0]["log"])
    assert resumed[1]["losses"] == saved[1]["losses"][3:]  # the 4th iteration, from the 3rd's weights
    # The per-rank format, in a directory of its own.
    saved, resumed = outcomes["np_dyn_saved"], outcomes["np_dyn_resumed"]
    assert sorted(os.listdir(paths["np_dir"])) == ["iter_0000003", "latest_checkpointed_iteration.txt"]
    assert not os.path.exists(os.path.join(paths["np_dyn"], "non_persistent"))
    assert all("error" not in o for o in resumed) and [o["start"] for o in resumed] == [3, 3], resumed
    assert f"loading the non-persistent checkpoint of iteration 3 from {paths['np_dir']}" in resumed[0]["log"]
    assert resumed[1]["losses"] == saved[1]["losses"][3:]
