"""HF config -> Megatron GPTModel, the HF<->Megatron mapping tables, weight loading and export.

Importing this package does not import Megatron-Core; the functions that need it import it when
called (after `distributed.init_distributed` has enabled the CPU compatibility layer if needed).
"""

from megatron_dapo.model.arch_tables import mapping_for
from megatron_dapo.model.hf_config import HFModelConfig, UnsupportedModelError, read_hf_config
from megatron_dapo.model.mapping import Map, MappingTable, ModelShape, padded_vocab_size

__all__ = [
    "HFModelConfig",
    "Map",
    "MappingTable",
    "ModelShape",
    "UnsupportedModelError",
    "mapping_for",
    "padded_vocab_size",
    "read_hf_config",
]
