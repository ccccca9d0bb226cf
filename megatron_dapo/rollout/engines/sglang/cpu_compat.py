"""SGLang's CPU engine without SGLang's CPU kernel package: the few stand-ins it needs, nothing else.

    if sglang_cpu_compat.needed(device):           # CPU, and no real `sgl_kernel` installed
        sglang_cpu_compat.install()                # this process, before `import sglang`
        site_dir = sglang_cpu_compat.make_site_dir()
        with temporary_environment(sglang_cpu_compat.child_environment(site_dir)):
            engine = sglang.Engine(...)            # its scheduler processes install them as they start

SGLang 0.5.23 runs on CPU with `SGLANG_USE_CPU_ENGINE=1`, but two things stop it here:

* Its CPU path imports two kernels of its kernel package (`sgl_kernel`) at module level, and no CPU
  build of that package exists on the package index (sglang-kernel ships CUDA builds only):
  `assign_req_to_token_pool_cpu` (`srt/mem_cache/allocation.py`, on every decode step) and
  `copy_all_layer_kv_cache_cpu` (`kernels/ops/kvcache/cache_move.py`, KV moves of speculative
  decoding). `install` provides a `sgl_kernel` module with pure-torch versions of both, computing
  what the C++ kernels compute (tests/rollout/engines/test_sglang_cpu_compat.py checks them against a
  reference). The speculative-decoding kernels imported beside them exist only as functions that
  raise: speculative decoding is not supported by this layer. Any other name is missing, so
  SGLang's own `try: from sgl_kernel import ... except ImportError` fallbacks keep working.
* `sglang.srt.configs` imports torchvision at module level (image processors of OCR / VL models),
  and the only torchvision build on the index for this torch is a CUDA build that does not import.
  `install` serves `torchvision` (and its submodules) as placeholders whose attributes fail with
  ImportError when used. transformers decides whether torchvision exists with `find_spec` and
  caches the answer: it is asked first, so it keeps answering "absent".

* Its routed-experts capturer (rollout routing replay: `enable_return_routed_experts`) allocates its
  host buffer through `mem_cache/pool_host/common.py`'s `ALLOC_MEMORY_FUNCS`, whose default registers
  the memory with CUDA (`cudaHostRegister`), which a CPU-only torch cannot do. `install` adds a "cpu"
  entry there that allocates the same buffer unregistered (nothing on CPU needs pinned memory), as
  soon as SGLang imports that module (`_AfterImportFinder`).
* SGLang gives a process group an NCCL communicator whenever an NCCL library loads, also for CPU
  groups: with PyPI's CUDA build of torch (it brings the library; Python 3.12 has no CPU-only torch
  on PyPI) a TP>1 CPU engine asked for a CUDA device and failed. `install` disables the
  communicator of CPU groups, the state SGLang gives them where no library is found.

The first two are not installed where the real package is importable (never shadowed), nor on CUDA (the
adapter calls `needed(device)`, which is False off the CPU); the finder sits last on
`sys.meta_path`.

SGLang starts its schedulers with multiprocessing's spawn, and a fresh interpreter imports the
scheduler module (and with it the kernels) while unpickling the process object, before any hook
SGLang offers (its plugin entry points load later). So `make_site_dir` writes a one-file
`sitecustomize` directory, and `child_environment` puts it first on PYTHONPATH, with a marker
variable, for the engine to set only while it starts; the children run `install` as their
interpreter starts (then hand over to any other `sitecustomize` on the path). The variables are
restored as soon as the engine is up, the directory is removed with the engine, and a process that sees the directory without the marker and
SGLANG_USE_CPU_ENGINE=1 does nothing. This module imports nothing of megatron_dapo: the children
load it by file path.
"""

from __future__ import annotations

import ctypes
import importlib.abc
import importlib.machinery
import importlib.util
import os
import shutil
import sys
import tempfile
import types
from pathlib import Path

import torch

MARKER_ENV = "MEGATRON_DAPO_SGLANG_CPU_COMPAT"
"""Set (to 1) only in the environment SGLang's processes are started with."""

CPU_ENGINE_ENV = "SGLANG_USE_CPU_ENGINE"
"""SGLang's own switch to its CPU engine (read at import and at run time, so it stays set)."""

