"""HF <-> Megatron checkpoint conversion, streaming, in one process (the library of `megatron-dapo convert`).

    megatron-dapo convert hf-to-megatron --hf-dir Qwen2.5-7B --output ckpt/qwen7b --tp 4 --pp 2
    megatron-dapo convert megatron-to-hf --megatron-dir runs/dapo/checkpoints --output exported/

HF -> Megatron writes a Megatron distributed checkpoint (torch_dist) of the model alone, in the
directory format `megatron_dapo.checkpoint` loads (metadata.json + dist/ + hf/ with the config and
tokenizer files). Distributed checkpoints store every tensor with its global shape, so one process
writes full tensors and Megatron loads them at any TP / PP / VPP / DP / EP: `--tp/--pp/--vpp/--ep`
are checked against the model (heads, query groups, layers, experts) and recorded, nothing more. A mixture of experts stores each layer's experts stacked along an
expert axis by global id, which each expert-parallel rank slices its own experts from. The keys,
shapes and chunks are the ones Megatron's own `GPTModel.sharded_state_dict()` asks for at TP=1
(`checkpoint.template`), and the tensors are the HF tensors passed through the same mapping table
the trainer loads with (`model.mapping`), so HF -> Megatron -> HF is bit-exact.

Megatron -> HF reads the model part of any such checkpoint (a converted one, or a training
checkpoint saved at any layout with `hf_dir`, optimizer state ignored) and writes safetensors
shards (+ `model.safetensors.index.json` when there is more than one) and the HF side files.

Memory: both directions stream. HF -> Megatron materialises one Megatron tensor at a time from its
HF source tensors and writes it to its own data file; Megatron -> HF reads one layer, converts it
and streams the bytes into pre-planned safetensors files whose headers were written first. Peak
memory is about twice the largest tensor (the embedding: the source and its converted copy), not
the model size (benchmarks/bench_convert_memory.py measures it).
"""

from __future__ import annotations

import io
import json
import os
import re
import shutil
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Optional, Sequence, Union

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.dist_checkpointing.core import CheckpointingConfig, save_config
from tqdm import tqdm
from transformers import AutoModelForCausalLM

from megatron_dapo.checkpoint.core import load_checkpoint, make_metadata
from megatron_dapo.checkpoint.layout import (
    DIST_DIR,
    HF_DIR,
    METADATA_FILE,
    copy_hf_side_files,
    fsync_dir,
    resolve_checkpoint_dir,
)
from megatron_dapo.checkpoint.streaming import ChunkTargets, LazyChunk, LazyChunkedTensor, read_chunks, write_streaming
from megatron_dapo.checkpoint.template import checkpoint_template
from megatron_dapo.checkpoint.torch_dist import stored_entries
from megatron_dapo.compat.megatron_core import store_common_state
from megatron_dapo.distributed import ParallelLayout, init_distributed, teardown
from megatron_dapo.errors import InputError, StopError
from megatron_dapo.model.arch_tables import mapping_for
from megatron_dapo.model.builder import build_gpt_models, check_against_hf
from megatron_dapo.model.debug import compare_with_hf
from megatron_dapo.model.hf_config import read_hf_config
from megatron_dapo.model.hf_weights import HFWeightReader, check_weight_files, open_safetensors
from megatron_dapo.model.mapping import LOCAL_SPEC, ModelShape
from megatron_dapo.model.safetensors_format import SAFETENSORS_DTYPES, safetensors_header, tensor_nbytes
from megatron_dapo.checkpoint.disk_full import disk_full_error

__all__ = [
    "DTYPES",
    "ConversionError",
    "ConversionReport",
    "ConversionWriteError",
    "convert_hf_to_megatron",
    "convert_megatron_to_hf",
    "parse_size",
    "verify_logits_against_hf",
]

PathLike = Union[str, os.PathLike]
DTYPES = ("float32", "bfloat16", "float16")


class ConversionError(InputError, ValueError):
    """The inputs cannot be converted (the message says why and what to do)."""


class ConversionWriteError(StopError, OSError):
    """Writing the output failed (a full disk, a read-only directory); the partial output was removed."""


