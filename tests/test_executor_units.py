"""Executor pieces that need no process group: tensor checks, buffers, releasing sent
activations, the local plan check, plan digests, the trace format."""
from __future__ import annotations

import dataclasses
import gc
import json
import threading
import time

import pytest
import torch

from dynapipe.batching.types import MicroBatch
from dynapipe.config import load_model_config
from dynapipe.errors import ExecutorError, PlanError
from dynapipe.plan import compile_plans
from dynapipe.plan.instructions import BackwardPass, FreeBuffer, SendActivationStart, TensorSpec
from dynapipe.runtime.buffers import BufferTable, backward_from, release_data
from dynapipe.runtime.distributed import pipeline_ranks
from dynapipe.runtime.exec_trace import ExecEvent, ExecTrace, chrome_trace, describe
from dynapipe.schedule.trace import op_event
from dynapipe.runtime.abort_channel import AbortChannel
from dynapipe.runtime.p2p import Waiter, check_tensor
from dynapipe.runtime.plan_check import check_plan_locally, message_digests, pair_starts

CFG = load_model_config("gpt-tiny")
CPU = torch.device("cpu")


def _plans(num_stages=2, schedule="1f1b", seqlens=(32, 64, 16)):
    mbs = [MicroBatch(samples=[i], seqlen=s, real_tokens=s) for i, s in enumerate(seqlens)]
    return compile_plans(schedule, mbs, CFG, num_stages=num_stages)


def test_check_tensor_refuses_what_the_plan_does_not_say():
    spec = TensorSpec("hidden_states", (4, 2, 8), "float32")
    with pytest.raises(ExecutorError, match=r"rank 1 x.*\[4, 3, 8\] float32, the plan says \[4, 2, 8\] float32"):
        check_tensor(torch.zeros(4, 3, 8), spec, CPU, "rank 1 x")
    with pytest.raises(ExecutorError, match="bfloat16"):
        check_tensor(torch.zeros(4, 2, 8, dtype=torch.bfloat16), spec, CPU, "w")
    with pytest.raises(ExecutorError, match="is a list"):
        check_tensor([1, 2], spec, CPU, "w")
    t = torch.zeros(8, 2, 4).permute(2, 1, 0)
    assert not t.is_contiguous()
    assert check_tensor(t, spec, CPU, "w").is_contiguous()


def test_buffer_table_names_use_after_free_and_counts_bytes():
    table = BufferTable()
    table.put("act_in:0:0", {"h": torch.zeros(10)}, "i0")
    assert table.live_bytes == 40 and table.peak_bytes == 40
    table.free("act_in:0:0", 7, "i8")
    assert table.live_bytes == 0
    with pytest.raises(ExecutorError, match="used after instruction 7 freed it"):
        table.get("act_in:0:0", "i9")
    with pytest.raises(ExecutorError, match="before anything filled it"):
        table.get("grad_in:3:0", "i9")
    with pytest.raises(ExecutorError, match="filled a second time"):
        table.put("act_in:0:0", {"h": torch.zeros(1)}, "i10")


def test_released_output_keeps_its_graph_and_gives_the_same_gradients():
    torch.manual_seed(0)
    w = torch.randn(8, 8, requires_grad=True)
    x = torch.randn(5, 8)
    g = torch.randn(5, 8)
    out = torch.tanh(x @ w) * 2
    freed = release_data(out)
    assert freed == 5 * 8 * 4 - 4 and out.numel() == 1
    backward_from([out], [g])
    w2 = w.detach().clone().requires_grad_()
    (torch.tanh(x @ w2) * 2).backward(g)
    assert torch.equal(w.grad, w2.grad)
    # Views share their base's storage: releasing them would free nothing, so they are kept.
    view = (x @ w).view(40)
    assert release_data(view) == 0 and view.numel() == 40


