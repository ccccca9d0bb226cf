"""`megatron-dapo check-sync --engine sglang` end to end against the real SGLang CPU engine.

* TP = 1, tied Qwen2: every tensor read back from the engine equals the actor's export bit for bit
  after the sync, and the engine's log-probs of its own samples match the actor's (float32): the
  "check-sync dense, SGLang" step of `megatron-dapo smoke`, whose log tests/smoke/test_smoke_command.py
  reads (one SGLang start for both).
* TP = 2 (the actor over two processes, the sync through the shared-memory hand-over; SGLang with
  two TP ranks of its own, each loading its slices of the full tensors, read back by gathering
  them), Qwen3 (q_norm / k_norm, head_dim != hidden / heads), with the self-test that corrupts one
  tensor after the sync: exactly that one differs (every other is gathered back equal), exit 1.
* EP = 2 (a Qwen3-MoE whose 4 experts per layer are split over two processes): the sync gathers
  (the shard modes are refused at EP > 1) and every tensor, each expert included, is read back equal.
"""

from __future__ import annotations

import re

import pytest

from tests.support.check_sync_runs import run_check_sync

pytestmark = pytest.mark.usefixtures("require_sglang")


def test_tp2_engine_fails_only_on_a_corrupted_tensor(tiny_model_dirs):
    name = "model.layers.1.mlp.up_proj.weight"
    out = run_check_sync("--hf-dir", str(tiny_model_dirs["qwen3"]), "--engine", "sglang", "--tp", "2", "--corrupt-tensor", name,
               timeout=600)  # fmt: skip
    assert out.returncode == 1, out.stdout[-3000:] + out.stderr[-3000:]
    assert "starting 2 processes" in out.stdout and "(shared_memory)" in out.stdout
    assert re.findall(r"^   DIFF  (\S+)", out.stdout, flags=re.M) == [name]
    equal = re.search(r"(\d+) of (\d+) tensors equal", out.stdout)
    assert equal and int(equal.group(1)) == int(equal.group(2)) - 1 > 40, out.stdout[-3000:]
    assert f"FAIL: 1 tensor(s) differ ({name})" in out.stdout


def test_ep2_moe_gathers_and_every_expert_is_equal(tmp_path):
    from tests.support.tiny_models import save_tiny_model

    tensors = 45  # embedding, final norm, LM head + 2 layers x (9 attention / norm / router + 4 experts x 3)
    moe_dir = save_tiny_model("qwen3_moe", tmp_path / "qwen3_moe")
    out = run_check_sync("--hf-dir", str(moe_dir), "--engine", "sglang", "--ep", "2", timeout=900)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "starting 2 processes (tp=1 x pp=1 x ep=2)" in out.stdout and "(gather)" in out.stdout
    assert f"{tensors} of {tensors} tensors equal" in out.stdout and "PASS" in out.stdout
