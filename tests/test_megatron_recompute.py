"""Recompute levels executed on real megatron-core stages (PP2, gloo), one spawn for every check.

The same plan runs with every ForwardPass/BackwardPass at ``none``, ``selective``,
``full``, and with levels mixed across stages and micro-batches; the RNG is reseeded
before each run, so with dropout on the recomputed forward must redraw the same masks
for the losses and every parameter's gradient to match the ``none`` run.
"""
import dataclasses

import numpy as np
import pytest
import torch

from dynapipe.plan.instructions import BackwardPass, ForwardPass
from megatron_integration.launch import spawn

LEVELS = ("none", "selective", "full")
ARGS = ("--num-layers 4 --hidden-size 64 --num-attention-heads 4 --ffn-hidden-size 128 --seq-length 64 "
        "--max-position-embeddings 64 --vocab-size 256 --global-batch-size 8 --train-iters 1 --lr 1e-3 "
        "--mock-data --seed 11 --pipeline-model-parallel-size 2 --use-dynapipe")


def with_levels(plan, level_of):
    """``plan`` with every forward/backward of micro-batch ``mb`` at ``level_of(stage, mb)``."""
    ins = tuple(dataclasses.replace(x, recompute=level_of(plan.stage, x.mb))
                if isinstance(x, (ForwardPass, BackwardPass)) else x for x in plan.instructions)
    return dataclasses.replace(plan, instructions=ins)


def _mixed(stage, mb):
    return LEVELS[(mb + stage) % 3]


def _rank_body(dropouts):
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from dynapipe.cost import build_cost_model
    from dynapipe.config import load_device_config
    from dynapipe.pipeline_planner import plan_iteration
    from dynapipe.runtime.activation_meter import ActivationMeter, measure_activations
    from dynapipe.runtime.activation_plan import planned_activation_peak_mib
    from dynapipe.runtime.executor import Executor
    from megatron_integration.arguments import parse_training_args
    from megatron_integration.initialize import destroy, initialize_megatron
    from megatron_integration.model import build_stage
    from megatron_integration.dynapipe_step import MegatronStageHandlers

    out = {}
    info = None
    try:
        for dropout in dropouts:
            cfg = parse_training_args((ARGS + f" --hidden-dropout {dropout} --attention-dropout {dropout}").split(), 2)
            info = info or initialize_megatron(cfg.parallel, cfg.seed)
            stage = build_stage(cfg, info)
            cost = build_cost_model(cfg.model.to_model_config(), load_device_config("cpu"), 2, None)
            lengths = np.random.default_rng(3).integers(12, 64, size=8)
            it = plan_iteration(lengths, cost, stages=2, recompute="none", memory_limit_mib=1e12, schedule="1f1b")
            plan = it.plan_for(0, info.pp_rank)
            gen = torch.Generator().manual_seed(5)
            tensors = {}
            for m in plan.micro_batches:
                shape = (m.mbs, m.seqlen)
                tensors[m.mb] = {"tokens": torch.randint(1, 256, shape, generator=gen),
                                 "position_ids": torch.arange(m.seqlen).expand(shape).contiguous(),
                                 "labels": torch.randint(1, 256, shape, generator=gen),
                                 "loss_mask": torch.ones(shape)}
            handlers = MegatronStageHandlers(stage, info.device)
            meter = ActivationMeter()
            runs = {}
            variants = {lv: (lambda s, mb, lv=lv: lv) for lv in LEVELS}
            variants["mixed"] = _mixed
            with Executor(handlers, group=parallel_state.get_pipeline_model_parallel_group(), meter=meter) as ex:
                for name, level_of in variants.items():
                    torch.manual_seed(99)
                    model_parallel_cuda_manual_seed(99)
                    stage.module.zero_grad_buffer()
                    handlers.begin(tensors, plan.global_loss_tokens)
                    p = with_levels(plan, level_of)
                    with measure_activations(stage.module, info.device, meter) as act:
                        res = ex.run(p, loss_tokens=plan.global_loss_tokens)
                    # numpy: torch tensors would travel back through shared memory the rank releases.
                    grads = {n: q.main_grad.detach().numpy().copy() for n, q in stage.gpt.named_parameters()}
                    runs[name] = {"loss": res.loss, "mb_losses": res.mb_loss_sums, "grads": grads,
                                  "measured": act["peak_mib"], "planned": planned_activation_peak_mib(p, cost)}
            out[dropout] = runs
        return {"pp_rank": info.pp_rank, "runs": out}
    finally:
        destroy()


@pytest.fixture(scope="module")
def ranks():
    return spawn(_rank_body, 2, ((0.0, 0.1),), timeout_s=300, threads_per_rank=1)


@pytest.mark.parametrize("dropout", [0.0, 0.1])
@pytest.mark.parametrize("variant", ["selective", "full", "mixed"])
def test_losses_and_gradients_equal_the_none_run(ranks, dropout, variant):
    for r in ranks:
        base, got = r["runs"][dropout]["none"], r["runs"][dropout][variant]
        assert got["mb_losses"] == pytest.approx(base["mb_losses"], rel=1e-6, abs=1e-6)
        assert got["loss"] == pytest.approx(base["loss"], rel=1e-6)
        assert set(got["grads"]) == set(base["grads"]) and base["grads"]
        for name, g in base["grads"].items():
            assert np.abs(g).sum() > 0, name  # every parameter got a gradient
            np.testing.assert_allclose(got["grads"][name], g, rtol=1e-5, atol=1e-7, err_msg=name)


def test_dropout_changes_the_loss(ranks):
    # Otherwise the dropout runs would prove nothing about reproduced masks.
    last = next(r for r in ranks if r["pp_rank"] == 1)
    assert last["runs"][0.1]["none"]["loss"] != pytest.approx(last["runs"][0.0]["none"]["loss"], rel=1e-6)


@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_measured_peaks_order_full_below_selective_below_none(ranks, dropout):
    for r in ranks:
        runs = r["runs"][dropout]
        assert runs["full"]["measured"] < runs["selective"]["measured"] < runs["none"]["measured"], r["pp_rank"]
        assert runs["full"]["planned"] < runs["selective"]["planned"] < runs["none"]["planned"]
        # The mixed plan holds no more than all-none and no less than all-full.
        assert runs["full"]["measured"] <= runs["mixed"]["measured"] <= runs["none"]["measured"]
