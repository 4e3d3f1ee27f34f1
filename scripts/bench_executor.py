"""Executor overhead: the same fixed-shape micro-batches through the plan executor and
through a plain 1F1B loop written directly on torch.distributed, side by side.

Spawns ``--stages`` gloo processes (one thread each) running the toy GPT stage model
(``gpt-tiny``: hidden 64). Every round runs one iteration with each runner, alternating
which goes first, so both see the same machine load; an iteration's time is the slowest
rank's. Reports the median iteration time of each, the executor / plain ratio (the
median over rounds of the two runners' ratio in that round; target <= 1.05) and, from
one traced executor iteration, the measured / simulated ratio: against the simulator
replaying the schedule with the op durations the trace measured (what scheduling and
transfers add on top of compute), and against the planner's prediction from the
analytic CPU cost model. Both runners must produce the same loss, checked every round.

    python scripts/bench_executor.py --stages 2 --micro-batches 8 --mbs 2 --seqlen 128
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import numpy as np
import torch
import torch.distributed as dist

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests")]

from dynapipe.batching.types import MicroBatch  # noqa: E402
from dynapipe.config import load_device_config, load_model_config  # noqa: E402
from dynapipe.cost import build_cost_model  # noqa: E402
from dynapipe.plan import compile_plans  # noqa: E402
from dynapipe.runtime.distributed import spawn  # noqa: E402
from dynapipe.runtime.exec_trace import chrome_trace, gather_traces  # noqa: E402
from dynapipe.runtime.executor import Executor, ExecutorConfig  # noqa: E402
from dynapipe.schedule.costs import StageTimes  # noqa: E402
from dynapipe.schedule.one_f_one_b import one_f_one_b  # noqa: E402
from dynapipe.schedule.simulator import simulate  # noqa: E402
from dynapipe.schedule.trace import chrome_trace as sim_chrome_trace  # noqa: E402
from toy_model import ToyGPT, ToyHandlers, make_samples, micro_batch_tensors  # noqa: E402


class Plain1F1B:
    """Megatron's non-interleaved 1F1B, written directly on ``isend``/``irecv``: warm-up
    forwards, then a forward and a backward per step with the activation send and the
    gradient receive posted together, then the remaining backwards. Fixed shapes."""

    def __init__(self, stage, rank: int, size: int, shape: tuple, tokens: int):
        self.stage, self.rank, self.size, self.shape, self.tokens = stage, rank, size, shape, tokens
        self.first, self.last = rank == 0, rank == size - 1

    def _p2p(self, send_next=None, send_prev=None, recv_prev=False, recv_next=False):
        ops, got = [], {}
        if send_next is not None:
            ops.append(dist.isend(send_next, self.rank + 1))
        if send_prev is not None:
            ops.append(dist.isend(send_prev, self.rank - 1))
        if recv_prev:
            got["prev"] = torch.empty(self.shape)
            ops.append(dist.irecv(got["prev"], self.rank - 1))
        if recv_next:
            got["next"] = torch.empty(self.shape)
            ops.append(dist.irecv(got["next"], self.rank + 1))
        for w in ops:
            w.wait()
        return got

    def _forward(self, data: dict, x):
        inputs = dict(data)
        if x is not None:
            x.requires_grad_(True)
            inputs["hidden_states"] = x
        y = self.stage(inputs)
        return y / self.tokens if self.last else y

    def _backward(self, x, y, g):
        if self.last:
            y.backward()
        else:
            torch.autograd.backward(y, g)
        return x.grad if x is not None else None

    def run(self, batches: list[dict]) -> float:
        M = len(batches)
        warm = min(self.size - self.rank - 1, M)
        xs, ys, loss = [], [], 0.0
        recv_prev = not self.first
        for i in range(warm):
            x = self._p2p(recv_prev=recv_prev).get("prev")
            y = self._forward(batches[i], x)
            self._p2p(send_next=None if self.last else y.detach().contiguous())
            xs.append(x)
            ys.append(y)
        x = self._p2p(recv_prev=recv_prev).get("prev") if M > warm else None
        for i in range(M - warm):
            y = self._forward(batches[warm + i], x)
            if self.last:
                loss += float(y.detach())
            g = self._p2p(send_next=None if self.last else y.detach().contiguous(),
                          recv_next=not self.last).get("next")
            xs.append(x)
            ys.append(y)
            gin = self._backward(xs.pop(0), ys.pop(0), g)
            send_prev = gin if not self.first else None
            if i == M - warm - 1:
                x = None
                self._p2p(send_prev=send_prev)
            else:
                x = self._p2p(send_prev=send_prev, recv_prev=recv_prev).get("prev")
        for _ in range(warm):
            g = self._p2p(recv_next=not self.last).get("next")
            gin = self._backward(xs.pop(0), ys.pop(0), g)
            self._p2p(send_prev=gin if not self.first else None)
        return loss


def _slowest(seconds: float) -> float:
    t = torch.tensor([seconds], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def _worker(ctx, args):
    cfg = load_model_config("gpt-tiny")
    S, M = ctx.pp, args.micro_batches
    lengths = [args.seqlen] * (M * args.mbs)
    samples = make_samples(lengths, cfg.vocab_size, seed=0)
    mbs = [MicroBatch(samples=list(range(i * args.mbs, (i + 1) * args.mbs)), seqlen=args.seqlen,
                      real_tokens=args.mbs * args.seqlen) for i in range(M)]
    cost = build_cost_model(cfg, load_device_config("cpu"), S)
    plan = compile_plans("1f1b", mbs, cfg, num_stages=S, cost_model=cost)[ctx.stage]
    model = ToyGPT(cfg, seed=1)
    stage = model.stage(ctx.stage, S)
    params = list(stage.own_parameters().values())
    handlers = ToyHandlers(stage, samples)
    ex = Executor(handlers, group=ctx.pipeline_group, store=None if args.no_store else ctx.store,
                  config=ExecutorConfig(timeout_s=120, check_peers=not args.no_peer_check,
                                        watch_failures=not args.no_watch))
    plain = Plain1F1B(stage, ctx.stage, S, (args.seqlen, args.mbs, cfg.hidden_size), plan.global_real_tokens)
    batches = [micro_batch_tensors(samples, m.samples, m.seqlen) for m in mbs]
    first, last = ctx.stage == 0, ctx.stage == S - 1
    batches = [{k: v for k, v in b.items() if (first and k in ("tokens", "position_ids"))
                or (last and k in ("labels", "loss_mask"))} for b in batches]

    def run_executor():
        return ex.run(plan).loss

    def run_plain():
        return plain.run(batches)

    times = {"executor": [], "plain": []}
    for r in range(args.warmup + args.rounds):
        order = [("executor", run_executor), ("plain", run_plain)]
        if r % 2:
            order.reverse()
        losses = {}
        for name, fn in order:
            dist.barrier()
            t0 = time.perf_counter()
            losses[name] = fn()
            dt = _slowest(time.perf_counter() - t0)
            for p in params:
                p.grad = None
            if r >= args.warmup:
                times[name].append(dt * 1e3)
        if last and abs(losses["executor"] - losses["plain"]) > 1e-6 * abs(losses["plain"]):
            raise RuntimeError(f"the two runners disagree: loss {losses['executor']} vs {losses['plain']}")
    # One traced iteration: the op durations it measured drive the simulator.
    ex.config.trace = True
    dist.barrier()
    t0 = time.perf_counter()
    res = ex.run(plan)
    traced_ms = _slowest(time.perf_counter() - t0) * 1e3
    traces = gather_traces(res.trace, ctx.pipeline_group)
    if ctx.rank != 0:
        return None
    fw = np.zeros((S, M))
    bw = np.zeros((S, M))
    for t in traces:
        for e in t.events:
            if e.kind in ("F", "B"):
                (fw if e.kind == "F" else bw)[t.stage, e.mb] = e.dur_us / 1e3
    zeros = np.zeros((S, M))
    comm = np.zeros((S - 1, M))
    timeline = simulate(one_f_one_b(S, M), StageTimes(fw, bw, zeros, zeros, comm, comm, np.zeros(S)),
                        record_memory=False)
    replay = timeline.makespan_ms
    if args.trace_out:  # executed (rows "executed replica 0") and replayed simulation side by side
        doc = sim_chrome_trace([timeline], [mbs], {"what": "simulation replayed with the measured op times"})
        doc["traceEvents"] += chrome_trace(traces, pid_offset=1)["traceEvents"]
        with open(args.trace_out, "w") as f:
            json.dump(doc, f)
    ex_ms, plain_ms = statistics.median(times["executor"]), statistics.median(times["plain"])
    return {"stages": S, "micro_batches": M, "mbs": args.mbs, "seqlen": args.seqlen, "rounds": args.rounds,
            "executor_ms": round(ex_ms, 2), "plain_1f1b_ms": round(plain_ms, 2),
            "ratio": round(statistics.median(e / p for e, p in zip(times["executor"], times["plain"])), 4),
            "ratio_of_medians": round(ex_ms / plain_ms, 4),
            "executor_best_ms": round(min(times["executor"]), 2), "plain_best_ms": round(min(times["plain"]), 2),
            "ratio_best": round(min(times["executor"]) / min(times["plain"]), 4),
            "traced_ms": round(traced_ms, 2), "replayed_simulation_ms": round(replay, 2),
            "measured_over_replayed": round(traced_ms / replay, 4),
            "planner_simulated_ms": round(float(plan.meta["simulated_ms"]), 2),
            "measured_over_planner": round(ex_ms / float(plan.meta["simulated_ms"]), 4),
            "abort_channel": not args.no_store, "watch_failures": not (args.no_store or args.no_watch),
            "peer_check": not args.no_peer_check}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--stages", type=int, default=2, help="pipeline stages = processes (default 2: one per core)")
    p.add_argument("--micro-batches", type=int, default=8)
    p.add_argument("--mbs", type=int, default=2, help="samples per micro-batch")
    p.add_argument("--seqlen", type=int, default=128, help="tokens per sample")
    p.add_argument("--rounds", type=int, default=20, help="timed rounds (each runs both)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--no-store", action="store_true", help="run the executor without the abort channel")
    p.add_argument("--no-watch", action="store_true",
                   help="wait for transfers in the main thread (ExecutorConfig(watch_failures=False))")
    p.add_argument("--no-peer-check", action="store_true", help="skip the per-iteration plan digest exchange")
    p.add_argument("--trace-out", default=None,
                   help="write the traced executor iteration and the replayed simulation here (Chrome JSON)")
    p.add_argument("--json", action="store_true", help="print the result as one JSON line")
    args = p.parse_args(argv)
    out = spawn(_worker, args.stages, args=(args,), pp=args.stages, timeout_s=1200)[0]
    if args.json:
        print(json.dumps(out))
        return 0
    print(f"{out['stages']} stages, {out['micro_batches']} micro-batches of {out['mbs']}x{out['seqlen']} tokens, "
          f"{out['rounds']} rounds (gloo, CPU, 1 thread per rank); executor with store: {out['abort_channel']}, "
          f"watch_failures: {out['watch_failures']}, peer plan check: {out['peer_check']}")
    print(f"  plain 1F1B loop      {out['plain_1f1b_ms']:9.2f} ms / iteration (median; best {out['plain_best_ms']:.2f})")
    print(f"  plan executor        {out['executor_ms']:9.2f} ms / iteration (median; best {out['executor_best_ms']:.2f})")
    print(f"  executor / plain     {out['ratio']:9.4f}   (median of the per-round ratios; ratio of medians "
          f"{out['ratio_of_medians']:.4f}, of bests {out['ratio_best']:.4f}; target <= 1.05)")
    print(f"  measured / simulated {out['measured_over_replayed']:9.4f}   (traced {out['traced_ms']:.1f} ms vs "
          f"{out['replayed_simulation_ms']:.1f} ms replayed from the trace's op times)")
    print(f"  measured / planner   {out['measured_over_planner']:9.4f}   (planner's analytic CPU estimate "
          f"{out['planner_simulated_ms']:.1f} ms)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
