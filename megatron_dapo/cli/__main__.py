"""`python -m megatron_dapo.cli ...` (what torchrun and srun launch) = the `megatron-dapo` command."""

from megatron_dapo.cli.main import entry

entry()
