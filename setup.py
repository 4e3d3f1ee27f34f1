"""dynapipe-megatron: dynamic micro-batching and variable-shape pipelines for Megatron.

Install torch first (``pip install torch==<version>``): a bare ``torch`` requirement
resolved from scratch may pull a multi-GB CUDA build you did not ask for.
"""
from setuptools import Extension, find_packages, setup

# The micro-batch DP's inner loop in C (plain C API, no numpy headers needed to build).
# Optional: if it does not compile, the planner falls back to an identical numpy loop.
DP_KERNEL = Extension("dynapipe.batching._dp_kernel", sources=["dynapipe/batching/csrc/dp_kernel.c"],
                      optional=True)

setup(
    name="dynapipe-megatron",
    version="0.1.0",
    description="DynaPipe for Megatron: DP-planned variable-shape micro-batches and pipeline plans",
    long_description=open("README.md").read() if __import__("os").path.exists("README.md") else "",
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    packages=find_packages(include=["dynapipe", "dynapipe.*", "megatron_integration", "megatron_integration.*"]),
    install_requires=[
        "numpy>=1.24",
        "pyyaml>=6",
        # Compiles the schedule simulator's event loops (a pure-Python fallback gives the same results).
        "numba>=0.59",
        # Runtime and integration layers; the planning layers need only numpy and pyyaml.
        "torch>=2.1",
        "megatron-core>=0.16.1",
        # megatron-core's dist_checkpointing writer (torch_dist checkpoints) needs it and does not declare it.
        "psutil>=5.9",
    ],
    extras_require={
        "dev": ["pytest>=7", "pytest-xdist>=3.5", "hypothesis>=6", "matplotlib>=3.7", "redis>=5", "tqdm>=4.60",
                # The HuggingFaceTokenizer path and the TensorBoard scalars are tested against
                # the real packages.
                "transformers>=4.40", "tensorboard>=2.14"],
        # Progress bars for `python -m dynapipe profile` on a terminal (plain lines without it).
        "progress": ["tqdm>=4.60"],
        # --tokenizer-type HuggingFaceTokenizer.
        "hf": ["transformers>=4.40"],
        "plot": ["matplotlib>=3.7"],
        "redis": ["redis>=5"],
        "tensorboard": ["tensorboard>=2.14"],
        # Apex and Transformer Engine come with NVIDIA's PyTorch containers (see docker/);
        # they are not on PyPI under those names and are never required.
    },
    ext_modules=[DP_KERNEL],
    entry_points={"console_scripts": ["dynapipe=dynapipe.cli:main"]},
)
