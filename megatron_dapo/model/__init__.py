"""HF config -> Megatron GPTModel, the HF<->Megatron mapping tables, weight loading and export.

Importing this package imports nothing: the names below load their module on first use. Reading a
model's config.json (`model.hf_config`, which `config.load_config` checks) must not pay for torch,
which the mapping tables need; Megatron-Core loads only in the functions that build a model (after
`distributed.init_distributed` has enabled the CPU compatibility layer if needed).
"""

import importlib

_HOMES = {
    "mapping_for": "arch_tables",
    "HFModelConfig": "hf_config",
    "UnsupportedModelError": "hf_config",
    "read_hf_config": "hf_config",
    "Map": "mapping",
    "MappingTable": "mapping",
    "ModelShape": "mapping",
    "padded_vocab_size": "mapping",
}

__all__ = sorted(_HOMES)


def __getattr__(name: str):
    if name in _HOMES:
        return getattr(importlib.import_module(f"{__name__}.{_HOMES[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
