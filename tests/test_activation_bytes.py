"""What a layer keeps for its backward (``dynapipe.cost.activation_bytes``): the analytic
model's terms against megatron-core's local layers, measured with saved-tensor hooks."""
import dataclasses
import json
import subprocess
import sys

import pytest

from dynapipe.config import DeviceConfig, ModelConfig, load_device_config, load_model_config, model_config_from_dict
from dynapipe.cost.activation_bytes import layer_token_bytes, score_bytes
from dynapipe.cost.analytic import AnalyticCostModel
from dynapipe.cost.base import StageLayout
from dynapipe.errors import DynaPipeError

DEVICE = DeviceConfig(name="gpu", peak_tflops=100.0)
CPU = DeviceConfig(name="cpu", peak_tflops=0.04, dropout_mask_bytes=0)  # masks in the activation's dtype
H, HEADS, FFN = 64, 4, 256


def _gpt(**kw) -> ModelConfig:
    kw = {"dtype": "bf16", **kw}
    return ModelConfig(name="m", num_layers=1, hidden_size=H, num_attention_heads=HEADS, ffn_hidden_size=FFN,
                       vocab_size=512, **kw).validate()


def _t5(**kw) -> ModelConfig:
    kw = {"dtype": "bf16", **kw}
    return ModelConfig(name="t", arch="t5", num_layers=2, encoder_layers=1, decoder_layers=1, hidden_size=H,
                       num_attention_heads=HEADS, ffn_hidden_size=FFN, vocab_size=512, **kw).validate()


def _layer_bytes(model: ModelConfig, b: int, s: int) -> float:
    linear, scores = AnalyticCostModel(model, DEVICE, 1)._layer_act_bytes(b, s)
    return float(linear + scores)


def test_defaults_are_korthikanti_and_dropout_zero_keeps_no_masks():
    b, s = 2, 512
    with_dropout = _layer_bytes(_gpt(), b, s)
    # sbh(34 + 5as/h), plus the two LayerNorms' fp32 mean and 1/std (16 bytes a token).
    assert with_dropout == pytest.approx(b * s * H * (34 + 5 * HEADS * s / H) + 16 * b * s)
    # At dropout 0: no hidden masks (2 bytes a token and unit) and only the softmax output.
    assert _layer_bytes(_gpt(hidden_dropout=0.0, attention_dropout=0.0), b, s) == pytest.approx(
        b * s * (H * 32 + 16) + 2 * HEADS * b * s * s)
    assert _layer_bytes(_gpt(hidden_dropout=0.0), b, s) == pytest.approx(with_dropout - 2 * b * s * H)
    # fp32: 4-byte activations, 1-byte masks (a CPU's: 4).
    assert score_bytes(_gpt(dtype="fp32")) == 9 and score_bytes(_gpt(dtype="fp32", attention_dropout=0.0)) == 4
    assert score_bytes(_gpt(dtype="fp32"), CPU.dropout_mask_bytes_for(4)) == 12
    # A softmax in fp32 keeps its fp32 output and the cast copy the weighted sum reads.
    assert score_bytes(_gpt(attention_softmax_in_fp32=True, attention_dropout=0.0)) == 6
    assert score_bytes(_gpt(attention_softmax_in_fp32=True)) == 7


def test_fused_attention_keeps_no_scores_so_selective_recompute_saves_nothing_more():
    fused = _gpt(fused_attention=True)
    b, s = 1, 4096
    assert score_bytes(fused) == 0
    # Linear in the length: only the kernel's fp32 log-sum-exp per head and query is added.
    assert _layer_bytes(fused, b, s) == pytest.approx(b * s * (H * 34 + 16 + HEADS * 4))
    cm = AnalyticCostModel(fused, DEVICE, 1)
    layout = StageLayout(stage=1, encoder_layers=0, decoder_layers=1, has_embedding=False, has_output=False)
    none, sel = (cm.layout_cost(layout, b, s, s, level) for level in ("none", "selective"))
    assert float(sel.stored_mib) == pytest.approx(float(none.stored_mib))
    unfused = AnalyticCostModel(_gpt(), DEVICE, 1).layout_cost(layout, b, s, s, "none")
    assert float(unfused.stored_mib) > 10 * float(none.stored_mib)


