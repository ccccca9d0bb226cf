"""Megatron DDP's overlap_grad_reduce (on by default on GPUs) on the CPU under gloo: the same gradients
and weights as the synchronous reduction, with the plain and the distributed optimizer, several
micro-batches per rank and uneven data-parallel shares (see _overlap_worker.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.support.torchrun_utils import run_torchrun_function

WORKER = Path(__file__).parent / "_overlap_worker.py"


@pytest.mark.timeout(400)
def test_overlapped_grad_reduce_equals_the_synchronous_one(tiny_model_dirs, tmp_path):
    kwargs = {"model_dir": str(tiny_model_dirs["qwen2_tied"]), "out_dir": str(tmp_path)}
    result = run_torchrun_function(WORKER, "run", nproc=2, kwargs=kwargs, timeout=380)
    result.check()
    for rank in result.rank_results:
        runs = rank["runs"]
        for optimizer in ("plain", "dist"):
            sync, overlap = runs[f"{optimizer}_sync"], runs[f"{optimizer}_overlap"]
            # The hooks Megatron's own trainer installs with overlap (and only then).
            assert (sync["ddp_overlap"], sync["no_sync_func"], sync["grad_sync_func"]) == (False, False, False)
            assert (overlap["ddp_overlap"], overlap["no_sync_func"], overlap["grad_sync_func"]) == (True, True, True)
            assert overlap["synchronised_micro_batches"] > 1  # no_sync really held back earlier micro-batches
            for step in ("step1", "step2"):
                for key, value in sync[step].items():
                    assert overlap[step][key] == pytest.approx(value, rel=1e-6, abs=1e-9), (optimizer, step, key)
    for optimizer in ("plain", "dist"):
        sync = torch.load(tmp_path / f"{optimizer}_sync.pt")
        overlap = torch.load(tmp_path / f"{optimizer}_overlap.pt")
        assert sorted(sync) == sorted(overlap)
        for kind in sync:  # grads (plain optimizer only) and weights after two steps
            for name, tensor in sync[kind].items():
                assert torch.equal(overlap[kind][name], tensor), (optimizer, kind, name)
