"""`megatron-dapo check-sync` on a mixture of experts (the tiny Qwen3-MoE: 2 layers of 4 experts), as a
user runs it: the plain command at TP=2 starts its two processes and syncs with the shared-memory
hand-over (auto at TP=2); the engine's read-back covers the router and every expert.

* vLLM (leader placement): the router (vLLM's `GateLinear`) and the experts, read back from vLLM's
  fused experts one expert matrix at a time (`rollout/engines/vllm/experts.py`), equal the actor's
  export after the sync; the self-test then corrupts one expert's tensor, which must be the one
  reported (one launch covers both; a vLLM start costs ~30 s to minutes here);
* vLLM (spmd placement, tp_shards hand-over): every tensor equal, PASS;
* the embedded engine (transformers' fused experts, `model/hf_experts.py`): every tensor equal, PASS.
* expert parallelism, `--ep 2` (two processes, each holding 2 of the 4 experts of a layer): the sync
  takes the gather path ("auto"; the shard modes are refused at EP > 1), whose export moves the
  experts between the EP ranks; every tensor equal, PASS, for the embedded engine and vLLM spmd
  (each rank its own TP=1 engine). vLLM in the leader placement at EP=2 is the "check-sync MoE"
  step of `megatron-dapo smoke`, whose log tests/smoke/test_smoke_command.py reads for the same
  (one vLLM start for both). SGLang at EP=2: tests/rollout/sync/test_sglang_check_sync.py.
The commands start two at a time (`runs`). The dense models' runs: tests/rollout/sync/test_check_sync.py.
"""

from __future__ import annotations

import importlib.util
import re
import subprocess
from pathlib import Path

import pytest

from tests.support.check_sync_runs import run_check_sync
from tests.support.tiny_models import save_tiny_model
from tests.support.torchrun_utils import two_at_a_time

TENSORS = 45  # embedding, final norm, LM head + 2 layers x (9 attention / norm / router + 4 experts x 3)


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory) -> Path:
    return save_tiny_model("qwen3_moe", tmp_path_factory.mktemp("qwen3_moe"))


def _ok_names(stdout: str) -> list[str]:
    return re.findall(r"^   OK    (\S+)", stdout, flags=re.M)


CORRUPTED = "model.layers.1.mlp.experts.2.down_proj.weight"


@pytest.fixture(scope="module")
def runs(moe_dir) -> dict[str, subprocess.CompletedProcess]:
    """Every command of the module, two at a time (the vLLM ones only where vLLM imports; their tests then fail
    or skip through `require_vllm`): name -> process."""
    jobs = {
        "vllm_leader": lambda: run_check_sync("--hf-dir", str(moe_dir), "--engine", "vllm", "--tp", "2", "--corrupt-tensor", CORRUPTED, timeout=900),
        "vllm_spmd": lambda: run_check_sync("--hf-dir", str(moe_dir), "--engine", "vllm", "--tp", "2", "--placement", "spmd", timeout=900),
        "embedded": lambda: run_check_sync("--hf-dir", str(moe_dir), "--engine", "embedded", "--tp", "2", timeout=600),
        "vllm_spmd_ep2": lambda: run_check_sync("--hf-dir", str(moe_dir), "--engine", "vllm", "--ep", "2", "--placement", "spmd", timeout=900),
        "embedded_ep2": lambda: run_check_sync("--hf-dir", str(moe_dir), "--engine", "embedded", "--ep", "2", timeout=600),
    }
    if importlib.util.find_spec("vllm") is None:
        jobs = {name: job for name, job in jobs.items() if name.startswith("embedded")}
    return two_at_a_time(jobs)


def test_vllm_reads_router_and_experts_back_and_names_a_corrupted_expert(require_vllm, runs):
    name = CORRUPTED
    out = runs["vllm_leader"]
    assert out.returncode == 1, out.stdout[-3000:] + out.stderr[-3000:]
    assert f"before the sync, {TENSORS} of {TENSORS} engine tensors differ from the actor" in out.stdout
    assert "(shared_memory)" in out.stdout
    assert re.findall(r"^   DIFF  (\S+)", out.stdout, flags=re.M) == [name]
    assert f"{TENSORS - 1} of {TENSORS} tensors equal" in out.stdout
    ok = _ok_names(out.stdout)
    assert len(ok) == TENSORS - 1
    assert {"model.layers.0.mlp.gate.weight", "model.layers.1.mlp.gate.weight"} <= set(ok)  # the routers
    assert sum(".mlp.experts." in n for n in ok) == 2 * 4 * 3 - 1
    assert "NOTE" not in out.stdout and "MISSING" not in out.stdout  # nothing left under vLLM's own names
    assert f"FAIL: 1 tensor(s) differ ({name})" in out.stdout


def test_vllm_spmd_placement_takes_the_experts_as_tp_shards(require_vllm, runs):
    """vLLM's default placement: every process holds its engine shard and loads its own TP slices
    (`tp_shards.PlacedSlice` through vLLM's expert loader, which stacks and unstacks each expert)."""
    out = runs["vllm_spmd"]
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "(tp_shards)" in out.stdout
    assert f"{TENSORS} of {TENSORS} tensors equal" in out.stdout and "PASS" in out.stdout


def test_embedded_engine_passes_with_every_expert_equal(runs):
    out = runs["embedded"]
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert f"{TENSORS} of {TENSORS} tensors equal" in out.stdout and "PASS" in out.stdout
    ok = _ok_names(out.stdout)
    assert len(ok) == TENSORS and sum(".mlp.experts." in n for n in ok) == 2 * 4 * 3
    assert "model.layers.1.mlp.gate.weight" in ok
    largest = float(re.search(r"max \|diff\| (\S+)", out.stdout).group(1))
    assert largest < 1e-4


@pytest.mark.parametrize("name", ["embedded_ep2", "vllm_spmd_ep2"])
def test_expert_parallel_actor_syncs_every_expert(name, runs, request):
    if name.startswith("vllm"):
        request.getfixturevalue("require_vllm")
    out = runs[name]
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "starting 2 processes (tp=1 x pp=1 x ep=2)" in out.stdout and " ep=2 dp=2 " in out.stdout
    assert "(gather)" in out.stdout  # auto at EP > 1: each rank holds only its own experts
    assert f"{TENSORS} of {TENSORS} tensors equal" in out.stdout and "PASS" in out.stdout
    assert sum(".mlp.experts." in n for n in _ok_names(out.stdout)) == 2 * 4 * 3  # every expert, both EP ranks' own
