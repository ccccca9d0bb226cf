"""load_reward_function: every accepted form, and a clear error for every way it can go wrong."""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from megatron_dapo.reward import math_dapo
from megatron_dapo.reward.loader import RewardFunctionRef, load_reward_function, parse_reward_spec, reward_function_ref

PATH_KEY = r"reward\.custom_function\.path"
NAME_KEY = r"reward\.custom_function\.name"


@pytest.fixture
def reward_file(tmp_path):
    path = tmp_path / "my_reward.py"
    path.write_text(
        textwrap.dedent(
            """
            CONSTANT = 3

            def my_score(response, ground_truth):
                return {"score": float(len(response)), "acc": response == ground_truth}
            """
        )
    )
    return path


def test_none_gives_the_dapo_math_reward():
    assert load_reward_function(None) is math_dapo.compute_score


def test_module_colon_function():
    function = load_reward_function("megatron_dapo.reward.math_dapo:compute_score")
    assert function is math_dapo.compute_score
    assert reward_function_ref(function) == RewardFunctionRef("megatron_dapo.reward.math_dapo", "compute_score", False)


def test_module_with_separate_name():
    function = load_reward_function("megatron_dapo.reward.math_dapo", "normalize_final_answer")
    assert function is math_dapo.normalize_final_answer


def test_file_colon_function(reward_file):
    function = load_reward_function(f"{reward_file}:my_score")
    assert function("abc", "abc") == {"score": 3.0, "acc": True}
    ref = reward_function_ref(function)
    assert ref == RewardFunctionRef(str(reward_file), "my_score", True)
    # Loading twice executes the file once.
    assert load_reward_function(f"{reward_file}:my_score") is function
    assert ref.load() is function


def test_file_with_separate_name_and_relative_path(reward_file, monkeypatch):
    monkeypatch.chdir(reward_file.parent)
    function = load_reward_function("my_reward.py", "my_score")
    assert function("ab", "x") == {"score": 2.0, "acc": False}
    assert reward_function_ref(function).target == str(reward_file)  # stored absolute for workers


def test_ref_pickles_and_loads_in_a_fresh_interpreter(reward_file):
    ref = parse_reward_spec(f"{reward_file}:my_score")
    code = (
        "import pickle, sys; ref = pickle.loads(sys.stdin.buffer.read()); "
        "print(ref.load()('hello', 'x')['score'])"
    )
    repo_root = str(Path(__file__).resolve().parents[2])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([repo_root, os.environ.get("PYTHONPATH", "")])}
    command = [sys.executable, "-c", code]
    out = subprocess.run(command, input=pickle.dumps(ref), capture_output=True, check=True, cwd=reward_file.parent, env=env)
    assert out.stdout.decode().strip() == "5.0"


def test_missing_file(tmp_path):
    with pytest.raises(ValueError, match=PATH_KEY) as info:
        load_reward_function(f"{tmp_path}/nope.py:score")
    assert "no such file" in str(info.value)


def test_missing_module():
    with pytest.raises(ImportError, match=PATH_KEY) as info:
        load_reward_function("no_such_package_xyz.rewards:score")
    assert "no_such_package_xyz" in str(info.value)


def test_module_with_a_missing_dependency_names_the_dependency(tmp_path, monkeypatch):
    (tmp_path / "needs_dep_mod.py").write_text("import not_installed_dependency_xyz\n\ndef f(r, g):\n    return 1.0\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ImportError, match="not_installed_dependency_xyz"):
        load_reward_function("needs_dep_mod:f")


def test_file_that_fails_while_executing(tmp_path):
    path = tmp_path / "broken.py"
    path.write_text("raise RuntimeError('bad module')\n")
    with pytest.raises(ImportError, match="bad module") as info:
        load_reward_function(f"{path}:f")
    assert "reward.custom_function.path" in str(info.value)
    # A failed file is not cached: fixing it makes the next load work.
    path.write_text("def f(r, g):\n    return 1.0\n")
    assert load_reward_function(f"{path}:f")("", "") == 1.0


def test_missing_attribute(reward_file):
    with pytest.raises(ValueError, match=NAME_KEY) as info:
        load_reward_function(f"{reward_file}:not_there")
    assert "my_score" in str(info.value)  # lists what the file defines


def test_not_callable(reward_file):
    with pytest.raises(ValueError, match=NAME_KEY) as info:
        load_reward_function(f"{reward_file}:CONSTANT")
    assert "not a function" in str(info.value)


@pytest.mark.parametrize(
    "spec, name, pattern",
    [
        ("megatron_dapo.reward.math_dapo", None, "does not name the function"),
        ("megatron_dapo.reward.math_dapo:compute_score", "compute_score", "one place"),
        ("", None, "empty"),
        ("megatron_dapo.reward.math_dapo:", None, "both a module/file and a function"),
    ],
)
def test_malformed_specs(spec, name, pattern):
    with pytest.raises(ValueError, match=pattern):
        load_reward_function(spec, name)


def test_name_without_path():
    with pytest.raises(ValueError, match=NAME_KEY):
        load_reward_function(None, "compute_score")
