"""`model.transformer_engine: "on"` (the GPU recipes) on a machine without a usable Transformer Engine:
`megatron-dapo train` stops at start with one line naming the key, the reason (here: no CUDA device)
and the way out, not a traceback, and not a run on the slower local layers."""

from __future__ import annotations

import pytest
import torch

from tests.support.trainer_runs import CONFIG, FAST, run_cli, workspace_overrides


@pytest.mark.timeout(300)
@pytest.mark.skipif(torch.cuda.is_available(), reason="a machine without Transformer Engine's CUDA kernels")
def test_train_with_transformer_engine_on_and_none_here_stops_with_the_reason(demo_workspace, tmp_path):
    proc = run_cli("train", "--config", str(CONFIG), *FAST, *workspace_overrides(demo_workspace, tmp_path / "x"),
                   'model.transformer_engine="on"')  # fmt: skip
    assert proc.returncode != 0
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert "'model.transformer_engine'=on but Transformer Engine cannot be used here: no CUDA device" in proc.stderr
    assert "model.transformer_engine=auto" in proc.stderr
    assert not (tmp_path / "x" / "metrics.jsonl").exists()
