"""What the executor keeps alive: sent activations released without corrupting a backward
that saved them, nothing left counted after a refused plan, and forward-only runs that keep
no graph (one spawned 2-rank gloo job for all three)."""
import dataclasses
import gc
import weakref

import torch

from dynapipe.config import load_model_config
from dynapipe.errors import PlanError
from dynapipe.plan import serialize_plan
from dynapipe.plan.forward_only import forward_only
from dynapipe.runtime.activation_meter import ActivationMeter, measure_activations
from dynapipe.runtime.distributed import spawn_outcomes
from dynapipe.runtime.executor import Executor, ExecutorConfig
from toy_model import ToyGPT, ToyHandlers, make_samples, plan_batch

CFG = load_model_config("gpt-tiny")
LENGTHS = [40, 60, 30, 50, 20, 70]


class TanhOut(ToyHandlers):
    """Stage 0 sends tanh of its output: tanh's backward reads the very tensor that is sent."""

    def forward(self, mb, inputs, op):
        out = super().forward(mb, inputs, op)
        return torch.tanh(out) if out.dim() > 0 else out


class WeightOnly(ToyHandlers):
    """Runs deferred weight gradients, but has no backward that would defer them."""

    def backward_weight(self, mb, op):
        pass


class Watching(ToyHandlers):
    """Counts, before each forward, the earlier micro-batches' activations still alive."""

    def forward(self, mb, inputs, op):
        gc.collect()
        self.alive.append(sum(r() is not None for r in self.refs))
        out = super().forward(mb, inputs, op)
        for t in (inputs.get("hidden_states"), out if out.dim() > 0 else None):
            if t is not None:
                self.refs.append(weakref.ref(t))
        return out


def _worker(ctx):
    samples = make_samples(LENGTHS, CFG.vocab_size, seed=0)
    plan = plan_batch(LENGTHS, CFG, pp=2, dp=1, schedule="1f1b")[0][ctx.stage]
    stage = ToyGPT(CFG, seed=1).stage(ctx.stage, 2)
    cpu = torch.device("cpu")
    out = {}
    meter = ActivationMeter()
    with Executor(TanhOut(stage, samples), group=ctx.pipeline_group, store=ctx.store, meter=meter,
                  config=ExecutorConfig(timeout_s=30)) as ex:
        grads = {}
        for mode in ("plain", "metered"):
            for p in stage.parameters():
                p.grad = None
            if mode == "plain":
                ex.run(plan)
            else:
                with measure_activations(stage, cpu, meter):
                    ex.run(plan)
            grads[mode] = torch.cat([p.grad.reshape(-1) for p in stage.parameters() if p.grad is not None])
        out["grad_error"] = float((grads["metered"] - grads["plain"]).abs().max())
        # A plan the peer check refuses (rank 1's bytes corrupted) after the first forward ran.
        payload = bytearray(serialize_plan(plan))
        if ctx.stage == 1:
            payload[len(payload) // 2] ^= 0xFF
        try:
            with measure_activations(stage, cpu, meter):
                ex.run(bytes(payload))
            out["refused"] = False
        except PlanError:
            out["refused"] = True
        out["held_after_refusal"] = meter.live_bytes
        # A loss normaliser that cannot normalise: refused on every rank before anything runs.
        for bad in (0, 2.5):
            try:
                ex.run(plan, loss_tokens=bad)
                out[f"tokens {bad}"] = "ran"
            except PlanError as e:
                out[f"tokens {bad}"] = str(e)
        out["loss_after_refusals"] = ex.run(plan).loss
        # The run's own normaliser stands in for a plan that carries none.
        out["loss_given_tokens"] = ex.run(dataclasses.replace(plan, global_loss_tokens=0),
                                          loss_tokens=plan.global_loss_tokens).loss
    # A zero-bubble plan needs a backward that defers the weight gradients and backward_weight.
    zb = plan_batch(LENGTHS, CFG, pp=2, dp=1, schedule="zb-h1", split_backward=True)[0][ctx.stage]
    for handlers in (ToyHandlers, WeightOnly):
        with Executor(handlers(stage, samples), group=ctx.pipeline_group, store=ctx.store,
                      config=ExecutorConfig(timeout_s=30)) as ex:
            try:
                ex.run(zb)
                out[handlers.__name__] = "ran"
            except PlanError as e:
                out[handlers.__name__] = str(e)
    watching = Watching(ToyGPT(CFG, seed=1).stage(ctx.stage, 2), samples)
    watching.refs, watching.alive = [], []
    with Executor(watching, group=ctx.pipeline_group, store=ctx.store, config=ExecutorConfig(timeout_s=30)) as ex:
        with torch.no_grad():
            ex.run(forward_only(plan))
    out["alive_before_each_forward"] = watching.alive
    return out


def test_released_sends_refusals_and_forward_only_runs_keep_nothing_they_should_not():
    outs = spawn_outcomes(_worker, 2, pp=2, timeout_s=120)
    for o in outs:
        assert o.ok, o.error
        r = o.value
        # The meter kept the sent tensor object itself, whose data the executor then swapped out:
        # stage 0's gradients came out NaN.
        assert r["grad_error"] == 0.0, (o.rank, r)
        assert r["refused"] and r["held_after_refusal"] == 0, (o.rank, r)
        # Forward-only: the activations of earlier micro-batches were kept to the end of the run.
        assert max(r["alive_before_each_forward"]) <= 1, (o.rank, r)
        # Refused at acceptance on every rank (rank 1's reason: it computes the loss), not in the
        # last stage's forward with rank 0 waiting for it; the executor then runs on.
        assert "pipeline rank 1 (global rank 1): the loss normaliser is 0 tokens" in r["tokens 0"], r
        assert "loss_tokens 2.5: expected a whole number of tokens" in r["tokens 2.5"], r
        assert r["loss_given_tokens"] == r["loss_after_refusals"], r
        assert r["loss_after_refusals"] > 0 if o.rank == 1 else r["loss_after_refusals"] == 0.0, r  # the last stage's
        assert "handlers have no backward and no backward_weight" in r["ToyHandlers"], r
        assert "handlers have no backward (the input part" in r["WeightOnly"], r