def test_a_sent_tensor_another_of_its_message_was_computed_from_keeps_its_data():
    # b = a * w2 saves a for w2's gradient: releasing a's data after the send would leave a
    # one-element placeholder that broadcasts in b's backward, a wrong gradient and no error.
    def message():
        g = torch.Generator().manual_seed(0)
        x, c, d = (torch.randn(4, 3, generator=g) for _ in range(3))
        w1, w2 = (torch.randn(4, 3, generator=g).requires_grad_() for _ in range(2))
        a = x * w1
        return {"a": a, "b": a * w2, "lone": (x * c).requires_grad_() * d}, (w1, w2), (c, d)

    ref, (rw1, rw2), (c, d) = message()
    torch.autograd.backward([ref["a"], ref["b"]], [c, d])
    sent, (w1, w2), _ = message()
    table = BufferTable()
    table.put("act_out:0:0", sent, "test")
    freed = table.release("act_out:0:0", "test")
    assert sent["a"].numel() == 12 and sent["b"].numel() == 1 and sent["lone"].numel() == 1
    assert freed == 2 * (12 * 4 - 4)
    backward_from([sent["a"], sent["b"]], [c, d])
    assert torch.equal(w1.grad, rw1.grad) and torch.equal(w2.grad, rw2.grad)


def test_plans_from_the_compiler_pass_the_local_check():
    for schedule in ("1f1b", "adaptive"):
        for s, plan in enumerate(_plans(3, schedule)):
            check_plan_locally(plan, stage=s, num_stages=3)
            start_of, batches = pair_starts(plan)
            assert len(start_of) == sum(1 for x in plan.instructions if x.OPCODE.endswith("_finish"))


@pytest.mark.parametrize("breakage, message", [
    ("wrong_stage", "plan is for stage 1 of 2, but this rank is pipeline rank 0"),
    ("double_free", "used after it was freed"),
    ("free_before_send", "used after it was freed"),
    ("unknown_mb", "micro-batch 9 is not in the plan"),
    ("bad_peer", "peer 1 is not another stage"),
    ("bad_dtype", "is not a valid transfer"),
    ("no_tokens", "global_loss_tokens is 0"),
    # Every other check passes: the micro-batch's gradients would silently be missing.
    ("no_backward", r"micro-batch \d+ \(chunk 0\) is in the plan but never runs its backward"),
])
def test_local_check_refuses_broken_plans(breakage, message):
    plans = _plans(2)
    plan, stage = plans[0], 0
    ins = list(plan.instructions)
    if breakage == "wrong_stage":
        plan = plans[1]
    elif breakage == "double_free":
        ins.append(next(x for x in ins if isinstance(x, FreeBuffer)))
    elif breakage == "free_before_send":
        k = next(i for i, x in enumerate(ins) if isinstance(x, SendActivationStart))
        ins.insert(k, FreeBuffer(mb=ins[k].mb, buffer=ins[k].buffer))
    elif breakage == "unknown_mb":
        ins[0] = dataclasses.replace(ins[0], mb=9)
    elif breakage == "bad_peer":
        plan, stage = plans[1], 1
        ins = list(plan.instructions)
        k = next(i for i, x in enumerate(ins) if x.OPCODE == "recv_act_start")
        ins[k] = dataclasses.replace(ins[k], peer=1)
    elif breakage == "bad_dtype":
        k = next(i for i, x in enumerate(ins) if isinstance(x, SendActivationStart))
        ins[k] = dataclasses.replace(ins[k], tensors=(TensorSpec("hidden_states", (32, 1, 64), "float64"),))
    elif breakage == "no_backward":
        k = max(i for i, x in enumerate(ins) if isinstance(x, BackwardPass))
        del ins[k]
    elif breakage == "no_tokens":
        plan, stage = plans[1], 1
        plan = dataclasses.replace(plan, global_loss_tokens=0)
        ins = list(plan.instructions)
    broken = dataclasses.replace(plan, instructions=tuple(ins))
    with pytest.raises(PlanError, match=message):
        check_plan_locally(broken, stage=stage, num_stages=2)