def test_rotary_positions_keep_the_rotated_query_and_key():
    grouped = dict(num_query_groups=2)
    extra = layer_token_bytes(_gpt(position_embedding_type="rope", **grouped)) - layer_token_bytes(_gpt(**grouped))
    assert extra == (H + H // 2) * 2  # query (all heads) + key (2 groups of 16), bf16


def test_tensor_parallel_shards_the_terms_it_splits():
    m = _gpt(hidden_dropout=0.0)
    one, two, sp = layer_token_bytes(m), layer_token_bytes(m, 2), layer_token_bytes(m, 2, 2)
    assert sp == pytest.approx(one / 2)
    norms = 4 * H * 2 + 16  # the norms' inputs, outputs and statistics stay replicated
    assert two == pytest.approx(norms + (one - norms) / 2)


def test_t5_profile_drops_the_analytic_score_share_under_selective():
    # A T5 profile without level tables derives `selective` from `none` by the analytic share of
    # scores in a layer's stored bytes: the decoder's self- and cross-attention scores against its
    # self-attention, MLP and cross-attention blocks (the encoder tokens' keys and values too).
    from dynapipe.cost.profile_t5 import _core_shares

    for kw in ({}, dict(hidden_dropout=0.0, attention_dropout=0.0)):
        m = _t5(**kw)
        cm = AnalyticCostModel(m, DEVICE, 1)
        for s_enc, s_dec in ((512, 128), (2048, 128), (256, 256)):
            _, _, enc_share, dec_share = _core_shares(m, s_enc, s_dec)
            lin, sc = cm._layer_act_bytes(1, s_enc)
            assert enc_share == pytest.approx(sc / (lin + sc))
            (lin, sc), (x_lin, x_sc) = cm._layer_act_bytes(1, s_dec), cm._cross_act_bytes(1, s_dec, s_enc)
            assert dec_share == pytest.approx((sc + x_sc) / (lin + sc + x_lin + x_sc))


def test_device_dropout_mask_bytes():
    assert DEVICE.dropout_mask_bytes_for(2) == 1 and CPU.dropout_mask_bytes_for(2) == 2
    assert load_device_config("cpu").dropout_mask_bytes == 0
    with pytest.raises(DynaPipeError, match="dropout_mask_bytes=-1 must be 1 \\(a bool mask, as on CUDA\\), 2 or 4"):
        DeviceConfig(name="x", peak_tflops=1.0, memory_mib=1.0, dropout_mask_bytes=-1).validate()


@pytest.mark.parametrize("key, value, needle", [
    ("attention_dropout", 1.0, "attention_dropout=1.0 must be a probability"),
    ("hidden_dropout", -0.1, "hidden_dropout=-0.1 must be a probability"),
    ("position_embedding_type", "alibi", "position_embedding_type='alibi'"),
    ("fused_attention", "yes", "fused_attention='yes' must be"),
])
def test_bad_values_are_refused_naming_them(key, value, needle):
    data = dataclasses.asdict(load_model_config("gpt-tiny"))
    data[key] = value
    with pytest.raises(DynaPipeError, match=needle):
        model_config_from_dict(data, "m.yaml")


def test_megatron_arguments_reach_the_planner_model():
    from megatron_integration.train_config import GPTModelArgs

    args = GPTModelArgs(num_layers=2, hidden_size=H, num_attention_heads=HEADS, ffn_hidden_size=FFN,
                        kv_channels=16, seq_length=128, max_position_embeddings=128, vocab_size=512,
                        position_embedding_type="rope", hidden_dropout=0.0, attention_dropout=0.05, dtype="bf16")
    m = args.to_model_config()
    assert (m.hidden_dropout, m.attention_dropout, m.position_embedding_type, m.fused_attention) == (
        0.0, 0.05, "rope", False)
    te = dataclasses.replace(args, transformer_impl="transformer_engine")
    assert te.to_model_config().fused_attention
    # megatron-core's local layers norm with torch's modules; Transformer Engine with its own.
    assert m.torch_norms and not te.to_model_config().torch_norms
    # Where Transformer Engine may fall back to unfused attention, it is counted unfused: fp32,
    # heads its kernels do not take, and deterministic mode.
    for change in (dict(dtype="fp32"), dict(kv_channels=12), dict(kv_channels=512), dict(deterministic_mode=True)):
        assert not dataclasses.replace(te, **change).to_model_config().fused_attention, change
    # --apply-query-key-layer-scaling forces the softmax into fp32, as megatron-core's config does.
    assert not args.to_model_config().attention_softmax_in_fp32
    assert dataclasses.replace(args, apply_query_key_layer_scaling=True).to_model_config().attention_softmax_in_fp32


# One layer of megatron-core's local GPT layer and T5 encoder and decoder layers, measured as
# the profiler measures them: the bytes autograd keeps, each storage once, parameters excluded.
MEASURE = r"""
import json, os, sys, torch
from dataclasses import replace
from dynapipe.runtime.distributed import free_port
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0", WORLD_SIZE="1")
from megatron_integration.arguments import parse_training_args
from megatron_integration.initialize import initialize_megatron
from megatron_integration.profiler import _Ops, _saved_storage_bytes
from megatron_integration.t5_profiler import T5Ops
from megatron_integration.train_config import ParallelArgs
flags = ("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --ffn-hidden-size 256 --seq-length 128 "
         "--max-position-embeddings 128 --vocab-size 512 --transformer-impl local --micro-batch-size 1 "
         "--global-batch-size 1 --train-iters 1 --lr 1e-4 --mock-data").split()
base = parse_training_args(flags, 1).model
initialize_megatron(ParallelArgs(world_size=1, backend="gloo"), 1)
cpu = torch.device("cpu")
for case in json.loads(sys.argv[1]):
    m = replace(base, dtype=case["dtype"], hidden_dropout=case["dropout"], attention_dropout=case["dropout"],
                position_embedding_type=case["pe"], attention_softmax_in_fp32=case.get("fp32_softmax", False),
                **case.get("extra", {}))
    if case["arch"] == "gpt":
        fn, params = _Ops(m, cpu, False).layer_fn(case["b"], case["s"])
    else:
        ops = T5Ops(m, cpu)
        fn, params = (ops.encoder_layer(case["b"], case["s"]) if case["arch"] == "t5-encoder"
                      else ops.decoder_layer(case["b"], case["s_dec"], case["s"]))
    print(json.dumps(dict(case, measured=_saved_storage_bytes(fn, params)[1])), flush=True)
"""

CASES = [dict(arch="gpt", dtype="bf16", dropout=0.0, pe="learned_absolute"),
         dict(arch="gpt", dtype="bf16", dropout=0.0, pe="rope"),
         dict(arch="gpt", dtype="bf16", dropout=0.1, pe="learned_absolute"),
         dict(arch="gpt", dtype="fp32", dropout=0.1, pe="rope"),
         dict(arch="gpt", dtype="bf16", dropout=0.0, pe="learned_absolute", fp32_softmax=True),
         dict(arch="gpt", dtype="bf16", dropout=0.1, pe="learned_absolute", fp32_softmax=True),
         dict(arch="t5-encoder", dtype="bf16", dropout=0.0, pe="learned_absolute"),
         dict(arch="t5-decoder", dtype="bf16", dropout=0.0, pe="learned_absolute"),
         dict(arch="t5-decoder", dtype="fp32", dropout=0.1, pe="learned_absolute")]
# Layer variants (Megatron's --swiglu, --normalization RMSNorm, --qk-layernorm): megatron-core's
# unfused gate keeps two more FFN-wide tensors, torch's RMSNorm copies of what it normalises,
# and query/key norms without rotary positions the normalised queries and keys.
VARIANTS = [{"swiglu": True}, {"normalization": "RMSNorm"}, {"qk_layernorm": True},
            {"normalization": "RMSNorm", "qk_layernorm": True}]
CASES += [dict(arch="gpt", dtype=dt, dropout=0.0, pe=pe, extra=extra) for dt in ("fp32", "bf16")
          for extra in VARIANTS for pe in (("learned_absolute", "rope") if "qk_layernorm" in extra else
                                           ("learned_absolute",))]


def test_analytic_terms_match_megatron_core_local_layers():
    cases = [dict(c, b=2, s=128, s_dec=64) for c in CASES]
    result = subprocess.run([sys.executable, "-c", MEASURE, json.dumps(cases)], capture_output=True, text=True,
                            timeout=240)
    assert result.returncode == 0, result.stderr[-3000:]
    rows = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    assert len(rows) == len(cases)
    for r in rows:
        b, s, sd, d, p = r["b"], r["s"], r["s_dec"], 4 if r["dtype"] == "fp32" else 2, r["dropout"]
        kw = dict(dtype=r["dtype"], hidden_dropout=p, attention_dropout=p, position_embedding_type=r["pe"],
                  attention_softmax_in_fp32=r.get("fp32_softmax", False), torch_norms=True)
        extra = r.get("extra", {})
        if extra:
            kw.update(gated_linear_unit=extra.get("swiglu", False), qk_layernorm=extra.get("qk_layernorm", False),
                      normalization=extra.get("normalization", "LayerNorm"))
        if r["arch"] == "gpt":
            want = sum(AnalyticCostModel(_gpt(**kw), CPU, 1)._layer_act_bytes(b, s))
            if d == 2 and kw.get("normalization", "LayerNorm") == "LayerNorm":
                # A CPU keeps LayerNorm's mean and 1/std in bf16 (counted in fp32, as CUDA keeps
                # them): two norms, and the query and key norms' per head.
                want -= b * s * 2 * 2 * (2 + (2 * HEADS if kw.get("qk_layernorm") else 0))
        elif r["arch"] == "t5-encoder":
            want = sum(AnalyticCostModel(_t5(**kw), CPU, 1)._layer_act_bytes(b, s))
        else:
            cm = AnalyticCostModel(_t5(**kw), CPU, 1)
            want = sum(cm._layer_act_bytes(b, sd)) + sum(cm._cross_act_bytes(b, sd, s))
            # The measured layer also keeps the encoder output it reads (a stage holds it once
            # for all its decoder layers, as its input).
            want += b * s * H * d
        if r["pe"] == "rope":
            # The rotary angles' cosines and sines (per position, not per sample), which the model
            # leaves out: 4 x 4,096 x 128 x 2 bytes = 4 MiB a layer at 4,096 tokens of 128-wide heads.
            want += 4 * s * (H // HEADS) * d
        # The norms' statistics are counted in fp32, as CUDA keeps them; a CPU keeps bf16 ones.
        assert abs(r["measured"] - want) <= 0.005 * want, (r, want)
