"""`megatron-dapo convert {hf-to-megatron, megatron-to-hf}`: checkpoint conversion, one process, streaming.

    megatron-dapo convert hf-to-megatron --hf-dir Qwen2.5-7B --output ckpt/qwen7b --tp 4 --pp 2
    megatron-dapo convert megatron-to-hf --megatron-dir runs/dapo/checkpoints --output exported/

The library is `megatron_dapo.checkpoint.conversion`. Exit code 2 for bad input (a missing
directory, a layout that does not divide the model, a non-empty output), 1 when writing the output
failed (it is left as it was).
"""

from __future__ import annotations

import argparse

DTYPES = ("float32", "bfloat16", "float16")
"""What --dtype accepts (`checkpoint.conversion.DTYPES`; written here so that --help imports no torch)."""

HF_TO_MEGATRON_DESCRIPTION = """\
Convert a HuggingFace model directory (config.json + safetensors + tokenizer files) into a Megatron
distributed checkpoint that `megatron-dapo train` loads (model.megatron_checkpoint=OUTPUT).

Runs as one plain process on a CPU machine and streams: memory stays around one layer whatever the
model size. The checkpoint stores global tensors, so it loads at ANY tensor / pipeline / data /
expert parallel layout; --tp/--pp/--vpp/--ep are checked against the model (heads, KV heads, layers,
experts) and recorded. Supported: Qwen2, Qwen2.5, Llama (incl. Llama 3 RoPE scaling), Qwen3 dense
models; Qwen3-MoE and Qwen2-MoE mixtures of experts.
"""

MEGATRON_TO_HF_DESCRIPTION = """\
Export the model of a Megatron checkpoint (made by hf-to-megatron, or a training checkpoint saved at
any layout) to a HuggingFace directory: safetensors shards (+ model.safetensors.index.json),
config.json, tokenizer and generation config files. Optimizer state is ignored. Streams: memory
stays around one layer. --megatron-dir may be a checkpoint directory or a directory of step_*
checkpoints (the latest complete one is used).
"""


def add_hf_to_megatron_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--hf-dir", required=True, help="HF model directory (config.json, *.safetensors, tokenizer files)")
    parser.add_argument("--output", required=True, help="checkpoint directory to create (must be empty or absent)")
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel size to validate for (default 1)")
    parser.add_argument("--pp", type=int, default=1, help="pipeline-parallel size to validate for (default 1)")
    parser.add_argument("--vpp", type=int, default=None, help="virtual pipeline stages per rank (needs --pp > 1)")
    parser.add_argument("--ep", type=int, default=1, help="expert-parallel size to validate for (MoE models; default 1)")
    parser.add_argument("--dtype", choices=DTYPES, default=None, help="cast weights to this dtype (default: keep the HF dtype)")
    parser.add_argument("--overwrite", action="store_true", help="empty a non-empty --output first")
    parser.add_argument("--verify-logits", action="store_true",
                        help="afterwards load the result in Megatron and in transformers (float32, whole model in memory) "
                             "and compare every block; fails naming the first block that diverges")  # fmt: skip
    parser.add_argument("--verify-tol", type=float, default=1e-4, help="max |difference| for --verify-logits (default 1e-4)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")


def add_megatron_to_hf_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--megatron-dir", required=True, help="checkpoint directory, or a directory of step_* checkpoints")
    parser.add_argument("--output", required=True, help="HF directory to create (must be empty or absent)")
    parser.add_argument("--max-shard-size", default="5GB", help="largest safetensors file, e.g. 5GB, 500MB, 2GiB (default 5GB)")
    parser.add_argument("--dtype", choices=DTYPES, default=None, help="cast weights to this dtype (default: as stored)")
    parser.add_argument("--hf-config-dir", default=None,
                        help="HF directory to take config.json and tokenizer files from when the checkpoint has none")  # fmt: skip
    parser.add_argument("--overwrite", action="store_true", help="empty a non-empty --output first")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    directions = parser.add_subparsers(dest="direction", required=True)
    hf = directions.add_parser("hf-to-megatron", help="HF model directory -> Megatron distributed checkpoint",
                               description=HF_TO_MEGATRON_DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    add_hf_to_megatron_arguments(hf)
    back = directions.add_parser("megatron-to-hf", help="Megatron checkpoint -> HF model directory (safetensors)",
                                 description=MEGATRON_TO_HF_DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    add_megatron_to_hf_arguments(back)


def run(args: argparse.Namespace) -> int:
    from megatron_dapo.checkpoint.conversion import convert_hf_to_megatron, convert_megatron_to_hf

    if args.direction == "hf-to-megatron":
        report = convert_hf_to_megatron(
            args.hf_dir, args.output, args.tp, args.pp, args.vpp, args.dtype, ep=args.ep, overwrite=args.overwrite,
            verify_logits=args.verify_logits, verify_tol=args.verify_tol, progress=not args.no_progress,
        )  # fmt: skip
    else:
        report = convert_megatron_to_hf(
            args.megatron_dir, args.output, args.max_shard_size, args.dtype, hf_config_dir=args.hf_config_dir,
            overwrite=args.overwrite, progress=not args.no_progress,
        )  # fmt: skip
    print(f"wrote {report.output}: {report.tensors} tensors, {report.bytes / 1e9:.3f} GB in {report.seconds:.1f}s")
    for note in report.notes:
        print(f"  {note}")
    return 0
