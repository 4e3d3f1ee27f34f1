"""``torchrun scripts/pretrain_gpt.py``: Megatron-format logs, run configs, clear errors."""
import os
import re
import subprocess
import sys

from megatron_integration.launch import free_port

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "scripts", "pretrain_gpt.py")


def torchrun(nproc: int, *args: str, timeout: int = 240) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
           "--master-port", str(free_port()), SCRIPT, *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT)


def test_tiny_cpu_run_logs_in_megatron_format(tmp_path):
    # Megatron's manual garbage collection too: the collector off, a collection after every iteration.
    result = torchrun(2, "--run-config", "configs/runs/gpt-tiny-cpu-pp2.yaml", "--train-iters", "2",
                      "--seq-length", "128", "--global-batch-size", "8", "--save", str(tmp_path / "ckpt"),
                      "--manual-gc", "--manual-gc-interval", "1")
    assert result.returncode == 0, result.stderr[-3000:]
    lines = [l for l in result.stdout.splitlines() if "iteration" in l and "lm loss" in l]
    assert len(lines) == 2  # --log-interval 1, printed once (by the last stage)
    pattern = (r"iteration\s+2/\s+2 \| consumed samples:\s+16 \| elapsed time per iteration \(ms\): [\d.]+ \| "
               r".*lm loss: \d\.\d{6}E[+-]\d\d \|.*real tokens/s: [\d.]+ \| padding efficiency: [\d.]+ \| "
               r"plan wait \(ms\): [\d.]+ \|")
    assert re.search(pattern, lines[1]), lines[1]
    assert os.path.exists(tmp_path / "ckpt" / "latest_checkpointed_iteration.txt")


