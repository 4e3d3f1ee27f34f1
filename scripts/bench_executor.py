"""Pipeline machinery, side by side: the same fixed-shape micro-batches through (a) the
plan executor, (b) a plain 1F1B loop written directly on torch.distributed and (c)
megatron-core's own non-interleaved 1F1B (``get_forward_backward_func``).

Spawns ``--stages`` gloo processes (one thread each). All three runners drive the same
toy GPT stage (``gpt-tiny``: hidden 64, 4 layers; same weights) over the same pre-built
micro-batch tensors, and divide each micro-batch's summed token loss by the global
batch's real-token count before the backward: only the pipeline machinery differs
(schedule bookkeeping, transfers, buffers, checks). megatron-core runs the stage through
its ``forward_step_func`` / loss-function contract with its ``P2PCommunicator`` on a
gloo pipeline group (``megatron_integration.bench_pipeline``; the CPU compatibility layer
stands in for CUDA), with its defaults: fixed receive shapes, batched p2p, outputs
pseudo-freed after their send.

Every round runs one iteration with each runner, rotating which goes first, so all see
the same machine load; an iteration's time is the slowest rank's. Reported: the median
iteration time of each, and the ratios executor / plain and executor / megatron-core,
each the median over rounds of that round's ratio (target <= 1.05). All runners must
give the same loss every round and the same gradients (checked in the first warm-up
round). From one traced executor iteration, the measured / simulated ratio: against the
simulator replaying the schedule with the op durations the trace measured (what
scheduling and transfers add on top of compute), and against the planner's prediction
from the analytic CPU cost model.

    python scripts/bench_executor.py --stages 2 --micro-batches 8 --mbs 2 --seqlen 128
"""
from __future__ import annotations

import argparse
import importlib.util
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
from dynapipe.argparsing import StrictArgumentParser  # noqa: E402
from dynapipe.errors import DynaPipeError  # noqa: E402
from dynapipe.output_paths import check_output_file, write_output  # noqa: E402

RUNNERS = ("executor", "plain", "megatron")
LABELS = {"executor": "plan executor", "plain": "plain 1F1B loop", "megatron": "megatron-core 1F1B"}
# Gradients of the three runners are the same sums in the same order; allow for fp32 rounding.
GRAD_RTOL = 1e-5


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


class PrebuiltHandlers(ToyHandlers):
    """The toy stage's executor handlers, loading the pre-built tensors the other runners
    use, so that no runner pays for building micro-batches."""

    def __init__(self, stage, batches: list[dict]):
        super().__init__(stage)
        self.batches = batches

    def load(self, mb, specs):
        data = self.batches[mb.mb]
        return {s.name: data[s.name] for s in specs}

    def forward(self, mb, inputs, op):
        return self.stage(inputs)


def _slowest(seconds: float) -> float:
    t = torch.tensor([seconds], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def _grad_vector(params) -> torch.Tensor:
    return torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in params]).clone()


