"""Independent references the planner is checked against.

* Megatron-LM's theoretical memory formula, transcribed from
  megatron/training/theoretical_memory_usage.py of NVIDIA/Megatron-LM at commit
  d98e8a64ddf34856e74b24714e3bedb2f5a39553 (compute_weight_and_optimizer_memory,
  compute_activation_memory, compute_activation_memory_without_sp), dense GPT path only: no MoE,
  multi-latent attention or multi-token prediction; it is not part of the megatron-core package.
  `args` carries Megatron's argument names. Where our count differs on purpose (QKV bias, Qwen3's
  q/k norms, grouped-query K/V, a gated MLP, no dropout masks, token ids not split by TP, the final
  norm on the last stage) the tests write the difference out term by term; under Megatron's own
  assumptions the numbers are equal.
  Its MoE terms (`megatron_parameters` with `num_experts`: every layer an MoE layer of
  `num_experts` SwiGLU experts of `moe_ffn_hidden_size` plus a shared expert of
  `moe_shared_expert_intermediate_size`; no router, which it does not count) are transcribed from
  the same file at commit 00caa53af30912914981c86f39db123961678bbd.
* The parameter counts published for the public models of the built-in table.
"""

from __future__ import annotations

from types import SimpleNamespace

from megatron_dapo.model.hf_config import read_hf_config
from megatron_dapo.model.mapping import padded_vocab_size


def megatron_args(model, tp=1, pp=1, dp=1, *, distributed_optimizer=True, seq_length=1, vpp=None, vocab=None):
    return SimpleNamespace(
        hidden_size=model.hidden_size,
        kv_channels=model.head_dim,
        num_attention_heads=model.num_attention_heads,
        num_query_groups=model.num_key_value_heads,
        group_query_attention=model.num_key_value_heads != model.num_attention_heads,
        swiglu=True,
        ffn_hidden_size=model.ffn_hidden_size,
        normalization="RMSNorm",
        padded_vocab_size=vocab if vocab is not None else padded_vocab_size(model.vocab_size, tp),
        untie_embeddings_and_output_weights=not model.tie_word_embeddings,
        num_layers=model.num_layers,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=vpp,
        data_parallel_size=dp,
        use_distributed_optimizer=distributed_optimizer,
        seq_length=seq_length,
        micro_batch_size=1,
        num_experts=model.num_experts or None,
        moe_ffn_hidden_size=model.moe_ffn_hidden_size,
        moe_shared_expert_intermediate_size=model.shared_expert_ffn_hidden_size,
    )


def megatron_parameters(args):
    """(total parameters, parameters on the most loaded model shard)."""
    query_projection = args.kv_channels * args.num_attention_heads
    groups = args.num_query_groups if args.group_query_attention else args.num_attention_heads
    gated = 3 / 2 if args.swiglu else 1
    norm = 1 if args.normalization == "RMSNorm" else 2
    attention = 2 * args.hidden_size * args.hidden_size * (
        (1 + groups / args.num_attention_heads) * query_projection / args.hidden_size
    )
    if args.num_experts is None:
        mlp = 2 * args.hidden_size * args.ffn_hidden_size * gated
    else:  # every layer an MoE layer (moe_layer_freq = 1)
        shared = args.moe_shared_expert_intermediate_size or 0
        mlp = 2 * args.hidden_size * (args.moe_ffn_hidden_size * args.num_experts * gated + shared * gated)
    layernorms = 2 * args.hidden_size * norm
    embedding = args.hidden_size * args.padded_vocab_size
    final_norm = norm * args.hidden_size
    embeddings = 2 * embedding if args.untie_embeddings_and_output_weights else embedding
    total = (attention + mlp + layernorms) * args.num_layers + final_norm + embeddings

    tp_sharded = (attention + mlp) * args.num_layers
    replicated = layernorms * args.num_layers + final_norm
    most_loaded = (tp_sharded / args.pipeline_model_parallel_size + embedding) / args.tensor_model_parallel_size
    most_loaded += replicated / args.pipeline_model_parallel_size
    if args.untie_embeddings_and_output_weights and args.pipeline_model_parallel_size == 1:
        most_loaded += embedding / args.tensor_model_parallel_size
    return total, most_loaded


