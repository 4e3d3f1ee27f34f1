"""The executor across spawned gloo processes: results equal an unpipelined run, bad
plans are refused on every rank before anything is sent, and a failing, stuck or dead
rank makes every other rank raise within the timeout with a message that says where.

Each spawn reuses its process groups for several checks (a 4-rank start-up costs
seconds on a small machine); a check that breaks the group comes last in its spawn.
"""
from __future__ import annotations

import dataclasses
import os
import threading
import time

import pytest
import torch
import torch.distributed as dist

from dynapipe.config import load_model_config
from dynapipe.data.synthetic import sample_lengths
from dynapipe.errors import ExecutorError, PlanError
from dynapipe.plan import serialize_plan
from dynapipe.plan.instructions import FreeBuffer
from dynapipe.runtime.distributed import spawn, spawn_outcomes
from dynapipe.runtime.exec_trace import WAIT_SENDS, DeviceClock, chrome_trace, gather_traces
from dynapipe.runtime.executor import Executor, ExecutorConfig
from dynapipe.runtime.p2p import CommFailure, RemoteFailure
from toy_model import ToyGPT, ToyHandlers, make_samples, plan_batch, reference_step

CFG = load_model_config("gpt-tiny")
SCHEDULES = ("1f1b", "adaptive")  # auto chose 1f1b on every one of these batches
ITERATIONS = 2          # per schedule, each followed by an optimizer step
SAMPLES, SEQ = 12, 160  # mixture lengths clipped at SEQ tokens


def _batch(it: int, ctx, schedule: str):
    lengths = [int(x) for x in sample_lengths(SAMPLES, 100 + it, SEQ)]
    samples = make_samples(lengths, CFG.vocab_size, seed=it)
    return samples, plan_batch(lengths, CFG, pp=ctx.pp, dp=ctx.dp, schedule=schedule, iteration=it)


def _sum_over_replicas(ctx, tensors: list[torch.Tensor]) -> None:
    """Replicas hold their share of the global gradient: the full one is their sum."""
    if ctx.dp > 1:
        flat = torch.cat([t.reshape(-1) for t in tensors])
        dist.all_reduce(flat, group=ctx.data_group)
        k = 0
        for t in tensors:
            t.copy_(flat[k:k + t.numel()].view_as(t))
            k += t.numel()


def _train_and_compare(ctx):
    """Train with the executor and, on every rank, an unpipelined copy of the model on the
    same samples; report loss and gradient differences every iteration."""
    model, ref = ToyGPT(CFG, seed=11), ToyGPT(CFG, seed=11)
    stage = model.stage(ctx.stage, ctx.pp)
    own = stage.own_parameters()
    opt = torch.optim.SGD(own.values(), lr=0.05, momentum=0.9)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9)
    handlers = ToyHandlers(stage)
    ex = Executor(handlers, group=ctx.pipeline_group, store=ctx.store, replica=ctx.replica,
                  config=ExecutorConfig(timeout_s=60))
    # A device clock as CUDA's, on host-timed events: it may synchronise only in traced runs
    # (whether a run is traced is read per run, below).
    syncs = []
    ex._device_clock = DeviceClock(_HostEvent, lambda: syncs.append(it))
    rows, it = [], 0
    for schedule in SCHEDULES:
        for _ in range(ITERATIONS):
            samples, plans = _batch(it, ctx, schedule)
            plan = plans[ctx.replica][ctx.stage]
            handlers.samples = samples
            ex.config.trace = it == 0
            res = ex.run(plan)
            grads = [p.grad for p in own.values()]
            _sum_over_replicas(ctx, grads)
            loss = torch.tensor([res.loss], dtype=torch.float64)
            _sum_over_replicas(ctx, [loss])
            ref_loss, ref_grads = reference_step(ref, samples)
            err = max(float((p.grad - ref_grads[n]).abs().max()) for n, p in own.items())
            scale = max(float(ref_grads[n].abs().max()) for n in own)
            rows.append(dict(schedule=schedule, chosen=plan.schedule, it=it, stage=ctx.stage, loss=float(loss),
                             ref_loss=ref_loss, grad_err=err, grad_scale=scale,
                             micro_batches=len(plan.micro_batches),
                             shapes=sorted({(m.mbs, m.seqlen) for m in plan.micro_batches}),
                             released=res.released_bytes, peak=res.peak_buffer_bytes,
                             unfreed=res.unfreed_buffers))
            if res.trace is not None:
                traces = gather_traces(res.trace, ctx.pipeline_group)
                if traces is not None:
                    rows[-1]["trace"] = chrome_trace(traces)
                    rows[-1]["instructions"] = [len(plans[ctx.replica][s].instructions) for s in range(ctx.pp)]
            opt.step()
            ref_opt.step()
            opt.zero_grad(set_to_none=True)
            it += 1
    ref_params = dict(ref.named_parameters())
    drift = max(float((p.detach() - ref_params[n].detach()).abs().max()) for n, p in own.items())
    return dict(rows=rows, drift=drift, ex=ex, handlers=handlers, it=it, clock_syncs=syncs)


