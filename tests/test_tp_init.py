"""Tensor-parallel initialisation: TP2 shards are exact slices of the TP1 model.

One spawned job of 4 gloo ranks builds the same seeded GPT as TP2 (x DP2), as TP1 and as
TP2 x PP2 (each group layout re-created in the same processes), and compares gathered
shards, and for PP1 the per-token loss and gradients of a fixed batch (fp32, dropout 0).
Four models: tied and untied embeddings, a Llama-style layer (SwiGLU, whose FC1 is split
with stride 2; grouped-query attention; no linear biases; RMSNorm), and that layer with
Qwen's QKV bias and per-head query/key norms (replicated over TP: their gradients summed).
"""
import pytest

from megatron_integration.launch import spawn

SEED = 11
WORLD = 4


MODELS = [True, False, "llama", "qwen"]  # tied, untied, untied Llama-style and Qwen3-style layers


def _model_args(tied):
    from megatron_integration.train_config import GPTModelArgs

    llama = dict(swiglu=True, num_query_groups=2, add_bias_linear=False, normalization="RMSNorm",
                 rotary_base=500000) if tied in ("llama", "qwen") else {}
    if tied == "qwen":  # Llama's layer with a QKV bias and per-head query/key norms
        llama.update(add_qkv_bias=True, qk_layernorm=True)
    return GPTModelArgs(num_layers=2, hidden_size=64, num_attention_heads=4, ffn_hidden_size=128, kv_channels=16,
                        seq_length=64, max_position_embeddings=64, vocab_size=256, hidden_dropout=0.0,
                        attention_dropout=0.0, tie_embeddings=tied is True, position_embedding_type="rope", **llama)


def _gather(p, t, group, size=2):
    """The unsplit tensor of a TP-split parameter: shards concatenated along its partition dim,
    strided splits (SwiGLU's FC1: each rank holds [gate; up]) de-interleaved."""
    import torch
    import torch.distributed as dist

    parts = [torch.empty_like(t) for _ in range(size)]
    dist.all_gather(parts, t.contiguous(), group=group)
    stride = int(getattr(p, "partition_stride", 1))
    chunks = [part.chunk(stride, dim=p.partition_dim) for part in parts]
    return torch.cat([chunks[r][k] for k in range(stride) for r in range(size)], dim=p.partition_dim)


def _build(model, tp: int):
    import torch
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt.gpt_model import GPTModel

    from megatron_integration.initialize import init_model_parallel, set_seeds, rank_info
    from megatron_integration.model import layer_spec, transformer_config
    from megatron_integration.param_init import deterministic_init_
    from megatron_integration.train_config import ParallelArgs

    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    init_model_parallel(tp, 1)
    set_seeds(SEED, rank_info())
    parallel = ParallelArgs(world_size=WORLD, tensor_model_parallel_size=tp)
    gpt = GPTModel(config=transformer_config(model, parallel, cuda=False),
                   transformer_layer_spec=layer_spec(False, model.normalization, model.qk_layernorm)[0],
                   vocab_size=model.vocab_size, max_sequence_length=model.max_position_embeddings,
                   share_embeddings_and_output_weights=model.tie_embeddings,
                   position_embedding_type=model.position_embedding_type, rotary_base=model.rotary_base)
    deterministic_init_(gpt, model, SEED)
    torch.manual_seed(0)
    tokens = torch.randint(0, model.vocab_size, (2, 48))
    labels = torch.roll(tokens, -1, dims=1)
    positions = torch.arange(48).unsqueeze(0).expand(2, -1)
    loss = gpt(tokens, positions, None, labels=labels)  # per-token loss [b, s]
    loss.sum().backward()
    return gpt, loss.detach()


