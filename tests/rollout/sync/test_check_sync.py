"""`megatron-dapo check-sync` end to end, as a user runs it (subprocesses, the tiny models).

* TP=2, plain command: it starts its two processes itself; the sync takes the shared-memory
  hand-over (auto at TP=2); every tensor equal, mismatch printed, exit code 0;
* one process (no launcher) with a tolerance below the float32 noise: tensors equal, exit code 1
  because of the log-prob mismatch alone;
* `tools/check_sync.py` at PP=2 after one real optimizer step, with `--corrupt-tensor`: the
  corrupted tensor is reported as differing and the exit code is 1.
The commands start two at a time (`runs`). The command's help and its bad arguments, in this
process: tests/cli/test_check_sync.py; the separate placement: test_check_sync_separate.py.
"""

from __future__ import annotations

import importlib.util
import re
import subprocess

import pytest

from tests.support.check_sync_runs import printed_mismatch, run_check_sync
from tests.support.torchrun_utils import two_at_a_time

CORRUPTED_IN_VLLM = "model.layers.1.mlp.up_proj.weight"
CORRUPTED_AFTER_STEP = "model.layers.2.mlp.up_proj.weight"


@pytest.fixture(scope="module")
def runs(tiny_model_dirs) -> dict[str, subprocess.CompletedProcess]:
    """Every command of the module, two at a time, longest first (the vLLM one only where vLLM
    imports; its test then fails or skips through `require_vllm`): name -> process."""
    jobs = {
        "spmd_vllm": lambda: run_check_sync("--hf-dir", str(tiny_model_dirs["qwen3"]), "--engine", "vllm", "--tp", "2", "--placement", "spmd",
                                  "--corrupt-tensor", CORRUPTED_IN_VLLM, timeout=600),
        "after_step": lambda: run_check_sync("--hf-dir", str(tiny_model_dirs["llama3"]), "--pp", "2", "--update", "step",
                                   "--corrupt-tensor", CORRUPTED_AFTER_STEP, "--only-failures", script=True, timeout=400),
        "tp2": lambda: run_check_sync("--hf-dir", str(tiny_model_dirs["qwen2_tied"]), "--engine", "embedded", "--tp", "2", timeout=400),
        "single_process": lambda: run_check_sync("--hf-dir", str(tiny_model_dirs["qwen2"]), "--tolerance", "1e-12", "--only-failures", timeout=400),
    }  # fmt: skip
    if importlib.util.find_spec("vllm") is None:
        del jobs["spmd_vllm"]
    return two_at_a_time(jobs)


def test_tp2_passes_and_reports_every_tensor(runs):
    out = runs["tp2"]
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "starting 2 processes" in out.stdout
    assert "before the sync, 50 of 50 engine tensors differ from the actor" in out.stdout
    assert len(re.findall(r"^   OK    ", out.stdout, flags=re.M)) == 50  # tied: no lm_head.weight
    assert "50 of 50 tensors equal" in out.stdout and "PASS" in out.stdout
    assert "(shared_memory)" in out.stdout and "MB of this rank's own slices" in out.stdout  # auto at TP=2
    mean, largest = printed_mismatch(out.stdout)
    assert 0 <= mean <= largest < 1e-4


def test_spmd_vllm_tp2_fails_only_on_a_corrupted_tensor(require_vllm, runs):
    """--placement spmd: each of the 2 processes holds one vLLM shard; tp_shards sync. The self-test
    corrupts one tensor after the sync: that one must fail and every other one compare equal (one
    launch covers both the passing sync and the failing check; a vLLM TP=2 start costs ~35 s)."""
    name = CORRUPTED_IN_VLLM
    out = runs["spmd_vllm"]
    assert out.returncode == 1, out.stdout[-3000:] + out.stderr[-3000:]
    assert "spmd, TP=2 shards on every rank" in out.stdout and "(tp_shards)" in out.stdout
    assert re.findall(r"^   DIFF  (\S+)", out.stdout, flags=re.M) == [name]
    equal = re.search(r"(\d+) of (\d+) tensors equal", out.stdout)
    assert equal and int(equal.group(1)) == int(equal.group(2)) - 1 > 20, out.stdout[-3000:]
    assert len(re.findall(r"^   OK    ", out.stdout, flags=re.M)) == int(equal.group(1))
    assert f"FAIL: 1 tensor(s) differ ({name})" in out.stdout


def test_single_process_fails_on_tolerance_alone(runs):
    out = runs["single_process"]
    assert out.returncode == 1, out.stdout[-3000:] + out.stderr[-3000:]
    assert "starting" not in out.stdout  # one process: no relaunch
    assert "51 of 51 tensors equal" in out.stdout and "DIFF" not in out.stdout
    _, largest = printed_mismatch(out.stdout)
    assert largest > 1e-12
    assert "FAIL: max |diff|" in out.stdout


def test_corrupted_tensor_after_an_optimizer_step_fails(runs):
    name = CORRUPTED_AFTER_STEP
    out = runs["after_step"]
    assert out.returncode == 1, out.stdout[-3000:] + out.stderr[-3000:]
    assert "one optimizer step" in out.stdout
    assert "before the sync, 39 of 39 engine tensors differ" in out.stdout
    diff_lines = re.findall(r"^   DIFF  (\S+)", out.stdout, flags=re.M)
    assert diff_lines == [name]
    assert "38 of 39 tensors equal" in out.stdout
    assert f"FAIL: 1 tensor(s) differ ({name})" in out.stdout
