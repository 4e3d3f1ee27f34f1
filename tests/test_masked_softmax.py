"""The additive attention mask gives megatron-core's masked softmax bitwise, for less time.

megatron-core's torch fallback of ``FusedScaleMaskSoftmax`` with its own ``attention_mask_func``
against the same module with :func:`additive_attention_mask`: probabilities and score gradients
equal in every row that keeps a key (packed rows, padding, causal; fp32 and bf16), and a T5
encoder and decoder layer as the training stages build them give the same real-token outputs
and parameter gradients, padding decoder queries that see no key included.
"""
import numpy as np
import pytest
import torch

from megatron_integration.launch import spawn
from megatron_integration.masked_softmax import additive_attention_mask, use_additive_masks
from megatron_integration.t5_handlers import segment_mask

from t5_job import TIMEOUT


def _softmax(mask_func, dtype=torch.float32):
    from megatron.core.fusions.fused_softmax import FusedScaleMaskSoftmax
    from megatron.core.transformer.enums import AttnMaskType

    half = dtype != torch.float32
    return FusedScaleMaskSoftmax(input_in_fp16=dtype == torch.float16, input_in_bf16=dtype == torch.bfloat16,
                                 attn_mask_type=AttnMaskType.padding, scaled_masked_softmax_fusion=False,
                                 mask_func=mask_func, softmax_in_fp32=half, scale=None)


def _probs_and_grads(module, scores, mask, upstream):
    x = scores.clone().requires_grad_(True)
    probs = module(x.clone(), mask)  # not a leaf, as the scores of a layer are (masked in place)
    probs.backward(upstream)
    return probs.detach(), x.grad


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_additive_mask_equals_megatron_masked_fill_bitwise(dtype):
    from megatron.core.transformer.utils import attention_mask_func

    gen = torch.Generator().manual_seed(0)
    # Two packed rows: three samples then padding, and one sample filling the row.
    seg = torch.tensor([[1] * 7 + [2] * 5 + [3] * 9 + [0] * 3, [1] * 24])
    masks = {"packed": segment_mask(seg, seg), "causal": segment_mask(seg, seg, causal=True)}
    for name, mask in masks.items():
        scores = (torch.randn(2, 4, 24, 24, generator=gen) * 3).to(dtype)
        upstream = torch.randn(2, 4, 24, 24, generator=gen).to(dtype)
        ref = _probs_and_grads(_softmax(attention_mask_func, dtype), scores, mask, upstream)
        new = _probs_and_grads(_softmax(additive_attention_mask, dtype), scores, mask, upstream)
        assert torch.equal(ref[0], new[0]), name
        assert torch.equal(ref[1], new[1]), name
        assert float(new[0].float()[mask.expand_as(new[0])].abs().max()) == 0.0  # masked keys get exactly 0


def test_a_row_that_keeps_no_key_differs_only_in_itself():
    from megatron.core.transformer.utils import attention_mask_func

    # Cross-attention of decoder rows [1, 1, 0] over encoder rows [1, 1, 1, 0]: the padding
    # query keeps no key (megatron-core gives it a uniform row; the additive mask its own scores).
    mask = segment_mask(torch.tensor([[1, 1, 0]]), torch.tensor([[1, 1, 1, 0]]), self_attention=False)
    scores = torch.randn(1, 2, 3, 4, generator=torch.Generator().manual_seed(1))
    upstream = torch.ones(1, 2, 3, 4)
    ref = _probs_and_grads(_softmax(attention_mask_func), scores, mask, upstream)
    new = _probs_and_grads(_softmax(additive_attention_mask), scores, mask, upstream)
    assert torch.equal(ref[0][:, :, :2], new[0][:, :, :2]) and torch.equal(ref[1][:, :, :2], new[1][:, :, :2])
    assert torch.allclose(ref[0][:, :, 2], torch.full((1, 2, 4), 0.25))
    assert not torch.allclose(new[0][:, :, 2], ref[0][:, :, 2])


def test_a_float_mask_goes_to_megatron_core():
    scores, mask = torch.zeros(1, 1, 2, 2), torch.tensor([[[[0.0, 1.0], [0.0, 0.0]]]])
    with pytest.raises(RuntimeError):  # megatron-core's masked_fill_ takes only bool masks
        additive_attention_mask(scores, mask)