@dataclass
class ConversionReport:
    """What a conversion wrote."""

    output: Path
    tensors: int
    bytes: int
    seconds: float
    files: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


# ---------------------------------------------------------------------------------------------
# Shared helpers
# ---------------------------------------------------------------------------------------------


_SIZE_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
               "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}  # fmt: skip


def parse_size(size: Union[int, str]) -> int:
    """Bytes from an int or a string like "5GB" (10^9, as HF) or "2GiB" (2^30)."""
    if isinstance(size, int):
        value = size
    else:
        match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", str(size))
        if match is None or match.group(2).upper() not in _SIZE_UNITS:
            raise ConversionError(f"cannot read size {size!r}: use e.g. 5GB, 500MB or 2GiB")
        value = int(float(match.group(1)) * _SIZE_UNITS[match.group(2).upper()])
    if value <= 0:
        raise ConversionError(f"size must be positive, got {size!r}")
    return value


def _torch_dtype(name: Optional[str]):
    if name is None:
        return None
    if name not in DTYPES:
        raise ConversionError(f"unsupported dtype {name!r}: use one of {', '.join(DTYPES)}")
    return getattr(torch, name)


def _check_output(output: Path, overwrite: bool) -> None:
    """Refuse a non-empty output directory unless `overwrite` (it is replaced only once the new one is complete)."""
    if output.exists() and not output.is_dir():
        raise ConversionError(f"output {output} exists and is not a directory")
    if output.is_dir() and any(output.iterdir()) and not overwrite:
        raise ConversionError(f"output directory {output} is not empty: choose another one or pass --overwrite")


_STAGING = ".tmp-"


@contextmanager
def _atomic_output(output: Path, overwrite: bool) -> Iterator[Path]:
    """A temporary sibling of `output` to write into, renamed to `output` when the body finishes.

    Like the training checkpoints: a conversion that fails (bad input found late, a full disk, a
    failed logits check, Ctrl-C) removes its partial files and leaves `output` as it was (absent,
    empty, or with --overwrite the previous content), never an empty or half-written directory.
    A write that failed is raised as a `ConversionWriteError` that says so.
    """
    _check_output(output, overwrite)
    output.parent.mkdir(parents=True, exist_ok=True)
    for stale in output.parent.glob(f".{output.name}{_STAGING}*"):  # left by a conversion killed with -9
        shutil.rmtree(stale, ignore_errors=True)
    staging = output.parent / f".{output.name}{_STAGING}{os.getpid()}"
    staging.mkdir()
    try:
        yield staging
        if output.is_dir() and any(output.iterdir()):  # --overwrite: the old content goes only now
            retired = output.parent / f".{output.name}{_STAGING}old-{os.getpid()}"
            os.replace(output, retired)
            os.replace(staging, output)
            shutil.rmtree(retired, ignore_errors=True)
        else:
            if output.is_dir():
                output.rmdir()
            os.replace(staging, output)
        fsync_dir(output.parent)
    except BaseException as error:  # torch.distributed.checkpoint's CheckpointException is a BaseException
        shutil.rmtree(staging, ignore_errors=True)
        failed = _write_failure(error, output)
        if failed is None:
            raise
        raise failed from error


def _write_failure(error: BaseException, output: Path) -> Optional[ConversionWriteError]:
    """A `ConversionWriteError` when `error` is a write that failed (a full disk anywhere in its chain,
    or another OSError), else None: bad input, a missing file, a bug and Ctrl-C pass unchanged."""
    if isinstance(error, (KeyboardInterrupt, SystemExit, GeneratorExit, InputError, StopError, FileNotFoundError)):
        return None
    if disk_full_error(error, output.parent) is not None:
        reason, fix = f"no space left on the disk of {output.parent}", "free some space or choose another --output"
    elif isinstance(error, OSError):
        reason, fix = str(error), "check that the directory is writable, or choose another --output"
    else:
        return None
    return ConversionWriteError(
        f"writing {output} failed ({reason}); it is left as it was (the partial output was removed): {fix}, then run the command again"
    )


