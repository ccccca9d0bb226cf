"""The optional GPU kernels: Transformer Engine choice, overlap_grad_reduce, gradient_accumulation_fusion.

* The decisions are pure functions of (device, what imports, what is asked): every case on the CPU.
* Megatron-Core's side (installed here, 0.16.1) is read from its source and dataclasses: the field
  and hook names we set, and why apex (not TE) gates gradient_accumulation_fusion.
* A CPU start (the CLI's warning filters, process groups, actor and reference built) prints the two
  start-up lines once each and none of Megatron-Core's TE / apex UserWarnings; without the filters
  the same start does print them (so the check can fail).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import subprocess
import sys
import re
import textwrap
from pathlib import Path

import pytest
import torch

from megatron_dapo.config import ConfigError
from megatron_dapo.model import gpu_kernels as gk

REPO = Path(__file__).resolve().parents[2]
TE_OK = gk.KernelStatus(True, "Transformer Engine 2.8.0")
TE_BROKEN = gk.KernelStatus(False, "import transformer_engine.pytorch failed: OSError: libcudnn.so.9: cannot open shared object file")
NO_CUDA = gk.KernelStatus(False, "no CUDA device; Transformer Engine has no CPU kernels")


def _megatron_source(relative: str) -> str:
    root = Path(importlib.util.find_spec("megatron.core").origin).parent
    return (root / relative).read_text()


# ---------------------------------------------------------------------------------------------
# Transformer Engine
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "mode, status, expected",
    [("off", TE_OK, False), ("off", TE_BROKEN, False), ("auto", TE_OK, True), ("auto", TE_BROKEN, False),
     ("auto", NO_CUDA, False), ("on", TE_OK, True)],
)  # fmt: skip
def test_transformer_engine_choice(mode, status, expected):
    assert gk.resolve_transformer_engine(mode, status) is expected


@pytest.mark.parametrize("status", [TE_BROKEN, NO_CUDA])
def test_transformer_engine_on_without_it_names_the_key_and_the_import_error(status):
    with pytest.raises(gk.TransformerEngineUnavailable) as error:
        gk.resolve_transformer_engine("on", status)
    message = str(error.value)
    assert "'model.transformer_engine'=on" in message and status.detail in message
    assert "model.transformer_engine=auto" in message  # the way out
    assert isinstance(error.value, ConfigError)  # the CLI prints it as one line, no traceback
    with pytest.raises(ConfigError, match="auto, on or off"):
        gk.resolve_transformer_engine("maybe", TE_OK)


def test_layer_choice_line_says_what_and_why():
    assert gk.describe_layer_choice("on", TE_OK, True).startswith("layers: Transformer Engine 2.8.0 (")
    broken = gk.describe_layer_choice("auto", TE_BROKEN, False, "cuda")
    assert "Megatron local spec" in broken and TE_BROKEN.detail in broken
    assert "megatron-dapo plan" in broken and "model.transformer_engine=on" in broken  # a GPU run: the cost and the fix
    cpu = gk.describe_layer_choice("auto", NO_CUDA, False, "cpu")
    assert NO_CUDA.detail in cpu and "megatron-dapo plan" not in cpu
    assert gk.describe_layer_choice("off", TE_OK, False, "cuda").endswith("model.transformer_engine=off)")


def test_probes_on_this_machine():
    gk.transformer_engine_status.cache_clear()
    gk.apex_fused_wgrad_status.cache_clear()
    te, apex = gk.transformer_engine_status(), gk.apex_fused_wgrad_status()
    if not torch.cuda.is_available():
        assert te == NO_CUDA and not apex.available
        from megatron_dapo.model import builder

        assert builder.resolve_transformer_engine("off") is False
        assert builder.resolve_transformer_engine("auto") is False
        with pytest.raises(gk.TransformerEngineUnavailable, match="no CUDA device"):
            builder.resolve_transformer_engine("on")
    else:  # a GPU machine: whatever it has, the detail says it (a version or the import error)
        assert te.detail and apex.detail


# ---------------------------------------------------------------------------------------------
# overlap_grad_reduce and gradient_accumulation_fusion
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "device, te, apex, overlap, fusion",
    [
        ("cpu", False, False, False, False),
        ("cpu", True, True, False, False),  # kernels are CUDA kernels
        ("cuda", False, False, True, False),
        ("cuda", True, False, True, False),  # TE alone: Megatron's output layer still needs apex (below)
        ("cuda", False, True, True, True),
        ("cuda", True, True, True, True),
    ],
)
def test_gradient_options_decided_from_device_and_kernels(device, te, apex, overlap, fusion):
    options = gk.gradient_options(device, te, apex)
    assert (options.overlap_grad_reduce, options.gradient_accumulation_fusion) == (overlap, fusion)
    assert f"overlap_grad_reduce {'on' if overlap else 'off'}" in options.describe()


def test_gradient_options_forced():
    assert gk.gradient_options("cpu", False, False, overlap_grad_reduce=True).overlap_grad_reduce  # gloo can
    assert not gk.gradient_options("cuda", True, True, overlap_grad_reduce=False).overlap_grad_reduce
    assert not gk.gradient_options("cuda", True, True, gradient_accumulation_fusion=False).gradient_accumulation_fusion
    for device, apex in (("cpu", True), ("cuda", False)):
        with pytest.raises(ConfigError, match="fused_weight_gradient_mlp_cuda"):
            gk.gradient_options(device, True, apex, gradient_accumulation_fusion=True)


def test_megatron_ddp_and_model_config_fields_we_set():
    """Contract with megatron-core: the DDP config fields, the schedule hooks and the model flags."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.transformer.transformer_config import TransformerConfig

    ddp_fields = {f.name for f in dataclasses.fields(DistributedDataParallelConfig)}
    assert {"grad_reduce_in_fp32", "overlap_grad_reduce", "use_distributed_optimizer", "average_in_collective"} <= ddp_fields
    model_fields = {f.name for f in dataclasses.fields(TransformerConfig)}
    assert {"gradient_accumulation_fusion", "no_sync_func", "grad_sync_func", "cuda_graph_scope"} <= model_fields
    for hook in ("no_sync", "start_grad_sync", "finish_grad_sync"):
        assert callable(getattr(DistributedDataParallel, hook, None)), hook
    schedules = _megatron_source("pipeline_parallel/schedules.py")
    assert "config.no_sync_func" in schedules and "config.grad_sync_func" in schedules
    assert "finish_grad_sync(" in _megatron_source("distributed/finalize_model_grads.py")


