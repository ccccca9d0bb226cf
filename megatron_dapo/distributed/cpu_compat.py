"""Run Megatron-Core on a machine without CUDA.

Megatron-Core is written for GPUs: it asks `torch.cuda.current_device()` for the device of new
tensors, creates some tensors with `device="cuda"`, keeps a separate "CUDA" random stream for
tensor-parallel regions, and synchronises streams around communication. None of that exists in a
CPU-only PyTorch. `enable_cpu_compat()` makes those calls mean "the CPU" so that the same Megatron
code paths (model construction, forward, backward, pipeline schedules over gloo) run unchanged.

It is active ONLY when `torch.cuda.is_available()` is False: on a GPU machine it returns False and
touches nothing. It is idempotent, and the distributed set-up (`megatron_dapo.distributed.setup`)
calls it before it first imports Megatron, so callers do not have to think about import order;
calling it after Megatron was imported works too, since every patch replaces a module attribute
that is looked up at call time.

The patches, each kept to what our code paths reach:

1. A global `TorchFunctionMode` that rewrites CUDA device requests to the CPU: a `device=` argument
   of any torch function ("cuda", "cuda:0", torch.device("cuda"), or an int, which torch reads as
   a CUDA ordinal), `Tensor.to(<cuda device>)`, `Tensor.cuda()`, and `pin_memory` (needs CUDA).
   `Tensor.type()` (the type string) reports the CUDA type name ("torch.cuda.FloatTensor"),
   because Megatron's optimizers accept parameters by that name.
   Torch function modes are thread-local: the mode is pushed on the thread that enables the layer
   (the main thread, where model code runs; CPU autograd runs backward on the calling thread). A mode
   is off while its own handler runs, and `torch.autograd.backward` arrives at the handler, so the
   backward of Python autograd functions (Megatron's) is run under a fresh instance of the mode.
2. `torch.cuda` functions Megatron calls for bookkeeping: `current_device` (returns 0, which the
   mode above maps to the CPU), `set_device(0)`, `synchronize`, `empty_cache`, streams and events
   (inert stand-ins: CPU ops are synchronous).
3. The "CUDA" random number generator: `torch.cuda.{get,set}_rng_state`, `torch.cuda.manual_seed` and
   Megatron's `tensor_parallel.random._{get,set}_cuda_rng_state` act on the CPU default generator.
   That is the faithful emulation, because on the CPU the ops that draw random numbers (dropout,
   init) use the CPU generator: `get_cuda_rng_tracker().fork()` then really switches streams, and
   `model_parallel_cuda_manual_seed` works. (Our models use dropout 0 anyway.)
4. Mixture-of-experts layers without Transformer Engine (`_patch_megatron_moe`):
   - the router's `RouterGatingLinearFunction` tests `te_general_gemm is not None`, a name
     `moe_utils` defines only when TE imports: without TE every router forward is a NameError.
     It is set to None, the value that selects the plain `torch.mm` path written for that case.
   - the alltoall token dispatcher moves its split sizes (tokens sent to / received from each
     expert-parallel rank) to the host with `maybe_move_tensor_to_cpu(..., as_numpy=True)`, which
     converts CUDA tensors only; a CPU tensor stays a tensor and reaches `all_to_all_single`, which
     takes a list of ints. CPU tensors get the conversion GPU tensors get (a NumPy array).
   - with expert-TP (TP > 1 and sequence parallelism) the alltoall dispatcher gathers and
     reduce-scatters token blocks of DIFFERENT sizes over the TP group (`output_split_sizes`,
     `input_split_sizes` of `tensor_parallel.mappings`), through `all_gather` into a list of unequal
     tensors and a list `reduce_scatter`, which NCCL takes and gloo refuses ("invalid tensor size").
     Those two branches go through equal-size collectives instead: the blocks padded to the largest
     and gathered, then cut to their sizes; the whole input all-reduced, then this rank's block
     taken (the same sums; more bytes, which on a CPU test machine do not matter). The equal-split
     branches are Megatron's own.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.autograd.function import BackwardCFunction

__all__ = ["enable_cpu_compat", "cpu_compat_enabled", "CudaToCpuMode"]

_lock = threading.Lock()
_enabled = False
_mode: "CudaToCpuMode | None" = None


def cpu_compat_enabled() -> bool:
    """True once `enable_cpu_compat()` has activated the layer in this process."""
    return _enabled


def enable_cpu_compat() -> bool:
    """Activate the CPU compatibility layer if (and only if) CUDA is unavailable.

    Returns True when the layer is active after the call, False on a CUDA machine (no effect).
    Safe to call any number of times.
    """
    global _enabled, _mode
    if torch.cuda.is_available():
        return False
    with _lock:
        if _enabled:
            return True
        _patch_torch_cuda()
        _patch_megatron_rng()
        _patch_megatron_moe()
        _patch_autograd_function_backward()
        _mode = CudaToCpuMode()
        _mode.__enter__()  # stays on the mode stack for the life of the process
        _enabled = True
    return True


# ---------------------------------------------------------------------------------------------
# 1. Device rerouting
# ---------------------------------------------------------------------------------------------


def _is_cuda_device(device: Any) -> bool:
    """Whether `device` names a CUDA device (an int is a CUDA ordinal for torch)."""
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device.startswith("cuda")
    return isinstance(device, int) and not isinstance(device, bool)


class CudaToCpuMode(TorchFunctionMode):
    """Torch function mode that turns requests for CUDA tensors into CPU tensors."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func is torch.Tensor.cuda:
            return args[0]  # already on "the device"
        if func is torch.Tensor.pin_memory:
            return args[0]  # pinning needs CUDA; a CPU tensor is already host memory
        if func is torch.Tensor.record_stream:
            return None  # there are no streams to record against
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            # Megatron's optimizers dispatch on the type string ("torch.cuda.FloatTensor", ...).
            name = func(*args)
            return name.replace("torch.", "torch.cuda.", 1) if not name.startswith("torch.cuda.") else name
        if _is_cuda_device(kwargs.get("device")):
            kwargs["device"] = "cpu"
        if kwargs.get("pin_memory"):
            kwargs["pin_memory"] = False
        if func is torch.Tensor.to and len(args) > 1 and _is_cuda_device(args[1]):
            args = (args[0], "cpu", *args[2:])
        return func(*args, **kwargs)


