"""`python -m megatron_dapo.cli ...` (what torchrun and srun launch) = the `megatron-dapo` command."""

import sys

from megatron_dapo.cli.main import main

sys.exit(main())
