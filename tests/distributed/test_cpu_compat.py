"""The CPU compatibility layer: CUDA requests land on the CPU, Megatron's RNG tracker works, and
nothing is touched when CUDA is available. Each case runs in a fresh interpreter."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.torchrun_utils import run_torchrun_function

WORKER = Path(__file__).parent / "_compat_worker.py"


def _run(function: str) -> dict:
    result = run_torchrun_function(WORKER, function, nproc=1, use_torchrun=False, timeout=120, fresh_interpreter=True).check()
    (observed,) = result.rank_results
    assert observed is not None, result.tail()
    return observed


def test_no_effect_when_cuda_is_available():
    observed = _run("cuda_reported_available")
    assert observed["enabled"] is False and observed["flag"] is False
    assert observed["modes"] == 0
    assert sorted(observed["unchanged"]) == ["Stream", "current_device", "get_rng_state", "synchronize"]
    assert observed["megatron_imported"] is False


@pytest.fixture(scope="module")
def cpu_observed() -> dict:
    return _run("cpu_behaviour")


def test_without_the_layer_cuda_calls_fail(cpu_observed):
    assert cpu_observed["before_current_device"].startswith("error:")


def test_enable_is_idempotent(cpu_observed):
    assert cpu_observed["first"] is True and cpu_observed["second"] is True
    assert cpu_observed["modes"] == 1
    assert cpu_observed["still_no_cuda"] is False


def test_cuda_device_requests_become_cpu(cpu_observed):
    assert cpu_observed["devices"] == {name: "cpu" for name in cpu_observed["devices"]}
    assert cpu_observed["dtype_kept"] == "torch.float64"
    assert cpu_observed["cuda_is_self"] is True
    assert cpu_observed["current_device"] == 0
    # Megatron's optimizers accept parameters by their CUDA type name; conversions still work.
    assert cpu_observed["type_strings"] == ["torch.cuda.FloatTensor", "torch.cuda.BFloat16Tensor", True]


def test_streams_and_events_are_inert(cpu_observed):
    assert cpu_observed["streams_ok"] is True


def test_megatron_rng_tracker_runs_on_cpu_generator(cpu_observed):
    assert cpu_observed["rng"] == {"default_stream_kept": True, "fork_uses_tp_seed": True}
    assert cpu_observed["megatron_causal_mask_device"] == "cpu"


def test_backward_of_python_functions_is_rerouted_too(cpu_observed):
    # Megatron's sequence-parallel linear allocates its reduce-scatter buffer this way in backward.
    assert cpu_observed["backward_allocation"] == [2.0, 2.0, 2.0]
    assert cpu_observed["modes_after_backward"] == 1


def test_moe_router_runs_without_transformer_engine():
    # moe_utils names TE's GEMM in the router's autograd function; without TE the name is undefined
    # up to megatron-core 0.18 (0.19 defines it: compat/megatron_core.py).
    from megatron_dapo.compat.megatron_core import installed_release

    observed = _run("moe_router_gemm")
    if installed_release() < (0, 19):
        assert observed["before"] == "error: NameError: name 'te_general_gemm' is not defined"
    else:
        assert observed["before"] == "ok"
    assert observed["after_equal"] == [True, True, True]  # logits, input and weight gradients
    assert observed["te_general_gemm"] == "None"


def test_moe_alltoall_split_sizes_reach_all_to_all_as_host_arrays():
    result = run_torchrun_function(WORKER, "moe_alltoall_split_sizes", nproc=2, timeout=180).check()
    for observed in result.rank_results:
        assert observed is not None, result.tail()
        assert observed["patched"] is True
        assert observed["received_equal"] is True
        # Without the layer's conversion the split sizes are CPU tensors, which all_to_all_single refuses.
        assert observed["without_layer"].startswith("error: TypeError: all_to_all_single(): incompatible function arguments")
