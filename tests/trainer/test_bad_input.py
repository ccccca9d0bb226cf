"""Bad input as a new user makes it, through the real commands: each ends in one named error (the
file or key, and the fix), never a traceback, and before anything expensive where it can.

* model files: config.json that is not JSON, truncated / empty / overwritten safetensors, an
  unsupported architecture (refused before the process groups start), tokenizer files removed;
* a custom reward that does not exist, does not import or has a syntax error (`config` and `train`
  say so before the model loads); one that raises on every sample is named as the reason dynamic
  sampling found nothing;
* a changed data.seed on --resume; a disk that fills up during training (ENOSPC injected at the
  metrics file's fsync, the operating-system boundary): one message, exit 1;
* `megatron-dapo config` with --world-size 0 / -2, and saying which model checks it skipped.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.trainer_runs import CONFIG, FAST, REPO, run_cli, workspace_overrides


def _assert_one_clean_error(proc: subprocess.CompletedProcess, code: int, *needles: str) -> None:
    detail = f"exit {proc.returncode}\n--- stdout\n{proc.stdout[-3000:]}\n--- stderr\n{proc.stderr[-6000:]}"
    assert proc.returncode == code, detail
    assert "Traceback" not in proc.stderr and "Traceback" not in proc.stdout, detail
    for needle in needles:
        assert needle in proc.stderr, f"{needle!r} not in stderr\n{detail}"


def _config_command(capsys, *args: str) -> subprocess.CompletedProcess:
    """`megatron-dapo config ...` in this process (it loads no model): its exit code and output."""
    from megatron_dapo.cli.main import main

    capsys.readouterr()
    code = main(["config", *args])
    out = capsys.readouterr()
    return subprocess.CompletedProcess(["config", *args], code, out.out, out.err)


@pytest.fixture
def model_copy(demo_workspace, tmp_path) -> Path:
    """A private copy of the demo model directory, free to damage."""
    return Path(shutil.copytree(demo_workspace["model"], tmp_path / "model"))


def _clobber(path: Path) -> None:
    with open(path, "r+b") as handle:
        handle.write(b"\xff" * 64)


DAMAGE = {
    "config_json_not_json": (lambda m: (m / "config.json").write_text('{"architectures": [\n'), "config.json is not valid JSON (line 2"),
    "safetensors_truncated": (lambda m: os.truncate(m / "model.safetensors", 100_000), "model.safetensors has 100000 bytes but its header describes"),
    "safetensors_empty": (lambda m: (m / "model.safetensors").write_bytes(b""), "model.safetensors has 0 bytes"),
    "safetensors_overwritten": (lambda m: _clobber(m / "model.safetensors"), "model.safetensors: its first 8 bytes announce a header"),
    "architecture_unsupported": (
        lambda m: (m / "config.json").write_text((m / "config.json").read_text().replace("Qwen2ForCausalLM", "MistralForCausalLM")),
        "unsupported architecture ['MistralForCausalLM']: supported are Qwen2ForCausalLM, LlamaForCausalLM, Qwen3ForCausalLM",
    ),
    "tokenizer_removed": (lambda m: [p.unlink() for p in m.glob("tokenizer*.json")], "has no tokenizer (none of tokenizer.json"),
}  # fmt: skip


@pytest.mark.parametrize("damage", sorted(DAMAGE))
def test_damaged_model_directory_is_named_before_start_up(demo_workspace, model_copy, tmp_path, capsys, damage):
    make, expected = DAMAGE[damage]
    make(model_copy)
    proc = run_cli("train", "--config", str(CONFIG), *FAST, *workspace_overrides(demo_workspace, tmp_path / "run"),
                   f"model.hf_dir={model_copy}")  # fmt: skip
    _assert_one_clean_error(proc, 2, "megatron-dapo: error:", expected, str(model_copy))
    # Refused in the pre-flight: no process group was created, no model built.
    assert "process(es), backend" not in proc.stdout
    config = _config_command(capsys, str(CONFIG), f"model.hf_dir={model_copy}")  # `config` finds the same
    _assert_one_clean_error(config, 2, "megatron-dapo: error:", expected)


def test_empty_tokenizer_is_named_not_blamed_on_the_prompts(model_copy):
    """transformers builds an EMPTY tokenizer when the files are gone; the run used to fail much later
    with "every prompt needs at least one token"."""
    from transformers import AutoTokenizer

    from megatron_dapo.config import ConfigError
    from megatron_dapo.trainer.startup import check_tokenizer

    check_tokenizer(AutoTokenizer.from_pretrained(model_copy), str(model_copy))  # intact: passes
    for path in model_copy.glob("tokenizer*.json"):
        path.unlink()
    with pytest.raises(ConfigError, match=r"the tokenizer loaded from 'model.hf_dir'=.* is empty .*files .* are missing"):
        check_tokenizer(AutoTokenizer.from_pretrained(model_copy), str(model_copy))


REWARD_FILES = {
    "missing": (None, "points to", "but no such file exists"),
    "syntax_error": ("def score(response, ground_truth:\n    return 1.0\n", "raised SyntaxError", "reward.custom_function.path"),
    "import_error": ("import package_that_is_not_installed\n\ndef score(r, g):\n    return 1.0\n",
                     "raised ModuleNotFoundError", "package_that_is_not_installed"),
}  # fmt: skip


@pytest.mark.parametrize("case", sorted(REWARD_FILES))
def test_custom_reward_that_cannot_load_is_found_by_config_and_first_by_train(demo_workspace, tmp_path, capsys, case):
    text, *expected = REWARD_FILES[case]
    reward = tmp_path / "my_reward.py"
    if text is not None:
        reward.write_text(text)
    override = f"reward.custom_function.path={reward}:score"
    config = _config_command(capsys, str(CONFIG), override)
    _assert_one_clean_error(config, 2, "megatron-dapo: error:", str(reward), *expected)
    proc = run_cli("train", "--config", str(CONFIG), *FAST, *workspace_overrides(demo_workspace, tmp_path / "run"), override)
    _assert_one_clean_error(proc, 2, "megatron-dapo: error:", str(reward), *expected)
    assert "process(es), backend" not in proc.stdout  # before the model loads


def test_reward_that_raises_on_every_sample_is_named_as_why_sampling_found_nothing(demo_workspace, tmp_path):
    reward = tmp_path / "broken_reward.py"
    reward.write_text("def score(response, ground_truth, **_):\n    raise KeyError('answer')\n")
    proc = run_cli("train", "--config", str(CONFIG), *FAST, *workspace_overrides(demo_workspace, tmp_path / "run"),
                   f"reward.custom_function.path={reward}:score", "algorithm.filter_groups.max_num_gen_batches=1")  # fmt: skip
    _assert_one_clean_error(
        proc, 1, "megatron-dapo: error:", "The cause is the reward function, not the data",
        "the reward function failed on 32 of 32 samples (first error: KeyError: 'answer')",
    )  # fmt: skip
    assert "too easy or too hard" not in proc.stderr


def test_changed_data_seed_on_resume_says_how_to_resume_or_start_fresh(demo_workspace, tmp_path):
    out = tmp_path / "run"
    first = run_cli("train", "--config", str(CONFIG), *FAST, *workspace_overrides(demo_workspace, out),
                    "trainer.total_steps=1", "trainer.save_every=1")  # fmt: skip
    assert first.returncode == 0, first.stderr[-3000:]
    proc = run_cli("train", "--config", str(CONFIG), *FAST, *workspace_overrides(demo_workspace, out),
                   "trainer.total_steps=2", "data.seed=2", "--resume")  # fmt: skip
    _assert_one_clean_error(
        proc, 2, "megatron-dapo: error: cannot resume the prompt order", "data.seed is 2 but was 1",
        "To resume, set them back", "run without --resume in a new trainer.output_dir",
    )  # fmt: skip


_NO_SPACE_AT_METRICS = """
import errno, os, sys
real_fsync = os.fsync
def fsync(fd):  # the disk fills up: the metrics file's data cannot be written back
    if os.readlink(f"/proc/self/fd/{fd}").endswith("metrics.jsonl"):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    return real_fsync(fd)