def test_pair_starts_refuses_unfinished_and_unstarted_transfers():
    plan = _plans(2)[0]
    ins = list(plan.instructions)
    k = next(i for i, x in enumerate(ins) if x.OPCODE == "send_act_finish")
    with pytest.raises(PlanError, match="started but never finished"):
        pair_starts(dataclasses.replace(plan, instructions=tuple(ins[:k] + ins[k + 1:])))
    k = next(i for i, x in enumerate(ins) if x.OPCODE == "send_act_start")
    with pytest.raises(PlanError, match="no earlier start"):
        pair_starts(dataclasses.replace(plan, instructions=tuple(ins[:k] + ins[k + 1:])))


def test_grouped_starts_form_one_batch():
    plan = _plans(2)[0]
    ins = list(plan.instructions)
    starts = [i for i, x in enumerate(ins) if x.OPCODE.endswith("_start")]
    a = next(i for i in starts if i + 1 in starts)
    ins[a] = dataclasses.replace(ins[a], group=5)
    ins[a + 1] = dataclasses.replace(ins[a + 1], group=5)
    _, batches = pair_starts(dataclasses.replace(plan, instructions=tuple(ins)))
    assert batches[a] == [a, a + 1]


def test_digests_of_matching_plans_agree_and_differ_when_shapes_differ():
    p0, p1 = _plans(2)
    s0, r0 = message_digests(p0)
    s1, r1 = message_digests(p1)
    assert s0[1] == r1[0] and s1[0] == r0[1]
    q0, q1 = _plans(2, seqlens=(32, 64, 24))
    assert message_digests(q0)[0][1] != r1[0]
    # Same shapes in another order is a different message sequence too.
    o0, _ = _plans(2, seqlens=(64, 32, 16))
    assert message_digests(o0)[0][1] != r1[0]
    # A send posted in a batch against a lone receive: gloo pairs them, NCCL runs the batch on
    # the group's communicator and the receive on the pair's, so they never meet: the digests
    # tell them apart under NCCL only.
    ins = list(p0.instructions)
    k = next(i for i, x in enumerate(ins) if isinstance(x, SendActivationStart) and ins[i + 1].OPCODE.endswith("_start"))
    ins[k] = dataclasses.replace(ins[k], group=0)
    ins[k + 1] = dataclasses.replace(ins[k + 1], group=0)
    grouped = dataclasses.replace(p0, instructions=tuple(ins))
    assert message_digests(grouped)[0][1] == r1[0]
    assert message_digests(grouped, grouping=True)[0][1] != message_digests(p1, grouping=True)[1][0]
    assert message_digests(p0, grouping=True)[0][1] == message_digests(p1, grouping=True)[1][0]
    # A group of one start is posted alone, as the receive is: they meet.
    ins = list(p0.instructions)
    ins[k] = dataclasses.replace(ins[k], group=3)
    alone = dataclasses.replace(p0, instructions=tuple(ins))
    assert message_digests(alone, grouping=True)[0][1] == message_digests(p1, grouping=True)[1][0]