def _patch_autograd_function_backward() -> None:
    """Run the backward of Python autograd functions under the mode when no mode is active.

    A mode is switched off while its own handler runs, and `torch.autograd.backward` (which Megatron's
    schedules call) reaches the handler as a torch function: the whole backward pass then runs without
    the mode, while Megatron's backward functions allocate on `torch.cuda.current_device()` (e.g. the
    sequence-parallel reduce-scatter buffer in `LinearWithGradAccumulationAndAsyncCommunication`).
    The autograd engine calls `BackwardCFunction.apply` for every Python function's backward.
    """
    original = BackwardCFunction.apply

    def apply_under_mode(self, *args):
        if torch._C._len_torch_function_stack() == 0:
            with CudaToCpuMode():
                return original(self, *args)
        return original(self, *args)

    BackwardCFunction.apply = apply_under_mode


# ---------------------------------------------------------------------------------------------
# 2. torch.cuda bookkeeping
# ---------------------------------------------------------------------------------------------


class _InertStream:
    """Stands in for torch.cuda.Stream: CPU work is synchronous, so waiting is a no-op."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def wait_stream(self, *args: Any, **kwargs: Any) -> None:
        pass

    def wait_event(self, *args: Any, **kwargs: Any) -> None:
        pass

    def record_event(self, event: Any = None) -> "_InertEvent":
        return event if event is not None else _InertEvent()

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True


class _InertEvent:
    """Stands in for torch.cuda.Event; elapsed_time is 0 (use wall clocks for CPU timing)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def record(self, *args: Any, **kwargs: Any) -> None:
        pass

    def wait(self, *args: Any, **kwargs: Any) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True

    def elapsed_time(self, other: Any) -> float:
        return 0.0


_INERT_STREAM = _InertStream()


def _set_device(device: Any) -> None:
    # Megatron and launchers call set_device(local_rank); on the CPU every rank shares "device 0".
    return None