def _layers_job() -> dict:
    """One rank: the T5 encoder and decoder layers of the profiler (built as the training stages
    are), run with megatron-core's mask function and with the additive one."""
    from megatron.core.transformer.utils import attention_mask_func

    from megatron_integration.initialize import destroy, initialize_megatron
    from megatron_integration.t5_profiler import T5Ops
    from megatron_integration.train_config import GPTModelArgs, ParallelArgs

    info = initialize_megatron(ParallelArgs(world_size=1, backend="gloo"), seed=3)
    try:
        model = GPTModelArgs(num_layers=2, hidden_size=64, num_attention_heads=4, ffn_hidden_size=128,
                             vocab_size=256, max_position_embeddings=96, seq_length=96, kv_channels=16,
                             hidden_dropout=0.0, attention_dropout=0.0)
        ops = T5Ops(model, torch.device("cpu"))
        layer = ops.decoder.layers[0]
        softmaxes = [m for block in (ops.encoder, layer) for m in block.modules() if hasattr(m, "mask_func")]
        built_with = {m.mask_func.__name__ for m in softmaxes}
        gen = torch.Generator().manual_seed(0)
        x, y = torch.randn(96, 2, 64, generator=gen), torch.randn(24, 2, 64, generator=gen)
        # Packed encoder rows with padding; decoder rows whose last queries are padding.
        enc_seg = torch.tensor([[1] * 40 + [2] * 50 + [0] * 6, [1] * 90 + [0] * 6])
        dec_seg = torch.tensor([[1] * 10 + [2] * 10 + [0] * 4, [1] * 20 + [0] * 4])
        real = (dec_seg > 0).T.unsqueeze(-1).float()  # [s, b, 1]: the loss sees real queries only
        out = {"built_with": sorted(built_with), "softmaxes": len(softmaxes)}
        for name, func in (("megatron", attention_mask_func), ("additive", additive_attention_mask)):
            for m in softmaxes:
                m.mask_func = func
            enc_out = ops.encoder(hidden_states=x, attention_mask=segment_mask(enc_seg, enc_seg))
            dec_out = layer(hidden_states=y, attention_mask=segment_mask(dec_seg, dec_seg, causal=True),
                            context=enc_out, context_mask=segment_mask(dec_seg, enc_seg, self_attention=False))[0]
            (enc_out.square().sum() + (dec_out * real).square().sum()).backward()
            params = list(ops.encoder.parameters()) + list(layer.parameters())
            out[name] = {"enc": enc_out.detach().numpy(), "dec": (dec_out * real).detach().numpy(),
                         "grads": [p.grad.numpy().copy() for p in params]}
            for p in params:
                p.grad = None
        # The GPT stage of a CPU run.
        from megatron_integration.arguments import parse_training_args
        from megatron_integration.model import build_gpt_stage

        cfg = parse_training_args(("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 64 "
                                   "--max-position-embeddings 64 --vocab-size 128 --micro-batch-size 1 "
                                   "--global-batch-size 1 --train-iters 1 --lr 1e-4 --mock-data").split(), 1)
        gpt = build_gpt_stage(cfg, info)
        out["gpt_built_with"] = sorted({m.mask_func.__name__ for m in gpt.modules() if hasattr(m, "mask_func")})
        return out
    finally:
        destroy()


def test_stages_built_for_the_cpu_use_it_and_t5_layers_train_the_same():
    (res,) = spawn(_layers_job, 1, timeout_s=TIMEOUT, threads_per_rank=1)
    # Encoder self-attention, decoder self- and cross-attention.
    assert res["built_with"] == ["additive_attention_mask"] and res["softmaxes"] == 3
    assert res["gpt_built_with"] == ["additive_attention_mask"]
    for key in ("enc", "dec"):
        assert np.array_equal(res["megatron"][key], res["additive"][key])
    assert all(np.array_equal(a, b) for a, b in zip(res["megatron"]["grads"], res["additive"]["grads"]))


def test_use_additive_masks_counts_what_it_changed():
    from megatron.core.transformer.utils import attention_mask_func

    holder = torch.nn.Sequential(_softmax(attention_mask_func), torch.nn.Linear(2, 2), _softmax(attention_mask_func))
    assert use_additive_masks(holder) == 2
    assert all(m.mask_func is additive_attention_mask for m in holder if hasattr(m, "mask_func"))
    assert use_additive_masks(torch.nn.Linear(2, 2)) == 0


def test_each_mask_gets_its_bias_once_and_a_changed_mask_a_new_one():
    from megatron_integration.masked_softmax import _BiasCache

    cache = _BiasCache(size=2)
    a, b = torch.tensor([[True, False]]), torch.tensor([[False, True]])
    first = cache.bias_of(a, torch.float32)
    assert first.tolist() == [[-10000.0, 0.0]]
    assert cache.bias_of(b, torch.float32).tolist() == [[0.0, -10000.0]]
    assert cache.bias_of(a, torch.float32) is first                 # alternating masks: no rebuild
    assert cache.bias_of(a, torch.bfloat16).dtype == torch.bfloat16  # another dtype: its own bias
    a[0, 1] = True                                                   # changed in place: rebuilt
    assert cache.bias_of(a, torch.float32).tolist() == [[-10000.0, -10000.0]]