def test_executed_trace_is_laid_out_like_the_simulated_one():
    plans = _plans(2)
    traces = []
    for plan in plans:
        mbs = {m.mb: m for m in plan.micro_batches}
        tr = ExecTrace(stage=plan.stage, replica=0, iteration=3)
        for i, x in enumerate(plan.instructions):
            name, cat, kind, shape = describe(x, mbs[x.mb])
            tr.events.append(ExecEvent(i, x.OPCODE, x.mb, name, cat, 1000.0 + 10 * i + plan.stage, 5.0, kind, shape))
        tr.memory.append((1000.0, 1 << 20))
        traces.append(tr)
    doc = json.loads(json.dumps(chrome_trace(traces)))
    ops = [e for e in doc["traceEvents"] if e["ph"] == "X"]
    assert [sum(1 for e in ops if e["tid"] == s) for s in range(2)] == [len(p.instructions) for p in plans]
    assert min(e["ts"] for e in ops) == 0.0
    compute = [e for e in ops if e["cat"] in ("forward", "backward")]
    # Same names, categories and args as the simulator's op events.
    mb0 = plans[0].micro_batches[0]
    sim = op_event(0, 0, "F", 0, 0.0, 1.0, mbs=mb0.mbs, seqlen=mb0.seqlen)
    mine = next(e for e in compute if e["tid"] == 0 and e["name"].startswith("F0 "))
    assert mine["name"] == sim["name"] == f"F0 {mb0.mbs}x{mb0.seqlen}" and mine["cat"] == sim["cat"]
    assert {k: mine["args"][k] for k in sim["args"]} == sim["args"]
    assert len(compute) == 2 * 2 * len(plans[0].micro_batches)
    rows = [e for e in doc["traceEvents"] if e["ph"] == "M" and e["name"] == "thread_name"]
    assert sorted(e["args"]["name"] for e in rows) == ["stage 0", "stage 1"]
    assert any(e["ph"] == "C" and e["args"]["MiB"] == 1.0 for e in doc["traceEvents"])
    assert traces[0].busy_us() == 5.0 * 2 * len(plans[0].micro_batches)
    # Shifted rows, so an executed trace and a simulated one can share a viewer.
    shifted = chrome_trace(traces, pid_offset=5)["traceEvents"]
    names = [e for e in shifted if e["ph"] == "M" and e["name"] == "process_name"]
    assert [(e["pid"], e["args"]["name"]) for e in names] == [(5, "executed replica 0")]
    assert {e["pid"] for e in shifted} == {5}


def test_a_handlers_trace_note_joins_its_ops_arguments():
    plan = _plans(2)[0]
    mbs = {m.mb: m for m in plan.micro_batches}
    tr = ExecTrace(stage=0, replica=0, iteration=0)
    for i, x in enumerate(plan.instructions):
        name, cat, kind, shape = describe(x, mbs[x.mb])
        note = {"masked": x.mb % 2 == 0} if kind else None
        tr.events.append(ExecEvent(i, x.OPCODE, x.mb, name, cat, 10.0 * i, 5.0, kind, shape, 0, note))
    ops = [e for e in chrome_trace([tr])["traceEvents"] if e["ph"] == "X"]
    compute = [e for e in ops if e["cat"] in ("forward", "backward")]
    assert compute and all(e["args"]["masked"] == (e["args"]["mb"] % 2 == 0) for e in compute)
    assert all("masked" not in e["args"] for e in ops if e not in compute)


def test_pipeline_rank_layout_is_megatrons():
    assert pipeline_ranks(4, 2) == [[0, 2], [1, 3]]
    assert pipeline_ranks(4, 4) == [[0, 1, 2, 3]]


def _helper_threads() -> int:
    return sum(t.name.startswith("dynapipe-wait") for t in threading.enumerate())


def _busy_waiter() -> Waiter:
    """A waiter whose helper threads (one per key) each ran a job."""
    w = Waiter(5.0, AbortChannel(torch.distributed.HashStore(), 1), poll_s=0.01)
    for key in ("calls", (1, True), (1, False)):
        w.join(w.submit(lambda: None, key=key), "test")
    return w


def test_waiter_helper_threads_end_on_close_and_when_the_waiter_is_dropped():
    base = _helper_threads()
    w = _busy_waiter()
    assert _helper_threads() == base + 3
    w.close()
    w.close()
    assert _helper_threads() == base
    ran = []
    job = w.submit(lambda: ran.append(1), key=(1, True))  # after close: runs in the caller
    assert job.done.is_set() and ran == [1] and _helper_threads() == base
    w = _busy_waiter()
    assert _helper_threads() == base + 3
    del w
    gc.collect()
    deadline = time.monotonic() + 5
    while _helper_threads() > base and time.monotonic() < deadline:
        time.sleep(0.01)
    assert _helper_threads() == base


