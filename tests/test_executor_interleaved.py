"""The executor runs interleaved plans (several virtual-pipeline chunks per rank) across
spawned gloo processes (Megatron's interleaved 1F1B and the adaptive interleaved schedule):
losses and gradients equal one unpipelined pass, the trace names
each op's chunk, and a plan whose wrap-around message (last rank -> rank 0's next chunk)
disagrees with its peer's is refused on every rank before anything is sent.

One spawn (PP2 x DP2, 4 processes) runs every check; the toy GPT of ``toy_model`` holds
one layer per virtual stage.
"""
from __future__ import annotations

import dataclasses

import numpy as np
import torch
import torch.distributed as dist

from dynapipe.config import load_device_config, load_model_config
from dynapipe.cost import build_cost_model
from dynapipe.cost.placement import StagePlacement
from dynapipe.data.synthetic import sample_lengths
from dynapipe.errors import PlanError
from dynapipe.plan.instructions import RecvActivationStart, is_last_virtual, virtual_stage
from dynapipe.runtime.distributed import spawn
from dynapipe.runtime.executor import Executor, ExecutorConfig
from toy_model import ToyGPT, ToyStage, make_samples, micro_batch_tensors, reference_step

CFG = load_model_config("gpt-tiny")  # 4 layers: one per virtual stage of PP2 x 2 chunks
PP, DP, CHUNKS = 2, 2, 2
SPEC = "1,1|1,1"


class ChunkHandlers:
    """Handlers of one rank holding one :class:`ToyStage` per chunk; ops dispatch on ``op.chunk``."""

    def __init__(self, chunks: list[ToyStage]):
        self.chunks = chunks
        self.samples: list = []
        self.calls: list[tuple[str, int, int]] = []

    def load(self, mb, specs):
        data = micro_batch_tensors(self.samples, mb.samples, mb.seqlen)
        return {s.name: data[s.name] for s in specs}

    def forward(self, mb, inputs, op):
        self.calls.append(("fw", mb.mb, op.chunk))
        return self.chunks[op.chunk](inputs)


def _plans(it: int, ctx, schedule: str = "auto"):
    from dynapipe.pipeline_planner import plan_iteration

    lengths = [int(x) for x in sample_lengths(12, 300 + it, 160)]
    cost = build_cost_model(CFG, load_device_config("cpu"), PP).with_placement(StagePlacement.parse(SPEC, CFG, PP))
    # The toy chunks run whole backwards only (split_backward=False keeps interleaved-zb out of auto).
    planned = plan_iteration(np.asarray(lengths), cost, stages=PP, dp=DP, iteration=it, schedule=schedule,
                             validate=True, split_backward=False)
    return make_samples(lengths, CFG.vocab_size, seed=it), planned.plans


def _worker(ctx):
    model, ref = ToyGPT(CFG, seed=5), ToyGPT(CFG, seed=5)
    layouts = StagePlacement.parse(SPEC, CFG, PP).virtual_layouts()
    starts = np.cumsum([0] + [l.decoder_layers + l.encoder_layers for l in layouts])
    V = PP * CHUNKS
    chunks = []
    for c in range(CHUNKS):
        k = c * PP + ctx.stage
        chunks.append(ToyStage(model, list(range(starts[k], starts[k + 1])), k == 0, k == V - 1))
    own = {n: p for st in chunks for n, p in st.own_parameters().items()}
    handlers = ChunkHandlers(chunks)
    ex = Executor(handlers, group=ctx.pipeline_group, store=ctx.store, replica=ctx.replica,
                  config=ExecutorConfig(timeout_s=60, trace=True))
    rows = []
    for it, schedule in enumerate(("interleaved", "interleaved-adaptive")):
        samples, plans = _plans(it, ctx, schedule)
        plan = plans[ctx.replica][ctx.stage]
        handlers.samples, handlers.calls = samples, []
        for p in own.values():
            p.grad = None
        res = ex.run(plan)
        grads = [own[n].grad for n in sorted(own)]
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, group=ctx.data_group)  # replicas hold shares of the global gradient
        loss = torch.tensor([res.loss], dtype=torch.float64)
        dist.all_reduce(loss, group=ctx.data_group)
        ref_loss, ref_grads = reference_step(ref, samples)
        want = torch.cat([ref_grads[n].reshape(-1) for n in sorted(own)])
        rows.append(dict(schedule=plan.schedule, loss=float(loss), ref_loss=ref_loss, grad_err=float((flat - want).abs().max()),
                         grad_scale=float(want.abs().max()), chunks=plan.meta["chunks"],
                         last=[is_last_virtual(plan, c) for c in range(CHUNKS)],
                         fw_chunks=sorted({c for kind, _, c in handlers.calls if kind == "fw"}),
                         trace_chunks=sorted({e.chunk for e in res.trace.events if e.kind == "F"}),
                         virtual=[virtual_stage(plan, c) for c in range(CHUNKS)], unfreed=res.unfreed_buffers))
    # Rank 0 expects the wrap-around activation of one micro-batch 8 tokens longer than rank 1
    # sends it, a plan each rank's own check passes: every rank refuses the iteration before
    # sending, from the exchanged digests. (Received into chunk 0 instead, it has no previous
    # stage, and rank 0's own check refuses it; tests/test_validate.py.)
    samples, plans = _plans(2, ctx)
    plan = plans[ctx.replica][ctx.stage]
    handlers.samples = samples
    if ctx.stage == 0:
        ins = list(plan.instructions)
        k = next(i for i, x in enumerate(ins) if isinstance(x, RecvActivationStart) and x.chunk == 1)
        longer = tuple(dataclasses.replace(t, shape=(t.shape[0] + 8, *t.shape[1:])) for t in ins[k].tensors)
        for i, x in enumerate(ins):  # the start and its finish
            if type(x).__name__.startswith("RecvActivation") and (x.mb, x.chunk) == (ins[k].mb, 1):
                ins[i] = dataclasses.replace(x, tensors=longer)
        plan = dataclasses.replace(plan, instructions=tuple(ins))
    posted = ex.comm.posted
    try:
        ex.run(plan)
        refused = None
    except PlanError as e:
        refused = str(e)
    again = ex.run(plans[ctx.replica][ctx.stage])  # the group is still usable
    ex.close()
    return dict(stage=ctx.stage, rows=rows, refused=refused, refused_transfers=ex.comm.posted - posted - again.transfers)


def test_interleaved_plans_train_like_one_unpipelined_pass_and_bad_chunks_are_refused():
    results = spawn(_worker, PP * DP, pp=PP, timeout_s=240)
    for res in results:
        assert [r["schedule"] for r in res["rows"]] == ["interleaved", "interleaved-adaptive"]
        for r in res["rows"]:
            assert r["chunks"] == CHUNKS and r["unfreed"] == []
            assert r["fw_chunks"] == [0, 1] and r["trace_chunks"] == [0, 1]
            assert r["virtual"] == [res["stage"], PP + res["stage"]]
            assert r["last"] == [False, res["stage"] == PP - 1]
            assert r["grad_scale"] > 1e-3
            assert r["grad_err"] <= 1e-6 and r["grad_err"] <= 1e-5 * r["grad_scale"], r
            if res["stage"] == PP - 1:
                assert abs(r["loss"] - r["ref_loss"]) <= 1e-6 * r["ref_loss"], r
        assert res["refused"] is not None and "differ from those rank" in res["refused"], res["refused"]
        assert res["refused_transfers"] == 0