def _worst_grad_diff(grads: dict[str, torch.Tensor]) -> float:
    """Largest difference of any runner's gradients from the executor's, relative to the
    largest executor gradient, over all ranks."""
    ref = grads["executor"]
    scale = float(ref.abs().max()) or 1.0
    worst = max((float((g - ref).abs().max()) / scale for g in grads.values()), default=0.0)
    t = torch.tensor([worst], dtype=torch.float64)
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
    first, last = ctx.stage == 0, ctx.stage == S - 1
    batches = [micro_batch_tensors(samples, m.samples, m.seqlen) for m in mbs]
    batches = [{k: v for k, v in b.items() if (first and k in ("tokens", "position_ids"))
                or (last and k in ("labels", "loss_mask"))} for b in batches]
    ex = Executor(PrebuiltHandlers(stage, batches), group=ctx.pipeline_group,
                  store=None if args.no_store else ctx.store,
                  config=ExecutorConfig(timeout_s=120, check_peers=not args.no_peer_check,
                                        watch_failures=not args.no_watch))
    plain = Plain1F1B(stage, ctx.stage, S, (args.seqlen, args.mbs, cfg.hidden_size), plan.global_loss_tokens)
    runners = {"executor": lambda: ex.run(plan).loss, "plain": lambda: plain.run(batches)}
    megatron_info = None
    if not args.no_megatron:
        from megatron_integration.bench_pipeline import MegatronPipeline, init_pipeline_parallel

        init_pipeline_parallel(S)
        mpipe = MegatronPipeline(stage, hidden_size=cfg.hidden_size, num_layers=cfg.num_layers,
                                 num_attention_heads=cfg.num_attention_heads, seq_length=args.seqlen,
                                 micro_batch_size=args.mbs, global_tokens=plan.global_loss_tokens)
        runners["megatron"] = lambda: mpipe.run(batches)
        megatron_info = {"schedule": mpipe.schedule_name, "batched_p2p": mpipe.batched_p2p}
    names = list(runners)

    times: dict[str, list[float]] = {n: [] for n in names}
    grad_diff = None
    for r in range(args.warmup + args.rounds):
        k = r % len(names)
        order = names[k:] + names[:k]  # each runner takes each slot equally often
        losses, grads = {}, {}
        for name in order:
            dist.barrier()
            t0 = time.perf_counter()
            losses[name] = runners[name]()
            dt = _slowest(time.perf_counter() - t0)
            if r == 0:
                grads[name] = _grad_vector(params)
            for p in params:
                p.grad = None
            if r >= args.warmup:
                times[name].append(dt * 1e3)
        if last:
            for name, loss in losses.items():
                if abs(loss - losses["executor"]) > 1e-6 * abs(losses["executor"]):
                    raise RuntimeError(f"round {r}: the runners disagree on the loss: {losses}")
        if r == 0:
            grad_diff = _worst_grad_diff(grads)
            if grad_diff > GRAD_RTOL:
                raise RuntimeError(f"the runners' gradients differ by {grad_diff:.3g} (relative), more than "
                                   f"{GRAD_RTOL}: they do not compute the same thing.")
    # One traced iteration: the op durations it measured drive the simulator.
    ex.config.trace = True
    dist.barrier()
    t0 = time.perf_counter()
    res = ex.run(plan)
    traced_ms = _slowest(time.perf_counter() - t0) * 1e3
    ex.close()
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
        write_output(args.trace_out, json.dumps(doc), "--trace-out")
    out = {"stages": S, "micro_batches": M, "mbs": args.mbs, "seqlen": args.seqlen, "rounds": args.rounds,
           "model": cfg.name, "runners": names, "megatron": megatron_info,
           "round_ms": {n: [round(t, 3) for t in v] for n, v in times.items()},
           "grad_max_rel_diff": grad_diff}
    out.update(summarise(times))
    out.update({"traced_ms": round(traced_ms, 2), "replayed_simulation_ms": round(replay, 2),
                "measured_over_replayed": round(traced_ms / replay, 4),
                "planner_simulated_ms": round(float(plan.meta["simulated_ms"]), 2),
                "measured_over_planner": round(out["executor_ms"] / float(plan.meta["simulated_ms"]), 4),
                "abort_channel": not args.no_store, "watch_failures": not (args.no_store or args.no_watch),
                "peer_check": not args.no_peer_check})
    return out


def summarise(times: dict[str, list[float]]) -> dict:
    """Medians and ratios from per-round iteration times (ms, one list per runner, rounds aligned).

    ``ratio`` is executor / plain and ``ratio_vs_megatron`` executor / megatron-core: the
    median over rounds of the ratio within each round (the two ran back to back, under
    the same load). Also the ratio of the medians and of the best rounds.
    """
    ex = times["executor"]
    out = {"executor_ms": round(statistics.median(ex), 2), "executor_best_ms": round(min(ex), 2)}
    for name, key, suffix in (("plain", "plain_1f1b_ms", ""), ("megatron", "megatron_1f1b_ms", "_vs_megatron")):
        other = times.get(name)
        if not other:
            out.update({key: None, "ratio" + suffix: None, "ratio_of_medians" + suffix: None,
                        "ratio_best" + suffix: None})
            continue
        out[key] = round(statistics.median(other), 2)
        out[key.replace("_ms", "_best_ms")] = round(min(other), 2)
        out["ratio" + suffix] = round(statistics.median(e / o for e, o in zip(ex, other)), 4)
        out["ratio_of_medians" + suffix] = round(statistics.median(ex) / statistics.median(other), 4)
        out["ratio_best" + suffix] = round(min(ex) / min(other), 4)
    return out


