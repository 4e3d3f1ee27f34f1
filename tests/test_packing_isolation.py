"""Packing under the DynaPipe executor isolates samples on every pipeline stage.

Planning side: packed micro-batches make every stage load compact per-token sample ids
(never an ``s x s`` mask), the plans stay valid and survive serialization. Model side:
the device-built mask equals the one megatron's ``--reset-attention-mask`` baseline
builds. The end-to-end loss check is in ``test_megatron_packing.py``.
"""
import numpy as np
import pytest
import torch

from dynapipe.batching.baselines import packing
from dynapipe.config import load_model_config
from dynapipe.data.collate import TensorRequest, collate
from dynapipe.data.samples import Sample
from dynapipe.errors import DynaPipeError
from dynapipe.plan import compile_plans, deserialize_plan, serialize_plan, validate_plans
from dynapipe.plan.instructions import LoadInput
from dynapipe.plan.validate_fast import group_is_valid
from plan_helpers import chunked_micro_batches


@pytest.fixture(scope="module")
def tiny():
    return load_model_config("gpt-tiny")


def _packed(seed=0, n=40, seqlen=512, rows=2):
    lengths = np.random.default_rng(seed).integers(5, 300, n)
    mbs, _ = packing(lengths, rows, seqlen)
    return mbs


@pytest.mark.parametrize("stages", [2, 4])
def test_every_stage_loads_sample_ids_of_packed_rows(tiny, stages):
    mbs = _packed()
    plans = compile_plans("1f1b", mbs, tiny, num_stages=stages)
    validate_plans(plans)
    assert group_is_valid(plans)
    for p in plans:
        loads = {i.mb: i for i in p.instructions if isinstance(i, LoadInput)}
        assert sorted(loads) == list(range(len(mbs)))
        for i, mb in enumerate(mbs):
            specs = {t.name: t for t in loads[i].tensors}
            seg = specs["segment_ids"]
            assert seg.shape == (mb.mbs, mb.seqlen) and seg.dtype == "int32"
            # Only the first stage embeds tokens; middle stages load nothing but the ids.
            assert ("tokens" in specs) == (p.stage == 0)
            assert ("labels" in specs) == (p.stage == stages - 1)
            if 0 < p.stage < stages - 1:
                assert set(specs) == {"segment_ids"}
        back = deserialize_plan(serialize_plan(p))
        assert back.instructions == p.instructions


def test_unpacked_plans_load_no_sample_ids(tiny):
    mbs = chunked_micro_batches(np.random.default_rng(1).integers(1, 300, 12), 3)
    plans = compile_plans("1f1b", mbs, tiny, num_stages=3)
    names = {t.name for p in plans for i in p.instructions if isinstance(i, LoadInput) for t in i.tensors}
    assert "segment_ids" not in names
    assert not any(isinstance(i, LoadInput) for i in plans[1].instructions)


def test_mixing_packed_and_unpacked_micro_batches_is_refused(tiny):
    mixed = _packed()[:2] + chunked_micro_batches(np.array([30, 40, 50]), 3)
    with pytest.raises(DynaPipeError, match="packs all of its micro-batches or none"):
        compile_plans("1f1b", mixed, tiny, num_stages=3)


def test_device_mask_equals_the_reset_attention_mask_baseline():
    from megatron_integration.batches import rows_micro_batch
    from megatron_integration.dynapipe_step import packed_attention_mask

    rng = np.random.default_rng(3)
    mk = lambda n: Sample(rng.integers(2, 200, n // 2), rng.integers(2, 200, n - n // 2))
    rows = [[mk(10), mk(7), mk(20)], [mk(33)], []]
    seqlen = 48
    baseline = rows_micro_batch(rows, seqlen, reset_position_ids=True, reset_attention_mask=True)
    seg = collate(rows, [TensorRequest("segment_ids", (3, seqlen), "int32")], seqlen)["segment_ids"]
    mine = packed_attention_mask(torch.from_numpy(seg))
    assert mine.dtype == torch.bool and mine.shape == (3, 1, seqlen, seqlen)
    assert torch.equal(mine, baseline.attention_mask)
    # Token 12 (second sample of row 0) sees tokens 10..12 only.
    assert (~mine[0, 0, 12]).nonzero().flatten().tolist() == [10, 11, 12]
