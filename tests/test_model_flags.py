"""Megatron's model-shape and fp16 loss-scale flags: parsed with Megatron's defaults, priced by
the planner's cost model, mapped into megatron-core's configs (no processes; the built
models are checked in tests/test_tp_init.py's spawned job)."""
import dataclasses

import numpy as np
import pytest

from dynapipe.config import DeviceConfig, ModelConfig, TensorParallelConfig
from dynapipe.cost import AnalyticCostModel, ProfileCostModel, StageLayout
from dynapipe.errors import DynaPipeError
from megatron_integration.arguments import parse_training_args
from megatron_integration.model_flags import swiglu_ffn_hidden_size
from profile_widths import widths

BASE = ("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 128 --micro-batch-size 2 "
        "--global-batch-size 8 --lr 1e-3 --mock-data --train-iters 10")


def parse(extra: str = "", world: int = 1, cuda: bool = False):
    return parse_training_args(f"{BASE} {extra}".split(), world, cuda=cuda)


def test_shape_flags_with_megatron_defaults():
    m = parse().model
    assert (m.swiglu, m.add_bias_linear, m.num_query_groups, m.rotary_base, m.ffn_hidden_size) == \
        (False, True, None, 10000, 256)
    # Megatron-LM's SwiGLU width: int(4h x 2/3 / 64) x 64.
    assert swiglu_ffn_hidden_size(64) == 128 and swiglu_ffn_hidden_size(4096) == 10880
    assert parse("--swiglu").model.ffn_hidden_size == 128
    assert parse("--swiglu --ffn-hidden-size 96").model.ffn_hidden_size == 96
    assert parse("--disable-bias-linear").model.add_bias_linear is False
    assert parse("--group-query-attention --num-query-groups 2").model.num_query_groups == 2
    # Megatron-LM ignores --num-query-groups without --group-query-attention; refused here, not dropped.
    with pytest.raises(DynaPipeError, match="--num-query-groups 2 without --group-query-attention"):
        parse("--num-query-groups 2")
    cfg = parse("--position-embedding-type rope --rotary-base 500000 --normalization RMSNorm")
    assert (cfg.model.rotary_base, cfg.model.normalization) == (500000, "RMSNorm")
    mc = parse("--swiglu --disable-bias-linear --group-query-attention --num-query-groups 2 "
               "--normalization RMSNorm").model.to_model_config()
    assert (mc.gated_linear_unit, mc.add_bias_linear, mc.num_query_groups, mc.normalization) == \
        (True, False, 2, "RMSNorm")
    assert (mc.fc1_width, mc.kv_dim, mc.attention_dim) == (256, 32, 64)


@pytest.mark.parametrize("extra, world, cuda, needle", [
    ("--group-query-attention --num-query-groups 3", 1, False, "--num-query-groups 3 must be a positive divisor of"),
    ("--group-query-attention --num-query-groups 0", 1, False, "--num-query-groups 0 must be a positive divisor"),
    ("--group-query-attention --num-query-groups 1 --tensor-model-parallel-size 2", 2, True,
     "--num-query-groups 1 is not divisible by --tensor-model-parallel-size 2"),
    ("--swiglu --hidden-size 16", 1, False, "give --ffn-hidden-size"),
    ("--position-embedding-type rope --rotary-base 0", 1, False, "--rotary-base 0: must be positive"),
])
def test_shape_flags_refused_with_the_fix(extra, world, cuda, needle, gpu_with_te):
    with pytest.raises(DynaPipeError) as e:
        parse(extra, world, cuda)
    assert needle in str(e.value) and "\n" not in str(e.value)