def format_report(out: dict) -> str:
    """The human-readable table of a result from :func:`run` (times in ms per iteration)."""
    lines = [f"{out['stages']} stages, {out['micro_batches']} micro-batches of {out['mbs']}x{out['seqlen']} tokens, "
             f"{out['rounds']} rounds (gloo, CPU, 1 thread per rank; runners rotated every round); executor with "
             f"store: {out['abort_channel']}, watch_failures: {out['watch_failures']}, "
             f"peer plan check: {out['peer_check']}",
             f"  same compute in every runner: the {out['model']} toy stage on the same pre-built micro-batches; "
             f"only the pipeline machinery differs"]
    if out.get("megatron"):
        m = out["megatron"]
        lines.append(f"  megatron-core: get_forward_backward_func -> {m['schedule']}, its P2PCommunicator on gloo "
                     f"(batched p2p: {m['batched_p2p']}), CPU compatibility layer")
    lines.append(f"  {'runner':<20} {'median ms':>10} {'best ms':>9}   executor / runner (median of per-round "
                 f"ratios; of medians; of bests)")
    rows = [("plain", "plain_1f1b_ms", ""), ("megatron", "megatron_1f1b_ms", "_vs_megatron"),
            ("executor", "executor_ms", None)]
    for name, key, suffix in rows:
        if out.get(key) is None:
            continue
        row = f"  {LABELS[name]:<20} {out[key]:>10.2f} {out[key.replace('_ms', '_best_ms')]:>9.2f}"
        if suffix is not None:
            row += (f"   {out['ratio' + suffix]:.4f}  ({out['ratio_of_medians' + suffix]:.4f}; "
                    f"{out['ratio_best' + suffix]:.4f})  target <= 1.05")
        lines.append(row)
    lines.append(f"  losses equal every round; gradients equal to {out['grad_max_rel_diff']:.1e} (relative)")
    lines.append(f"  measured / simulated {out['measured_over_replayed']:9.4f}   (traced {out['traced_ms']:.1f} ms vs "
                 f"{out['replayed_simulation_ms']:.1f} ms replayed from the trace's op times)")
    lines.append(f"  measured / planner   {out['measured_over_planner']:9.4f}   (planner's analytic CPU estimate "
                 f"{out['planner_simulated_ms']:.1f} ms)")
    return "\n".join(lines)


def parse_args(argv=None) -> argparse.Namespace:
    p = StrictArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--stages", type=int, default=2, help="pipeline stages = processes (default 2: one per core)")
    p.add_argument("--micro-batches", type=int, default=8)
    p.add_argument("--mbs", type=int, default=2, help="samples per micro-batch")
    p.add_argument("--seqlen", type=int, default=128, help="tokens per sample")
    p.add_argument("--rounds", type=int, default=60, help="timed rounds (each runs every runner once)")
    p.add_argument("--warmup", type=int, default=3, help="untimed rounds first (the first also checks gradients)")
    p.add_argument("--no-megatron", action="store_true", help="leave out megatron-core's 1F1B (runner c)")
    p.add_argument("--no-store", action="store_true", help="run the executor without the abort channel")
    p.add_argument("--no-watch", action="store_true",
                   help="wait for transfers in the main thread (ExecutorConfig(watch_failures=False))")
    p.add_argument("--no-peer-check", action="store_true", help="skip the per-iteration plan digest exchange")
    p.add_argument("--trace-out", default=None,
                   help="write the traced executor iteration and the replayed simulation here (Chrome JSON)")
    p.add_argument("--json", action="store_true", help="print the result as one JSON line")
    args = p.parse_args(argv)
    if args.stages < 2:
        p.error(f"--stages {args.stages}: a pipeline needs at least 2 stages")
    for flag, value in (("--micro-batches", args.micro_batches), ("--mbs", args.mbs), ("--seqlen", args.seqlen)):
        if value < 1:
            p.error(f"{flag} {value}: must be at least 1")
    if args.rounds < 1 or args.warmup < 1:
        p.error(f"--rounds {args.rounds} / --warmup {args.warmup}: need at least one of each "
                f"(the first warm-up round checks the gradients)")
    if args.trace_out is not None:
        try:
            # Written by rank 0 after all the rounds: a path that cannot take it would waste the run.
            check_output_file(args.trace_out, "--trace-out")
        except DynaPipeError as e:
            p.error(str(e).rstrip("."))
    return args


def run(args: argparse.Namespace) -> dict:
    """Run the benchmark on ``args.stages`` spawned ranks; rank 0's result (see module doc)."""
    return spawn(_worker, args.stages, args=(args,), pp=args.stages, timeout_s=1200)[0]


def main(argv=None) -> int:
    args = parse_args(argv)
    if not args.no_megatron and importlib.util.find_spec("megatron") is None:
        print("error: megatron-core is not installed (pip install megatron-core==0.16.1 next to torch); "
              "or run with --no-megatron to compare the executor with the plain loop only.", file=sys.stderr)
        return 2
    out = run(args)
    print(json.dumps(out) if args.json else format_report(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