class _SingleProcessMegatron:
    """Megatron's parallel state at TP=PP=1 for this process (set up and torn down if we own it)."""

    def __enter__(self) -> "_SingleProcessMegatron":
        self.owned = not dist.is_initialized()
        if self.owned:
            # A world of one with a gloo group on a free port, whatever launcher variables are set.
            init_distributed(ParallelLayout(1, 1), timeout_s=600, env={})
        else:
            if dist.get_world_size() != 1 or not parallel_state.model_parallel_is_initialized():
                raise ConversionError("conversion runs in a single process: do not launch it with torchrun / srun")
        return self

    def __exit__(self, *exc) -> None:
        if self.owned:
            teardown()


def _progress(total: int, desc: str, enabled: bool):
    return tqdm(total=total, desc=desc, unit="layer", disable=not enabled, file=sys.stderr, dynamic_ncols=True)


def _rows_in_order(cfg) -> list[tuple[Any, Optional[int], str]]:
    """(mapping row, global layer or None, Megatron parameter name at TP=PP=1) in HF order."""
    table = mapping_for(cfg)
    return [(row, layer, row.megatron_name(LOCAL_SPEC, layer)) for row, layer in table.ordered(cfg.num_layers)]


def _group(layer: Optional[int], row) -> str:
    if layer is not None:
        return f"layer {layer}"
    return "embedding" if row.megatron.startswith("embedding.") else "final norm / output"


def _check_template_covers(rows, template) -> None:
    names = {name for _, _, name in rows}
    unknown = sorted(set(template.params) - names)
    absent = sorted(names - set(template.params))
    if unknown or absent:
        raise ConversionError(
            f"the mapping table and Megatron's model disagree: Megatron parameters without an HF source "
            f"{unknown}, mapped names Megatron does not have {absent}"
        )


# ---------------------------------------------------------------------------------------------
# HF -> Megatron
# ---------------------------------------------------------------------------------------------


def _check_hf_dir(hf_dir: Path):
    if not hf_dir.exists():
        raise FileNotFoundError(f"HF model directory {hf_dir} does not exist")
    if not hf_dir.is_dir():
        raise FileNotFoundError(f"HF model path {hf_dir} is not a directory")
    if not (hf_dir / "config.json").is_file():
        raise FileNotFoundError(f"no config.json in {hf_dir}: point --hf-dir at a HuggingFace model directory")
    return read_hf_config(hf_dir)


def _stored_hf_dtype(reader) -> "torch.dtype":
    """The dtype of the HF weights, read from a safetensors header (no tensor is loaded)."""
    names = reader.names()
    name = next((n for n in names if n.endswith("embed_tokens.weight")), names[0])
    with open_safetensors(reader.hf_dir / reader.file_of(name)) as handle:
        code = handle.get_slice(name).get_dtype()
    stored = next((dtype for dtype, name in SAFETENSORS_DTYPES.items() if name == code), None)
    if stored is None or not stored.is_floating_point:
        raise ConversionError(f"HF weights are stored as {code}: pass --dtype {' / '.join(DTYPES)}")
    return stored


def _read_hf_tensor(reader, name: str) -> "torch.Tensor":
    """One HF tensor, with its file mapped only while it is read.

    HFWeightReader keeps the current shard memory-mapped; the pages it touched would stay resident
    until the next shard, adding up to a whole shard to the converter's footprint.
    """
    if name not in reader:
        raise ConversionError(f"{reader.hf_dir} lacks tensor {name!r} (is the checkpoint complete?)")
    with open_safetensors(reader.hf_dir / reader.file_of(name)) as handle:
        return handle.get_tensor(name)


def _validate_layout(cfg, tp: int, pp: int, vpp: Optional[int], ep: int = 1):
    layout = ParallelLayout(tp=tp, pp=pp, vpp=vpp, ep=ep)
    try:
        layout.validate(None, cfg.num_layers, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.num_experts)
    except ValueError as error:  # the layout's rule, said about this model and these flags
        raise ConversionError(str(error)) from None
    return layout