def test_loss_scale_flags_reach_megatron_optimizer_config(gpu_with_te):
    pytest.importorskip("megatron.core")
    from megatron_integration.optimizer import optimizer_config

    dynamic = optimizer_config(parse("--fp16", cuda=True))
    # Megatron-LM's defaults.
    assert (dynamic.fp16, dynamic.loss_scale, dynamic.initial_loss_scale, dynamic.min_loss_scale,
            dynamic.loss_scale_window, dynamic.hysteresis) == (True, None, 2.0 ** 32, 1.0, 1000, 2)
    cfg = parse("--fp16 --initial-loss-scale 65536 --min-loss-scale 16 --loss-scale-window 200 --hysteresis 4",
                cuda=True)
    o = optimizer_config(cfg)
    assert (o.initial_loss_scale, o.min_loss_scale, o.loss_scale_window, o.hysteresis) == (65536, 16, 200, 4)
    assert optimizer_config(parse("--fp16 --loss-scale 1024", cuda=True)).loss_scale == 1024
    # Megatron-LM scales bf16 by a static --loss-scale too (megatron-core's constant scaler).
    assert optimizer_config(parse("--bf16 --loss-scale 1024")).loss_scale == 1024
    assert optimizer_config(parse()).fp16 is False


@pytest.mark.parametrize("extra, cuda, needle", [
    ("--loss-scale 1024", False, "--loss-scale applies to --fp16 and --bf16"),
    ("--hysteresis 3", False, "--hysteresis sets the dynamic loss scale"),
    ("--bf16 --min-loss-scale 2", True, "--min-loss-scale sets the dynamic loss scale, which --fp16 only uses"),
    ("--fp16 --hysteresis 0", True, "--hysteresis 0: must be at least 1"),
    ("--fp16 --loss-scale-window 0", True, "--loss-scale-window 0.0: must be positive"),
    ("--fp16 --loss-scale -1", True, "--loss-scale -1.0: must be positive"),
    ("--fp16 --initial-loss-scale 8 --min-loss-scale 16", True, "--min-loss-scale 16.0 is above --initial-loss-scale"),
])
def test_loss_scale_flags_refused(extra, cuda, needle, gpu_with_te):
    with pytest.raises(DynaPipeError) as e:
        parse(extra, cuda=cuda)
    assert needle in str(e.value)


# -- the planner prices what the flags change -------------------------------------------------

DEVICE = DeviceConfig(name="flat", peak_tflops=1.0, achievable_fraction=1.0, memory_mib=1e6)
GPT = ModelConfig(name="t", num_layers=4, hidden_size=64, num_attention_heads=4, ffn_hidden_size=128,
                  vocab_size=256, max_seq_length=512, dtype="fp32")
MIDDLE = StageLayout(1, 0, 2, False, False)  # two layers, no embedding or output layer
B, S = 2.0, 96.0


def _cost(model, recompute="none"):
    return AnalyticCostModel(model, DEVICE, 2).layout_cost(MIDDLE, B, S, S, recompute)


def test_cost_model_prices_swiglu_flops_and_activations():
    gelu, glu = _cost(GPT), _cost(dataclasses.replace(GPT, gated_linear_unit=True))
    ms_per_flop = 1 / DEVICE.effective_flops_per_ms
    h, f = GPT.hidden_size, GPT.ffn_hidden_size
    # The gated FC1 adds a second h x f GEMM per layer: 2bshf forward FLOPs, twice that backward.
    assert float(glu.fw_ms - gelu.fw_ms) == pytest.approx(2 * 2 * B * S * h * f * ms_per_flop)
    assert float(glu.bw_ms - gelu.bw_ms) == pytest.approx(2 * 4 * B * S * h * f * ms_per_flop)
    # It also keeps the second FC1 half, and megatron-core's unfused gate the SiLU of one half and
    # the other's offset copy: 3bsf more elements a layer, 4 bytes each (fp32), 2 layers.
    assert float(glu.stored_mib - gelu.stored_mib) * 2 ** 20 == pytest.approx(2 * 3 * B * S * f * 4)


def test_cost_model_prices_grouped_query_attention():
    mha, gqa = _cost(GPT), _cost(dataclasses.replace(GPT, num_query_groups=1))
    h, ad, kd = GPT.hidden_size, GPT.attention_dim, 16
    # Key and value projections shrink from a_d to k_d columns each.
    assert float(mha.fw_ms - gqa.fw_ms) == pytest.approx(2 * 2 * 2 * B * S * h * (ad - kd) / DEVICE.effective_flops_per_ms)
    # K and V activations shrink likewise (4 bytes a column at 2-byte scale, x2 for fp32).
    assert float(mha.stored_mib - gqa.stored_mib) * 2 ** 20 == pytest.approx(2 * B * S * 4 * (ad - kd) * 2)
    # The attention core (scores over every query head) is unchanged: selective recompute adds the same.
    sel = _cost(dataclasses.replace(GPT, num_query_groups=1), "selective")
    assert float(sel.bw_ms - gqa.bw_ms) == pytest.approx(float(_cost(GPT, "selective").bw_ms - mha.bw_ms))


