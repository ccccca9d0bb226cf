"""vLLM's CPU build cannot return routed experts: `actor.router_replay=r3` or
`rollout.return_routed_experts` with `rollout.engine=vllm` on a mixture-of-experts model without a
GPU is a config error of the pre-flight (`trainer.startup.check_engine_device`), naming the keys and
the fix, instead of a traceback from the engine's start."""

from __future__ import annotations

import pytest

from megatron_dapo.config import load_config
from megatron_dapo.errors import ConfigError, InputError, exit_code
from megatron_dapo.rollout.engines.vllm.limits import RoutedExpertsOnCPUError
from megatron_dapo.trainer import startup
from megatron_dapo.trainer.startup import check_engine_device


def _cfg(*overrides: str):
    return load_config(None, list(overrides))


@pytest.mark.parametrize(
    "overrides, named",
    [
        (["actor.router_replay=r3"], ["actor.router_replay=r3"]),
        (["rollout.return_routed_experts=true"], ["rollout.return_routed_experts=true"]),
        (["actor.router_replay=r3", "rollout.return_routed_experts=true"],
         ["actor.router_replay=r3", "rollout.return_routed_experts=true"]),
    ],
)  # fmt: skip
def test_vllm_asked_for_routed_experts_without_a_gpu_is_refused_by_name(overrides, named):
    cfg = _cfg("rollout.engine=vllm", *overrides)
    with pytest.raises(RoutedExpertsOnCPUError) as caught:
        check_engine_device(cfg, is_moe=True, cuda_available=False)
    error = caught.value
    assert isinstance(error, ConfigError) and isinstance(error, InputError) and exit_code(error) == 2  # one line, exit 2
    message = str(error)
    for key in named:
        assert key in message
    if len(named) == 1:  # only the setting that asks is named
        other = ({"actor.router_replay=r3", "rollout.return_routed_experts=true"} - set(named)).pop()
        assert other not in message
    assert "rollout.engine=vllm" in message and "rollout.engine=embedded" in message and "GPU" in message


@pytest.mark.parametrize(
    "overrides, is_moe, cuda",
    [
        (["rollout.engine=vllm", "actor.router_replay=r3"], True, True),  # on GPUs vLLM returns them
        (["rollout.engine=vllm", "rollout.return_routed_experts=true"], False, False),  # dense: nothing is asked
        (["rollout.engine=vllm", "actor.router_replay=r2"], True, False),  # r2 replays the actor's own routing
        (["rollout.engine=vllm"], True, False),
        (["rollout.engine=embedded", "actor.router_replay=r3"], True, False),  # the fix
        (["rollout.engine=sglang", "actor.router_replay=r3"], True, False),
    ],
)
def test_what_the_engine_can_do_passes(overrides, is_moe, cuda):
    check_engine_device(_cfg(*overrides), is_moe=is_moe, cuda_available=cuda)


def test_the_engines_own_guard_raises_the_same_error():
    from megatron_dapo.rollout.engines.vllm.limits import routed_experts_on_cpu_error

    error = routed_experts_on_cpu_error()
    assert isinstance(error, RoutedExpertsOnCPUError) and isinstance(error, ValueError)
    assert "actor.router_replay=r3 / rollout.return_routed_experts=true" in str(error)


def test_preflight_refuses_it_before_the_model_loads(moe_workspace, tmp_path, monkeypatch):
    monkeypatch.setattr(startup, "_cuda_available", lambda: False)
    where = [f"model.hf_dir={moe_workspace['model']}", f"data.train_files=[{moe_workspace['train']}]",
             f"data.val_files=[{moe_workspace['val']}]", f"trainer.output_dir={tmp_path / 'out'}"]  # fmt: skip
    cfg = _cfg("rollout.engine=vllm", "actor.router_replay=r3", *where)
    with pytest.raises(RoutedExpertsOnCPUError, match="actor.router_replay=r3"):
        startup.preflight(cfg, 1, resume=False)
    startup.preflight(cfg, 1, needs_data=False)  # the SFT warm start starts no engine
    monkeypatch.setattr(startup, "_cuda_available", lambda: True)
    startup.preflight(cfg, 1, resume=False)
