"""Peak memory of HF <-> Megatron conversion versus model size: the converters stream.

Builds Qwen2-shaped models on disk with random weights (written shard by shard with safetensors,
no transformers model is instantiated): hidden 2048, 16 query / 2 KV heads (head dim 128), MLP
1024, vocabulary 32000, tied embeddings, float32, 12 and 24 layers (~0.26 / 0.44 B parameters,
~1.0 / 1.77 GB in 4 safetensors shards). For each, runs in its own subprocess (as a user would):

    python tools/convert_hf_to_megatron.py --hf-dir MODEL --output CKPT --tp 2 --pp 2
    python tools/convert_megatron_to_hf.py --megatron-dir CKPT --output EXPORT --max-shard-size 1GB

and reads each process's peak resident set size (VmHWM from /proc, read as it exits). The same two
commands on a tiny model (same imports, Megatron set-up, code paths; negligible tensors) give the
fixed cost of the Python process, so "peak - fixed" is what the model costs. Streaming means that
figure follows the largest single tensor (the embedding, 262 MB: its source and its converted
copy), not the number of layers or the model size. Each export is compared tensor by tensor with
its original (bit-identical).

    python benchmarks/bench_convert_memory.py [--workdir DIR] [--layers 12,24] [--keep]

Runs in ~1 minute on 2 CPU cores; needs ~6 GB of free disk in --workdir (default: a temp dir).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

REPO = Path(__file__).resolve().parents[1]

SHAPE = dict(hidden=2048, layers=24, heads=16, kv_heads=2, intermediate=1024, vocab=32000)
TINY = dict(hidden=64, layers=4, heads=4, kv_heads=2, intermediate=128, vocab=300)


def qwen2_config(s: dict) -> dict:
    return {
        "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": s["hidden"],
        "num_hidden_layers": s["layers"], "num_attention_heads": s["heads"], "num_key_value_heads": s["kv_heads"],
        "intermediate_size": s["intermediate"], "vocab_size": s["vocab"], "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "hidden_act": "silu", "tie_word_embeddings": True,
        "torch_dtype": "float32", "use_sliding_window": False, "attention_dropout": 0.0,
    }  # fmt: skip


def layer_shapes(s: dict, i: int) -> dict[str, tuple[int, ...]]:
    h, kv = s["hidden"], s["kv_heads"] * (s["hidden"] // s["heads"])
    p = f"model.layers.{i}."
    return {
        p + "input_layernorm.weight": (h,),
        p + "self_attn.q_proj.weight": (h, h), p + "self_attn.q_proj.bias": (h,),
        p + "self_attn.k_proj.weight": (kv, h), p + "self_attn.k_proj.bias": (kv,),
        p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.v_proj.bias": (kv,),
        p + "self_attn.o_proj.weight": (h, h),
        p + "post_attention_layernorm.weight": (h,),
        p + "mlp.gate_proj.weight": (s["intermediate"], h), p + "mlp.up_proj.weight": (s["intermediate"], h),
        p + "mlp.down_proj.weight": (h, s["intermediate"]),
    }  # fmt: skip


def write_model(directory: Path, s: dict, shards: int) -> tuple[int, int]:
    """Random Qwen2 weights in `shards` safetensors files + index; returns (total bytes, largest shard bytes)."""
    directory.mkdir(parents=True)
    (directory / "config.json").write_text(json.dumps(qwen2_config(s), indent=2))
    (directory / "tokenizer_config.json").write_text('{"model_max_length": 4096}\n')
    groups: list[dict[str, tuple[int, ...]]] = [{"model.embed_tokens.weight": (s["vocab"], s["hidden"])}]
    groups += [layer_shapes(s, i) for i in range(s["layers"])]
    groups[-1]["model.norm.weight"] = (s["hidden"],)
    per_shard = -(-len(groups) // shards)
    generator = torch.Generator().manual_seed(0)
    weight_map, total, largest = {}, 0, 0
    for index in range(shards):
        name = f"model-{index + 1:05d}-of-{shards:05d}.safetensors"
        tensors = {}
        for group in groups[index * per_shard : (index + 1) * per_shard]:
            for tensor_name, shape in group.items():
                tensors[tensor_name] = torch.randn(shape, generator=generator) * 0.02
                weight_map[tensor_name] = name
        size = sum(t.numel() * t.element_size() for t in tensors.values())
        total, largest = total + size, max(largest, size)
        save_file(tensors, str(directory / name), metadata={"format": "pt"})
        del tensors
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    return total, largest


# Runs a tool as __main__ and reports the process's own high-water mark of resident memory
# (VmHWM). wait4's ru_maxrss would also fold in any short-lived helper process a library forks.
_MEASURE = """
import runpy, sys
sys.argv = sys.argv[1:]
code = 0
try:
    runpy.run_path(sys.argv[0], run_name="__main__")
except SystemExit as exit:
    code = exit.code or 0
