"""Core attention for Megatron's local layer spec on `torch.nn.functional.scaled_dot_product_attention`.

Megatron-Core's own `DotProductAttention` (the local spec's core attention) is unfused: a baddbmm
into a [b, heads, s, s] score buffer, a float32 masked softmax, dropout, a bmm, and the backward of
each. On an H100 that made the update step of a 0.5B model 1.5-3x slower than HF with SDPA. PyTorch's
SDPA dispatches to fused kernels on a GPU (cuDNN / FlashAttention / memory-efficient: no s x s tensor
at all); on the CPU we pin its math kernel (see `_CPU_BACKENDS`). Same mathematics either way.
Measured (benchmarks/bench_gpu.py, H100, Qwen2.5-0.5B shape, bf16, 8 x 2048 tokens): update step
0.83 s -> 0.46-0.48 s, peak memory 38 -> 25 GiB; core attention alone (b=2, s=2048) 4.3 -> 0.6-0.9 ms
forward + backward.

    SDPADotProductAttention   drop-in `core_attention` (same constructor and forward as Megatron's)
    with_sdpa_core_attention  a copy of a layer spec with only `core_attention` replaced

Semantics follow `DotProductAttention` (megatron-core 0.16.1) exactly where our models reach them:
inputs query [sq, b, np, hn], key/value [sk, b, ng, hn] (np / ng query heads per key/value group,
per tensor-parallel rank), output [sq, b, np * hn]; Megatron's boolean masks are True where
attention is NOT allowed (SDPA's are the opposite); an explicit mask takes precedence over the mask
type, and without one `AttnMaskType.causal` means causal attention (self-attention, sq == sk; a
single query attends to everything, as in KV-cached decoding). The causal case - `attention_mask`
None or the pure causal mask `builder.causal_attention_mask` builds - runs with `is_causal=True`,
the only form the flash kernel accepts. Context parallelism (causal only): keys/values are
all-gathered over the CP group and each local chunk attends its key prefix (`_chunked_causal_sdpa`).
Packed sequences (THD), attention bias,
sliding windows and non-vanilla softmax are refused: Transformer Engine's attention handles those.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import weakref
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn.attention import SDPBackend, sdpa_kernel

from megatron.core import tensor_parallel
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.utils import is_layer_window_attention
import torch.distributed as dist
from megatron.core import parallel_state
from torch.nn.attention.bias import causal_lower_right

from megatron_dapo.distributed.context_parallel import gather_sequence_sum_grads

__all__ = ["SDPADotProductAttention", "is_causal_mask", "with_sdpa_core_attention"]

# `enable_gqa` (grouped keys/values without copying them) exists from torch 2.5 on.
_SDPA_HAS_GQA = tuple(int(part) for part in torch.__version__.split(".")[:2]) >= (2, 5)

# Off the GPU, the math kernel: PyTorch's CPU flash kernel tiles the keys in blocks whose size
# depends on the sequence length, so a token's result changes (~1e-7 in float32) with the padded
# width of its micro-batch. The math kernel computes each row like Megatron's DotProductAttention,
# which keeps forward-only and update log-probs consistent across micro-batch plans (the CPU runs
# tests and tiny demos, where that exactness is checked; its speed is of no concern there).
_CPU_BACKENDS = [SDPBackend.MATH]


def is_causal_mask(mask: Tensor, sq: int, sk: int) -> bool:
    """Whether a Megatron boolean mask (True = masked) is exactly causal for sq == sk queries/keys.

    Any leading (batch, head) shape is accepted as long as every slice is the same upper triangle.
    On a GPU this synchronises once; `SDPADotProductAttention` remembers the answer per mask tensor.
    """
    if mask.dtype != torch.bool or mask.dim() < 2 or tuple(mask.shape[-2:]) != (sq, sk) or sq != sk:
        return False
    causal = torch.ones(sq, sk, dtype=torch.bool, device=mask.device).triu_(1)
    return torch.equal(mask, causal.expand(mask.shape))


class _CausalMaskMemo:
    """Remembers which mask tensors were found to be causal, so that the check runs once per mask.

    Every layer of a forward (and a recomputed forward) receives the same mask object; checking it
    again in each layer would cost one GPU synchronisation per layer. Entries are weak references
    compared by identity, and the tensor's version counter must be unchanged: a freed mask, or one
    modified in place, is checked again.
    """

    def __init__(self, size: int = 8) -> None:
        self.size = size
        self.entries: list[tuple[weakref.ref, int, bool]] = []

    def is_causal(self, mask: Tensor, sq: int, sk: int) -> bool:
        for ref, version, answer in self.entries:
            if ref() is mask and mask._version == version:
                return answer
        answer = is_causal_mask(mask, sq, sk)
        self.entries = [e for e in self.entries if e[0]() is not None][-(self.size - 1) :]
        self.entries.append((weakref.ref(mask), mask._version, answer))
        return answer


_CAUSAL_MEMO = _CausalMaskMemo()


class SDPADotProductAttention(MegatronModule):
    """Megatron `core_attention` computed by `F.scaled_dot_product_attention`.

    The constructor takes what Megatron's `Attention` passes to any core attention (0.16.1: config,
    layer_number, attn_mask_type, attention_type, cp_comm_type, softmax_scale, pg_collection);
    unknown keywords of other versions (e.g. `model_comm_pgs`) are accepted and ignored. The module
    has no parameters or buffers, so checkpoints are interchangeable with `DotProductAttention`.
    """

    def __init__(
        self,
        config: TransformerConfig,
        layer_number: int,
        attn_mask_type: AttnMaskType,
        attention_type: str,
        attention_dropout: Optional[float] = None,
        softmax_scale: Optional[float] = None,
        cp_comm_type: Optional[str] = None,
        pg_collection: Any = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(config=config)
        # Context parallelism: this rank holds chunks r and 2*CP-1-r of every sequence (Megatron's
        # layout); keys/values are all-gathered over the CP group in `_context_parallel_attention`.
        self.cp_size = config.context_parallel_size
        self.cp_group = None
        if self.cp_size > 1:
            if pg_collection is not None and getattr(pg_collection, "cp", None) is not None:
                self.cp_group = pg_collection.cp
            else:
                self.cp_group = parallel_state.get_context_parallel_group()
        if getattr(config, "softmax_type", "vanilla") != "vanilla":
            raise NotImplementedError(
                f"SDPA core attention supports softmax_type='vanilla' only, got {config.softmax_type!r}"
            )
        if is_layer_window_attention(config.window_size, config.window_attn_skip_freq, layer_number):
            raise NotImplementedError(
                "SDPA core attention does not support sliding-window attention (config.window_size)"
            )
        self.layer_number = max(1, layer_number)
        self.attn_mask_type = attn_mask_type
        self.attention_type = attention_type
        self.head_dim = config.kv_channels
        # Megatron's default scale. apply_query_key_layer_scaling divides the scale by the layer
        # number and multiplies the scores back inside the fp32 softmax - an fp16 overflow guard
        # that leaves the result unchanged, and SDPA's kernels keep the softmax in fp32 anyway.
        self.softmax_scale = 1.0 / math.sqrt(self.head_dim) if softmax_scale is None else softmax_scale
        self.dropout_p = config.attention_dropout if attention_dropout is None else attention_dropout
        if pg_collection is not None and getattr(pg_collection, "tp", None) is not None:
            self.tp_group = pg_collection.tp  # MegatronModule.sharded_state_dict looks for it
        else:
            self.tp_group = parallel_state.get_tensor_model_parallel_group(check_initialized=False)

    def forward(
        self,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        attention_mask: Optional[Tensor],
        attn_mask_type: Optional[AttnMaskType] = None,
        attention_bias: Optional[Tensor] = None,
        packed_seq_params: Any = None,
        **kwargs: Any,
    ) -> Tensor:
        """query [sq, b, np, hn], key/value [sk, b, ng, hn] -> context [sq, b, np * hn]."""
        if packed_seq_params is not None:
            raise NotImplementedError(
                "SDPA core attention does not support packed sequences (packed_seq_params): "
                "use Transformer Engine's attention, or right-padded micro-batches"
            )
        if attention_bias is not None:
            raise NotImplementedError(
                "SDPA core attention does not support attention_bias: use Transformer Engine's attention"
            )
        unknown = sorted(name for name, value_ in kwargs.items() if value_ is not None)
        if unknown:
            raise NotImplementedError(f"SDPA core attention does not support the forward arguments {unknown}")

        sq, b, heads, hn = query.shape
        sk, groups = key.size(0), key.size(2)
        if heads % groups != 0:
            raise ValueError(f"{heads} query heads cannot share {groups} key/value groups")
        mask_type = self.attn_mask_type if attn_mask_type is None else attn_mask_type
        if self.cp_size > 1:
            if attention_mask is not None:
                raise NotImplementedError(
                    "SDPA core attention under context parallelism takes no explicit attention_mask: "
                    "pass attention_mask=None with the causal mask type (right padding is loss-masked)"
                )
            if mask_type != AttnMaskType.causal:
                raise NotImplementedError("SDPA core attention under context parallelism is causal only")
            return self._context_parallel_attention(query, key, value)

        # [s, b, n, h] -> [b, n, s, h]: views; the kernels need only the last dimension contiguous.
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
        sdpa_mask: Optional[Tensor] = None
        if attention_mask is None:
            if mask_type == AttnMaskType.causal and sq > 1:
                if sq != sk:
                    raise ValueError(f"a causal mask needs self-attention (sq == sk), got sq={sq}, sk={sk}")
                is_causal = True
            else:
                is_causal = False  # no mask, as Megatron (a single query sees every key)
        elif _CAUSAL_MEMO.is_causal(attention_mask, sq, sk):
            is_causal = True
        else:
            is_causal = False
            q, sdpa_mask = _explicit_mask(q, attention_mask)

        # Native GQA (no key/value copies) only on the path that fused kernels take with it: CUDA,
        # half precision, no explicit mask (an H100 with torch 2.11 ran cuDNN and flash attention
        # there). Elsewhere repeat keys/values, which every kernel accepts.
        native_gqa = (
            groups != heads
            and _SDPA_HAS_GQA
            and sdpa_mask is None
            and q.is_cuda
            and q.dtype in (torch.float16, torch.bfloat16)
        )
        if groups != heads and not native_gqa:
            # Megatron's grouping: consecutive query heads share a key/value head.
            k = k.repeat_interleave(heads // groups, dim=1)
            v = v.repeat_interleave(heads // groups, dim=1)
        extra = {"enable_gqa": True} if native_gqa else {}

        dropout_p = self.dropout_p if self.training else 0.0
        with self._kernel_context(q, dropout_p):
            context = F.scaled_dot_product_attention(
                q, k, v, attn_mask=sdpa_mask, dropout_p=dropout_p, is_causal=is_causal,
                scale=self.softmax_scale, **extra,
            )  # fmt: skip
        # [b, np, sq, hn] -> [sq, b, np * hn]
        return context.permute(2, 0, 1, 3).reshape(sq, b, heads * hn)

    def _kernel_context(self, q: Tensor, dropout_p: float) -> contextlib.ExitStack:
        """The SDPA kernels CPU may use and, with dropout, the rank's own RNG stream."""
        stack = contextlib.ExitStack()
        if not q.is_cuda:
            stack.enter_context(sdpa_kernel(_CPU_BACKENDS))
        if dropout_p > 0.0 and not self.config.sequence_parallel:
            # As Megatron: heads are split over TP ranks, so each rank draws from its own stream.
            stack.enter_context(tensor_parallel.get_cuda_rng_tracker().fork())
        return stack

    def _context_parallel_attention(self, query: Tensor, key: Tensor, value: Tensor) -> Tensor:
        """Causal attention of the local chunks; K/V all-gathered over CP (backward: dK/dV summed)."""
        sq, b, heads, hn = query.shape
        groups = key.size(2)
        if sq % 2:
            raise ValueError(f"a CP rank holds two equal chunks, got an odd local length {sq}: pad to 2*CP")
        key = gather_sequence_sum_grads(key, 0, self.cp_group)
        value = gather_sequence_sum_grads(value, 0, self.cp_group)
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
        if groups != heads:
            k = k.repeat_interleave(heads // groups, dim=1)
            v = v.repeat_interleave(heads // groups, dim=1)
        dropout_p = self.dropout_p if self.training else 0.0
        with self._kernel_context(q, dropout_p):
            context = _chunked_causal_sdpa(
                q, k, v, self.cp_size, dist.get_rank(self.cp_group), self.softmax_scale, dropout_p
            )
        return context.permute(2, 0, 1, 3).reshape(sq, b, heads * hn)


def _chunked_causal_sdpa(
    q: Tensor, k_full: Tensor, v_full: Tensor, cp_size: int, cp_rank: int, scale: float, dropout_p: float
) -> Tensor:
    """Attention of this rank's two query chunks against the gathered keys in full order.

    q [b, n, 2c, h] holds chunks cp_rank and 2*CP-1-cp_rank; chunk j sees the key prefix that ends with
    it, under a lower-right-aligned causal mask (`causal_lower_right`, which the fused GPU kernels take).
    """
    chunk = q.size(2) // 2
    outputs = []
    for local_index, chunk_index in enumerate((cp_rank, 2 * cp_size - 1 - cp_rank)):
        q_chunk = q[:, :, local_index * chunk : (local_index + 1) * chunk]
        prefix = (chunk_index + 1) * chunk
        outputs.append(
            F.scaled_dot_product_attention(
                q_chunk, k_full[:, :, :prefix], v_full[:, :, :prefix],
                attn_mask=causal_lower_right(chunk, prefix), dropout_p=dropout_p, scale=scale,
            )  # fmt: skip
        )
    return torch.cat(outputs, dim=2)


def _explicit_mask(q: Tensor, attention_mask: Tensor) -> tuple[Tensor, Tensor]:
    """The query and SDPA boolean mask (True = attend) for an arbitrary Megatron mask (True = masked).

    Megatron fills masked scores with -10000 before the softmax, so a query row whose keys are all
    masked attends uniformly to every key (SDPA would return NaN there). Zeroing that query and
    unmasking its row gives equal scores - the same uniform weights - and, as in Megatron, no
    gradient to that query.
    """
    if attention_mask.dtype != torch.bool:
        raise TypeError(f"Megatron attention masks are boolean (True = masked), got {attention_mask.dtype}")
    dead = attention_mask.all(dim=-1, keepdim=True)  # [.., sq, 1]
    return q.masked_fill(dead, 0.0), ~attention_mask | dead


def with_sdpa_core_attention(spec: ModuleSpec) -> ModuleSpec:
    """A copy of a transformer-layer spec whose self-attention uses `SDPADotProductAttention`.

    Only the `core_attention` entry changes; the spec passed in is left untouched.
    """
    attention = spec.submodules.self_attention
    if not hasattr(attention.submodules, "core_attention"):
        raise TypeError(f"layer spec has no self_attention.submodules.core_attention: {attention.submodules!r}")
    attention = dataclasses.replace(
        attention, submodules=dataclasses.replace(attention.submodules, core_attention=SDPADotProductAttention)
    )
    return dataclasses.replace(spec, submodules=dataclasses.replace(spec.submodules, self_attention=attention))