def test_parameter_count_follows_the_flags():
    from dynapipe.cost.base import stage_param_count

    def count(**kw):
        return stage_param_count(dataclasses.replace(GPT, **kw), MIDDLE)

    h, f, layers = GPT.hidden_size, GPT.ffn_hidden_size, 2
    assert count(gated_linear_unit=True) - count() == layers * (h * f + f)
    assert count() - count(add_bias_linear=False) == layers * (3 * h + f + h + h)
    assert count() - count(num_query_groups=2) == layers * 2 * (h + 1) * (h - 32)
    assert count() - count(normalization="RMSNorm") == layers * 2 * h
    # Model state memory follows the count (what the planner subtracts from the memory limit).
    full = AnalyticCostModel(GPT, DEVICE, 2).model_state_mib()
    glu = AnalyticCostModel(dataclasses.replace(GPT, gated_linear_unit=True), DEVICE, 2).model_state_mib()
    assert glu > full


def test_tp_refuses_query_groups_it_cannot_split():
    with pytest.raises(DynaPipeError, match="num_query_groups=1"):
        TensorParallelConfig(size=2).validate(dataclasses.replace(GPT, num_query_groups=1))
    TensorParallelConfig(size=2).validate(dataclasses.replace(GPT, num_query_groups=2))
    with pytest.raises(DynaPipeError, match="num_query_groups=3 must divide"):
        dataclasses.replace(GPT, num_query_groups=3).validate()


def _grid(value):
    return [[value] * 2 for _ in range(2)]


def _profile(model: dict):
    table = {k: _grid(0.5) for k in ("fw_ms", "bw_ms", "stored_mib", "peak_mib")}
    return {"format": "dynapipe-profile", "version": 1, "mbs": [1, 2], "seqlen": [64, 128],
            "model": {**widths(GPT), **model},
            "ops": {"layer": table, "embedding": table, "output": table}}


def test_profile_of_another_layer_kind_is_refused():
    swiglu = dataclasses.replace(GPT, gated_linear_unit=True)
    # A profile that does not record the switches was measured on the default layer.
    ProfileCostModel(GPT, _profile({"hidden_size": 64}), 2)
    with pytest.raises(DynaPipeError, match="measured with gated_linear_unit=False but the model has "
                                            "gated_linear_unit=True"):
        ProfileCostModel(swiglu, _profile({"hidden_size": 64}), 2)
    ProfileCostModel(swiglu, _profile({"gated_linear_unit": True}), 2)
    with pytest.raises(DynaPipeError, match="num_query_groups=2"):
        ProfileCostModel(GPT, _profile({"num_query_groups": 2}), 2)
    assert np.isfinite(float(ProfileCostModel(GPT, _profile({}), 2).stage_cost(2, 96, stage=0).fw_ms))
    # Precision too: a profile without "dtype" was measured in fp32.
    bf16 = dataclasses.replace(GPT, dtype="bf16")
    with pytest.raises(DynaPipeError, match="measured in fp32 but the model trains in bf16; profile in bf16"):
        ProfileCostModel(bf16, _profile({}), 2)
    ProfileCostModel(bf16, {**_profile({}), "dtype": "bf16"}, 2)


def _rotary(argv: list) -> dict:
    """The inverse frequencies and the first positions' angles of a one-rank GPT stage's RoPE."""
    from megatron_integration.initialize import initialize_megatron
    from megatron_integration.model import build_stage

    cfg = parse_training_args(argv, 1)
    stage = build_stage(cfg, initialize_megatron(cfg.parallel, cfg.seed))
    rope = stage.gpt.rotary_pos_emb
    return {"inv_freq": rope.inv_freq.double().numpy(), "angles": rope(4).reshape(4, -1).double().numpy()}


