"""rollout/engines/sglang/cpu_compat.py: each kernel stand-in against a reference written from the kernel's
documented semantics (SGLang's C++ CPU kernels and their Triton twins: one request's run of slots
after another; gather every source row before any target row is written), and the activation
rules: never over a real package, never off the CPU, children only through the marker.

Pure torch, no SGLang needed; the real engine runs with these stand-ins in test_sglang_engine.py.
"""

from __future__ import annotations

import os
import subprocess
import sys
import types

import pytest
import torch

from megatron_dapo.rollout.engines.process_state import temporary_environment
from megatron_dapo.rollout.engines.sglang import cpu_compat as compat


def _reference_assign(req_pool_indices, req_to_token, start_offset, end_offset, out_cache_loc):
    offset = 0
    for i in range(req_pool_indices.numel()):
        start, end = int(start_offset[i]), int(end_offset[i])
        req_to_token[int(req_pool_indices[i]), start:end] = out_cache_loc[offset : offset + end - start].to(torch.int32)
        offset += end - start


@pytest.mark.parametrize("offset_dtype", [torch.int32, torch.int64])
def test_assign_req_to_token_pool_equals_the_reference(offset_dtype):
    generator = torch.Generator().manual_seed(0)
    for trial in range(20):
        num_reqs, pool_len = 6, 40
        batch = int(torch.randint(1, num_reqs + 1, (1,), generator=generator))
        rows = torch.randperm(num_reqs, generator=generator)[:batch].to(torch.int64 if trial % 2 else torch.int32)
        starts = torch.randint(0, pool_len // 2, (batch,), generator=generator)
        lengths = torch.randint(0, pool_len // 2, (batch,), generator=generator)  # empty runs included
        ends = starts + lengths
        slots = torch.randperm(10_000, generator=generator)[: int(lengths.sum())].to(torch.int64)
        before = torch.randint(-5, 5, (num_reqs, pool_len), generator=generator, dtype=torch.int32)
        mine, reference = before.clone(), before.clone()
        compat.assign_req_to_token_pool_cpu(rows, mine, starts.to(offset_dtype), ends.to(offset_dtype), slots, pool_len)
        _reference_assign(rows, reference, starts, ends, slots)
        assert torch.equal(mine, reference)


def test_assign_req_to_token_pool_checks_dtypes_like_the_kernel():
    table = torch.zeros(2, 8, dtype=torch.int32)
    one = torch.tensor([0])
    with pytest.raises(RuntimeError, match="int32"):
        compat.assign_req_to_token_pool_cpu(one, table.long(), one, one + 2, torch.arange(2), 8)
    with pytest.raises(RuntimeError, match="int64"):
        compat.assign_req_to_token_pool_cpu(one, table, one, one + 2, torch.arange(2, dtype=torch.int32), 8)


def test_copy_all_layer_kv_cache_equals_the_reference_with_overlapping_slots():
    generator = torch.Generator().manual_seed(1)
    buffers = [torch.randn(12, 3, 4, generator=generator), torch.randn(12, 2, 8, generator=generator).to(torch.bfloat16)]
    expected = [buffer.clone() for buffer in buffers]
    # Overlapping and chained moves: 2 -> 5 while 5 -> 7 (the old row 5 must land in 7).
    sources = torch.tensor([2, 5, 9, 0])
    targets = torch.tensor([5, 7, 2, 11])
    for buffer in expected:
        buffer[targets] = buffer[sources].clone()
    data_ptrs = torch.tensor([b.data_ptr() for b in buffers], dtype=torch.uint64)
    strides = torch.tensor([b[0].numel() * b.element_size() for b in buffers], dtype=torch.int64)
    compat.copy_all_layer_kv_cache_cpu(data_ptrs, strides, targets, sources)
    for got, want in zip(buffers, expected):
        assert torch.equal(got, want)
    compat.copy_all_layer_kv_cache_cpu(data_ptrs, strides, targets[:0], sources[:0])  # nothing to move
    with pytest.raises(RuntimeError, match="uint64"):
        compat.copy_all_layer_kv_cache_cpu(data_ptrs.long(), strides, targets, sources)


def test_speculative_kernels_fail_by_name():
    module = compat._kernel_module()
    with pytest.raises(NotImplementedError, match="speculative decoding"):
        module.verify_tree_greedy_cpu()
    assert not hasattr(module, "rmsnorm_cpu")  # SGLang's own ImportError fallbacks stay in charge


def test_install_never_shadows_a_real_package(monkeypatch):
    real = types.ModuleType("sgl_kernel")
    monkeypatch.setitem(sys.modules, "sgl_kernel", real)
    monkeypatch.setattr(sys, "meta_path", list(sys.meta_path))
    assert not compat.needed("cpu")
    installed = compat.install()
    assert "sgl_kernel" not in installed and sys.modules["sgl_kernel"] is real
    assert not compat.needed("cuda") and not compat.needed(torch.device("cuda", 0))


def test_install_serves_torchvision_placeholders_only_when_it_is_absent(monkeypatch):
    # Without the placeholder an earlier engine start of this session installed (restored afterwards).
    finders = (compat._PlaceholderFinder, compat._AfterImportFinder)
    monkeypatch.setattr(sys, "meta_path", [f for f in sys.meta_path if not isinstance(f, finders)])
    for name in [n for n in sys.modules if n == "torchvision" or n.startswith("torchvision.") or n == "sgl_kernel"]:
        monkeypatch.delitem(sys.modules, name)
    # As if SGLang's host pool were not imported yet (an earlier in-process SGLang test may have).
    for name in compat.AFTER_IMPORT_PATCHES:
        monkeypatch.delitem(sys.modules, name, raising=False)
    if compat._importable("torchvision"):
        pytest.skip("a real torchvision is installed here")
    monkeypatch.setitem(sys.modules, "sgl_kernel", None)  # restored (removed) afterwards
    monkeypatch.delitem(sys.modules, "sgl_kernel")
    installed = compat.install()
    try:
        assert installed == ["host_pool_allocator", "pynccl_cpu_groups", "sgl_kernel", "torchvision"]
        from transformers.utils import import_utils

        assert import_utils.is_torchvision_available() is False  # transformers still sees none
        from torchvision.transforms import InterpolationMode  # what SGLang's configs import

        with pytest.raises(ImportError, match="needs torchvision"):
            InterpolationMode.BICUBIC()
        assert compat.install() == []  # once is enough
    finally:
        for name in [n for n in sys.modules if n == "torchvision" or n.startswith("torchvision.") or n == "sgl_kernel"]:
            del sys.modules[name]


def test_install_patches_an_already_imported_host_pool_once(monkeypatch):
    finders = (compat._PlaceholderFinder, compat._AfterImportFinder)
    monkeypatch.setattr(sys, "meta_path", [f for f in sys.meta_path if not isinstance(f, finders)])
    host_pool = types.ModuleType(compat.HOST_POOL_MODULE)
    host_pool.ALLOC_MEMORY_FUNCS = {"cuda": object()}
    monkeypatch.setitem(sys.modules, compat.HOST_POOL_MODULE, host_pool)
    assert "host_pool_allocator" in compat.install()
    assert host_pool.ALLOC_MEMORY_FUNCS["cpu"] is compat.alloc_host_buffer_cpu
    assert not any(isinstance(f, compat._AfterImportFinder) and f.module_name == compat.HOST_POOL_MODULE
                   for f in sys.meta_path)  # patched in place  # fmt: skip
    assert "host_pool_allocator" not in compat.install()  # once is enough, also when it was already loaded


def _child(env: dict, code: str) -> str:
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "Error in sitecustomize" not in result.stderr, result.stderr[-2000:]
    return result.stdout.strip()


def test_children_install_the_stand_ins_only_with_the_marker(tmp_path):
    probe = "import sys; print('sgl_kernel' in sys.modules, any('megatron_dapo_sglang' in p for p in sys.path))"
    base = {k: v for k, v in os.environ.items() if k not in (compat.MARKER_ENV, compat.CPU_ENGINE_ENV)}
    directory = compat.make_site_dir()
    try:
        with temporary_environment(compat.child_environment(directory)):
            assert os.environ[compat.MARKER_ENV] == "1" and os.environ["PYTHONPATH"].startswith(str(directory))
            inside = dict(os.environ)
        assert compat.MARKER_ENV not in os.environ and str(directory) not in os.environ.get("PYTHONPATH", "")
        # SGLang's CPU engine children: the stand-ins are there, the directory is off sys.path again.
        assert _child({**inside, compat.CPU_ENGINE_ENV: "1"}, probe) == "True False"
        # Without SGLang's CPU switch, or without the marker, nothing happens.
        assert _child({**inside, compat.CPU_ENGINE_ENV: "0"}, probe) == "False False"
        no_marker = {**base, "PYTHONPATH": inside["PYTHONPATH"], compat.CPU_ENGINE_ENV: "1"}
        assert _child(no_marker, probe) == "False False"
        # A sitecustomize it shadows still runs.
        other = tmp_path / "other"
        other.mkdir()
        (other / "sitecustomize.py").write_text("print('other sitecustomize')\n")
        chained = {**inside, compat.CPU_ENGINE_ENV: "1", "PYTHONPATH": f"{inside['PYTHONPATH']}{os.pathsep}{other}"}
        assert _child(chained, probe).splitlines() == ["other sitecustomize", "True False"]
    finally:
        compat.remove_site_dir(directory)
    assert not directory.exists()


def test_cpu_groups_get_no_nccl_communicator(monkeypatch):
    """With an NCCL library present (PyPI's CUDA torch), SGLang would build a CPU group's NCCL
    communicator on a CUDA device; patched, the CPU group's communicator is disabled as where no
    library loads, and a CUDA group still reaches SGLang's own constructor."""
    calls = []

    class PyNcclCommunicator:
        def __init__(self, group, device, library_path=None):
            calls.append(device)

    module = types.ModuleType(compat.PYNCCL_MODULE)
    module.PyNcclCommunicator = PyNcclCommunicator
    monkeypatch.setattr(torch.distributed, "get_rank", lambda group=None: 1)
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda group=None: 2)
    compat._patch_pynccl(module)
    compat._patch_pynccl(module)  # once
    communicator = PyNcclCommunicator("group", torch.device("cpu"))
    assert communicator.disabled and not communicator.available and communicator.world_size == 2
    assert calls == []
    PyNcclCommunicator("group", 0)  # an int is a CUDA index
    assert calls == [0] and compat._pynccl_is_patched(module)
