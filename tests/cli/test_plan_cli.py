"""`megatron-dapo plan` (cli/plan.py), in this process: JSON and table, options before or after the
overrides, the GPU choice, a model shape from `model.hf_dir`, exit statuses and error messages."""

from __future__ import annotations

import json

import pytest

from megatron_dapo import plan as mp
from megatron_dapo.cli.main import main
from megatron_dapo.model.hf_config import read_hf_config
from tests.support.plan_references import PUBLISHED_PARAMETERS
from tests.support.plans import known


def test_cli_json_and_table(capsys):
    code = main(["plan", "--model", "qwen2.5-7b", "--nodes", "2", "--json", "parallel.tp=4"])
    out = json.loads(capsys.readouterr().out)
    assert code in (0, 3) and (code == 0) == out["fits"]
    assert out["world_size"] == 16 and out["dp"] == 4 and out["hf_parameters"] == PUBLISHED_PARAMETERS["qwen2.5-7b"]
    assert out["stages"][0]["actor_distributed_optimizer"]["total"] == pytest.approx(
        mp.actor_memory(mp.stage_parameters(known("qwen2.5-7b"), 4, 1, 0), "bfloat16", 4).total
    )
    # Options after the overrides, overrides first: the same plan as a table.
    code = main(["plan", "parallel.tp=4", "--nodes", "2", "--model", "qwen2.5-7b"])
    table = capsys.readouterr().out
    assert "largest trainer.max_tokens_per_micro_batch: " + str(out["max_tokens_per_micro_batch"]) in table
    assert "DP=4" in table and "not built (no KL)" in table


def test_cli_errors_and_exit_codes(capsys, tmp_path):
    assert main(["plan", "--model", "qwen2.5-7b", "parallel.tp=8"]) == 2
    assert "megatron-dapo: error: 'parallel.tp'=8 does not divide" in capsys.readouterr().err
    assert main(["plan", "model.hf_dir=/nonexistent"]) == 2
    assert "pass --model" in capsys.readouterr().err
    assert main(["plan", "--model", "qwen2.5-7b", "--nodes", "0"]) == 2
    assert "megatron-dapo: error: --nodes must be >= 1, got 0" in capsys.readouterr().err
    assert main(["plan", "--model", "qwen2.5-7b", "--gpus-per-node", "0", "--gpu-memory-gib", "0"]) == 2
    err = capsys.readouterr().err  # every bad flag in one line
    assert "--gpus-per-node must be >= 1, got 0; --gpu-memory-gib must be > 0, got 0" in err and err.count("\n") == 1
    # A model the planner has no formulas for: the config's message names the directory and the reason.
    mistral = {**mp.KNOWN_MODELS["qwen2.5-0.5b"], "architectures": ["MistralForCausalLM"]}
    (tmp_path / "config.json").write_text(json.dumps(mistral))
    assert main(["plan", f"model.hf_dir={tmp_path}", "--gpus-per-node", "2"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"megatron-dapo: error: 'model.hf_dir'={tmp_path} ")
    assert "unsupported architecture ['MistralForCausalLM']" in err
    # A 72B actor with TP=1 cannot fit one GPU: the plan prints and says so with exit status 3.
    assert main(["plan", "--model", "qwen2.5-72b", "--gpus-per-node", "1", "--nodes", "1"]) == 3
    assert "NO" in capsys.readouterr().out


def test_model_shape_from_hf_dir(tmp_path, capsys):
    from tests.support.tiny_models import tiny_config

    model_dir = tmp_path / "tiny-qwen3"
    model_dir.mkdir()
    (model_dir / "config.json").write_text(json.dumps(tiny_config("qwen3").to_dict()))
    code = main(["plan", f"model.hf_dir={model_dir}", "--gpus-per-node", "2", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert code == 0 and out["model_name"] == "tiny-qwen3" and out["architecture"] == "Qwen3ForCausalLM"
    assert out["hf_parameters"] == mp.hf_parameter_count(read_hf_config(model_dir))


def test_cli_gpu_choice(capsys):
    main(["plan", "--model", "qwen2.5-7b", "--nodes", "2", "--json", "parallel.tp=4", "--gpu", "h200"])
    assert json.loads(capsys.readouterr().out)["gpu_memory"] == pytest.approx(139.8 * mp.GIB)
    main(["plan", "--model", "qwen2.5-7b", "--nodes", "2", "--json", "parallel.tp=4", "--gpu-memory-gib", "78"])
    assert json.loads(capsys.readouterr().out)["gpu_memory"] == pytest.approx(78 * mp.GIB)
    main(["plan", "--model", "qwen2.5-7b", "--nodes", "2", "parallel.tp=4"])
    assert "79.1 GiB per GPU (H100 80GB as reported)" in capsys.readouterr().out
