"""The demo's workspace: its tokenizer, a tiny randomly initialised model and the arithmetic task.

`megatron-dapo demo` trains in it, `megatron-dapo smoke` checks the weight sync and one trainer step
on its models, and the tests build theirs with it. Dense: a Qwen2-shaped model, ~0.8M parameters,
head_dim 32 (which vLLM's CPU attention supports). MoE: a Qwen3-MoE of the same width and attention,
8 experts of width 96 with 2 routed per token in every layer.
"""

from __future__ import annotations

import json
from pathlib import Path

__all__ = ["DEMO_MODEL", "DEMO_MODELS", "DEMO_MOE_MODEL", "prepare_workspace", "workspace_paths"]

DEMO_MODEL = dict(hidden_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, intermediate_size=384)
DEMO_MOE_MODEL = dict(hidden_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                      intermediate_size=384, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=96,
                      decoder_sparse_step=1, norm_topk_prob=True)  # fmt: skip
DEMO_MODELS = ("dense", "moe")


def workspace_paths(root: Path) -> dict[str, Path]:
    """Where `prepare_workspace` puts the demo's model and data under `root`."""
    return {"model": root / "model", "train": root / "data" / "train.parquet", "val": root / "data" / "val.parquet",
            "sft": root / "data" / "sft.jsonl"}  # fmt: skip


def prepare_workspace(
    root: Path, seed: int, num_train: int = 8000, num_val: int = 128, max_operand: int = 50, model: str = "dense"
) -> dict[str, Path]:
    """Create the demo's model (`model`: "dense" or "moe"), tokenizer and data under `root`
    (idempotent; deterministic in `seed`)."""
    import torch
    from transformers import AutoModelForCausalLM, Qwen2Config, Qwen3MoeConfig

    from megatron_dapo.data.arithmetic import build_tokenizer, write_arithmetic_dataset

    paths = workspace_paths(root)
    ready = root / ".ready"
    if model not in DEMO_MODELS:
        raise ValueError(f"unknown demo model {model!r} ({', '.join(DEMO_MODELS)})")
    shape = DEMO_MODEL if model == "dense" else DEMO_MOE_MODEL
    recipe = {"seed": seed, "model": shape, "num_train": num_train, "num_val": num_val, "max_operand": max_operand}
    if ready.exists() and json.loads(ready.read_text()) == recipe:
        return paths
    tokenizer = build_tokenizer()
    special = dict(eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, bos_token_id=None)
    if model == "dense":
        config = Qwen2Config(vocab_size=len(tokenizer), max_position_embeddings=512, tie_word_embeddings=True, rope_theta=10000.0,
                             **special, **shape)  # fmt: skip
        config.architectures = ["Qwen2ForCausalLM"]
    else:
        config = Qwen3MoeConfig(vocab_size=len(tokenizer), max_position_embeddings=512, tie_word_embeddings=False,
                                rope_theta=1000000.0, **special, **shape)  # fmt: skip
        config.architectures = ["Qwen3MoeForCausalLM"]
    torch.manual_seed(seed)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(paths["model"])
    tokenizer.save_pretrained(str(paths["model"]))
    write_arithmetic_dataset(root / "data", num_train=num_train, num_val=num_val, seed=seed, max_operand=max_operand, sft_file=paths["sft"])
    ready.write_text(json.dumps(recipe))
    return paths
