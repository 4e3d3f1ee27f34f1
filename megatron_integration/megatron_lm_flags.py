"""Megatron-LM's command-line flags this build neither reads nor refuses with a reason of its
own (:data:`~megatron_integration.args_refusals.UNSUPPORTED_MEGATRON_FLAGS`), by Megatron-LM's
argument group, so that a launch script brought over from Megatron-LM gets, for each of them,
"a Megatron-LM flag this build does not support" and the group's reason rather than argparse's
"unrecognized arguments". Taken from the parser of Megatron-LM's main branch of 2026-08
(``add_megatron_arguments``: 878 option strings, its dataclass-generated ones included), less
those this build reads or refuses by name.
"""
from __future__ import annotations

from typing import Optional

# Why a group's flags are not taken, where one reason covers the group; the other groups get
# :data:`UNBUILT`.
GROUP_REASONS = {
    'rl': ("Megatron-LM's reinforcement-learning loop is not built (this project pretrains GPT and T5)"),
    'inference': ('inference and serving are not built (this project trains)'),
    'vision': ('vision models are not built (GPT and T5 only)'),
    'biencoder': ('BERT biencoder models are not built (GPT and T5 only)'),
    'In-process restart': ("in-process restart is not built; a failed rank stops every rank with its cause "
                           "(README, Fail-safety): restart the job from its last checkpoint"),
    'fault injector': ('fault injection is not built (the test suite injects its faults itself)'),
    'ft_package': ("NVIDIA's fault-tolerance package is not integrated; restart the job from its last checkpoint"),
    'straggler': ('the straggler detector is not built'),
    'one logger': ("NVIDIA's one-logger telemetry is not built; use --tensorboard-dir for metrics"),
    'opentelemetry': ('OpenTelemetry export is not built; use --tensorboard-dir for metrics'),
    'autoresume': ('ADLR autoresume is not built; resume with --load'),
    'msc': ('the multi-storage client is not built: --save and --load take local (or mounted) paths'),
    'workload inspector': ('the workload inspector is not built'),
    'mla': ("multi-latent attention is not built (GPT and T5 stages use megatron-core's standard attention)"),
    'experimental_attention_variant': ('experimental attention variants are not built'),
    'heterogeneous architecture': ("heterogeneous layer configurations are not built (every layer of a stack has "
                                   "one shape)"),
    'Logits Distillation': ('distillation is not built'),
    'sft': ("Megatron-LM's SFT mode is not built; train on JSONL input/target pairs (README, Data)"),
}

UNBUILT = "this build does not implement it (the Megatron-LM flags it reads are under Arguments in the README)"