def test_a_stream_ordered_waiter_still_stops_a_blocking_call_on_another_ranks_report():
    # Under NCCL the plan-digest exchange blocked inline in the store's wait and ignored a peer's
    # report until its own timeout (300 s by default); it runs on a helper thread like gloo's.
    from dynapipe.runtime.p2p import RemoteFailure

    abort = AbortChannel(torch.distributed.HashStore(), 2)
    w = Waiter(30.0, abort, poll_s=0.01, stream_ordered=True)
    release = threading.Event()
    job = w.submit(lambda: release.wait(30))
    assert not job.done.is_set()  # not run inline
    abort.report(1, "iteration 2: rank 1's loader failed", primary=True)
    t0 = time.monotonic()
    with pytest.raises(RemoteFailure, match="rank 1's loader failed"):
        w.join(job, "exchanging plan digests")
    assert time.monotonic() - t0 < 5
    release.set()
    w.close()


def test_an_abort_report_that_cannot_be_published_is_told_on_stderr(capsys):
    from dynapipe.runtime.abort_channel import AbortChannel

    class GoneStore:
        def set(self, *a):
            raise RuntimeError("Connection reset by peer")

    AbortChannel(GoneStore(), 2).report(1, "iteration 3: handler failed\nTraceback ...", primary=True)
    err = capsys.readouterr().err
    assert "global rank 1 could not tell the other ranks of its failure (RuntimeError: Connection reset" in err
    assert "iteration 3: handler failed" in err and "Traceback" not in err


def test_a_device_clock_times_ops_on_the_device_timeline():
    # CUDA's host only launches ops: their trace times must come from device events, resolved
    # after the iteration against an origin stamped with the wall clock. Fake events on a
    # device timeline that runs 5 ms behind the host stand in for CUDA's.
    from dynapipe.runtime.exec_trace import DeviceClock, ExecEvent, ExecTrace

    device_ms = iter([0.0, 5.0, 12.0, 12.0, 30.0])  # origin, op 0 start/end, op 1 start/end

    class Event:
        def record(self):
            self.t = next(device_ms)

        def elapsed_time(self, other):
            return other.t - self.t

    synced = []
    clock = DeviceClock(Event, lambda: synced.append(True))
    clock.begin()
    trace = ExecTrace(0, 0, 0)
    for i in range(2):
        start = clock.mark()
        host_t0 = 1e12 + i  # the host's own (launch) times, which must not survive
        clock.add(len(trace.events), len(trace.memory), start, clock.mark())
        trace.events.append(ExecEvent(i, "forward", i, f"F{i}", "forward", host_t0, 1.0))
        trace.memory.append((host_t0, 100 * i))
    origin_us = clock._origin_us
    clock.resolve(trace)
    assert len(synced) == 2  # once at the start, once before reading the events
    assert [round(e.start_us - origin_us) for e in trace.events] == [5000, 12000]
    assert [round(e.dur_us) for e in trace.events] == [7000, 18000]
    assert [(round(t - origin_us), b) for t, b in trace.memory] == [(5000, 0), (12000, 100)]


def test_a_free_between_a_send_start_and_its_finish_is_refused_before_anything_runs():
    # validate_plans refused it, the rank's own check did not: the executor then failed mid-run.
    from toy_model import plan_batch

    plan = plan_batch([40, 60, 30, 50], CFG, pp=2, dp=1, schedule="1f1b")[0][0]
    ins = list(plan.instructions)
    free = ins.pop(next(i for i, x in enumerate(ins) if isinstance(x, FreeBuffer) and x.buffer == "act_out:0:0"))
    ins.insert(next(i for i, x in enumerate(ins)
                    if isinstance(x, SendActivationStart) and x.buffer == "act_out:0:0") + 1, free)
    check_plan_locally(plan, stage=0, num_stages=2)
    with pytest.raises(PlanError, match="buffer 'act_out:0:0' is freed while its send is still in flight"):
        check_plan_locally(dataclasses.replace(plan, instructions=tuple(ins)), stage=0, num_stages=2)