def test_rope_scaling_and_interpolation_reach_the_rotary_embedding():
    """--use-rope-scaling (Llama 3.x: wavelengths beyond 8,192 / 1 positions divided by the factor,
    below 8,192 / 4 kept, smoothly between) and --rotary-seq-len-interpolation-factor (positions
    divided by it), checked against the formulas on kv_channels 16, base 10000, whose wavelengths
    (6 to 19,869 positions) fall in all three bands."""
    import math

    from megatron_integration.launch import spawn

    base = ("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 64 --vocab-size 256 "
            "--micro-batch-size 1 --global-batch-size 1 --train-iters 1 --lr 1e-3 --mock-data "
            "--position-embedding-type rope")
    plain = spawn(_rotary, 1, (base.split(),), timeout_s=120)[0]
    scaled = spawn(_rotary, 1, ((base + " --use-rope-scaling --rope-scaling-factor 4").split(),), timeout_s=120)[0]
    interp = spawn(_rotary, 1, ((base + " --rotary-seq-len-interpolation-factor 2").split(),), timeout_s=120)[0]
    freq = 1.0 / 10000 ** (np.arange(0, 16, 2) / 16)
    assert np.allclose(plain["inv_freq"], freq)
    want = []
    for f in freq:
        wavelen = 2 * math.pi / f
        if wavelen < 8192 / 4:
            want.append(f)
        elif wavelen > 8192:
            want.append(f / 4)
        else:
            smooth = (8192 / wavelen - 1) / (4 - 1)
            want.append((1 - smooth) * f / 4 + smooth * f)
    assert np.allclose(scaled["inv_freq"], want, rtol=1e-6)
    assert not np.allclose(scaled["inv_freq"], freq)  # the two longest wavelengths changed
    # Positions 0..3 at half speed: angle = position / 2 x frequency.
    assert np.allclose(interp["angles"][:, :8], np.outer(np.arange(4) / 2, freq), rtol=1e-6)
    assert np.allclose(plain["angles"][:, :8], np.outer(np.arange(4), freq), rtol=1e-6)


@pytest.mark.parametrize("extra, needle", [
    ("--use-rope-scaling", "add --position-embedding-type rope"),
    ("--position-embedding-type rope --rope-scaling-factor 4", "needs --use-rope-scaling"),
    ("--position-embedding-type rope --use-rope-scaling --rope-scaling-factor 0", "must be positive"),
    ("--position-embedding-type rope --rotary-seq-len-interpolation-factor 0", "must be 1 or more"),
])
def test_rope_flags_without_rope_or_with_bad_values_are_refused(extra, needle):
    argv = ("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 64 --vocab-size 256 "
            f"--micro-batch-size 1 --global-batch-size 1 --train-iters 1 --lr 1e-3 --mock-data {extra}")
    with pytest.raises(DynaPipeError, match=needle):
        parse_training_args(argv.split(), 1, cuda=False)


