"""A checkpoint peer built from megatron-core alone (no dynapipe-megatron import).

Run as a script by ``tests/test_megatron_checkpoint.py`` so that nothing of this project is
on the loading path:

    python mcore_checkpoint_peer.py write DIR    # GPTModel(seed) -> DIR/iter_0000005 (torch_dist)
    python mcore_checkpoint_peer.py check DIR    # DIR's newest checkpoint == GPTModel(seed)?

``write`` saves what megatron-core's own ``dist_checkpointing.save`` writes from
``GPTModel.sharded_state_dict()``, in Megatron-LM's directory layout (tracker file and
``iter_XXXXXXX``). ``check`` loads the newest checkpoint under DIR into a fresh one-stage
``GPTModel`` and prints one JSON line: whether every tensor equals the seeded model's, and
the iteration and args the checkpoint records. CUDA-only calls of megatron-core's writer
(a synchronize, device='cuda' flags) are pointed at the CPU here, in this file.
"""
import json
import os
import sys

import torch
import torch.distributed as dist

# The model of TINY in test_megatron_checkpoint.py, one stage.
SEED = 5
MODEL = dict(num_layers=2, hidden_size=64, num_attention_heads=4, ffn_hidden_size=128)
VOCAB, MAX_POSITIONS = 256, 128
ITERATION = 5


def _init():
    # One rank: an in-memory store, no port another process could take first.
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    from megatron.core import parallel_state

    parallel_state.initialize_model_parallel(1, 1)


def _model():
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.transformer_config import TransformerConfig

    config = TransformerConfig(**MODEL, use_cpu_initialization=True, hidden_dropout=0.0, attention_dropout=0.0,
                               gradient_accumulation_fusion=False, masked_softmax_fusion=False,
                               bias_activation_fusion=False, bias_dropout_fusion=False, persist_layer_norm=False)
    torch.manual_seed(SEED)
    model = GPTModel(config=config, transformer_layer_spec=get_gpt_layer_local_spec(), vocab_size=VOCAB,
                     max_sequence_length=MAX_POSITIONS, position_embedding_type="learned_absolute",
                     share_embeddings_and_output_weights=True)
    with torch.no_grad():  # biases and norms start at 0/1: make every tensor seed-specific
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.01)
    return model


def _cpu_writer():
    from megatron.core.dist_checkpointing.strategies import filesystem_async, state_dict_saver

    class Cuda:
        @staticmethod
        def synchronize(*a, **k):
            pass

        @staticmethod
        def current_device():
            return "cpu"

    class CpuTorch:
        cuda = Cuda

        def __getattr__(self, name):
            return getattr(torch, name)

        @staticmethod
        def tensor(*args, device=None, **kwargs):
            return torch.tensor(*args, **kwargs)

    filesystem_async.torch = CpuTorch()
    state_dict_saver.torch = CpuTorch()


def write(root):
    from megatron.core import dist_checkpointing

    _cpu_writer()
    iter_dir = os.path.join(root, f"iter_{ITERATION:07d}")
    os.makedirs(iter_dir)
    model = _model()
    dist_checkpointing.save({"model": model.sharded_state_dict(), "iteration": ITERATION,
                             "checkpoint_version": 3.0}, iter_dir)
    with open(os.path.join(root, "latest_checkpointed_iteration.txt"), "w") as f:
        f.write(str(ITERATION))


def check(root):
    from megatron.core import dist_checkpointing

    with open(os.path.join(root, "latest_checkpointed_iteration.txt")) as f:
        iteration = int(f.read())
    iter_dir = os.path.join(root, f"iter_{iteration:07d}")
    reference = _model()
    fresh = _model()
    with torch.no_grad():
        for p in fresh.parameters():
            p.zero_()
    loaded = dist_checkpointing.load({"model": fresh.sharded_state_dict()}, iter_dir)
    fresh.load_state_dict(loaded["model"], strict=True)
    ref, got = reference.state_dict(), fresh.state_dict()
    differ = [k for k, v in ref.items() if torch.is_tensor(v) and not torch.equal(v, got[k])]
    common = dist_checkpointing.load_common_state_dict(iter_dir)
    args = common.get("args")
    print(json.dumps({"tensors": sum(torch.is_tensor(v) for v in ref.values()), "differ": differ,
                      "iteration": common.get("iteration"), "checkpoint_version": common.get("checkpoint_version"),
                      "pipeline_model_parallel_size": getattr(args, "pipeline_model_parallel_size", None),
                      "consumed_train_samples": getattr(args, "consumed_train_samples", None),
                      "keys": sorted(k for k in common if k != "content_metadata")}))


if __name__ == "__main__":
    _init()
    try:
        {"write": write, "check": check}[sys.argv[1]](sys.argv[2])
        assert not any(m.startswith("megatron_integration") or m.startswith("dynapipe") for m in sys.modules)
    finally:
        dist.destroy_process_group()