def _patch_torch_cuda() -> None:
    cuda = torch.cuda
    cuda.current_device = lambda: 0
    cuda.set_device = _set_device
    cuda.synchronize = lambda device=None: None
    cuda.empty_cache = lambda: None
    cuda.Stream = _InertStream
    cuda.Event = _InertEvent
    cuda.current_stream = lambda device=None: _INERT_STREAM
    cuda.default_stream = lambda device=None: _INERT_STREAM
    cuda.set_stream = lambda stream: None
    cuda.stream = lambda stream=None: contextlib.nullcontext()
    # 3. The "CUDA" generator is the CPU generator (see the module docstring).
    cuda.get_rng_state = lambda device="cuda": torch.get_rng_state()
    cuda.set_rng_state = lambda new_state, device="cuda": torch.set_rng_state(new_state)
    # Seed the CPU generator only: torch.manual_seed itself calls torch.cuda.manual_seed_all,
    # which therefore stays the original (a no-op without CUDA) to avoid recursion.
    cuda.manual_seed = lambda seed: torch.default_generator.manual_seed(int(seed))
    cuda.random.get_rng_state = cuda.get_rng_state
    cuda.random.set_rng_state = cuda.set_rng_state
    cuda.random.manual_seed = cuda.manual_seed


# ---------------------------------------------------------------------------------------------
# 3. Megatron's CUDA RNG tracker
# ---------------------------------------------------------------------------------------------


def _get_cpu_rng_state(device: Any = "cuda", clone: bool = False, graph_safe: bool = False) -> torch.Tensor:
    return torch.get_rng_state()  # already a copy


def _set_cpu_rng_state(new_state: torch.Tensor, device: Any = -1, graph_safe: bool = False) -> None:
    torch.set_rng_state(new_state)


def _patch_megatron_rng() -> None:
    # Megatron's own helpers go through torch.cuda.default_generators (empty without CUDA) and
    # torch.cuda._lazy_call (which silently queues forever without CUDA), so they are replaced.
    # Imported here: with CUDA this module must not load Megatron at all (it changes nothing there).
    from megatron.core.tensor_parallel import random as mcore_random

    mcore_random._get_cuda_rng_state = _get_cpu_rng_state
    mcore_random._set_cuda_rng_state = _set_cpu_rng_state


# ---------------------------------------------------------------------------------------------
# 4. Mixture-of-experts layers without Transformer Engine
# ---------------------------------------------------------------------------------------------


def _split_sizes_to_host(tensor: Any, as_numpy: bool = False, record_stream: bool = False) -> Any:
    """`moe_utils.maybe_move_tensor_to_cpu` for a machine without CUDA: CPU tensors also become NumPy
    arrays when asked (`as_numpy`), as CUDA tensors do on GPUs."""
    if torch.is_tensor(tensor) and as_numpy:
        return tensor.numpy()
    return tensor


def _gather_uneven_first_dim(original):
    def gather(input_, group, output_split_sizes=None, use_global_buffer=False):
        if output_split_sizes is None or group.size() == 1:
            return original(input_, group, output_split_sizes, use_global_buffer)
        sizes = [int(size) for size in output_split_sizes]
        padded = input_.new_zeros((max(sizes), *input_.shape[1:]))
        padded[: input_.shape[0]] = input_
        blocks = [torch.empty_like(padded) for _ in sizes]
        torch.distributed.all_gather(blocks, padded.contiguous(), group=group)
        return torch.cat([block[:size] for block, size in zip(blocks, sizes)], dim=0)

    gather._megatron_dapo_original = original
    return gather


def _reduce_scatter_uneven_first_dim(original):
    def reduce_scatter(input_, group, input_split_sizes=None, use_global_buffer=False):
        if input_split_sizes is None or group.size() == 1:
            return original(input_, group, input_split_sizes, use_global_buffer)
        total = input_.contiguous().clone()
        torch.distributed.all_reduce(total, group=group)
        return torch.split(total, [int(size) for size in input_split_sizes], dim=0)[group.rank()].clone()

    reduce_scatter._megatron_dapo_original = original
    return reduce_scatter


def _patch_megatron_moe() -> None:
    from megatron.core.tensor_parallel import mappings  # see _patch_megatron_rng
    from megatron.core.transformer.moe import moe_utils, token_dispatcher

    if not hasattr(moe_utils, "te_general_gemm"):  # TE's GEMM, defined only when TE imports
        moe_utils.te_general_gemm = None
    token_dispatcher.maybe_move_tensor_to_cpu = _split_sizes_to_host
    if not hasattr(mappings._gather_along_first_dim, "_megatron_dapo_original"):  # idempotent
        mappings._gather_along_first_dim = _gather_uneven_first_dim(mappings._gather_along_first_dim)
        mappings._reduce_scatter_along_first_dim = _reduce_scatter_uneven_first_dim(mappings._reduce_scatter_along_first_dim)