def test_qwen_layer_flags_parse_price_and_reach_megatron_core():
    """Qwen2's ``--add-qkv-bias`` (QKV bias without the others) and Qwen3's ``--qk-layernorm``
    (per-head query/key norms); the legacy RoPE spellings; ``--apply-wd-to-qk-layernorm``."""
    m = parse("--disable-bias-linear --add-qkv-bias --qk-layernorm --use-rotary-position-embeddings "
              "--no-position-embedding --apply-wd-to-qk-layernorm").model
    assert (m.add_bias_linear, m.add_qkv_bias, m.qk_layernorm, m.position_embedding_type) == (False, True, True, "rope")
    mc = m.to_model_config()
    assert (mc.add_qkv_bias, mc.qk_layernorm) == (True, True)
    assert parse("").model.position_embedding_type == "learned_absolute"
    from dynapipe.cost.base import stage_param_count

    def count(**kw):
        return stage_param_count(dataclasses.replace(GPT, **kw), MIDDLE)

    hd, layers = GPT.head_dim, 2
    qkv = GPT.attention_dim + 2 * GPT.kv_dim
    assert count(add_bias_linear=False, add_qkv_bias=True) - count(add_bias_linear=False) == layers * qkv
    assert count(add_qkv_bias=True) == count()  # the linear biases already include it
    assert count(qk_layernorm=True) - count() == layers * 2 * 2 * hd  # LayerNorm: weight and bias, q and k
    assert count(qk_layernorm=True, normalization="RMSNorm") - count(normalization="RMSNorm") == layers * 2 * hd
    # The norms keep fp32 statistics per head (LayerNorm: mean and 1/std; RMSNorm: 1/rms), the
    # attention core the normalised queries and keys (learned positions), torch's RMSNorm a
    # copy of them too (as measured on CPU), 2 layers.
    normed = (GPT.attention_dim + GPT.kv_dim) * 4
    plain, qk = _cost(GPT), _cost(dataclasses.replace(GPT, qk_layernorm=True))
    assert float(qk.stored_mib - plain.stored_mib) * 2 ** 20 == pytest.approx(2 * B * S * ((4 + 4) * 2 * 4 + normed))
    for torch_norms in (False, True):
        rms = dataclasses.replace(GPT, normalization="RMSNorm", torch_norms=torch_norms)
        plain, qk = _cost(rms), _cost(dataclasses.replace(rms, qk_layernorm=True))
        assert float(qk.stored_mib - plain.stored_mib) * 2 ** 20 == pytest.approx(
            2 * B * S * ((4 + 4) * 4 + normed * (2 if torch_norms else 1)))
    # Under rotary positions nothing keeps the norms' output (the rotated copies are counted apart).
    rope = dataclasses.replace(GPT, position_embedding_type="rope")
    plain, qk = _cost(rope), _cost(dataclasses.replace(rope, qk_layernorm=True))
    assert float(qk.stored_mib - plain.stored_mib) * 2 ** 20 == pytest.approx(2 * B * S * (4 + 4) * 2 * 4)
    pytest.importorskip("megatron.core")
    from megatron_integration.model import transformer_config
    from megatron_integration.optimizer import optimizer_config

    cfg = parse("--disable-bias-linear --add-qkv-bias --qk-layernorm --apply-wd-to-qk-layernorm")
    tc = transformer_config(cfg.model, cfg.parallel, cuda=False)
    assert (tc.add_bias_linear, tc.add_qkv_bias, tc.qk_layernorm) == (False, True, True)
    assert optimizer_config(cfg).apply_wd_to_qk_layernorm
    assert not optimizer_config(parse("--qk-layernorm")).apply_wd_to_qk_layernorm


@pytest.mark.parametrize("extra, needle", [
    ("--add-qkv-bias", "--add-qkv-bias without --disable-bias-linear"),
    ("--apply-wd-to-qk-layernorm", "--apply-wd-to-qk-layernorm without --qk-layernorm"),
    ("--no-position-embedding", "--no-position-embedding with --position-embedding-type learned_absolute"),
    ("--recompute-modules core_attn", "add --recompute-granularity selective"),
    ("--recompute-activations --recompute-modules core_attn mlp", "--recompute-modules core_attn mlp: selective"),
    ("--recompute-activations --recompute-modules", "--recompute-modules (none): selective"),
])
def test_layer_flags_that_cannot_be_honoured_are_refused(extra, needle):
    with pytest.raises(DynaPipeError) as e:
        parse(extra)
    assert needle in str(e.value) and "\n" not in str(e.value)


def test_recompute_modules_core_attn_is_selective_recompute():
    assert parse("--recompute-activations --recompute-modules core_attn").recompute.granularity == "selective"