KERNEL_MODULE = "sgl_kernel"
UNSUPPORTED_KERNELS = (
    # kernels/ops/speculative/*: imported at module level on CPU, called only by speculative decoding
    "assign_draft_cache_locs_contiguous_cpu",
    "assign_extend_cache_locs_cpu",
    "build_draft_decode_metadata_cpu",
    "build_tree_kernel_efficient_cpu",
    "fill_accept_out_cache_loc_cpu",
    "fill_bonus_tokens_cpu",
    "rotate_input_ids_cpu",
    "verify_tree_greedy_cpu",
)


def _importable(name: str) -> bool:
    """Whether `name` would import from the installed packages (not counting our own stand-ins)."""
    module = sys.modules.get(name)
    if module is not None:
        return not getattr(module, "__megatron_dapo_standin__", False)
    for finder in sys.meta_path:
        if isinstance(finder, _PlaceholderFinder):
            continue
        find_spec = getattr(finder, "find_spec", None)
        if find_spec is not None and find_spec(name, None) is not None:
            return True
    return False


def needed(device: torch.device | str) -> bool:
    """True on CPU when SGLang's kernel package is not installed (the only case the stand-ins are for)."""
    return torch.device(device).type == "cpu" and not _importable(KERNEL_MODULE)


# ---- the kernels ------------------------------------------------------------------------------


def assign_req_to_token_pool_cpu(
    req_pool_indices: torch.Tensor,
    req_to_token: torch.Tensor,
    start_offset: torch.Tensor,
    end_offset: torch.Tensor,
    out_cache_loc: torch.Tensor,
    pool_len: int,
) -> None:
    """req_to_token[req_pool_indices[i], start_offset[i]:end_offset[i]] = the i-th run of out_cache_loc.

    The runs are consecutive: request i takes the next end_offset[i] - start_offset[i] slots.
    Same argument checks as the kernel: int32 map, int64 slots, equal offset dtypes.
    """
    if req_to_token.dim() != 2 or req_to_token.dtype != torch.int32 or req_to_token.shape[1] != pool_len:
        raise RuntimeError(f"req_to_token must be int32 [max_reqs, {pool_len}], got {req_to_token.dtype} {tuple(req_to_token.shape)}")
    if out_cache_loc.dtype != torch.int64 or start_offset.dtype != end_offset.dtype:
        raise RuntimeError("out_cache_loc must be int64 and start_offset / end_offset of one dtype")
    starts, ends = start_offset.long(), end_offset.long()
    lengths = ends - starts
    total = int(lengths.sum())
    if total == 0:
        return
    rows = req_pool_indices.long().repeat_interleave(lengths)
    run_first = torch.cumsum(lengths, 0) - lengths  # where each request's run begins in out_cache_loc
    columns = starts.repeat_interleave(lengths) + torch.arange(total) - run_first.repeat_interleave(lengths)
    req_to_token[rows, columns] = out_cache_loc[:total].to(torch.int32)


def copy_all_layer_kv_cache_cpu(
    data_ptrs: torch.Tensor, strides: torch.Tensor, tgt_loc: torch.Tensor, src_loc: torch.Tensor
) -> None:
    """For every K/V buffer b (base address data_ptrs[b], strides[b] bytes per slot row):
    buf_b[tgt_loc[i]] = buf_b[src_loc[i]], all sources read before any target is written."""
    if data_ptrs.dtype != torch.uint64 or strides.dtype != torch.int64 or tgt_loc.dtype != src_loc.dtype:
        raise RuntimeError("data_ptrs must be uint64, strides int64, tgt_loc / src_loc of one dtype")
    if tgt_loc.numel() != src_loc.numel():
        raise RuntimeError(f"tgt_loc has {tgt_loc.numel()} slots, src_loc {src_loc.numel()}")
    if tgt_loc.numel() == 0:
        return
    targets, sources = tgt_loc.long(), src_loc.long()
    rows_needed = int(torch.maximum(targets.max(), sources.max())) + 1
    for address, stride in zip(data_ptrs.tolist(), strides.tolist()):
        memory = (ctypes.c_uint8 * (rows_needed * stride)).from_address(address)
        rows = torch.frombuffer(memory, dtype=torch.uint8).view(rows_needed, stride)
        rows[targets] = rows[sources]  # advanced indexing gathers a copy first