def test_gradient_accumulation_fusion_needs_apex_even_with_transformer_engine():
    """Why `gradient_options` asks for apex: megatron-core's ColumnParallelLinear refuses the flag without
    apex's extension, and GPTModel's output layer is that class under the TE spec too; TE's own layers
    take the flag as fuse_wgrad_accumulation."""
    layers = _megatron_source("tensor_parallel/layers.py")
    assert f"import {gk.APEX_FUSED_WGRAD_MODULE}" in layers
    assert "if config.gradient_accumulation_fusion and not _grad_accum_fusion_available:" in layers
    gpt_model = _megatron_source("models/gpt/gpt_model.py")
    # 0.16-0.18 build the output layer as that class; 0.19 too, unless an MXFP8 output projection picks
    # TE's LM head (a recipe this package never turns on).
    assert "self.output_layer = tensor_parallel.ColumnParallelLinear(" in gpt_model or re.search(
        r"output_layer_cls = \(\s*TELMHeadColumnParallelLinear\s*if is_mxfp8_output_proj_active\(config\)\s*"
        r"else tensor_parallel\.ColumnParallelLinear\s*\)\s*self\.output_layer = output_layer_cls\(", gpt_model)
    assert "fuse_wgrad_accumulation=self.config.gradient_accumulation_fusion" in _megatron_source(
        "extensions/transformer_engine.py"
    )
    from megatron.core.tensor_parallel import layers as megatron_layers

    gk.apex_fused_wgrad_status.cache_clear()
    assert megatron_layers._grad_accum_fusion_available == (importlib.util.find_spec(gk.APEX_FUSED_WGRAD_MODULE) is not None)


# ---------------------------------------------------------------------------------------------
# A CPU start: two start-up lines, no TE / apex warnings
# ---------------------------------------------------------------------------------------------

_START = textwrap.dedent(
    """
    import sys
    if sys.argv[1] == "cli":
        from megatron_dapo.cli.main import _quiet_known_warnings
        _quiet_known_warnings()
    import torch
    from megatron_dapo.actor.policy import build_actor, build_reference
    from megatron_dapo.config import load_config
    from megatron_dapo.distributed import ParallelLayout, init_distributed, teardown
    from megatron_dapo.model.builder import build_gpt_models
    from megatron_dapo.model.hf_config import read_hf_config
    from tests.support.tiny_models import tiny_config

    layout = ParallelLayout(1, 1)
    init_distributed(layout, timeout_s=120, seed=0)
    hf = read_hf_config(tiny_config("qwen2").to_dict())
    cfg = load_config(None, [])
    actor = build_actor(cfg, build_gpt_models(hf, layout, torch.float32), vocab_size=hf.vocab_size)
    reference = build_reference(cfg, build_gpt_models(hf, layout, torch.float32), vocab_size=hf.vocab_size)
    teardown()
    print("started")
    """
)


def _start(mode: str) -> str:
    env = {**os.environ, "PYTHONPATH": str(REPO), "MASTER_PORT": "0"}
    env.pop("PYTHONWARNINGS", None)
    from tests.support.torchrun_utils import free_port

    env["MASTER_ADDR"], env["MASTER_PORT"] = "127.0.0.1", str(free_port())
    proc = subprocess.run([sys.executable, "-c", _START, mode], capture_output=True, text=True, timeout=240, env=env, cwd=REPO)
    assert proc.returncode == 0 and "started" in proc.stdout, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout + proc.stderr


@pytest.mark.timeout(300)
@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU start-up")
def test_cpu_start_prints_the_choices_once_and_no_te_apex_warnings():
    from megatron_dapo.cli.main import MISSING_KERNEL_WARNINGS
    from megatron_dapo.compat.megatron_core import QUIET_NOTICES

    quiet = _start("cli")
    assert quiet.count("[megatron-dapo] layers: Megatron local spec") == 1  # actor and reference: one line
    assert "Transformer Engine not available: no CUDA device" in quiet
    assert quiet.count("[megatron-dapo] gradients: overlap_grad_reduce off, gradient_accumulation_fusion off") == 1
    assert "UserWarning" not in quiet, quiet
    assert "full scope is deprecated" not in quiet  # fixed at the source: cuda_graph_scope=[]
    assert not [p for _, p in QUIET_NOTICES if re.search(p, quiet)], quiet  # the releases' notices we silence

    loud = _start("plain")  # the same start without the CLI's filters: megatron-core does warn
    warned = [line for line in loud.splitlines() if "UserWarning" in line]
    assert len(warned) >= 5, loud
    known = [*MISSING_KERNEL_WARNINGS, *(p for source, p in QUIET_NOTICES if source == "warnings")]
    assert all(any(re.search(m, line) for m in known) for line in warned), warned