def tp_job():
    """Rank body: {tp1/tp2 gathered weights, losses and gradient sums}."""
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from megatron_integration.initialize import init_distributed
    from megatron_integration.train_config import ParallelArgs

    init_distributed(ParallelArgs(world_size=WORLD))
    out = {"pp2": _pp_tp_weights(), "flags": _flag_models(), "group_timeouts": _group_timeouts()}
    for tied in MODELS:
        model = _model_args(tied)
        gpt2, loss2 = _build(model, 2)
        group = ps.get_tensor_model_parallel_group()
        weights2, grads2 = {}, {}
        for name, p in gpt2.named_parameters():
            if getattr(p, "tensor_model_parallel", False):
                for store, t in ((weights2, p.detach()), (grads2, p.main_grad if hasattr(p, "main_grad") else p.grad)):
                    store[name] = _gather(p, t, group)
            else:
                weights2[name], grads2[name] = p.detach().clone(), p.grad.clone()
                if "q_layernorm" in name or "k_layernorm" in name:
                    # Each TP rank normalised its own heads: summed over the group, as megatron-core's
                    # finalize_model_grads sums them under --qk-layernorm.
                    dist.all_reduce(grads2[name], group=group)
        gpt1, loss1 = _build(model, 1)
        weights1 = {n: p.detach().clone() for n, p in gpt1.named_parameters()}
        grads1 = {n: p.grad.clone() for n, p in gpt1.named_parameters()}
        # numpy, not tensors: tensors would travel back as shared memory of an exited process.
        out[tied] = {k: ({n: t.numpy() for n, t in v.items()} if isinstance(v, dict) else v.numpy())
                     for k, v in dict(weights1=weights1, weights2=weights2, grads1=grads1, grads2=grads2,
                                      loss1=loss1, loss2=loss2).items()}
    ps.destroy_model_parallel()
    dist.destroy_process_group()
    return out


@pytest.fixture(scope="module")
def ranks():
    return spawn(tp_job, WORLD, timeout_s=300)


@pytest.mark.parametrize("tied", MODELS)
def test_gathered_tp2_shards_equal_tp1_weights(ranks, tied):
    for r in ranks:
        res = r[tied]
        assert set(res["weights1"]) == set(res["weights2"])
        for name, w1 in res["weights1"].items():
            w2 = res["weights2"][name]
            assert w2.shape == w1.shape, name
            assert bool((w2 == w1).all()), f"{name}: TP2 shards are not slices of the TP1 weight"
    # The check compares something: weights differ between parameters and are not trivial.
    w = ranks[0][tied]["weights1"]
    qkv = next(v for k, v in w.items() if "linear_qkv.weight" in k)
    assert float(qkv.std()) == pytest.approx(0.02, rel=0.1)


@pytest.mark.parametrize("tied", MODELS)
def test_tp2_loss_and_gradients_equal_tp1(ranks, tied):
    import numpy as np

    for r in ranks:
        res = r[tied]
        np.testing.assert_allclose(res["loss2"], res["loss1"], atol=1e-5, rtol=1e-5)
        for name, g1 in res["grads1"].items():
            np.testing.assert_allclose(res["grads2"][name], g1, atol=1e-5, rtol=1e-4, err_msg=name)