def test_bad_arguments_fail_with_one_line():
    result = subprocess.run([sys.executable, SCRIPT, "--num-layers", "2", "--hidden-size", "64",
                             "--num-attention-heads", "4", "--seq-length", "64", "--global-batch-size", "4",
                             "--micro-batch-size", "2", "--train-iters", "1", "--lr", "1e-3", "--mock-data",
                             "--fp16", "--bf16"], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert result.returncode == 2
    assert "error: --fp16 and --bf16 were both given" in result.stderr
    assert "Traceback" not in result.stderr


def test_run_config_world_size_is_checked():
    result = subprocess.run([sys.executable, SCRIPT, "--run-config", "configs/runs/gpt-tiny-cpu-pp2.yaml"],
                            capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert result.returncode == 2
    assert "torchrun --nnodes 1 --nproc-per-node 2" in result.stderr


TINY = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "64",
        "--max-position-embeddings", "64", "--vocab-size", "128", "--micro-batch-size", "2", "--global-batch-size",
        "4", "--pipeline-model-parallel-size", "2", "--lr", "1e-3", "--train-iters", "1"]


def start_up_job(rounds: list) -> list:
    """Rank body: for each ``(script, port, argv of every rank)``, the script's ``main`` with this
    rank's command line as a fresh job on ``port``; (exit status, stderr, seconds) of each."""
    import contextlib
    import importlib.util
    import io
    import time

    out = []
    for script, port, argvs in rounds:
        spec = importlib.util.spec_from_file_location("pretrain_script", script)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        os.environ["MASTER_PORT"] = str(port)
        err, t0 = io.StringIO(), time.monotonic()
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            code = module.main(argvs[int(os.environ["RANK"])])
        out.append((code, err.getvalue(), time.monotonic() - t0))
    return out


def test_a_rank_failing_its_start_up_checks_stops_every_rank(tmp_path):
    # A file only some nodes see: the rank that cannot see it fails before the process group exists;
    # the others must stop with its line at once, not wait out the distributed timeout.
    from megatron_integration.launch import spawn
    from t5_job import TINY as T5_TINY

    missing = str(tmp_path / "on-another-node")
    ok, bad = TINY + ["--mock-data"], TINY + ["--data-path", missing]
    t5_ok = T5_TINY.split()
    t5_bad = [a for a in t5_ok if a != "--mock-data"] + ["--data-path", missing]
    t5_script = os.path.join(ROOT, "scripts", "pretrain_t5.py")
    # The store's host (rank 0) failing too, and the T5 script.
    # Two refused values on one rank: every rank prints both, a line each (one pass mends them).
    refused = ok + ["--apply-layernorm-1p", "--cross-entropy-loss-fusion"]
    rounds = [(SCRIPT, free_port(), [ok, bad]), (SCRIPT, free_port(), [bad, ok]), (t5_script, free_port(), [t5_ok, t5_bad]),
              (SCRIPT, free_port(), [ok, refused])]
    results = spawn(start_up_job, 2, (rounds,), timeout_s=120)
    for failing, per_rank in zip((1, 0, 1), zip(*results)):
        for code, err, seconds in per_rank:
            assert code == 2 and seconds < 30, (code, seconds, err)
            lines = err.strip().splitlines()
            assert len(lines) == 1 and lines[0].startswith(f"error: rank {failing}: --data-path {missing!r}: "), err
    for code, err, seconds in [rank[3] for rank in results]:
        lines = err.strip().splitlines()
        assert code == 2 and seconds < 30 and len(lines) == 2, (code, seconds, err)
        assert lines[0].startswith("error: rank 1: --apply-layernorm-1p is a Megatron-LM flag"), err
        assert lines[1].startswith("error: rank 1: --cross-entropy-loss-fusion is a Megatron-LM flag"), err


def restart_job(port: int) -> list:
    """Rank body: two torchrun attempts agreeing through one long-lived agent store on ``port``;
    rank 1's check fails in attempt 0 only. What each attempt raised (None: agreed)."""
    import time

    from dynapipe.errors import DynaPipeError
    from megatron_integration.agreement import agree_at_start, joined_rendezvous

    os.environ.update(MASTER_PORT=str(port), TORCHELASTIC_USE_AGENT_STORE="True")
    out = []
    for attempt in (0, 1):
        os.environ["TORCHELASTIC_RESTART_COUNT"] = str(attempt)
        failing = attempt == 0 and os.environ["RANK"] == "1"
        if attempt == 1 and os.environ["RANK"] == "1":
            time.sleep(1.0)  # rank 0 reads first: attempt 0's keys must not answer it
        try:
            agree_at_start("--data-path '/nfs/c4': no such file." if failing else None, timeout_minutes=0.5)
            out.append(None)
            joined_rendezvous()  # not used for a process group here
        except DynaPipeError as e:
            out.append(str(e))
    return out


def test_a_restarted_attempt_agrees_afresh_through_torchruns_agent_store():
    # torchrun's agent store outlives a restart (--max-restarts): attempt 1 must not read
    # attempt 0's results (rank 1's failure, which it fixed).
    import datetime

    import torch.distributed as dist

    from megatron_integration.launch import spawn

    store = dist.TCPStore("127.0.0.1", 0, None, True, timeout=datetime.timedelta(seconds=60), wait_for_workers=False)
    results = spawn(restart_job, 2, (store.port,), timeout_s=120)
    assert [r[0] for r in results] == ["rank 1: --data-path '/nfs/c4': no such file."] * 2
    assert [r[1] for r in results] == [None, None]


def test_a_rank_whose_checks_failed_waits_the_jobs_distributed_timeout(monkeypatch, capsys):
    import importlib.util

    import megatron_integration.agreement as agreement
    from megatron_integration.agreement import timeout_in_argv
    from dynapipe.errors import DynaPipeError

    # Both scripts hand the start-up agreement the job's --distributed-timeout-minutes, read from
    # the command line itself: a rank whose own checks failed has no parsed config to read it from.
    given = []

    def agreed_start(check, timeout_of, fallback_minutes):
        given.append(fallback_minutes)
        raise DynaPipeError("stopped here")

    monkeypatch.setattr(agreement, "agreed_start", agreed_start)
    for path in (SCRIPT, SCRIPT.replace("pretrain_gpt.py", "pretrain_t5.py")):
        spec = importlib.util.spec_from_file_location(os.path.basename(path)[:-3] + "_script", path)
        script = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(script)
        assert script.main(["--lr", "1e-3", "--distributed-timeout-minutes", "2.5"]) == 2
    assert given == [2.5, 2.5] and capsys.readouterr().err.count("stopped here") == 2

    assert timeout_in_argv(["--lr", "1e-3"]) == 10.0
    assert timeout_in_argv(["--distributed-timeout-minutes", "30"]) == 30.0
    assert timeout_in_argv(["--distributed-timeout-minutes=2.5", "--lr", "1"]) == 2.5
    assert timeout_in_argv(["--distributed-timeout-minutes", "soon"]) == 10.0
    assert timeout_in_argv(["--distributed-timeout-minutes", "-1"]) == 10.0


def test_a_peer_lost_before_the_training_loop_is_one_line_on_the_survivor(monkeypatch, capsys):
    # A rank dying while the others build the model or the optimizer (megatron-core's first
    # collectives): the survivor's gloo error becomes the loop's one line, exit status 2.
    import importlib.util

    import megatron_integration.training as training

    def dies(cfg):
        raise RuntimeError("[../third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:4805: "
                           "Connection reset by peer")

    monkeypatch.setattr(training, "pretrain", dies)
    spec = importlib.util.spec_from_file_location("pretrain_gpt_script", SCRIPT)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    at = TINY.index("--pipeline-model-parallel-size")
    argv = TINY[:at] + TINY[at + 2:] + ["--mock-data"]  # one rank
    assert script.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: start-up: rank 0 lost a peer (RuntimeError: [") and "\n" not in err, err
    assert err.endswith("its own log holds the cause.")

    def other(cfg):
        raise RuntimeError("something else")

    monkeypatch.setattr(training, "pretrain", other)
    try:
        script.main(argv)
    except RuntimeError as e:
        assert str(e) == "something else"  # not a lost peer: raised as it was
    else:
        raise AssertionError("a RuntimeError that is not a lost peer was swallowed")