os.fsync = fsync
from megatron_dapo.cli.main import main
sys.exit(main(sys.argv[1:]))
"""


def test_full_disk_during_training_is_one_message(demo_workspace, tmp_path):
    out = tmp_path / "run"
    args = ["train", "--config", str(CONFIG), *FAST, *workspace_overrides(demo_workspace, out), "trainer.total_steps=2"]
    proc = subprocess.run([sys.executable, "-c", _NO_SPACE_AT_METRICS, *args], cwd=REPO, capture_output=True, text=True, timeout=300)
    _assert_one_clean_error(proc, 1, f"megatron-dapo: error: no space left on the disk of trainer.output_dir={out}",
                            "then continue with --resume")  # fmt: skip
    assert proc.stderr.count("megatron-dapo: error") == 1


def test_full_disk_during_the_warm_start_is_one_message(demo_workspace, tmp_path):
    out = tmp_path / "sft"
    args = ["sft", "--config", str(CONFIG), f"model.hf_dir={demo_workspace['model']}", f"sft.train_files=[{demo_workspace['sft']}]",
            "sft.total_steps=2", f"sft.output_dir={out}", "trainer.loggers=[console,jsonl]"]  # fmt: skip
    proc = subprocess.run([sys.executable, "-c", _NO_SPACE_AT_METRICS, *args], cwd=REPO, capture_output=True, text=True, timeout=300)
    _assert_one_clean_error(proc, 1, f"megatron-dapo: error: no space left on the disk of sft.output_dir={out}",
                            "then run the warm start again")  # fmt: skip


def test_config_command_world_size_and_skipped_checks(capsys):
    proc = run_cli("config", str(CONFIG), "--world-size", "0")  # once as a user runs it
    _assert_one_clean_error(proc, 2, "megatron-dapo: error: world size 0: a run needs at least one process")
    proc = _config_command(capsys, str(CONFIG), "--world-size", "-2")
    _assert_one_clean_error(proc, 2, "megatron-dapo: error: world size -2: a run needs at least one process")
    proc = _config_command(capsys, str(CONFIG), "parallel.tp=3", "--world-size", "3")
    assert proc.returncode == 0, proc.stderr
    assert "note: 'model.hf_dir' is empty, so the model-shape checks" in proc.stderr


def test_disk_full_is_recognised_through_the_chain_of_what_it_broke(tmp_path):
    """The first failed write is often buried: under the plot that failed next in a `finally`, or
    inside torch.distributed.checkpoint's CheckpointException (a BaseException carrying each rank's
    error), or as torch.save's short-write RuntimeError that lost its errno."""
    import errno

    from torch.distributed.checkpoint.api import CheckpointException

    from megatron_dapo.checkpoint.disk_full import DiskFullError, disk_full_error, stop_on_full_disk

    def chained(first: BaseException, then: BaseException) -> BaseException:
        try:
            try:
                raise first
            except BaseException:
                raise then
        except BaseException as error:
            return error

    enospc = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(tmp_path / "metrics.jsonl"))
    full = disk_full_error(chained(enospc, ValueError("plot failed")), tmp_path)
    assert isinstance(full, DiskFullError) and full.errno == errno.ENOSPC
    assert f"no space left on the disk of trainer.output_dir={tmp_path} (writing {tmp_path / 'metrics.jsonl'})" in full.strerror
    assert "MiB free now" in full.strerror and "--resume" in full.strerror
    short_write = RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")
    assert disk_full_error(CheckpointException("save", {0: (short_write, None)}), tmp_path) is not None
    quota = disk_full_error(OSError(errno.EDQUOT, "Disk quota exceeded"), tmp_path)
    assert quota is not None and "disk quota exceeded" in quota.strerror
    assert disk_full_error(chained(KeyError("x"), RuntimeError("NaN in the loss")), tmp_path) is None

    with pytest.raises(DiskFullError):
        with stop_on_full_disk(tmp_path):
            raise CheckpointException("save", {0: (enospc, None)})
    with pytest.raises(RuntimeError, match="NaN in the loss"):  # anything else passes unchanged
        with stop_on_full_disk(tmp_path):
            raise RuntimeError("NaN in the loss")
    with pytest.raises(SystemExit):
        with stop_on_full_disk(tmp_path):
            raise SystemExit(143)