def _pp_tp_weights():
    """TP2 x PP2: {local name: (this stage's gathered weight, the TP1 PP1 weight)}."""
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt.gpt_model import GPTModel

    from megatron_integration.initialize import init_model_parallel
    from megatron_integration.model import layer_spec, transformer_config
    from megatron_integration.param_init import deterministic_init_, global_parameter_name
    from megatron_integration.train_config import ParallelArgs

    model = _model_args(True)

    def build(tp, pp):
        if ps.model_parallel_is_initialized():
            ps.destroy_model_parallel()
        init_model_parallel(tp, pp)
        parallel = ParallelArgs(world_size=WORLD, tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
        gpt = GPTModel(config=transformer_config(model, parallel, cuda=False),
                       transformer_layer_spec=layer_spec(False)[0], vocab_size=model.vocab_size,
                       max_sequence_length=model.max_position_embeddings,
                       pre_process=ps.is_pipeline_first_stage(), post_process=ps.is_pipeline_last_stage(),
                       share_embeddings_and_output_weights=True, position_embedding_type=model.position_embedding_type)
        deterministic_init_(gpt, model, SEED)
        return gpt

    gpt = build(2, 2)
    group = ps.get_tensor_model_parallel_group()
    split = {}
    for name, p in gpt.named_parameters():
        t = p.detach()
        if getattr(p, "tensor_model_parallel", False):
            parts = [torch.empty_like(t) for _ in range(2)]
            dist.all_gather(parts, t.contiguous(), group=group)
            t = torch.cat(parts, dim=p.partition_dim)
        split[(name, global_parameter_name(gpt, name, True))] = t
    whole = dict(build(1, 1).named_parameters())
    return {local: (t.numpy(), whole[glob].detach().numpy()) for (local, glob), t in split.items()}


def test_pp2_tp2_stages_hold_slices_of_the_unsplit_model(ranks):
    """Layer numbering and the last stage's tied output copy line up under PP x TP too."""
    ranks = [r["pp2"] for r in ranks]
    names = [set(r) for r in ranks]
    # Both stages are covered: stage 0 has the embedding, stage 1 the output layer and layer 2 of 2.
    assert any("embedding.word_embeddings.weight" in n for n in names)
    assert any("output_layer.weight" in n for n in names)
    for r in ranks:
        for name, (got, want) in r.items():
            assert got.shape == want.shape, name
            assert (got == want).all(), f"{name}: PP2 x TP2 weight differs from the unsplit model's"


def test_llama_layer_layout(ranks):
    """The Llama-style model is what the flags ask for: a 2 x 128 FC1, QKV of 4 query + 2 x 2
    key/value heads of 16, no linear biases, RMSNorm (weights only)."""
    w = ranks[0]["llama"]["weights1"]
    assert w["decoder.layers.0.mlp.linear_fc1.weight"].shape == (256, 64)
    assert w["decoder.layers.0.self_attention.linear_qkv.weight"].shape == (128, 64)
    assert not any(k.endswith(".bias") for k in w), sorted(k for k in w if k.endswith(".bias"))
    assert "output_layer.weight" in w


# Megatron model-shape flags, each alone on a small RoPE model; the last two give it learned
# absolute positions (a position table on the embedding stage, which the planner counts too).
FLAG_BASE = ("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 64 --vocab-size 256 "
             "--micro-batch-size 1 --global-batch-size 4 --train-iters 1 --lr 1e-3 --mock-data "
             "--position-embedding-type rope")
FLAGS = ["", "--swiglu", "--swiglu --ffn-hidden-size 96", "--disable-bias-linear",
         "--group-query-attention --num-query-groups 2", "--normalization RMSNorm",
         "--untie-embeddings-and-output-weights", "--kv-channels 32", "--rotary-base 500000",
         "--qk-layernorm", "--qk-layernorm --normalization RMSNorm", "--disable-bias-linear --add-qkv-bias",
         "--apply-query-key-layer-scaling", "--position-embedding-type learned_absolute",
         "--position-embedding-type learned_absolute --max-position-embeddings 96"]


def _flag_models():
    """{flags: ({parameter name: shape}, parameters built, planner's count, rotary base used,
    (each layer's 1 / sqrt(head width) attention scale, its softmax's score scale))} at TP1 PP1."""
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt.gpt_model import GPTModel

    from dynapipe.cost.base import StageLayout, stage_param_count
    from megatron_integration.arguments import parse_training_args
    from megatron_integration.initialize import init_model_parallel
    from megatron_integration.model import layer_spec, transformer_config

    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    init_model_parallel(1, 1)
    out = {}
    for flags in FLAGS:
        cfg = parse_training_args(f"{FLAG_BASE} {flags}".split(), WORLD, cuda=False)
        m = cfg.model
        gpt = GPTModel(config=transformer_config(m, cfg.parallel, cuda=False),
                       transformer_layer_spec=layer_spec(False, m.normalization, m.qk_layernorm)[0],
                       vocab_size=m.vocab_size,
                       max_sequence_length=m.max_position_embeddings, share_embeddings_and_output_weights=m.tie_embeddings,
                       position_embedding_type=m.position_embedding_type, rotary_base=m.rotary_base)
        planned = stage_param_count(m.to_model_config(), StageLayout(0, 0, m.num_layers, True, True))
        scales = [(layer.self_attention.core_attention.softmax_scale,
                   layer.self_attention.core_attention.scale_mask_softmax.scale) for layer in gpt.decoder.layers]
        out[flags] = ({n: tuple(p.shape) for n, p in gpt.named_parameters()},
                      sum(p.numel() for p in gpt.parameters()), planned,
                      _rope_base(gpt.rotary_pos_emb.inv_freq) if hasattr(gpt, "rotary_pos_emb") else None,
                      scales)
    return out


def _group_timeouts() -> dict:
    """The collective timeout (minutes) of megatron's pipeline, tensor and data-parallel groups
    built with ``--distributed-timeout-minutes 7`` and without it."""
    import torch
    from megatron.core import parallel_state as ps

    from megatron_integration.initialize import init_model_parallel

    out = {}
    for given in (7, None):
        if ps.model_parallel_is_initialized():
            ps.destroy_model_parallel()
        init_model_parallel(1, 2, timeout_minutes=given)
        groups = (ps.get_pipeline_model_parallel_group(), ps.get_tensor_model_parallel_group(),
                  ps.get_data_parallel_group())
        out[given] = [g._get_backend(torch.device("cpu")).options._timeout.total_seconds() / 60 for g in groups]
    ps.destroy_model_parallel()
    return out


def test_megatron_groups_take_the_distributed_timeout(ranks):
    # Megatron-LM passes --distributed-timeout-minutes to every group it builds; megatron-core's
    # own default is 30 minutes.
    for r in ranks:
        assert r["group_timeouts"] == {7: [7.0, 7.0, 7.0], None: [30.0, 30.0, 30.0]}


def _rope_base(inv_freq) -> float:
    """The base RoPE frequencies were built with: inv_freq[i] = base^(-2i / dim)."""
    dim = 2 * inv_freq.numel()
    return float(inv_freq[1].double() ** (-dim / 2))


def _layer0(shapes: dict) -> dict:
    prefix = "decoder.layers.0."
    return {k[len(prefix):]: v for k, v in shapes.items() if k.startswith(prefix)}


def test_each_model_flag_builds_what_megatron_builds(ranks):
    flags = ranks[0]["flags"]
    base = _layer0(flags[""][0])
    assert base["mlp.linear_fc1.weight"] == (256, 64) and base["self_attention.linear_qkv.weight"] == (192, 64)
    expect = {
        # Megatron's SwiGLU default width: int(4h x 2/3 / 64) x 64 = 128, FC1 holds gate and up.
        "--swiglu": {"mlp.linear_fc1.weight": (256, 64), "mlp.linear_fc1.bias": (256,),
                     "mlp.linear_fc2.weight": (64, 128)},
        "--swiglu --ffn-hidden-size 96": {"mlp.linear_fc1.weight": (192, 64), "mlp.linear_fc1.bias": (192,),
                                          "mlp.linear_fc2.weight": (64, 96)},
        # 4 query heads + 2 key and 2 value heads of 16.
        "--group-query-attention --num-query-groups 2": {"self_attention.linear_qkv.weight": (128, 64),
                                                        "self_attention.linear_qkv.bias": (128,)},
        "--kv-channels 32": {"self_attention.linear_qkv.weight": (384, 64), "self_attention.linear_qkv.bias": (384,),
                             "self_attention.linear_proj.weight": (64, 128)},
    }
    for f, changed in expect.items():
        assert _layer0(flags[f][0]) == {**base, **changed}, f
    no_bias = _layer0(flags["--disable-bias-linear"][0])
    assert no_bias == {k: v for k, v in base.items() if not (k.endswith("bias") and "linear" in k)}
    rms = _layer0(flags["--normalization RMSNorm"][0])
    assert rms == {k: v for k, v in base.items() if not k.endswith("layernorm.bias")}
    # Qwen3's per-head query and key norms (over the 16 channels of a head); Qwen2's QKV bias alone.
    qk = {f"self_attention.{n}_layernorm.{w}": (16,) for n in "qk" for w in ("weight", "bias")}
    assert _layer0(flags["--qk-layernorm"][0]) == {**base, **qk}
    assert _layer0(flags["--qk-layernorm --normalization RMSNorm"][0]) == \
        {**rms, **{k: v for k, v in qk.items() if k.endswith("weight")}}
    assert _layer0(flags["--disable-bias-linear --add-qkv-bias"][0]) == \
        {**no_bias, "self_attention.linear_qkv.bias": (192,)}
    untied = flags["--untie-embeddings-and-output-weights"][0]
    assert "output_layer.weight" in untied and "output_layer.weight" not in flags[""][0]
    assert flags["--rotary-base 500000"][3] == pytest.approx(500000) and flags[""][3] == pytest.approx(10000)
    # Megatron's query-key layer scaling: layer n divides its scores by n more, and its softmax
    # (in fp32) multiplies them back; off, the softmax does not scale.
    assert flags[""][4] == [(pytest.approx(0.25), None)] * 2
    assert flags["--apply-query-key-layer-scaling"][4] == [(pytest.approx(0.25 / n), n) for n in (1, 2)]
    # The planner prices exactly the parameters each flag builds, a learned position table included.
    for f, (_, built, planned, _, _) in flags.items():
        assert planned == built, f
    table = {f: flags[f][0].get("embedding.position_embeddings.weight") for f in FLAGS if "learned" in f}
    assert list(table.values()) == [(64, 64), (96, 64)], table