def test_deterministic_mode_sets_megatrons_environment_and_reaches_the_config(monkeypatch, gpu_with_te):
    import os

    import torch

    from megatron_integration.determinism import (DETERMINISTIC_ENV, deterministic_env, end_deterministic_run,
                                                  start_deterministic_run)

    assert deterministic_env({"NCCL_ALGO": "Ring,CollnetDirect"}) == {"CUBLAS_WORKSPACE_CONFIG": ":4096:8",
                                                                       "NVTE_ALLOW_NONDETERMINISTIC_ALGO": "0"}
    for name, bad in (("NCCL_ALGO", "Tree"), ("NCCL_ALGO", "Ring,Tree"), ("CUBLAS_WORKSPACE_CONFIG", ":0:0"),
                      ("NVTE_ALLOW_NONDETERMINISTIC_ALGO", "1")):
        with pytest.raises(DynaPipeError, match=f"{name}='{bad}': not a deterministic setting"):
            deterministic_env({name: bad})
    env = {k: v for k, v in os.environ.items() if k not in DETERMINISTIC_ENV}
    monkeypatch.setattr(os, "environ", env)
    start_deterministic_run(True)
    try:
        assert torch.are_deterministic_algorithms_enabled()
        assert (env["NCCL_ALGO"], env["CUBLAS_WORKSPACE_CONFIG"]) == ("Ring", ":4096:8")
    finally:
        end_deterministic_run()
    assert not torch.are_deterministic_algorithms_enabled()
    cfg = parse("--deterministic-mode")
    assert cfg.model.deterministic_mode and not parse("").model.deterministic_mode
    with pytest.raises(DynaPipeError, match="--deterministic-mode with --cross-entropy-loss-fusion"):
        parse("--deterministic-mode --cross-entropy-loss-fusion", cuda=True)
    pytest.importorskip("megatron.core")
    from megatron_integration.model import transformer_config

    assert transformer_config(cfg.model, cfg.parallel, cuda=False).deterministic_mode


def test_attention_softmax_in_fp32_is_megatrons_flag():
    """Off by default (the softmax in the run's precision, as Megatron-LM, where megatron-core
    defaults to fp32); on with the flag or with --apply-query-key-layer-scaling. The bf16
    softmax runs on a CPU with this build's additive mask and masks exactly."""
    pytest.importorskip("megatron.core")
    import torch

    from megatron.core.fusions.fused_softmax import FusedScaleMaskSoftmax
    from megatron.core.transformer.enums import AttnMaskType

    from megatron_integration.masked_softmax import additive_attention_mask
    from megatron_integration.model import transformer_config

    seen = {}
    for extra in ("", "--attention-softmax-in-fp32", "--apply-query-key-layer-scaling"):
        cfg = parse("--bf16 " + extra)
        seen[extra] = transformer_config(cfg.model, cfg.parallel, cuda=False).attention_softmax_in_fp32
    assert seen == {"": False, "--attention-softmax-in-fp32": True, "--apply-query-key-layer-scaling": True}
    scores = torch.randn(2, 4, 16, 16).to(torch.bfloat16)
    mask = torch.triu(torch.ones(16, 16, dtype=torch.bool), 1)[None, None]
    probs = {}
    for fp32 in (False, True):
        softmax = FusedScaleMaskSoftmax(input_in_fp16=False, input_in_bf16=True, attn_mask_type=AttnMaskType.causal,
                                        scaled_masked_softmax_fusion=False, mask_func=additive_attention_mask,
                                        softmax_in_fp32=fp32, scale=None)
        probs[fp32] = softmax(scores, mask)
        assert probs[fp32].dtype == torch.bfloat16 and (probs[fp32][mask.expand_as(scores)] == 0).all()
    assert torch.allclose(probs[False].float(), probs[True].float(), atol=1e-2)


def test_gelu_is_the_tanh_approximation_of_megatrons_default_bias_gelu_fusion():
    # Megatron-LM fuses bias and GeLU by default (fused_bias_gelu.bias_gelu: GeLU's tanh
    # approximation); --no-bias-gelu-fusion runs its unfused path, the exact GeLU, as does a
    # model without biases (Megatron-LM then turns the fusion off). SwiGLU has no GeLU.
    import torch
    import torch.nn.functional as F

    from megatron_integration.model import transformer_config

    def activation(extra=""):
        cfg = parse(extra)
        return transformer_config(cfg.model, cfg.parallel, cuda=False).activation_func

    x = torch.linspace(-6, 6, 1001, dtype=torch.float64)
    megatron_bias_gelu = x * 0.5 * (1.0 + torch.tanh(0.79788456 * x * (1 + 0.044715 * x * x)))
    assert torch.allclose(activation()(x), megatron_bias_gelu, atol=1e-8)
    assert not torch.allclose(F.gelu(x), megatron_bias_gelu, atol=1e-4)  # the two differ
    for extra in ("--no-bias-gelu-fusion", "--disable-bias-linear"):
        assert activation(extra) is F.gelu, extra
    assert activation("--swiglu") is F.silu
