"""The conversion commands as a user runs them, as processes: tools/*.py and `megatron-dapo convert ...`.

An error reaches the shell as one line with exit code 2; an end-to-end run: `megatron-dapo convert
hf-to-megatron --verify-logits` (its Megatron vs HF block-by-block check passes), then
tools/convert_megatron_to_hf.py restores the exact tensors (and refuses an output inside the
checkpoint); a conversion whose write fails leaves its output as it was, exit code 1.
Help texts and every bad-input case, in this process: tests/cli/test_convert.py.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

REPO = Path(__file__).resolve().parents[2]
HF_TO_MEGATRON = [sys.executable, str(REPO / "tools" / "convert_hf_to_megatron.py")]
MEGATRON_TO_HF = [sys.executable, str(REPO / "tools" / "convert_megatron_to_hf.py")]
CLI = [sys.executable, "-m", "megatron_dapo.cli", "convert"]


def _run(cmd: list[str], timeout: float = 240) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=REPO)


def _tool(name: str):
    """The `main(argv)` of a tools/ script, imported from its file."""
    spec = importlib.util.spec_from_file_location(name, REPO / "tools" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.main


def test_parse_size():
    from megatron_dapo.checkpoint.conversion import ConversionError, parse_size

    assert parse_size("5GB") == 5 * 10**9 and parse_size("500MB") == 5 * 10**8
    assert parse_size("2GiB") == 2 * 2**30 and parse_size("1.5 kb") == 1500 and parse_size(1234) == 1234
    for bad in ("five GB", "5XB", "0MB", -1):
        with pytest.raises(ConversionError):
            parse_size(bad)


def test_errors_reach_the_shell_as_one_line(tmp_path):
    result = _run([*CLI, "hf-to-megatron", "--hf-dir", str(tmp_path / "missing"), "--output", str(tmp_path / "o")])
    assert result.returncode == 2
    assert result.stderr.strip() == f"megatron-dapo: error: HF model directory {tmp_path / 'missing'} does not exist"


def test_end_to_end_with_logits_check(tiny_model_dirs, tmp_path, capsys):
    hf_dir = tiny_model_dirs["qwen2_tied"]
    checkpoint, exported = tmp_path / "megatron", tmp_path / "exported"
    forward = _run([*CLI, "hf-to-megatron", "--hf-dir", str(hf_dir), "--output", str(checkpoint),
                    "--tp", "2", "--pp", "2", "--verify-logits", "--verify-tol", "1e-5"])  # fmt: skip
    assert forward.returncode == 0, forward.stdout + forward.stderr
    assert "logits check: all 6 blocks match (embedding, 4 layers, logits)" in forward.stdout
    assert "HF -> Megatron" in forward.stderr and "layer 3" in forward.stderr  # the per-layer progress bar
    backward = _run([*MEGATRON_TO_HF, "--megatron-dir", str(checkpoint), "--output", str(exported)])
    assert backward.returncode == 0, backward.stdout + backward.stderr
    original, restored = load_file(str(hf_dir / "model.safetensors")), load_file(str(exported / "model.safetensors"))
    assert sorted(original) == sorted(restored)
    assert all(torch.equal(original[n], restored[n]) and original[n].dtype == restored[n].dtype for n in original)
    assert (exported / "config.json").read_bytes() == (hf_dir / "config.json").read_bytes()
    # Exporting into the checkpoint itself is refused (checked before anything is written).
    assert _tool("convert_megatron_to_hf")(["--megatron-dir", str(checkpoint), "--output", str(checkpoint / "hf")]) == 2
    assert "must not be inside the checkpoint" in capsys.readouterr().err
    assert not (checkpoint / "hf" / "model.safetensors").exists()


# A full disk at the end of a conversion: the HF side files cannot be copied (ENOSPC injected at
# shutil.copy2, the operating-system boundary), after every tensor was written.
_NO_SPACE_AT_SIDE_FILES = """
import errno, os, shutil, sys
def copy2(*args, **kwargs):
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
shutil.copy2 = copy2
from megatron_dapo.cli.main import main
sys.exit(main(sys.argv[1:]))
"""


def _leftovers(output: Path) -> list[str]:
    return sorted(p.name for p in output.parent.iterdir() if p.name.startswith(f".{output.name}"))


def test_a_failed_conversion_leaves_the_output_as_it_was(tiny_model_dirs, tmp_path):
    """Atomic like the training checkpoints: written to a temporary sibling and renamed at the end, so
    a conversion that fails (here: the disk fills up) leaves no empty or partial output directory, and
    with --overwrite the previous content stays until a new one is complete."""
    hf_dir = tiny_model_dirs["qwen2"]
    fresh = tmp_path / "fresh"
    failed = _run([sys.executable, "-c", _NO_SPACE_AT_SIDE_FILES, "convert", "hf-to-megatron", "--hf-dir", str(hf_dir),
                   "--output", str(fresh), "--no-progress"])  # fmt: skip
    assert failed.returncode == 1, failed.stderr[-3000:]
    assert f"megatron-dapo: error: writing {fresh} failed (no space left on the disk of {tmp_path})" in failed.stderr
    assert "Traceback" not in failed.stderr
    assert not fresh.exists() and _leftovers(fresh) == []

    kept = tmp_path / "kept"
    kept.mkdir()
    (kept / "previous.txt").write_text("the previous conversion")
    failed = _run([sys.executable, "-c", _NO_SPACE_AT_SIDE_FILES, "convert", "hf-to-megatron", "--hf-dir", str(hf_dir),
                   "--output", str(kept), "--overwrite", "--no-progress"])  # fmt: skip
    assert failed.returncode == 1 and "it is left as it was" in failed.stderr, failed.stderr[-3000:]
    assert sorted(p.name for p in kept.iterdir()) == ["previous.txt"] and _leftovers(kept) == []

    # The same conversion without the fault replaces it, and the export back fails just as cleanly.
    done = _run([*CLI, "hf-to-megatron", "--hf-dir", str(hf_dir), "--output", str(kept), "--overwrite", "--no-progress"])
    assert done.returncode == 0, done.stderr[-3000:]
    assert (kept / "metadata.json").is_file() and not (kept / "previous.txt").exists() and _leftovers(kept) == []
    exported = tmp_path / "exported"
    failed = _run([sys.executable, "-c", _NO_SPACE_AT_SIDE_FILES, "convert", "megatron-to-hf", "--megatron-dir", str(kept),
                   "--output", str(exported), "--no-progress"])  # fmt: skip
    assert failed.returncode == 1 and "no space left" in failed.stderr, failed.stderr[-3000:]
    assert not exported.exists() and _leftovers(exported) == []