def _unsupported(name: str):
    def kernel(*args, **kwargs):
        raise NotImplementedError(
            f"sgl_kernel.{name}: speculative decoding needs SGLang's CPU kernel package, which "
            "megatron_dapo's CPU layer (rollout/engines/sglang/cpu_compat.py) does not replace"
        )

    kernel.__name__ = name
    return kernel


def _kernel_module() -> types.ModuleType:
    module = types.ModuleType(KERNEL_MODULE, "megatron_dapo's pure-torch stand-ins for SGLang's CPU kernels")
    module.__megatron_dapo_standin__ = True
    module.assign_req_to_token_pool_cpu = assign_req_to_token_pool_cpu
    module.copy_all_layer_kv_cache_cpu = copy_all_layer_kv_cache_cpu
    for name in UNSUPPORTED_KERNELS:
        setattr(module, name, _unsupported(name))
    return module


# ---- torchvision placeholders -----------------------------------------------------------------


class _Unavailable:
    """Stands for any torchvision object: attribute access works (module-level references), use fails."""

    def __init__(self, name: str) -> None:
        self._name = name

    def __getattr__(self, attribute: str) -> "_Unavailable":
        if attribute.startswith("__"):
            raise AttributeError(attribute)
        return _Unavailable(f"{self._name}.{attribute}")

    def __call__(self, *args, **kwargs):
        raise ImportError(f"{self._name} needs torchvision, which is not installed (SGLang's image processors use it)")


class _PlaceholderModule(types.ModuleType):
    __megatron_dapo_standin__ = True

    def __getattr__(self, attribute: str) -> _Unavailable:
        if attribute.startswith("__"):
            raise AttributeError(attribute)
        return _Unavailable(f"{self.__name__}.{attribute}")


class _PlaceholderFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Serves `torchvision` and `torchvision.*` as placeholder packages (last on sys.meta_path)."""

    def find_spec(self, name, path=None, target=None):
        if name == "torchvision" or name.startswith("torchvision."):
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec):
        return _PlaceholderModule(spec.name)

    def exec_module(self, module) -> None:
        module.__path__ = []


HOST_POOL_MODULE = "sglang.srt.mem_cache.pool_host.common"
PYNCCL_MODULE = "sglang.srt.distributed.device_communicators.pynccl"


def alloc_host_buffer_cpu(dims, dtype, device, pin_memory, allocator, registration_granularity_bytes=None):
    """SGLang's host-buffer allocation (`alloc_with_host_register`) without the CUDA registration."""
    return allocator.allocate(dims, dtype=dtype, device=device)


def _patch_host_pool(module: types.ModuleType) -> None:
    functions = getattr(module, "ALLOC_MEMORY_FUNCS", None)
    if functions is not None:
        functions["cpu"] = alloc_host_buffer_cpu


def _host_pool_is_patched(module: types.ModuleType) -> bool:
    functions = getattr(module, "ALLOC_MEMORY_FUNCS", None)
    return functions is not None and functions.get("cpu") is alloc_host_buffer_cpu


def _patch_pynccl(module: types.ModuleType) -> None:
    """A CPU group gets no NCCL communicator, as when no NCCL library is found. SGLang decides by
    whether the library loads, and PyPI's CUDA build of torch (Python 3.12 on a CPU machine) brings
    one: SGLang then asks for the CPU group's CUDA device and the TP>1 engine fails to start."""
    communicator = getattr(module, "PyNcclCommunicator", None)
    if communicator is None or getattr(communicator.__init__, "_cpu_compat", False):
        return
    original = communicator.__init__

    def __init__(self, group, device, *args, **kwargs):
        if torch.device(f"cuda:{device}" if isinstance(device, int) else device).type == "cpu":
            self.group, self.available, self.disabled = group, False, True
            self.rank, self.world_size = torch.distributed.get_rank(group), torch.distributed.get_world_size(group)
            return
        original(self, group, device, *args, **kwargs)

    __init__._cpu_compat = True
    communicator.__init__ = __init__


def _pynccl_is_patched(module: types.ModuleType) -> bool:
    return getattr(getattr(getattr(module, "PyNcclCommunicator", None), "__init__", None), "_cpu_compat", False)


AFTER_IMPORT_PATCHES = {
    # module: (name in install()'s list, patch, "is it patched?")
    HOST_POOL_MODULE: ("host_pool_allocator", _patch_host_pool, _host_pool_is_patched),
    PYNCCL_MODULE: ("pynccl_cpu_groups", _patch_pynccl, _pynccl_is_patched),
}
"""SGLang modules patched as soon as they are imported (see the module docstring)."""


