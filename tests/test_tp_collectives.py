"""The analytic cost model prices the TP collectives megatron-core's layers actually issue.

One spawned job of 2 gloo ranks builds a TP2 GPT stage (2 layers, embedding and output layer)
with and without sequence parallelism, with learned and rotary positions, and records the
c10d collectives of one forward and one backward with torch's profiler. The cost model, given
a link that costs only latency (1 ms a step: an all-reduce 2, an all-gather or a
reduce-scatter 1), must price the same steps in each direction. Under sequence parallelism
the backward gathers the column-parallel inputs again for the weight gradients, which the
model once left out (9 steps priced of 15).
"""
import pytest

from megatron_integration.launch import spawn

CASES = [(sp, pos) for sp in (False, True) for pos in ("learned_absolute", "rope")]
LAYERS, HIDDEN, HEADS, FFN, VOCAB, SEQ, MBS = 2, 64, 4, 128, 256, 64, 2
STEPS = {"c10d::allreduce_": 2}  # ring steps of one collective in latency units; the rest 1


def collectives_job():
    """Rank body: {(sp, positions): {"fw": [op names], "bw": [op names]}} of c10d collectives."""
    import torch
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt.gpt_model import GPTModel
    from torch.profiler import ProfilerActivity, profile

    from megatron_integration.initialize import destroy, init_distributed, init_model_parallel, rank_info, set_seeds
    from megatron_integration.model import layer_spec, transformer_config
    from megatron_integration.tensor_parallel import sequence_parallel_block_spec
    from megatron_integration.train_config import GPTModelArgs, ParallelArgs

    init_distributed(ParallelArgs(world_size=2))
    init_model_parallel(2, 1)
    set_seeds(1, rank_info())
    out = {}
    try:
        for sp, pos in CASES:
            m = GPTModelArgs(num_layers=LAYERS, hidden_size=HIDDEN, num_attention_heads=HEADS, ffn_hidden_size=FFN,
                             kv_channels=HIDDEN // HEADS, seq_length=SEQ, max_position_embeddings=SEQ,
                             vocab_size=VOCAB, hidden_dropout=0.0, attention_dropout=0.0, position_embedding_type=pos)
            cfg = transformer_config(m, ParallelArgs(world_size=2, tensor_model_parallel_size=2, sequence_parallel=sp),
                                     cuda=False)
            spec = sequence_parallel_block_spec(layer_spec(False, m.normalization, m.qk_layernorm)[0], cfg, LAYERS)
            gpt = GPTModel(config=cfg, transformer_layer_spec=spec, vocab_size=VOCAB, max_sequence_length=SEQ,
                           position_embedding_type=pos)
            tokens = torch.randint(0, VOCAB, (MBS, SEQ))
            positions = torch.arange(SEQ).unsqueeze(0).expand(MBS, -1)
            with profile(activities=[ProfilerActivity.CPU]) as fw:
                loss = gpt(tokens, positions, None, labels=torch.roll(tokens, -1, 1))
            with profile(activities=[ProfilerActivity.CPU]) as bw:
                loss.sum().backward()
            out[(sp, pos)] = {phase: [e.name for e in prof.events() if e.name.startswith("c10d::")]
                              for phase, prof in (("fw", fw), ("bw", bw))}
    finally:
        ps.destroy_model_parallel()
        destroy()
    return out


@pytest.fixture(scope="module")
def recorded():
    return spawn(collectives_job, 2, timeout_s=300)[0]


def _priced_steps(sp: bool, pos: str) -> tuple[float, float]:
    from dynapipe.config import LinkConfig, TensorParallelConfig, load_device_config, model_config_from_dict
    from dynapipe.cost import AnalyticCostModel

    model = model_config_from_dict(dict(name="tp-probe", arch="gpt", num_layers=LAYERS, hidden_size=HIDDEN,
                                        num_attention_heads=HEADS, ffn_hidden_size=FFN, vocab_size=VOCAB,
                                        max_seq_length=SEQ, dtype="fp32", position_embedding_type=pos))
    device = load_device_config("cpu")

    def cost(link):
        cm = AnalyticCostModel(model, device, 1, TensorParallelConfig(2, sp, link))
        return cm.layout_cost(cm.layouts[0], MBS, SEQ, SEQ, "none")

    latency, free = cost(LinkConfig(1e15, 1.0)), cost(LinkConfig(1e15, 0.0))
    return float(latency.fw_ms - free.fw_ms), float(latency.bw_ms - free.bw_ms)


@pytest.mark.parametrize("sp, pos", CASES)
def test_priced_collectives_are_the_ones_megatron_core_issues(recorded, sp, pos):
    ops = recorded[(sp, pos)]
    measured = tuple(float(sum(STEPS.get(name, 1) for name in ops[phase])) for phase in ("fw", "bw"))
    assert ops["fw"] and ops["bw"]
    assert _priced_steps(sp, pos) == pytest.approx(measured, abs=1e-6), ops