def convert_hf_to_megatron(
    hf_dir: PathLike,
    output: PathLike,
    tp: int = 1,
    pp: int = 1,
    vpp: Optional[int] = None,
    dtype: Optional[str] = None,
    *,
    ep: int = 1,
    overwrite: bool = False,
    verify_logits: bool = False,
    verify_tol: float = 1e-4,
    progress: bool = True,
) -> ConversionReport:
    """Write the HF model in `hf_dir` as a Megatron distributed checkpoint in `output` (see module doc).

    `tp/pp/vpp/ep`: the layout it is meant for (validated against the model and recorded; the
    checkpoint loads at any layout). `dtype`: cast the weights (default: keep the HF dtype).
    `verify_logits`: afterwards load the checkpoint into Megatron and HF (float32, whole model in
    memory) and compare every block's output; raises ConversionError at the first divergence.
    """
    start = time.monotonic()
    hf_dir, output = Path(hf_dir), Path(output)
    cfg = _check_hf_dir(hf_dir)
    layout = _validate_layout(cfg, tp, pp, vpp, ep)
    check_weight_files(hf_dir)  # a truncated or overwritten shard is named now, not after half the layers
    reader = HFWeightReader(hf_dir)
    out_dtype = _torch_dtype(dtype) or _stored_hf_dtype(reader)
    if out_dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ConversionError(f"HF weights are {out_dtype}: pass --dtype {' / '.join(DTYPES)}")
    _check_output(output, overwrite)

    final = output
    with _atomic_output(final, overwrite) as output, _SingleProcessMegatron():
        template = checkpoint_template(cfg, out_dtype)
        rows = _rows_in_order(cfg)
        _check_template_covers(rows, template)
        shape = ModelShape.from_hf(cfg, tp_size=1)
        groups = list(dict.fromkeys(_group(layer, row) for row, layer, _ in rows))
        bar = _progress(len(groups), "HF -> Megatron", progress)
        cache: dict[str, Any] = {"name": None, "tensor": None, "group": None}
        totals = {"tensors": 0, "bytes": 0}

        def full_parameter(row, layer, name: str) -> torch.Tensor:
            """The TP=1 Megatron parameter from its HF tensors (one-entry cache: gate/up share it)."""
            if cache["name"] != name:
                cache["tensor"] = None  # drop the previous one before reading the next
                hf_tensors = [_read_hf_tensor(reader, n) for n in row.hf_names(layer)]
                cache["tensor"] = row.to_megatron_shard(hf_tensors, 0, 1, shape).to(out_dtype)
                cache["name"] = name
                totals["tensors"] += 1
                group = _group(layer, row)
                if group != cache["group"]:
                    if cache["group"] is not None:
                        bar.update(1)
                    cache["group"] = group
                    bar.set_postfix_str(group)
            return cache["tensor"]

        def producer(row, layer, name, spec):
            def produce() -> torch.Tensor:
                tensor = full_parameter(row, layer, name)[spec.param_region()]
                if tuple(tensor.shape) != spec.param_sizes:
                    raise ConversionError(f"{name}: HF tensors give {tuple(tensor.shape)}, Megatron expects {spec.param_sizes}")
                totals["bytes"] += tensor.numel() * tensor.element_size()
                return tensor.reshape(spec.stored_sizes)

            return produce

        state: dict[str, Any] = {}
        chunks_of: dict[str, list] = {}
        shapes_of: dict[str, tuple] = {}
        order = 0
        for row, layer, name in rows:
            for spec in template.params[name]:
                chunks_of.setdefault(spec.key, []).append(
                    LazyChunk(spec.global_offset, spec.stored_sizes, producer(row, layer, name, spec), order)
                )
                shapes_of[spec.key] = spec.global_shape
                order += 1
        for key, chunks in chunks_of.items():
            state[key] = LazyChunkedTensor(shapes_of[key], out_dtype, chunks)
        for obj in template.objects:  # Megatron stores each ShardedObject as a pickled list
            buffer = io.BytesIO()
            torch.save([obj.data], buffer)
            buffer.seek(0)
            state[obj.unique_key] = buffer

        dist_dir = output / DIST_DIR
        dist_dir.mkdir()
        store_common_state({}, dist_dir, state)  # a model alone has no common state; Megatron needs it there
        try:
            write_streaming(state, dist_dir)
        finally:
            reader.close()
            cache["tensor"] = None
            bar.update(bar.total - bar.n)
            bar.close()
        save_config(CheckpointingConfig("torch_dist", 1), str(dist_dir))

        copied = copy_hf_side_files(hf_dir, output / HF_DIR)
        notes = [f"copied HF files: {', '.join(copied)}"]
        metadata = make_metadata(
            0,
            contents={"model": True, "optimizer": None, "optimizer_sharding": None, "scheduler": False,
                      "rng": False, "trainer_state": False, "hf_files": True},
            layout={"tp": layout.tp, "pp": layout.pp, "vpp": layout.vpp, "cp": 1, "ep": layout.ep, "dp": None, "world_size": None},
            model={"num_chunks": layout.vpp_size, "dtype": str(out_dtype).replace("torch.", ""),
                   "hf_config": json.loads((hf_dir / "config.json").read_text())},
            converted_from={"hf_dir": str(hf_dir.resolve()), "parameters": totals["tensors"]},
        )  # fmt: skip
        (output / METADATA_FILE).write_text(json.dumps(metadata, indent=2, sort_keys=True))  # last: marks it complete

        if verify_logits:  # before the rename: a checkpoint that fails it is never published
            notes.append(verify_logits_against_hf(output, hf_dir, verify_tol))
    files = sorted(str(p.relative_to(final)) for p in final.rglob("*") if p.is_file())
    return ConversionReport(final, totals["tensors"], totals["bytes"], time.monotonic() - start, files, notes)


