"""The T5 bench's presets: default arguments, the baselines' micro-batch sizes to try and the
methods each runs (``bench --model t5 --preset NAME``; :mod:`megatron_integration.bench_t5`)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from megatron_integration.bench_presets import CPU_PRETOUCH_MB, fill_defaults


# --manual-gc as in the GPT presets (see bench_presets._COMMON).
_COMMON = {"--lr": "1e-4", "--hidden-dropout": "0", "--attention-dropout": "0", "--log-interval": "1",
           "--seed": "1234", "--vocab-size": "512", "--pipeline-model-parallel-size": "2", "--manual-gc": None}


@dataclass(frozen=True)
class T5Preset:
    """Default arguments of a T5 bench preset, the baselines' micro-batch sizes to try and the
    methods run unless ``--methods`` names them."""

    args: dict
    sweep: tuple[int, ...]
    warmup_iters: int
    about: str
    methods: tuple[str, ...] = ("dynapipe", "dynapipe-even", "dynapipe-per-sample", "padding", "packing",
                                "packing-per-sample", "packing-search")
    #: Iterations of the untimed DynaPipe run that fits the profile's fixed cost per stage op
    #: (0: none); ``--calibrate-iters`` overrides it.
    calibrate_iters: int = 0
    #: ``--dynapipe-cpu-pretouch-mb`` of every rank on a host without CUDA (as the GPT presets').
    cpu_pretouch_mb: int = CPU_PRETOUCH_MB


# As the GPT presets, one iteration planned ahead: planning runs during the timed iterations.
_TINY_ARGS = {"--encoder-num-layers": "2", "--decoder-num-layers": "2", "--hidden-size": "64",
              "--num-attention-heads": "4", "--ffn-hidden-size": "256", "--encoder-seq-length": "1024",
              "--decoder-seq-length": "256", "--global-batch-size": "32", "--train-iters": "4",
              "--dynapipe-prefetch": "2", **_COMMON}
T5_PRESETS = {
    # Calibrated: the profiler times an op alone in a tight loop; on a training rank each stage op
    # also pays a fixed cost here (handler, dispatch, two ranks on two cores: 5-8 ms, 1.5-3.1 ms
    # since one-sample rows get broadcast masks), and a planner that does not see it cuts
    # DynaPipe's micro-batches too fine. Four iterations: the first is
    # a warm-up the fit leaves out, and one fitted iteration alone has given a 0.28x slope.
    "tiny": T5Preset(
        args=_TINY_ARGS,
        sweep=(1, 2, 4), warmup_iters=1, calibrate_iters=4,
        about="tiny T5 (2+2 layers, hidden 64), inputs up to 1,024 and targets up to 256 tokens"),
    "representative": T5Preset(
        args={"--encoder-num-layers": "1", "--decoder-num-layers": "1", "--hidden-size": "512",
              "--num-attention-heads": "8", "--ffn-hidden-size": "2048", "--encoder-seq-length": "512",
              "--decoder-seq-length": "128", "--global-batch-size": "16", "--train-iters": "4",
              "--dynapipe-prefetch": "2", **_COMMON},
        sweep=(1, 2), warmup_iters=1,
        about="T5 with hidden = encoder length (1+1 layers, hidden 512 at 512/128 tokens)"),
    # The tiny model on the long rows where packing wastes most (the paper's regime). A global
    # batch of 128 gives packing about 8 rows of 4,096 tokens an iteration, as the tiny
    # preset's 32 give it 8 rows of 1,024. Packing's mbs 1 only: its fastest in every tiny run,
    # and each further size costs about 4 minutes a round here. Padding is left out by
    # default: 128 rows of 4,096 tokens take minutes an iteration on 2 cores.
    "long": T5Preset(
        args={**_TINY_ARGS, "--encoder-seq-length": "4096", "--global-batch-size": "128"},
        # Encoder rows up to 3,600 tokens: over 1 GiB of attention scores on a stage.
        cpu_pretouch_mb=3 * CPU_PRETOUCH_MB,
        sweep=(1,), warmup_iters=1, methods=("dynapipe", "dynapipe-even", "dynapipe-per-sample", "packing",
                                             "packing-per-sample", "packing-search"),
        about="tiny T5 (2+2 layers, hidden 64), inputs up to 4,096 and targets up to 256 tokens, global batch 128"),
}


def t5_with_defaults(argv: Sequence[str], preset: str) -> list[str]:
    """``argv`` plus every default of the preset it does not set (``--mock-data`` unless data is given)."""
    return fill_defaults(argv, T5_PRESETS[preset].args)
