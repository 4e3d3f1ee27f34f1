"""The run config ``advise --output`` writes: the best layout as Megatron arguments for
``scripts/pretrain_gpt.py --run-config`` (``scripts/pretrain_t5.py`` for an encoder-decoder
model), with the model's layer flags, so the run trains the model that was simulated."""
from __future__ import annotations

import json
import os

from dynapipe.data.synthetic import DEFAULT_MIXTURE
from dynapipe.errors import DynaPipeError


def _same_file(a: str, b: str) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:
        return False


def layer_flags(model) -> dict:
    """The Megatron flags (run-config keys) of ``model``'s layers (local or Transformer Engine),
    and its layer kind, dropout and positions where they differ from Megatron's defaults, so
    the run trains the model that was simulated."""
    # The layers simulated: Transformer Engine's where the config has fused attention, else
    # megatron-core's local ones (--transformer-impl's default on GPUs is Transformer Engine;
    # T5 stages are built from local layers only).
    flags = {"transformer-impl": "transformer_engine" if model.fused_attention else "local"}
    if model.hidden_dropout != 0.1:
        flags["hidden-dropout"] = model.hidden_dropout
    if model.attention_dropout != 0.1:
        flags["attention-dropout"] = model.attention_dropout
    if model.attention_softmax_in_fp32:
        flags["attention-softmax-in-fp32"] = True
    if not model.tie_embeddings:
        flags["untie-embeddings-and-output-weights"] = True
    if model.is_encoder_decoder:  # T5 stages are built as Megatron's T5: nothing else to choose
        return flags
    if model.position_embedding_type != "learned_absolute":
        flags["position-embedding-type"] = model.position_embedding_type
    if model.gated_linear_unit:
        flags["swiglu"] = True
    if not model.add_bias_linear:
        flags["disable-bias-linear"] = True
    if model.add_qkv_bias:
        flags["add-qkv-bias"] = True
    if model.qk_layernorm:
        flags["qk-layernorm"] = True
    if model.normalization != "LayerNorm":
        flags["normalization"] = model.normalization
    if model.num_query_groups:
        flags.update({"group-query-attention": True, "num-query-groups": model.num_query_groups})
    return flags


def launch_shape(gpus: int, cluster) -> tuple[int, int]:
    """``(nnodes, nproc_per_node)`` of a run config for ``gpus`` GPUs on ``cluster``'s nodes;
    :class:`DynaPipeError` where they do not fill whole nodes (torchrun starts as many processes
    on every node: rounding once wrote 3 x 6 for 20 GPUs)."""
    per_node = cluster.gpus_per_node if cluster is not None else gpus
    if gpus > per_node and gpus % per_node:
        lower, upper = gpus // per_node * per_node, -(-gpus // per_node) * per_node
        raise DynaPipeError(f"--gpus {gpus} is not a whole number of {cluster.name}'s {per_node}-GPU nodes, and a "
                            f"run config launches as many processes on every node; advise --gpus {lower} or "
                            f"{upper} to write --output, or use a cluster config of the nodes you have.")
    nnodes = max(1, gpus // per_node)
    return nnodes, gpus // nnodes


def config_ref(given: str) -> str:
    """How a run config names a device or cluster config given as ``given``: a YAML file by
    its absolute path (its ``name`` field may repeat a shipped config's, whose figures the
    training run would then plan with), a shipped config by its name."""
    return os.path.abspath(given) if os.path.exists(given) else given


def run_config_text(best, model, device_name: str, cluster_name: str, cluster, gpus: int, tokens: int,
                    seq_length: int, memory_limit_mib, mixture_path, batches) -> str:
    """The best layout as a run config (``scripts/pretrain_gpt.py --run-config``, or
    ``scripts/pretrain_t5.py`` for an encoder-decoder model); ``device_name`` /
    ``cluster_name``: the configs as the run config names them (see :func:`config_ref`)."""
    lay = best.layout
    nnodes, nproc = launch_shape(gpus, cluster)
    samples = int(round(sum(len(b) for b in batches) / len(batches)))
    if model.is_encoder_decoder:  # both sides were clipped at seq_length in the simulation
        args = {"encoder-num-layers": model.encoder_layers, "decoder-num-layers": model.decoder_layers,
                "hidden-size": model.hidden_size, "num-attention-heads": model.num_attention_heads,
                "ffn-hidden-size": model.ffn_hidden_size, "encoder-seq-length": seq_length,
                "decoder-seq-length": seq_length}
    else:
        args = {"num-layers": model.num_layers, "hidden-size": model.hidden_size,
                "num-attention-heads": model.num_attention_heads, "ffn-hidden-size": model.ffn_hidden_size,
                "seq-length": seq_length}
    args.update({"max-position-embeddings": max(seq_length, model.max_seq_length), "vocab-size": model.vocab_size})
    if model.kv_channels:
        args["kv-channels"] = model.kv_channels
    args.update(layer_flags(model))
    if model.dtype in ("bf16", "fp16"):
        args[model.dtype] = True
    if samples < lay.dp:
        # A larger global batch would be another workload than the one simulated.
        raise DynaPipeError(f"{lay.label()}: the simulated global batches hold {samples} samples, fewer than its "
                            f"{lay.dp} data-parallel replicas; raise --tokens-per-iteration.")
    args.update({"micro-batch-size": 1, "global-batch-size": samples,
                 "tensor-model-parallel-size": lay.tp, "pipeline-model-parallel-size": lay.pp})
    if lay.sp:
        args["sequence-parallel"] = True
    if lay.chunks > 1:
        args["num-virtual-stages-per-pipeline-rank"] = lay.chunks
    if best.placement is not None:
        args["dynapipe-placement"] = best.placement
    if lay.zero:
        args["use-distributed-optimizer"] = True
    args.update({"lr": 1.5e-4, "train-iters": 1000, "log-interval": 10, "mock-data": True,
                 "use-dynapipe": True, "dynapipe-device": device_name, "dynapipe-cluster": cluster_name,
                 "dynapipe-schedule": "auto"})
    if not model.is_encoder_decoder:
        # T5's span-corruption data draws whole global batches of samples, so T5 keeps the
        # batches' mean sample count (global-batch-size above) and runs with --data-path too.
        args["dynapipe-tokens-per-global-batch"] = tokens
    if memory_limit_mib is not None:
        args["dynapipe-memory-limit-mb"] = memory_limit_mib
    if mixture_path is not None and not _same_file(mixture_path, DEFAULT_MIXTURE):
        args["dynapipe-mixture"] = os.path.abspath(mixture_path)
    script = "scripts/pretrain_t5.py" if model.is_encoder_decoder else "scripts/pretrain_gpt.py"
    d = best.dynapipe.summary()
    lines = ["description: >",
             f"  Written by `python -m dynapipe advise`: {model.name} on {gpus} x {device_name} ({cluster_name}),",
             f"  {lay.label()}, predicted {d['real_tokens_per_s']:,.0f} real tokens/s by simulation",
             "  (DynaPipe, schedule search). lr and train-iters are placeholders, and mock-data",
             "  stands in for data-path. Launch on every node:",
             f"  torchrun --nnodes {nnodes} --nproc-per-node {nproc} {script} --run-config FILE",
             f"launch: {{nnodes: {nnodes}, nproc_per_node: {nproc}}}", "args:"]
    for k, v in args.items():
        lines.append(f"  {k}: {json.dumps(v) if isinstance(v, str) else str(v).lower() if isinstance(v, bool) else v}")
    return "\n".join(lines) + "\n"