# Megatron-LM's group name -> its flags (space-separated, sorted).
_GROUPS = {
    'transformer configuration': """
        --activation-func-clamp-value --activation-offload-fraction --apply-residual-connection-post-layernorm
        --attention-output-gate --batch-invariant-backend --batch-invariant-mode --config-logger-dir
        --cpu-offloading-num-layers --cpu-offloading-retain-pinned-cpu-buffers --cross-entropy-fusion-impl
        --cuda-graph-impl --cuda-graph-warmup-steps --defer-embedding-wgrad-compute
        --delay-offload-until-cuda-graph --delay-wgrad-compute --delta-offload-bytes-across-pp-ranks
        --disable-clone-scatter-output-in-embedding --disable-dsa-indexer-rotate-activation
        --disable-dsa-indexer-scoring-relu --disable-fp8-wgrad --disable-mamba-mem-eff-path
        --disable-tp-comm-bulk-dgrad --disable-tp-comm-bulk-wgrad --disable-tp-comm-overlap-ag
        --disable-tp-comm-overlap-rs --disable-tp-comm-split-ag --disable-tp-comm-split-rs
        --dsa-indexer-head-dim --dsa-indexer-k-norm-epsilon --dsa-indexer-k-norm-fp32 --dsa-indexer-loss-coeff
        --dsa-indexer-n-heads --dsa-indexer-rope-interleaved --dsa-indexer-skip-topk-offset --dsa-indexer-topk
        --dsa-indexer-topk-freq --dsa-indexer-use-sparse-loss --dsa-kernel-backend --embedding-init-method-std
        --enable-cuda-graph --enable-mhc-connections --ep-overlap-early-attn-memory-release
        --experimental-attention-variant --expert-tensor-parallel-num-weight-shards
        --expert-tensor-parallel-size --external-cuda-graph --fine-grained-activation-offloading
        --fine-grained-offloading-max-inflight-offloads --first-last-layers-bf16 --flash-attention-version
        --flash-decode --fp32-residual-connection --fp4-format --fp4-quantizer-factory --fp4-recipe
        --fused-residual-rmsnorm --gdp-cutedsl-kernel --gdp-num-chunk-states-to-recompute --gdp-num-householder
        --glu-linear-offset --gtp-remat-opt-in-modules --hierarchical-context-parallel-sizes
        --high-priority-a2a-comm-stream --hybrid-context-parallel --inference-cuda-graph-scope
        --inference-disable-triton-nvls-kernels --inference-fuse-tp-communication
        --inference-grouped-gemm-backend --inference-moe-disable-fused-quant-kernels
        --inference-moe-token-dispatcher-type --is-hybrid-model --kitchen-attention-backend
        --linear-conv-kernel-dim --linear-key-head-dim --linear-num-key-heads --linear-num-value-heads
        --linear-value-head-dim --mamba-head-dim --mamba-num-groups --mamba-num-heads --mamba-state-dim
        --max-seqlen-per-dp-cp-rank --mhc-init-gating-factor --mhc-num-residual-streams
        --mhc-recompute-layer-num --mhc-sinkhorn-iterations --min-offloaded-tensor-size --mlp-chunks-for-prefill
        --mlp-chunks-for-training --mrope-section --mtp-detach-heads --mtp-hsm --mtp-hybrid-override-pattern
        --mtp-loss-scaling-factor --mtp-num-layers --mtp-standalone --mtp-use-repeated-layer
        --mup-attn-scale-power --mup-base-head-dim --mup-base-hidden-size --mup-embedding-mult --mup-output-mult
        --mup-width-mult --nccl-all-reduce-for-prefill --no-clone-scatter-output-in-embedding
        --no-dsa-indexer-rotate-activation --no-dsa-indexer-scoring-relu --no-initialization
        --no-tp-comm-bulk-dgrad --no-tp-comm-bulk-wgrad --no-tp-comm-overlap-ag --no-tp-comm-overlap-rs
        --no-tp-comm-split-ag --no-tp-comm-split-rs --num-layers-at-end-in-bf16 --num-layers-at-start-in-bf16
        --offload-modules --overlap-dispatch-backward-with-experts-wgrad --overlap-moe-expert-parallel-comm
        --overlap-p2p-communication-warmup-flush --pipeline-model-parallel-comm-backend --qk-clip
        --qk-clip-alpha --qk-clip-threshold --qk-l2-norm --rotary-interleaved --softmax-type --symmetric-ar-type
        --tensor-parallel-num-weight-shards --tp-comm-bootstrap-backend --tp-comm-overlap-rs-dgrad
        --use-fused-weighted-squared-relu --use-grouped-gemm-for-dense-mlp --use-grouped-gemm-for-shared-expert
        --use-kitchen-attention --use-mup --use-ring-exchange-p2p --use-te-activation-func
        --use-transformer-engine-op-fuser --wgrad-deferral-limit""",
    'rl': """
        --grpo-clamp-eps-lower --grpo-clamp-eps-upper --grpo-entropy-term-weight
        --grpo-filter-groups-with-same-reward --grpo-group-size --grpo-iterations --grpo-kl-beta
        --grpo-prompts-per-step --langrl-env-config --no-rl-inference-logprobs-is-correction
        --no-rl-offload-inference-model-weights-when-idle --no-rl-partial-rollouts --no-rl-persist-cuda-graphs
        --no-rl-skip-bos-token --no-rl-training-cuda-graphs --no-rl-use-sequence-packing
        --no-rl-verify-model-weights-swap --perform-rl-step --refit-method --rl-consumption-granularity
        --rl-default-temperature --rl-default-top-k --rl-default-top-p --rl-durable-rollout-bank
        --rl-generation-lag --rl-importance-sampling-truncation-coef --rl-inference-expert-model-parallel-size
        --rl-inference-expert-tensor-model-parallel-size --rl-inference-logprobs-is-correction
        --rl-inference-model-unified-memory-level --rl-inference-parsers
        --rl-inference-pipeline-model-parallel-size --rl-inference-tensor-model-parallel-size
        --rl-kv-cache-management-mode --rl-max-inflight-requests --rl-offload-inference-model-weights-when-idle
        --rl-offload-optimizer-during-inference --rl-partial-rollouts --rl-persist-cuda-graphs --rl-profile
        --rl-profile-dir --rl-prompts-per-eval --rl-rollout-bank-dir --rl-rollout-bank-max-bytes
        --rl-sequence-packing-algo --rl-sequence-packing-max-sequences-per-bin --rl-skip-bos-token
        --rl-submission-granularity --rl-training-cuda-graphs --rl-use-sequence-packing
        --rl-verify-model-weights-swap""",
    'inference': """
        --bert-embedder-type --cuda-graph-modules --cuda-graph-scope --decode-only-cuda-graphs
        --enable-chunked-prefill --inference-batch-times-seqlen-threshold --inference-coordinator-port
        --inference-cuda-graph-all-prefills --inference-cuda-graph-max-tokens --inference-disable-ep-consensus
        --inference-dynamic-batching --inference-dynamic-batching-async-sched-mode
        --inference-dynamic-batching-block-size --inference-dynamic-batching-buffer-size-gb
        --inference-dynamic-batching-cuda-graph-mixed-prefill-count
        --inference-dynamic-batching-cuda-graph-sizing-distribution --inference-dynamic-batching-logprobs-mode
        --inference-dynamic-batching-mamba-memory-ratio --inference-dynamic-batching-max-requests
        --inference-dynamic-batching-max-tokens --inference-dynamic-batching-num-cuda-graphs
        --inference-dynamic-batching-paused-buffer-size-gb --inference-dynamic-batching-prefix-caching
        --inference-dynamic-batching-prefix-caching-coordinator-policy
        --inference-dynamic-batching-prefix-caching-eviction-policy
        --inference-dynamic-batching-prefix-caching-mamba-gb
        --inference-dynamic-batching-prefix-caching-routing-alpha --inference-dynamic-batching-sampling-backend
        --inference-dynamic-batching-track-generated-token-events
        --inference-dynamic-batching-track-paused-request-events
        --inference-dynamic-batching-unified-memory-level --inference-logging-step-interval
        --inference-max-requests --inference-max-seq-length --inference-shards
        --inference-text-gen-server-logging --inference-use-synchronous-zmq-collectives
        --inference-wandb-logging --mamba-inference-conv-states-dtype --mamba-inference-ssm-states-dtype
        --max-tokens-to-oom --no-inference-disable-ep-consensus --no-inference-dynamic-batching-prefix-caching
        --no-inference-text-gen-server-logging --no-inference-use-synchronous-zmq-collectives
        --no-inference-wandb-logging --num-speculative-tokens --output-bert-embeddings
        --use-legacy-static-engine --use-same-sampling-seed-across-dp-ranks""",
    'checkpointing': """
        --async-ckpt-cpu-priority --async-ckpt-io-priority --async-ckpt-use-cpu-shm --async-strategy
        --ckpt-convert-format --ckpt-convert-save --ckpt-convert-update-legacy-dist-opt-format
        --ckpt-drop-redundant-extra-state --ckpt-fully-parallel-load-exchange-algo
        --ckpt-fully-parallel-load-per-rank-objects --ckpt-fully-parallel-load-process-group
        --ckpt-fully-parallel-save-process-group --ckpt-pg-tensors-cache-create --ckpt-pg-tensors-cache-path
        --disable-ckpt-load-validate-sharding-integrity --disable-save-tokenizer-assets
        --disable-strict-fsdp-dtensor-load --disable-use-tokenizer-model-from-checkpoint-args
        --dist-ckpt-optim-fully-reshardable --dist-ckpt-save-pre-mcore-014 --dist-ckpt-workers
        --distrib-optim-fully-reshardable-mem-efficient --load-main-params-from-ckpt
        --no-ckpt-load-validate-sharding-integrity --no-save-tokenizer-assets --no-strict-fsdp-dtensor-load
        --no-use-tokenizer-model-from-checkpoint-args
        --non-persistent-local-ckpt-algo --non-persistent-local-ckpt-dir --override-ckpt-iteration --replication
        --replication-factor --replication-jump --save-activations-interval --save-dgrads-interval
        --save-params-interval --save-tokens-per-expert-interval --save-wgrads-interval
        --use-mp-args-from-checkpoint-args --verify-integrity""",
    'distributed init': """
        --create-all-gather-group --ddp-param-name-patterns-for-fp32-local-accumulation
        --disable-align-grad-reduce --disable-flight-recorder-dump-on-timeout
        --disable-flight-recorder-extra-dump-on-exec --disable-flight-recorder-include-only-active
        --disable-gloo-process-groups --disable-jit-fuser --disable-symmetric-registration
        --distributed-timeout-seconds-after-init --enable-full-sharding-in-hsdp --fake-process-group
        --flight-recorder-dump-path --flight-recorder-include-stack-trace --flight-recorder-trace-buffer-size
        --gtp-expert-remat-nccl-ub --gtp-remat-nccl-ub --gtp-remat-reduce-scatter-with-fp32-accumulation
        --high-priority-stream-groups --keep-fp8-transpose-cache --lazy-mpu-init --megatron-fsdp-version
        --nccl-communicator-config-path --no-align-grad-reduce --no-align-param-gather
        --no-flight-recorder-dump-on-timeout --no-flight-recorder-extra-dump-on-exec
        --no-flight-recorder-include-only-active --no-gradient-reduce-div-fusion
        --no-use-layer-wise-param-layout --outer-dp-sharding-strategy --sharp-enabled-group
        --suggested-communication-unit-size --torch-fsdp2-no-reshard-after-forward --use-sharp
        --use-tp-pp-dp-mapping""",
    'vision': """
        --classes-fraction --data-per-class-fraction --dino-bottleneck-size --dino-freeze-last-layer
        --dino-head-hidden-size --dino-local-crops-number --dino-local-img-size --dino-norm-last-layer
        --dino-teacher-temp --dino-warmup-teacher-temp --dino-warmup-teacher-temp-epochs --head-lr-mult --img-h
        --img-w --iter-per-epoch --mask-factor --mask-type --no-data-sharding --num-channels --num-classes
        --patch-dim --swin-backbone-type --vision-backbone-type --vision-pretraining --vision-pretraining-type""",
    'data and dataloader': """
        --allow-ambiguous-pad-tokens --dataloader-defer-npy-index-mmap --dataloader-fast-cache-load
        --dataloader-inter-document-masking --fim-data --fim-eod-token --fim-fragment-rate --fim-middle-token
        --fim-no-prefix --fim-pad-token --fim-prefix-token --fim-rate --fim-split-sample --fim-spm-rate
        --fim-suffix-token --object-storage-cache-path --per-dataset-sequences-path
        --phase-transition-iterations --sample-rate""",
    'training': """
        --decrease-batch-size-if-needed --dump-param-to-param-group-map --gpu-sniff-test-interval
        --no-pin-cpu-grads --no-pin-cpu-params --optimizer-cpu-offload
        --optimizer-cuda-graph --optimizer-offload-fraction --overlap-cpu-optimizer-d2h-h2d
        --tp-comm-overlap-cfg --train-sync-interval
        --use-torch-optimizer-for-cpu-offload""",
    'In-process restart': """
        --inprocess-active-world-size --inprocess-barrier-timeout --inprocess-completion-timeout
        --inprocess-empty-cuda-cache --inprocess-granularity --inprocess-hard-timeout
        --inprocess-heartbeat-interval --inprocess-heartbeat-timeout --inprocess-last-call-wait
        --inprocess-max-iterations --inprocess-monitor-process-interval --inprocess-monitor-thread-interval
        --inprocess-progress-watchdog-interval --inprocess-restart --inprocess-soft-timeout
        --inprocess-termination-grace-time""",
    'biencoder': """
        --bert-load --biencoder-projection-dim --biencoder-shared-query-context-model --block-data-path
        --embedding-path --evidence-data-path --ict-head-size --ict-load --indexer-batch-size
        --indexer-log-interval --query-in-block-prob --retriever-report-topk-accuracies
        --retriever-score-scaling --titles-data-path --use-one-sent-docs""",
    'tokenizer': """
        --chat-template --disable-pad-vocab-size --disable-tokenizer-sentencepiece-ignore-extra-whitespaces
        --no-pad-vocab-size --no-tokenizer-sentencepiece-ignore-extra-whitespaces --padded-vocab-size
        --tiktoken-num-special-tokens --tokenizer-hf-no-include-special-tokens --tokenizer-hf-no-use-fast
        --tokenizer-metadata --tokenizer-sentencepiece-legacy --tokenizer-special-tokens --trust-remote-code
        --use-gigatoken""",
    'regularization': """
        --lion-beta1 --lion-beta2 --muon-coefficient-type --muon-extra-scale-factor --muon-fp32-matmul-prec
        --muon-momentum --muon-nesterov --muon-no-split-qkv --muon-num-ns-steps --muon-scalar-optimizer
        --muon-scale-mode --muon-tp-mode --muon-use-syrk --no-weight-decay-cond-type""",
    'Logits Distillation': """
        --logits-load-decode-threads --logits-load-dir --logits-load-ignore-errors --logits-load-kd-loss-alpha
        --logits-load-msc-prefetch-depth --logits-load-prefetch-factor --logits-save-dir --logits-save-dtype
        --logits-save-top-k --logits-save-top-p --logits-save-top-p-min-k""",
    'mla': """
        --cache-mla-latents --kv-lora-rank --mla-down-proj-fusion --mscale --mscale-all-dim --q-lora-rank
        --qk-head-dim --qk-pos-emb-head-dim --rotary-scaling-factor --v-head-dim""",
    'network size': """
        --bert-no-binary-head --no-rope-freq --no-yarn-correction-range-round-to-int --onnx-safe
        --window-attn-skip-freq --yarn-beta-fast --yarn-beta-slow --yarn-correction-range-round-to-int
        --yarn-original-max-position-embeddings""",
    'fault injector': """
        --fault-injector-delay-start-iteration --fault-injector-fault-delay --fault-injector-fault-probabilities
        --fault-injector-fault-types --fault-injector-mtti-seconds --fault-injector-num-ranks
        --fault-injector-offset-seconds --fault-injector-ranks --fault-injector-seed""",
    'experimental': """
        --enable-experimental --hybrid-layer-pattern --hybrid-override-pattern
        --megatron-fsdp-enable-fine-grained-param-gather --megatron-fsdp-grad-comm-dtype
        --megatron-fsdp-main-grads-dtype --megatron-fsdp-main-params-dtype
        --megatron-fsdp-max-pool-double-buffer""",
    'one logger': """
        --app-tag-run-name --app-tag-run-version --no-one-logger --one-logger-async --one-logger-project
        --one-logger-run-name""",
    'profiling': """
        --memory-snapshot-path --nvtx-ranges --pytorch-profiler-collect-callstack
        --pytorch-profiler-collect-chakra --pytorch-profiler-collect-shapes --record-shapes""",
    'validation': """
        --multiple-validation-sets --test-mode --validation-set-names""",
    'logging': """
        --log-device-memory-used --log-max-attention-logit --log-memory-interval
        --no-barrier-with-level-1-timing""",
    'ft_package': """
        --calc-ft-timeouts --enable-ft-package --ft-num-warmup-iters""",
    'RNG and initialization': """
        --data-parallel-random-init --inference-rng-tracker --te-rng-tracker""",
    'straggler': """
        --disable-straggler-on-startup --straggler-ctrlr-port --straggler-minmax-count""",
    'mixed precision': """
        --mamba-training-ssm-states-dtype --output-logit-dtype --reuse-grad-buf-for-mxfp8-param-ag""",
    'opentelemetry': """
        --otel-enabled --otel-service-name --otel-span-groups""",
    'autoresume': """
        --adlr-autoresume --adlr-autoresume-interval""",
    'msc': """
        --disable-msc --enable-msc""",
    'Transformer-Engine': """
        --fp4-param-gather --te-precision-config-file""",
    'learning rate and weight decay': """
        --freeze-all-layers""",
    'heterogeneous architecture': """
        --heterogeneous-layers-config-encoded-json --heterogeneous-layers-config-path""",
    'experimental_attention_variant': """
        --linear-attention-freq""",
    'workload inspector': """
        --run-workload-inspector-server""",
    'sft': """
        --sft-tokenizer-prompt-format""",
}

FLAG_GROUP = {flag: group for group, text in _GROUPS.items() for flag in text.split()}


def megatron_lm_reason(flag: str) -> Optional[str]:
    """Why the Megatron-LM flag ``flag`` (``--name``) is not taken, naming its Megatron-LM group,
    or None when it is not one of :data:`FLAG_GROUP`'s."""
    group = FLAG_GROUP.get(flag)
    if group is None:
        return None
    return f"{GROUP_REASONS.get(group, UNBUILT)} (Megatron-LM's {group!r} group); drop it"