def _patched_or_pending(module_name: str) -> bool:
    """True once `install` has patched `module_name`, or will when it is imported."""
    if any(isinstance(f, _AfterImportFinder) and f.module_name == module_name for f in sys.meta_path):
        return True
    loaded = sys.modules.get(module_name)
    return loaded is not None and AFTER_IMPORT_PATCHES[module_name][2](loaded)


class _AfterImportFinder(importlib.abc.MetaPathFinder):
    """Runs a module's patch of AFTER_IMPORT_PATCHES right after it is imported (first on sys.meta_path)."""

    def __init__(self, module_name: str = HOST_POOL_MODULE):
        self.module_name = module_name

    def find_spec(self, name, path=None, target=None):
        if name != self.module_name:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return spec
        execute = spec.loader.exec_module
        patch = AFTER_IMPORT_PATCHES[name][1]

        def exec_module(module) -> None:
            execute(module)
            patch(module)

        spec.loader.exec_module = exec_module
        return spec


def install() -> list[str]:
    """Put the stand-ins in place in this process where the real package is missing; returns what was installed."""
    installed = []
    for module_name, (label, patch, _) in AFTER_IMPORT_PATCHES.items():
        if _patched_or_pending(module_name):
            continue
        loaded = sys.modules.get(module_name)
        if loaded is not None:
            patch(loaded)
        else:
            sys.meta_path.insert(0, _AfterImportFinder(module_name))
        installed.append(label)
    if sys.modules.get(KERNEL_MODULE) is None and not _importable(KERNEL_MODULE):
        sys.modules[KERNEL_MODULE] = _kernel_module()
        installed.append(KERNEL_MODULE)
    if not _importable("torchvision") and not any(isinstance(f, _PlaceholderFinder) for f in sys.meta_path):
        try:  # transformers caches "is torchvision there?": let it answer before the placeholder exists
            from transformers.utils import import_utils

            import_utils.is_torchvision_available()
            import_utils.is_torchvision_v2_available()
        except ImportError:
            pass
        sys.meta_path.append(_PlaceholderFinder())
        installed.append("torchvision")
    return installed


# ---- SGLang's spawned processes ---------------------------------------------------------------

_SITECUSTOMIZE = '''\
# Written by megatron_dapo/rollout/engines/sglang/cpu_compat.py for one SGLang engine's processes.
import importlib.machinery as _machinery, importlib.util as _util, os as _os, sys as _sys

_here = _os.path.dirname(_os.path.abspath(__file__))
if _os.environ.get({marker!r}) == "1" and _os.environ.get({cpu!r}) == "1":
    _spec = _util.spec_from_file_location("_megatron_dapo_sglang_cpu_compat", {source!r})
    _module = _util.module_from_spec(_spec)
    _spec.loader.exec_module(_module)
    _module.install()
# Leave the path as it was, and run the sitecustomize this one shadows, if any.
_sys.path[:] = [p for p in _sys.path if _os.path.abspath(p or ".") != _here]
_next = _machinery.PathFinder.find_spec("sitecustomize", _sys.path)
if _next is not None and _next.loader is not None:
    _next.loader.exec_module(_util.module_from_spec(_next))
'''


def child_environment(directory: str | os.PathLike) -> dict[str, str]:
    """The variables under which processes started from here install the stand-ins as they start.

    `directory` (made by `make_site_dir`) first on this process's PYTHONPATH, and the marker variable.
    Set them only while the engine starts (`process_state.temporary_environment`).
    """
    path = os.pathsep.join(p for p in (str(directory), os.environ.get("PYTHONPATH")) if p)
    return {"PYTHONPATH": path, MARKER_ENV: "1"}


def make_site_dir() -> Path:
    """A new directory holding the `sitecustomize.py` of `child_environment` (remove with `remove_site_dir`)."""
    directory = Path(tempfile.mkdtemp(prefix="megatron_dapo_sglang_cpu_"))
    source = str(Path(__file__).resolve())
    (directory / "sitecustomize.py").write_text(_SITECUSTOMIZE.format(marker=MARKER_ENV, cpu=CPU_ENGINE_ENV, source=source))
    return directory


def remove_site_dir(directory: str | os.PathLike | None) -> None:
    if directory is not None:
        shutil.rmtree(directory, ignore_errors=True)