def verify_logits_against_hf(checkpoint: PathLike, hf_dir: PathLike, tol: float = 1e-4) -> str:
    """Load `checkpoint` into Megatron (TP=1, float32) and `hf_dir` into transformers; compare every block.

    Whole model in memory, twice. Returns the one-line summary; raises ConversionError naming the
    first block whose output differs by more than `tol` (`model.debug.compare_with_hf`).
    """
    cfg = read_hf_config(hf_dir)
    with _SingleProcessMegatron():
        models = build_gpt_models(cfg, ParallelLayout(1, 1), torch.float32, transformer_engine="off", init_weights=False)
        check_against_hf(models, cfg)
        load_checkpoint(checkpoint, models, load_rng=False)
        hf_model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32, attn_implementation="eager")
        input_ids = torch.randint(0, cfg.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
        report = compare_with_hf(models, hf_model, input_ids, tol=tol, vocab_size=cfg.vocab_size)
    summary = report.summary()
    if report.first_divergence is not None:
        raise ConversionError(f"logits check failed: {summary}")
    return f"logits check: {summary}"


# ---------------------------------------------------------------------------------------------
# Megatron -> HF
# ---------------------------------------------------------------------------------------------


class SafetensorsStreamWriter:
    """Write one safetensors file whose tensors (names, dtypes, shapes) are known up front.

    The header (`safetensors_format.safetensors_header`) is written first; tensors are then
    streamed in the declared order, so no tensor is held after its write.
    """

    def __init__(self, path: Path, entries: Sequence[tuple[str, "torch.dtype", tuple[int, ...]]]) -> None:
        self._expected = [(name, dtype, tuple(shape)) for name, dtype, shape in entries]
        prefix, _ = safetensors_header(self._expected, metadata={"format": "pt"})
        self.path = path
        self._handle = open(path, "wb")
        self._handle.write(prefix)
        self._next = 0

    def write(self, name: str, tensor: "torch.Tensor") -> None:
        want = self._expected[self._next]
        got = (name, tensor.dtype, tuple(tensor.shape))
        if got != want:
            raise ConversionError(f"{self.path.name}: expected {want}, got {got}")
        data = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
        self._handle.write(memoryview(data.numpy()))
        self._next += 1

    def close(self) -> None:
        self._handle.close()
        if self._next != len(self._expected):
            raise ConversionError(f"{self.path.name}: wrote {self._next} of {len(self._expected)} tensors")


def _plan_shards(entries: list[tuple[str, Any, tuple]], max_bytes: int) -> list[list[tuple[str, Any, tuple]]]:
    """Split tensors (in order) into files of at most `max_bytes` (a bigger tensor gets its own file)."""
    shards: list[list] = [[]]
    size = 0
    for entry in entries:
        nbytes = tensor_nbytes(entry[1], entry[2])
        if shards[-1] and size + nbytes > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append(entry)
        size += nbytes
    return shards


def _find_hf_config(checkpoint: Path, hf_config_dir: Optional[Path]) -> Path:
    candidates = ([hf_config_dir] if hf_config_dir else []) + [checkpoint / HF_DIR]
    for directory in candidates:
        if (directory / "config.json").is_file():
            return directory
    if hf_config_dir is not None:
        raise FileNotFoundError(f"no config.json in --hf-config-dir {hf_config_dir}")
    raise FileNotFoundError(
        f"{checkpoint} has no {HF_DIR}/config.json (it was saved without hf_dir): pass --hf-config-dir with the "
        "HF model directory it was trained from"
    )


def _layer_batches(rows) -> Iterator[list]:
    """Rows grouped by layer (global rows each on their own), in HF order."""
    batch, current = [], object()
    for item in rows:
        group = _group(item[1], item[0])
        if batch and group != current:
            yield batch
            batch = []
        batch.append(item)
        current = group
    if batch:
        yield batch


def convert_megatron_to_hf(
    megatron_dir: PathLike,
    output: PathLike,
    max_shard_size: Union[int, str] = "5GB",
    dtype: Optional[str] = None,
    *,
    hf_config_dir: Optional[PathLike] = None,
    overwrite: bool = False,
    progress: bool = True,
) -> ConversionReport:
    """Write the model of a Megatron checkpoint as an HF directory (safetensors + config + tokenizer).

    `megatron_dir`: a checkpoint directory or a root of step directories (its latest is used).
    `hf_config_dir`: where config.json / tokenizer files come from when the checkpoint has no hf/.
    `dtype`: cast the weights (default: as stored).
    """
    start = time.monotonic()
    megatron_dir, output = Path(megatron_dir), Path(output)
    if not megatron_dir.exists():
        raise FileNotFoundError(f"Megatron checkpoint {megatron_dir} does not exist")
    checkpoint = resolve_checkpoint_dir(megatron_dir)
    side_dir = _find_hf_config(checkpoint, Path(hf_config_dir) if hf_config_dir else None)
    cfg = read_hf_config(side_dir)
    max_bytes = parse_size(max_shard_size)
    out_dtype = _torch_dtype(dtype)
    if output.resolve() == checkpoint.resolve() or checkpoint.resolve() in output.resolve().parents:
        raise ConversionError(f"output {output} must not be inside the checkpoint {checkpoint}")
    _check_output(output, overwrite)
    with _atomic_output(output, overwrite) as staging:
        report = _export_hf(checkpoint, side_dir, cfg, staging, max_bytes, out_dtype, progress)
    files = sorted(p.name for p in output.iterdir() if p.is_file())
    return ConversionReport(output, report.tensors, report.bytes, time.monotonic() - start, files, report.notes)


def _export_hf(checkpoint: Path, side_dir: Path, cfg, output: Path, max_bytes: int, out_dtype, progress: bool) -> ConversionReport:
    """The body of `convert_megatron_to_hf`, writing into `output` (the staging directory)."""
    dist_dir = checkpoint / DIST_DIR
    stored = stored_entries(dist_dir)
    with _SingleProcessMegatron():
        template = checkpoint_template(cfg, torch.float32)
    rows = _rows_in_order(cfg)
    _check_template_covers(rows, template)
    shape = ModelShape.from_hf(cfg, tp_size=1)

    # Check the checkpoint holds this model, and learn the stored dtypes.
    problems, stored_dtype = [], {}
    for name, specs in template.params.items():
        for spec in specs:
            meta = stored.get(spec.key)
            if meta is None or not hasattr(meta, "size"):
                problems.append(f"{spec.key} is not in the checkpoint")
            elif not spec.allow_shape_mismatch and tuple(meta.size) != spec.global_shape:
                problems.append(f"{spec.key}: checkpoint {tuple(meta.size)}, config.json gives {spec.global_shape}")
            else:
                stored_dtype[name] = meta.properties.dtype
    if problems:
        raise ConversionError(
            f"{checkpoint} does not hold the model described by {side_dir / 'config.json'}:\n  " + "\n  ".join(problems[:10])
        )

    # Plan every HF tensor (name, dtype, shape) first: the safetensors headers are written up front.
    entries = []
    for row, layer, name in rows:
        fake = torch.empty(template.param_shapes[name], dtype=stored_dtype[name], device="meta")
        for hf_name, tensor in zip(row.hf_names(layer), row.to_hf([fake], shape)):
            entries.append((hf_name, out_dtype or stored_dtype[name], tuple(tensor.shape)))
    shards = _plan_shards(entries, max_bytes)
    if len(shards) == 1:
        file_names = ["model.safetensors"]
    else:
        file_names = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    file_of = {entry[0]: file_names[i] for i, shard in enumerate(shards) for entry in shard}
    writers: dict[str, SafetensorsStreamWriter] = {}
    remaining = {file_names[i]: len(shard) for i, shard in enumerate(shards)}

    def emit(hf_name: str, tensor: torch.Tensor) -> None:
        file_name = file_of[hf_name]
        if file_name not in writers:
            writers[file_name] = SafetensorsStreamWriter(output / file_name, shards[file_names.index(file_name)])
        writers[file_name].write(hf_name, tensor if out_dtype is None else tensor.to(out_dtype))
        remaining[file_name] -= 1
        if remaining[file_name] == 0:
            writers.pop(file_name).close()

    batches = list(_layer_batches(rows))
    total_bytes = 0
    with _progress(len(batches), "Megatron -> HF", progress) as bar:
        for batch in batches:
            # One read per layer: every chunk lands in its place inside the full TP=1 parameter.
            params, targets = {}, {}
            for row, layer, name in batch:
                param = torch.zeros(template.param_shapes[name], dtype=stored_dtype[name])
                params[name] = param
                for spec in template.params[name]:
                    stored_shape = tuple(stored[spec.key].size)
                    sizes = [min(s, g - o) for s, o, g in zip(spec.stored_sizes, spec.global_offset, stored_shape)]
                    if any(s <= 0 for s in sizes):
                        continue  # vocabulary padding beyond what this checkpoint stores
                    region = tuple(slice(o, o + s) for o, s in zip(spec.param_offset, sizes[spec.prepend_axis_num:]))
                    target = param[region]
                    if not target.is_contiguous():
                        raise ConversionError(f"{name}: chunk {spec.param_offset} is not a contiguous region")
                    key_targets = targets.setdefault(spec.key, (stored_shape, stored_dtype[name], []))[2]
                    key_targets.append((spec.global_offset, target.view(sizes)))
            read_chunks(dist_dir, {key: ChunkTargets(*value) for key, value in targets.items()})
            targets.clear()
            for row, layer, name in batch:
                for hf_name, tensor in zip(row.hf_names(layer), row.to_hf([params.pop(name)], shape)):
                    emit(hf_name, tensor)
                    total_bytes += tensor.numel() * tensor.element_size()
            bar.set_postfix_str(_group(batch[0][1], batch[0][0]))
            bar.update(1)
    if writers or any(remaining.values()):
        raise ConversionError(f"internal error: unfinished files {sorted(writers)}")

    if len(shards) > 1:
        index = {
            "metadata": {"total_size": sum(tensor_nbytes(d, s) for _, d, s in entries)},
            "weight_map": {name: file_of[name] for name, _, _ in entries},
        }
        (output / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    copied = copy_hf_side_files(side_dir, output)
    notes = [f"from {checkpoint} (step {json.loads((checkpoint / 'metadata.json').read_text()).get('step')})",
             f"copied HF files: {', '.join(copied)}"]  # fmt: skip
    return ConversionReport(output, len(entries), total_bytes, 0.0, [], notes)
