"""Subprocess bodies for test_cpu_compat.py (the compat layer changes process-global state, so each
check runs in a fresh interpreter started by torchrun_utils)."""

from __future__ import annotations

import torch


def _device_type(make) -> str:
    try:
        return make().device.type
    except Exception as exc:  # recorded, asserted in the test
        return f"error: {type(exc).__name__}: {exc}"


def cuda_reported_available() -> dict:
    """With torch.cuda.is_available() patched to True, enabling must change nothing."""
    from torch.overrides import _get_current_function_mode_stack

    from megatron_dapo.distributed import cpu_compat

    originals = {name: getattr(torch.cuda, name) for name in ("current_device", "synchronize", "Stream", "get_rng_state")}
    torch.cuda.is_available = lambda: True
    enabled = cpu_compat.enable_cpu_compat()
    return {
        "enabled": enabled,
        "flag": cpu_compat.cpu_compat_enabled(),
        "modes": len(_get_current_function_mode_stack()),
        "unchanged": [name for name, fn in originals.items() if getattr(torch.cuda, name) is fn],
        "megatron_imported": any(m.startswith("megatron.core") for m in __import__("sys").modules),
    }


def cpu_behaviour() -> dict:
    """Enable the layer on this CUDA-less machine and record what CUDA-style calls do."""
    from torch.overrides import _get_current_function_mode_stack

    from megatron_dapo.distributed.cpu_compat import enable_cpu_compat

    out: dict = {"before_current_device": _device_type(lambda: torch.empty(1, device=torch.cuda.current_device()))}
    out["first"] = enable_cpu_compat()
    out["second"] = enable_cpu_compat()
    out["modes"] = len(_get_current_function_mode_stack())
    x = torch.ones(3)
    out["devices"] = {
        'empty(device="cuda")': _device_type(lambda: torch.empty(2, device="cuda")),
        'zeros(device="cuda:0")': _device_type(lambda: torch.zeros(2, device="cuda:0")),
        "arange(device=torch.device(cuda))": _device_type(lambda: torch.arange(2, device=torch.device("cuda"))),
        "ones(device=0)": _device_type(lambda: torch.ones(2, device=0)),
        "ones(device=current_device())": _device_type(lambda: torch.ones(2, device=torch.cuda.current_device())),
        "tensor(device=cuda)": _device_type(lambda: torch.tensor([1.0], device="cuda")),
        ".cuda()": _device_type(lambda: x.cuda()),
        '.to("cuda")': _device_type(lambda: x.to("cuda")),
        ".to(torch.device(cuda, 0))": _device_type(lambda: x.to(torch.device("cuda", 0))),
        ".to(device=cuda, dtype=float64)": _device_type(lambda: x.to(device="cuda", dtype=torch.float64)),
        "new_zeros(device=cuda)": _device_type(lambda: x.new_zeros(2, device="cuda")),
        "zeros(pin_memory=True)": _device_type(lambda: torch.zeros(2, pin_memory=True)),
        "empty(device=cpu)": _device_type(lambda: torch.empty(2, device="cpu")),
    }
    out["dtype_kept"] = str(x.to("cuda", torch.float64).dtype)
    out["type_strings"] = [x.type(), x.bfloat16().type(), x.type(torch.float64).dtype == torch.float64]
    out["cuda_is_self"] = x.cuda() is x
    stream = torch.cuda.Stream()
    event = torch.cuda.Event(enable_timing=True)
    event.record()
    torch.cuda.current_stream().wait_stream(stream)
    with torch.cuda.stream(stream):
        y = x * 2
    torch.cuda.synchronize()
    out["streams_ok"] = bool(y.sum() == 6) and event.elapsed_time(torch.cuda.Event()) == 0.0
    out["current_device"] = torch.cuda.current_device()
    out["still_no_cuda"] = torch.cuda.is_available()

    # Megatron's RNG tracker on the CPU generator: the model-parallel stream is seeded with
    # seed + 2718 + tp_rank (Megatron's rule) and fork() leaves the default stream where it was.
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker, model_parallel_cuda_manual_seed
    from megatron.core.transformer.utils import get_default_causal_mask

    model_parallel_cuda_manual_seed(123, tp_rank=0, ep_rank=0, etp_rank=0)
    torch.manual_seed(0)
    a = torch.rand(4)
    with get_cuda_rng_tracker().fork():
        b1 = torch.rand(4)
    with get_cuda_rng_tracker().fork():
        b2 = torch.rand(4)
    c = torch.rand(4)
    g = torch.Generator().manual_seed(0)
    a_ref, c_ref = torch.rand(4, generator=g), torch.rand(4, generator=g)
    g_tp = torch.Generator().manual_seed(123 + 2718)
    b1_ref, b2_ref = torch.rand(4, generator=g_tp), torch.rand(4, generator=g_tp)
    out["rng"] = {
        "default_stream_kept": torch.equal(a, a_ref) and torch.equal(c, c_ref),
        "fork_uses_tp_seed": torch.equal(b1, b1_ref) and torch.equal(b2, b2_ref),
    }
    out["megatron_causal_mask_device"] = get_default_causal_mask(4).device.type

    # Backward of a Python autograd function that allocates on the "current CUDA device", reached through
    # torch.autograd.backward as Megatron's schedules call it (the mode is off inside its own handler).
    class AllocatesInBackward(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x * 2

        @staticmethod
        def backward(ctx, grad):
            buffer = torch.empty(grad.shape, dtype=grad.dtype, device=torch.cuda.current_device())
            return buffer.copy_(grad * 2)

    leaf = torch.ones(3, requires_grad=True)
    torch.autograd.backward(AllocatesInBackward.apply(leaf).sum())
    out["backward_allocation"] = leaf.grad.tolist()
    out["modes_after_backward"] = len(_get_current_function_mode_stack())
    return out


def _outcome(call) -> str:
    try:
        call()
        return "ok"
    except Exception as exc:  # recorded, asserted in the test
        return f"error: {type(exc).__name__}: {exc}"


def moe_router_gemm() -> dict:
    """The MoE router's gating GEMM, before and after the layer (Megatron imported first, without it)."""
    from megatron.core.transformer.moe import moe_utils

    g = torch.Generator().manual_seed(0)
    inp = torch.randn(3, 5, 8, generator=g, requires_grad=True)
    weight = torch.randn(4, 8, generator=g, requires_grad=True)
    out: dict = {"before": _outcome(lambda: moe_utils.router_gating_linear(inp, weight, None, torch.float32))}

    from megatron_dapo.distributed.cpu_compat import enable_cpu_compat

    enable_cpu_compat()
    logits = moe_utils.router_gating_linear(inp, weight, None, torch.float32)
    logits.square().sum().backward()
    ref_inp, ref_weight = inp.detach().clone().requires_grad_(), weight.detach().clone().requires_grad_()
    (ref_inp @ ref_weight.t()).square().sum().backward()
    out["after_equal"] = [
        torch.allclose(logits, (inp @ weight.t()).detach(), atol=1e-6),
        torch.allclose(inp.grad, ref_inp.grad, atol=1e-5),
        torch.allclose(weight.grad, ref_weight.grad, atol=1e-5),
    ]
    out["te_general_gemm"] = repr(moe_utils.te_general_gemm)
    return out


def moe_alltoall_split_sizes() -> dict:
    """Megatron's all-to-all with split sizes as the alltoall dispatcher hands them over (2 ranks, gloo).

    Rank r sends r + 1 rows to each rank. With the layer, the dispatcher's host copy of the split sizes
    is what CUDA tensors get on GPUs; with Megatron's own helper (the layer's patch undone) they stay
    tensors and `all_to_all_single` refuses them.
    """
    import torch.distributed as dist

    from megatron_dapo.distributed import ParallelLayout, init_distributed, teardown

    ctx = init_distributed(ParallelLayout(), timeout_s=60)
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.mappings import all_to_all
    from megatron.core.transformer.moe import moe_utils, token_dispatcher

    rank, world = ctx.rank, ctx.world_size
    group = ps.get_data_parallel_group()
    rows = torch.arange(world * (rank + 1), dtype=torch.float32).unsqueeze(1) + 100 * rank
    send = torch.full((world,), rank + 1)
    receive = torch.arange(1, world + 1)

    def exchange(to_host):
        return all_to_all(group, rows, to_host(receive, as_numpy=True), to_host(send, as_numpy=True))

    out: dict = {"patched": token_dispatcher.maybe_move_tensor_to_cpu is not moe_utils.maybe_move_tensor_to_cpu}
    received = exchange(token_dispatcher.maybe_move_tensor_to_cpu)
    expected = torch.cat([torch.arange(r + 1, dtype=torch.float32) + (r + 1) * rank + 100 * r for r in range(world)])
    out["received_equal"] = torch.equal(received.squeeze(1), expected)
    out["without_layer"] = _outcome(lambda: exchange(moe_utils.maybe_move_tensor_to_cpu))
    dist.barrier()
    teardown()
    return out