class _HostEvent:
    """A stand-in for ``torch.cuda.Event(enable_timing=True)`` on the host clock (ms)."""

    def record(self):
        self.t = time.perf_counter() * 1e3

    def elapsed_time(self, other):
        return other.t - self.t


def _refuse(ex, handlers, plan_or_bytes):
    calls, posted = len(handlers.calls), ex.comm.posted
    params = list(handlers.stage.own_parameters().values())
    try:
        ex.run(plan_or_bytes)
        return dict(error=None)
    except PlanError as e:
        return dict(error=str(e), handler_calls=len(handlers.calls) - calls, transfers=ex.comm.posted - posted,
                    grads=sum(p.grad is not None for p in params))


def _refusals(ctx, state):
    """Bad plans on one rank are refused by all ranks; the group stays usable after."""
    ex, handlers, it = state["ex"], state["handlers"], state["it"]
    samples, plans = _batch(it, ctx, "1f1b")
    handlers.samples = samples
    plan = plans[ctx.replica][ctx.stage]
    out = {}
    payload = bytearray(serialize_plan(plan))
    if ctx.stage == 1:
        payload[len(payload) // 2] ^= 0xFF
    out["corrupt"] = _refuse(ex, handlers, bytes(payload))
    _, other = _batch(it + 1, ctx, "1f1b")  # another batch's plan, posing as this iteration's
    other_plan = dataclasses.replace(other[ctx.replica][ctx.stage], iteration=plan.iteration)
    out["mismatch"] = _refuse(ex, handlers, other_plan if ctx.stage == 0 else plan)
    bad = plan
    if ctx.stage == ctx.pp - 1:
        free = next(x for x in plan.instructions if isinstance(x, FreeBuffer))
        bad = dataclasses.replace(plan, instructions=plan.instructions + (free,))
    out["invalid"] = _refuse(ex, handlers, bad)
    res = ex.run(plan)
    out["after"] = dict(loss=res.loss, transfers=res.transfers)
    grouped, batches = _grouped(plan)
    real, posted = dist.batch_isend_irecv, []

    def counting(ops):
        posted.append(len(ops))
        return real(ops)

    dist.batch_isend_irecv = counting  # how the executor posts the grouped starts
    try:
        again = ex.run(grouped)
    finally:
        dist.batch_isend_irecv = real
    out["grouped"] = dict(loss=again.loss, batches=batches, transfers=again.transfers, posted=posted)
    out["scaled"] = _loss_scaled(ex, handlers, plan)
    return out


def _loss_scaled(ex, handlers, plan):
    """A handler's ``grad_scale`` (a mixed-precision optimizer's loss scale) scales the
    gradients and leaves the reported losses alone."""
    params = list(handlers.stage.own_parameters().values())
    runs = []
    for scale in (None, 1024.0):
        for p in params:
            p.grad = None
        handlers.grad_scale = None if scale is None else (lambda loss, s=scale: loss * s)
        res = ex.run(plan)
        runs.append((res.loss, dict(res.mb_loss_sums), [p.grad.clone() for p in params]))
    handlers.grad_scale = None
    (loss, sums, grads), (s_loss, s_sums, s_grads) = runs
    return dict(loss=(loss, s_loss), sums=(sums, s_sums),
                grad_ratio_err=max(float((sg - 1024.0 * g).abs().max()) for g, sg in zip(grads, s_grads)),
                grad_max=max(float(g.abs().max()) for g in grads))


def _grouped(plan):
    """The plan with every run of adjacent transfer starts posted as one batch."""
    ins = list(plan.instructions)
    starts = [x.OPCODE.endswith("_start") for x in ins]
    batches = 0
    for i in range(len(ins)):
        if starts[i] and (i + 1 < len(ins) and starts[i + 1] or i > 0 and starts[i - 1]):
            first = i
            while first > 0 and starts[first - 1]:
                first -= 1
            ins[i] = dataclasses.replace(ins[i], group=first)
            batches += first == i
    return dataclasses.replace(plan, instructions=tuple(ins)), batches


def _correctness_worker(ctx):
    groups = (dist.get_world_size(ctx.pipeline_group), dist.get_world_size(ctx.data_group))
    state = _train_and_compare(ctx)
    return dict(rows=state["rows"], drift=state["drift"], refusals=_refusals(ctx, state), groups=groups,
                clock_syncs=state["clock_syncs"])


class _FailingHandlers(ToyHandlers):
    """On pipeline rank ``fail_stage``, the forward of micro-batch 1 misbehaves: ``raise``s,
    returns a wrong ``shape``, ``stall``s for ``stall_s`` seconds, or makes the process ``die``."""

    def __init__(self, stage, samples, me: int, fail_stage: int, mode: str, stall_s: float):
        super().__init__(stage, samples)
        self.me, self.fail_stage, self.mode, self.stall_s = me, fail_stage, mode, stall_s

    def forward(self, mb, inputs, op):
        out = super().forward(mb, inputs, op)
        if mb.mb == 1 and self.me == self.fail_stage:
            if self.mode == "raise":
                raise ValueError(f"boom in stage {self.me}")
            if self.mode == "shape":
                return out[:-1]
            if self.mode == "stall":
                time.sleep(self.stall_s)
            if self.mode == "die":
                os._exit(9)
        return out


def _failure_worker(ctx, fail_stage: int, mode: str, timeout_s: float, with_store: bool = True,
                    schedule: str = "1f1b", linger_s: float = 0.0):
    model = ToyGPT(CFG, seed=5)
    samples, plans = _batch(0, ctx, schedule)
    handlers = _FailingHandlers(model.stage(ctx.stage, ctx.pp), samples, ctx.stage, fail_stage, mode,
                                stall_s=timeout_s + 1.5)
    ex = Executor(handlers, group=ctx.pipeline_group, store=ctx.store if with_store else None,
                  config=ExecutorConfig(timeout_s=timeout_s, poll_s=0.05))
    refused = None
    if not with_store:  # the plan check without a store goes through an all-gather: refuse once first
        payload = serialize_plan(plans[ctx.replica][ctx.stage])
        try:
            ex.run(payload[:-5] if ctx.stage == 1 else payload)
        except PlanError as e:
            refused = str(e)
    t0 = time.monotonic()
    try:
        ex.run(plans[ctx.replica][ctx.stage])
        return dict(error=None, elapsed=time.monotonic() - t0, refused=refused)
    except ExecutorError as e:
        elapsed = time.monotonic() - t0
        if ctx.stage == fail_stage:
            time.sleep(linger_s)  # a failed process that lingers keeps its connections open
        return dict(error=type(e).__name__, message=str(e), elapsed=elapsed, refused=refused)


# ---- tests ------------------------------------------------------------------------------
def _check_rows(results, pp):
    rows = [r for res in results for r in res["rows"]]
    assert {r["schedule"] for r in rows} == set(SCHEDULES)
    # Variable shapes: the planner cut micro-batches of several different shapes.
    assert len({s for r in rows for s in r["shapes"]}) >= 3
    for r in rows:
        assert r["unfreed"] == [], r  # the compiler frees every buffer it names
        assert r["grad_err"] <= 1e-6 and r["grad_err"] <= 1e-5 * r["grad_scale"], r
        assert r["grad_scale"] > 1e-3, r  # the comparison is not between zeros
        if r["stage"] == pp - 1:
            assert abs(r["loss"] - r["ref_loss"]) <= 1e-6 * r["ref_loss"], r
        else:
            assert r["released"] > 0, r  # sent activations' data was released
    assert max(res["drift"] for res in results) <= 1e-5
    # Only the traced iteration (0) synchronised the device, at its start and before its trace.
    assert all(res["clock_syncs"] == [0, 0] for res in results), [res["clock_syncs"] for res in results]


def _check_trace(results, pp):
    rows = [r for res in results for r in res["rows"] if "trace" in r]
    assert rows, "no rank returned a trace"
    doc = rows[0]["trace"]
    ops = [e for e in doc["traceEvents"] if e["ph"] == "X" and e["name"] != WAIT_SENDS]
    per_stage = [sum(1 for e in ops if e["tid"] == s) for s in range(pp)]
    assert per_stage == rows[0]["instructions"]
    names = {e["name"] for e in ops if e["cat"] in ("forward", "backward")}
    assert any(n.startswith("F0 ") and "x" in n for n in names) and any(n.startswith("B0 ") for n in names)


def _check_refusals(results, pp):
    for res in results:
        ref = res["refusals"]
        for case, expected in (("corrupt", "pipeline rank 1 refused its plan"),
                               ("mismatch", "rank 0 sends to rank 1 differ from those rank 1 expects"),
                               ("invalid", f"pipeline rank {pp - 1} refused its plan")):
            r = ref[case]
            assert r["error"] is not None and expected in r["error"], (case, r)
            # Refused before any transfer: at most the first micro-batch's load and forward
            # ran (they overlap the plan exchange), no backward, no gradient.
            assert r["transfers"] == 0 and r["grads"] == 0 and r["handler_calls"] <= 2, (case, r)
        assert "CRC" in ref["corrupt"]["error"] or "corrupt" in ref["corrupt"]["error"].lower()
        assert "used after it was freed" in ref["invalid"]["error"]
        assert ref["after"]["transfers"] > 0
        # Starts posted together (batch_isend_irecv) move the same data.
        assert ref["grouped"]["loss"] == ref["after"]["loss"]
        assert ref["grouped"]["transfers"] == ref["after"]["transfers"]
        # One batch_isend_irecv a group of starts (more than one op), as the plan grouped them.
        grouped = ref["grouped"]
        assert len([n for n in grouped["posted"] if n > 1]) == grouped["batches"], grouped
    assert sum(res["refusals"]["grouped"]["batches"] for res in results) > 0
    for res in results:
        scaled = res["refusals"]["scaled"]
        assert scaled["loss"][0] == scaled["loss"][1] and scaled["sums"][0] == scaled["sums"][1], scaled
        assert scaled["grad_max"] > 0 and scaled["grad_ratio_err"] <= 1e-6 * 1024 * scaled["grad_max"], scaled


@pytest.mark.parametrize("pp, dp", [(2, 2), (4, 1)])
def test_pipelined_training_equals_unpipelined_and_bad_plans_are_refused(pp, dp):
    results = spawn(_correctness_worker, pp * dp, pp=pp, timeout_s=240)
    assert all(res["groups"] == (pp, dp) for res in results)
    _check_rows(results, pp)
    _check_trace(results, pp)
    _check_refusals(results, pp)


def test_handler_exception_on_one_rank_stops_every_rank_with_its_traceback():
    timeout, linger = 30.0, 6.0
    results = spawn(_failure_worker, 4, pp=4, args=(2, "raise", timeout, True, "adaptive", linger), timeout_s=120)
    for rank, r in enumerate(results):
        assert r["error"] is not None, (rank, r)
        assert "boom in stage 2" in r["message"] and "Traceback" in r["message"], (rank, r)
        # Stopped by the failure report while the failed process still lingers, not by
        # its closed connections nor by the timeout.
        assert r["elapsed"] < linger / 2, (rank, r)
    assert results[2]["error"] == "HandlerFailure"
    assert "pipeline rank 2 (global rank 2), instruction" in results[2]["message"]
    for rank in (0, 1, 3):
        assert results[rank]["error"] in ("RemoteFailure", "CommFailure"), results[rank]
        assert f"pipeline rank {rank} (global rank {rank}), instruction" in results[rank]["message"]
        assert "global rank 2 failed first" in results[rank]["message"]


def test_wrong_shape_from_a_handler_is_caught_before_sending():
    results = spawn(_failure_worker, 2, pp=2, args=(0, "shape", 20.0), timeout_s=60)
    assert results[0]["error"] == "ExecutorError"
    assert "tensor 'hidden_states' is [" in results[0]["message"] and "the plan says" in results[0]["message"]
    # The other rank stops on the report, or on the failed rank's closed connection, and
    # names the failure either way.
    assert results[1]["error"] in ("RemoteFailure", "CommFailure"), results[1]
    assert "pipeline rank 1 (global rank 1), instruction" in results[1]["message"]
    assert "the plan says" in results[1]["message"]
    assert max(r["elapsed"] for r in results) < 10


def test_stuck_peer_makes_the_other_rank_fail_at_the_timeout():
    timeout = 2.0
    outs = spawn_outcomes(_failure_worker, 2, pp=2, args=(1, "stall", timeout), timeout_s=60)
    r0 = outs[0].value
    assert r0["error"] == "CommFailure", outs[0]
    assert "pipeline rank 0 (global rank 0), instruction" in r0["message"]
    assert "peer pipeline rank 1 (global rank 1)" in r0["message"] and "2 s timeout" in r0["message"]
    assert timeout <= r0["elapsed"] < timeout + 8  # about 1 s of it fixed: the rest is load's margin
    # The stalled rank learns of it when it resumes, instead of hanging.
    assert outs[1].value is not None and outs[1].value["error"] is not None, outs[1]


def test_killed_rank_makes_the_other_rank_fail_with_the_peer_named():
    timeout = 20.0
    outs = spawn_outcomes(_failure_worker, 2, pp=2, args=(1, "die", timeout, False), timeout_s=60)
    assert outs[1].exitcode == 9
    r0 = outs[0].value
    # Before that, a truncated plan on rank 1 was refused by both ranks (no store: all-gather).
    assert r0 is not None and "pipeline rank 1 refused its plan" in (r0["refused"] or ""), outs[0]
    assert r0 is not None and r0["error"] == "CommFailure", outs[0]
    assert "pipeline rank 0 (global rank 0), instruction" in r0["message"]
    assert "peer pipeline rank 1 (global rank 1)" in r0["message"] and "closed" in r0["message"]
    assert r0["elapsed"] < timeout / 2


def _helper_threads() -> list[str]:
    return sorted(t.name for t in threading.enumerate() if t.name.startswith("dynapipe-wait"))


def _two_executors_worker(ctx):
    """Executor A runs two iterations and is closed; executor B, on the same group and
    store, runs them in the opposite order (its exchange n meets A's leftovers of n)."""
    baseline = _helper_threads()
    handlers = ToyHandlers(ToyGPT(CFG, seed=11).stage(ctx.stage, ctx.pp))
    batches = [_batch(it, ctx, "1f1b") for it in (0, 1)]
    cfg = ExecutorConfig(timeout_s=30)

    def run(ex, it):
        samples, plans = batches[it]
        handlers.samples = samples
        res = ex.run(plans[ctx.replica][ctx.stage])
        return dict(loss=res.loss, mb=res.mb_loss_sums, transfers=res.transfers)

    a = Executor(handlers, group=ctx.pipeline_group, store=ctx.store, config=cfg)
    first = [run(a, 0), run(a, 1)]
    threads_running = _helper_threads()
    a.close()
    a.close()  # idempotent
    out = dict(first=first, threads_running=threads_running, threads_after_a=_helper_threads(),
               baseline=baseline, own_rows_after_close=[
                   k for k in (f"{a._plan_prefix}/{s}/{ctx.rank}" for s in (0, 1)) if ctx.store.check([k])])
    try:
        a.run(batches[0][1][ctx.replica][ctx.stage])
    except ExecutorError as e:
        out["run_after_close"] = str(e)
    dist.barrier(group=ctx.pipeline_group)  # every rank closed A
    out["rows_left"] = [k for k in (f"{a._plan_prefix}/{s}/{r}" for s in (0, 1) for r in range(ctx.world_size))
                        if ctx.store.check([k])]
    out["abort_reports"] = [r for r in range(ctx.world_size) if ctx.store.check([f"{a.abort.prefix}/{r}"])]
    with Executor(handlers, group=ctx.pipeline_group, store=ctx.store, config=cfg) as b:
        second = [run(b, 1), run(b, 0)][::-1]
        out["prefixes"] = (a._plan_prefix, b._plan_prefix)
    out["second"] = second
    out["threads_after_b"] = _helper_threads()
    return out


def test_closed_executor_stops_its_threads_and_a_second_one_runs_on_the_same_store():
    results = spawn(_two_executors_worker, 2, pp=2, timeout_s=90)
    for r in results:
        assert len(r["threads_running"]) > len(r["baseline"]), r  # A waited on helper threads ...
        assert r["threads_after_a"] == r["baseline"] and r["threads_after_b"] == r["baseline"], r  # ... now gone
        assert r["own_rows_after_close"] == [] and r["rows_left"] == [] and r["abort_reports"] == [], r
        assert "was closed" in r["run_after_close"]
        assert r["prefixes"][0] != r["prefixes"][1]
        for a, b in zip(r["first"], r["second"]):
            assert a["transfers"] > 0 and a["transfers"] == b["transfers"]
            assert a["mb"] == b["mb"] and a["loss"] == b["loss"]
    assert results[1]["first"][0]["loss"] > 0  # the last stage reports the loss


def _raise_or_hang(ctx):
    if ctx.rank == 0:
        raise ValueError("rank zero gives up")
    time.sleep(600)


def test_spawn_reports_tracebacks_and_kills_what_outlives_its_timeout():
    t0 = time.monotonic()
    outs = spawn_outcomes(_raise_or_hang, 2, timeout_s=8)
    assert time.monotonic() - t0 < 20
    assert not outs[0].ok and "ValueError: rank zero gives up" in outs[0].error and "Traceback" in outs[0].error
    assert outs[1].timed_out and not outs[1].ok


class _FailsThenLate(ToyHandlers):
    """Rank 0 fails at its second forward and exits; rank 1 is late, so its next send is posted
    to a peer that has already gone (gloo raises a plain RuntimeError as it is posted)."""

    def forward(self, mb, inputs, op):
        if self.me == 0 and mb.mb == 1:
            raise ValueError("boom on rank 0")
        if self.me == 1 and mb.mb == 0:
            time.sleep(2.0)
        return super().forward(mb, inputs, op)


FAILING_LENGTHS = [40, 60, 30, 50]


def _run_failing(ctx, handlers_cls):
    """One 1F1B iteration of FAILING_LENGTHS on 2 stages with ``handlers_cls``: ``(error type,
    message)`` of the ExecutorError it stops with, or ``("ok", "")``."""
    plan = plan_batch(FAILING_LENGTHS, CFG, pp=2, dp=1, schedule="1f1b")[0][ctx.stage]
    h = handlers_cls(ToyGPT(CFG, seed=1).stage(ctx.stage, 2), make_samples(FAILING_LENGTHS, CFG.vocab_size, seed=0))
    h.me = ctx.stage
    with Executor(h, group=ctx.pipeline_group, store=ctx.store, config=ExecutorConfig(timeout_s=20)) as ex:
        try:
            ex.run(plan)
        except ExecutorError as e:
            return type(e).__name__, str(e)
    return "ok", ""


def _post_to_a_gone_peer_worker(ctx):
    return _run_failing(ctx, _FailsThenLate)


def test_a_send_posted_to_a_peer_that_failed_names_the_peers_cause():
    # It was reported as this rank's own handler failure (primary), so a job could blame it.
    outs = spawn_outcomes(_post_to_a_gone_peer_worker, 2, pp=2, timeout_s=120)
    (kind0, msg0), (kind1, msg1) = outs[0].value, outs[1].value
    assert kind0 == "HandlerFailure" and "boom on rank 0" in msg0
    assert kind1 in ("CommFailure", "RemoteFailure"), msg1
    assert "boom on rank 0" in msg1, msg1


def _receive_buffer_out_of_memory_worker(ctx):
    """Rank 1 runs out of memory allocating its first receive buffer."""
    from dynapipe.runtime import exec_transfers

    if ctx.stage == 1:
        def allocate(spec, device):
            raise torch.OutOfMemoryError(f"no room for {spec.name} {list(spec.shape)}")
        exec_transfers.allocate = allocate
    return _run_failing(ctx, ToyHandlers)


def test_running_out_of_memory_for_a_receive_buffer_is_the_ranks_own_failure():
    # A RuntimeError under a transfer is read as a consequence of a failed peer; running out of
    # memory is not one: rank 1 reports it as its own, and rank 0 stops with rank 1's cause.
    outs = spawn_outcomes(_receive_buffer_out_of_memory_worker, 2, pp=2, timeout_s=120)
    (kind0, msg0), (kind1, msg1) = outs[0].value, outs[1].value
    assert kind1 == "HandlerFailure" and "OutOfMemoryError: no room for" in msg1, msg1
    assert kind0 in ("CommFailure", "RemoteFailure") and "OutOfMemoryError" in msg0, msg0


class _NeverDone:
    """A device event that never completes: a receive from a dead peer, as CUDA sees it."""

    def query(self) -> bool:
        return False


def _device_wait_worker(ctx):
    """Rank 1's device never finishes its plan; rank 0 finishes its own, waits a second and
    reports a failure: rank 1's end-of-plan wait must stop with rank 0's cause."""
    lengths = [40, 60, 30, 50]
    plan = plan_batch(lengths, CFG, pp=2, dp=1, schedule="1f1b")[0][ctx.stage]
    h = ToyHandlers(ToyGPT(CFG, seed=1).stage(ctx.stage, 2))
    h.samples = make_samples(lengths, CFG.vocab_size, seed=0)
    with Executor(h, group=ctx.pipeline_group, store=ctx.store, config=ExecutorConfig(timeout_s=20, poll_s=0.01)) as ex:
        on_cpu = ex._device_done is None  # nothing to wait for without CUDA
        if ctx.stage == 1:
            ex._device_done = _NeverDone
        t0 = time.monotonic()
        try:
            ex.run(plan)
        except ExecutorError as e:
            return dict(kind=type(e).__name__, message=str(e), failed=ex._failed, on_cpu=on_cpu,
                        waited_s=time.monotonic() - t0)
        if ctx.stage == 0:
            time.sleep(1.0)
            ex.abort.report(ctx.rank, "rank 0 lost its GPU", primary=True)
        return dict(kind="ok", on_cpu=on_cpu)


def test_the_end_of_plan_device_wait_stops_on_a_peer_failure():
    # On CUDA a rank's host ends its plan before its device; a receive that can never complete
    # would hold it until the process group's timeout. Stood in for by an event that never completes.
    first, last = spawn(_device_wait_worker, 2, pp=2, timeout_s=90)
    assert first["kind"] == "ok" and first["on_cpu"] and last["on_cpu"]
    assert last["kind"] == "RemoteFailure", last
    assert "finished its plan but another rank failed" in last["message"] and "rank 0 lost its GPU" in last["message"]
    assert last["failed"] and last["waited_s"] > 0.5  # it was in the wait when the report came