def megatron_weight_and_optimizer_bytes(args):
    bytes_per_parameter = 6 + 12 / args.data_parallel_size if args.use_distributed_optimizer else 18
    return megatron_parameters(args)[1] * bytes_per_parameter


def _megatron_pipeline_factor(args, value, num_microbatches):
    pp, vpp = args.pipeline_model_parallel_size, args.virtual_pipeline_model_parallel_size
    if vpp is not None:
        value *= 1 + (pp - 1) / (pp * vpp)
    if vpp is None and pp > 1 and num_microbatches is not None:
        value *= min(1, num_microbatches / pp)
    return value


def megatron_activation_bytes(args, num_microbatches=None):
    """compute_activation_memory: sequence parallel + selective recompute, first pipeline stage."""
    sbh = args.seq_length * args.micro_batch_size * args.hidden_size
    memory = sbh * (18 + 4 * args.ffn_hidden_size / args.hidden_size) * args.num_layers
    memory += 8 * args.seq_length * args.micro_batch_size * args.pipeline_model_parallel_size
    memory += sbh * args.pipeline_model_parallel_size
    memory = _megatron_pipeline_factor(args, memory, num_microbatches)
    if args.pipeline_model_parallel_size == 1:
        memory += sbh * 4 * (1 + args.padded_vocab_size / args.hidden_size)
    return memory / args.tensor_model_parallel_size


def megatron_layer_activation_bytes_without_sp(args):
    """compute_activation_memory_without_sp, the per-layer term (it assumes ffn = 4h)."""
    sbh = args.seq_length * args.micro_batch_size * args.hidden_size
    return sbh * (10 + 24 / args.tensor_model_parallel_size)


def megatron_like_shape(hidden=1024, heads=16, ffn=None, layers=8, vocab=32000):
    """A shape that meets Megatron's activation-formula assumptions: multi-head, heads x head_dim = hidden."""
    return read_hf_config(
        {
            "architectures": ["LlamaForCausalLM"],
            "hidden_size": hidden,
            "intermediate_size": ffn or 4 * hidden,
            "num_hidden_layers": layers,
            "num_attention_heads": heads,
            "num_key_value_heads": heads,
            "vocab_size": vocab,
            "max_position_embeddings": 4096,
        }
    )


def qkv_bias_per_layer(model):
    return (model.num_attention_heads + 2 * model.num_key_value_heads) * model.head_dim if model.qkv_bias else 0


def qk_norm_per_layer(model):
    return 2 * model.head_dim if model.qk_norm else 0


def router_per_layer(model):
    """The router ([E, h]) and the shared expert's gate ([1, h]), which Megatron's formula leaves out."""
    return model.num_experts * model.hidden_size + (model.hidden_size if model.shared_expert_ffn_hidden_size else 0)


# Totals published on the Hugging Face model pages (safetensors parameter count) of these models.
PUBLISHED_PARAMETERS = {
    "qwen2.5-0.5b": 494_032_768,
    "qwen2.5-1.5b": 1_543_714_304,
    "qwen2.5-7b": 7_615_616_512,
    "qwen2.5-14b": 14_770_033_664,
    "qwen2.5-32b": 32_763_876_352,
    "qwen2.5-72b": 72_706_203_648,
    "llama-3.1-8b": 8_030_261_248,
    "llama-3.1-70b": 70_553_706_496,
    "qwen3-8b": 8_190_735_360,
    "qwen3-32b": 32_762_123_264,
    "qwen3-30b-a3b": 30_532_122_624,
    "qwen3-235b-a22b": 235_093_634_560,
}

# The model cards' figures of the mixtures of experts: (total, activated) parameters in billions with
# their number of decimals ("30.5B in total and 3.3B activated"; "235B in total and 22B activated").
PUBLISHED_MOE_BILLIONS = {
    "qwen3-30b-a3b": ((30.5, 1), (3.3, 1)),
    "qwen3-235b-a22b": ((235, 0), (22, 0)),
}