hwm = [l.split()[1] for l in open("/proc/self/status") if l.startswith("VmHWM")][0]
print(f"VMHWM_KB={hwm}", file=sys.stderr)
sys.exit(code)
"""


def run_measured(cmd: list[str]) -> tuple[float, float]:
    """(peak RSS in MB, wall seconds) of one tool run in a fresh process; raises if it fails."""
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="2")
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", _MEASURE, *cmd[1:]], env=env, capture_output=True, text=True)
    seconds = time.monotonic() - start
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{(proc.stdout + proc.stderr)[-3000:]}")
    kib = int(next(l for l in proc.stderr.splitlines() if l.startswith("VMHWM_KB=")).split("=")[1])
    return kib * 1024 / 1e6, seconds


def convert_both_ways(model: Path, work: Path, tag: str) -> dict:
    ckpt, export = work / f"{tag}_megatron", work / f"{tag}_export"
    forward = [sys.executable, str(REPO / "tools" / "convert_hf_to_megatron.py"), "--hf-dir", str(model),
               "--output", str(ckpt), "--tp", "2", "--pp", "2", "--no-progress"]  # fmt: skip
    backward = [sys.executable, str(REPO / "tools" / "convert_megatron_to_hf.py"), "--megatron-dir", str(ckpt),
                "--output", str(export), "--max-shard-size", "1GB", "--no-progress"]  # fmt: skip
    peak_f, sec_f = run_measured(forward)
    peak_b, sec_b = run_measured(backward)
    return {"forward": (peak_f, sec_f), "backward": (peak_b, sec_b), "ckpt": ckpt, "export": export,
            "commands": [" ".join(forward), " ".join(backward)]}  # fmt: skip


def check_identical(original: Path, exported: Path) -> int:
    """Compare every tensor (streamed: one at a time); returns how many."""
    index = json.loads((original / "model.safetensors.index.json").read_text())["weight_map"]
    out_index_file = exported / "model.safetensors.index.json"
    out_index = json.loads(out_index_file.read_text())["weight_map"] if out_index_file.exists() else None
    assert out_index is None or sorted(out_index) == sorted(index), "exported tensor names differ"
    for name, file in index.items():
        with safe_open(str(original / file), framework="pt") as a:
            want = a.get_tensor(name)
        other = out_index[name] if out_index else "model.safetensors"
        with safe_open(str(exported / other), framework="pt") as b:
            got = b.get_tensor(name)
        assert got.dtype == want.dtype and torch.equal(got, want), f"{name} differs"
    return len(index)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workdir", default=None, help="where to write the models (default: a temp dir)")
    parser.add_argument("--layers", default="12,24", help="model depths to measure (default 12,24)")
    parser.add_argument("--keep", action="store_true", help="keep the written files")
    args = parser.parse_args()
    work = Path(args.workdir or tempfile.mkdtemp(prefix="bench_convert_"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        write_model(work / "tiny", TINY, shards=1)
        tiny = convert_both_ways(work / "tiny", work, "tiny")
        embedding = SHAPE["vocab"] * SHAPE["hidden"] * 4
        layer = sum(torch.Size(s).numel() for s in layer_shapes(SHAPE, 0).values()) * 4
        dims = {k: v for k, v in SHAPE.items() if k != "layers"}
        print(f"Qwen2-shaped {dims}, tied embeddings, float32, 4 safetensors shards; largest tensor (embedding) "
              f"{embedding / 1e6:.0f} MB, one decoder layer {layer / 1e6:.0f} MB")  # fmt: skip
        print(f"fixed cost (same commands on a tiny model): HF -> Megatron {tiny['forward'][0]:.0f} MB, "
              f"Megatron -> HF {tiny['backward'][0]:.0f} MB peak RSS")  # fmt: skip
        print()
        print(f"{'layers':>6} {'model':>8} {'largest shard':>14} {'direction':<16} {'peak RSS':>9} {'peak - fixed':>13} "
              f"{'/ model':>8} {'time':>6}")  # fmt: skip
        for depth in [int(d) for d in args.layers.split(",")]:
            shape = dict(SHAPE, layers=depth)
            model = work / f"model_{depth}"
            model_bytes, largest_shard = write_model(model, shape, shards=4)
            big = convert_both_ways(model, work, f"big_{depth}")
            count = check_identical(model, big["export"])
            for key, label in (("forward", "HF -> Megatron"), ("backward", "Megatron -> HF")):
                peak, seconds = big[key]
                extra = peak - tiny[key][0]
                print(f"{depth:>6} {model_bytes / 1e9:>6.2f}GB {largest_shard / 1e6:>12.0f}MB {label:<16} {peak:>7.0f}MB "
                      f"{extra:>11.0f}MB {extra * 1e6 / model_bytes:>7.1%} {seconds:>5.1f}s")  # fmt: skip
            print(f"{'':>6} round trip: {count} tensors bit-identical")
            if not args.keep:  # free the disk before the next size
                for path in (model, big["ckpt"], big["export"]):
                    shutil.rmtree(path, ignore_errors=True)
        print()
        print(f"commands ({depth} layers):")
        for command in big["commands"]:
            print("  " + command.replace(str(work), "$WORK"))
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