def test_a_plan_exchange_whose_store_host_died_fails_in_one_line_naming_the_store():
    # torchrun's store lives in global rank 0's process: when it dies mid-run, the survivors'
    # plan exchange gets the store's network error, which must become the executor's own
    # one-line failure (exit status 2), not a DistNetworkError traceback.
    import datetime
    import subprocess
    import sys
    from types import SimpleNamespace

    import torch.distributed as dist

    from dynapipe.runtime.p2p import CommFailure
    from dynapipe.runtime.plan_check import PeerPlanCheck
    from megatron_integration.launch import free_port

    port = free_port()
    host = subprocess.Popen([sys.executable, "-c", "import time, torch.distributed as d; "
                             f"s = d.TCPStore('127.0.0.1', {port}, 2, True); time.sleep(120)"])
    try:
        client = dist.TCPStore("127.0.0.1", port, 2, False, timeout=datetime.timedelta(seconds=30))
        client.set("ready", "1")
    finally:
        host.kill()
        host.wait(timeout=30)
    comm = SimpleNamespace(rank=1, size=2, global_ranks=[0, 1], global_rank=lambda p: p)
    check = PeerPlanCheck(comm, None, "refused", seq=0)
    check.where = "iteration 3 (exchanging plan digests)"
    start = time.monotonic()
    with pytest.raises(CommFailure, match=r"^iteration 3 \(exchanging plan digests\): the job's key-value store "
                                          r"stopped answering \(.*\); the process that hosts it \(global rank 0 "
                                          r"under torchrun\) has probably died"):
        check._store_rows(client, 20.0)
    assert time.monotonic() - start < 15


def _play_out(size: int, ring: bool = True) -> bool:
    """Whether every rank of a pipeline of ``size`` finishes its neighbour exchanges when each
    exchange blocks until its peer makes the same one (a rendezvous, as NCCL's channel set-up)."""
    from dynapipe.runtime.p2p import neighbour_exchanges

    todo = {r: list(neighbour_exchanges(r, size, ring)) for r in range(size)}
    while any(todo.values()):
        met = [(r, todo[r][0][0]) for r in range(size) if todo[r] and todo[todo[r][0][0]]
               and todo[todo[r][0][0]][0][0] == r]
        if not met:
            return False  # every rank with work left waits on a peer waiting elsewhere
        for r, _ in met:
            todo[r].pop(0)
    return True


@pytest.mark.parametrize("ring", [True, False])
@pytest.mark.parametrize("size", [1, 2, 3, 4, 5, 8])
def test_neighbour_exchanges_end_and_pair_each_sender_with_a_receiver(size, ring):
    from dynapipe.runtime.p2p import neighbour_exchanges

    plans = {r: neighbour_exchanges(r, size, ring) for r in range(size)}
    for r, plan in plans.items():
        # Both pipeline neighbours (the ring closed, for interleaved plans), each once.
        expected = {(r - 1) % size, (r + 1) % size} if ring else {r - 1, r + 1} & set(range(size))
        assert sorted(p for p, _ in plan) == sorted(expected - {r})
        for peer, send_first in plan:
            # One end sends first, the other receives first: neither waits behind its own send.
            assert dict(plans[peer])[r] is not send_first
    assert _play_out(size, ring)


def test_a_pair_order_that_differs_between_ranks_is_caught_by_the_play_out():
    # The play-out is not vacuous: rank 1 of a ring of 3 taking its pairs the other way round
    # waits on rank 2, which waits on rank 0, which waits on rank 1.
    import dynapipe.runtime.p2p as p2p

    real = p2p.neighbour_exchanges
    try:
        p2p.neighbour_exchanges = lambda r, n, ring: list(reversed(real(r, n, ring))) if r == 1 else real(r, n, ring)
        assert not _play_out(3)
    finally:
        p2p.neighbour_exchanges = real
