"""`megatron-dapo smoke`'s decisions, pure: which steps at which sizes on which machine, what an
engine that is not installed turns into, the detail line of each step and the table. The command
itself runs end to end on this CPU machine in tests/smoke/test_smoke_command.py."""

from __future__ import annotations

from pathlib import Path

from megatron_dapo.smoke.plan import TRAIN_STEP_OVERRIDES, Machine, plan_steps
from megatron_dapo.smoke.run import FAIL, PASS, SKIP, StepResult, detail_of, format_table

WS = Path("/ws")


def _by_name(steps):
    return {step.name.split(",")[0]: step for step in steps}


def test_cpu_sizes_without_cuda():
    steps = plan_steps(Machine(gpus=0, vllm=True, sglang=True), WS)
    assert [s.name for s in steps] == [
        "doctor", "check-sync dense, vLLM", "check-sync dense, SGLang", "check-sync MoE, vllm, EP=2",
        "trainer step, MoE, r3 routing from embedded", "weight push, cpu-shaped",  # vLLM's CPU build returns no routing
    ]  # fmt: skip
    assert all(s.skip is None for s in steps)
    moe = _by_name(steps)["check-sync MoE"]
    assert moe.argv[-2:] == ["--ep", "2"] and "--dtype" not in moe.argv  # float32 on the CPU, EP over two gloo processes
    assert _by_name(steps)["weight push"].argv == ["megatron_dapo.smoke.push", "--shape", "cpu"]


def test_gpu_sizes_and_ep_only_with_two_gpus():
    one = _by_name(plan_steps(Machine(gpus=1, vllm=True, sglang=True), WS))
    assert "rollout.engine=vllm" in one["trainer step"].argv  # on a GPU the r3 routing comes from vLLM
    assert one["check-sync MoE"].argv[one["check-sync MoE"].argv.index("--ep") + 1] == "1"
    assert one["check-sync dense"].argv[-4:] == ["--dtype", "bfloat16", "--tolerance", "0.5"]
    assert one["weight push"].argv[-1] == "1.5b"
    two = _by_name(plan_steps(Machine(gpus=2, vllm=True, sglang=True), WS))
    assert "EP=2" in [s.name for s in plan_steps(Machine(gpus=2, vllm=True, sglang=True), WS)][3]
    assert two["doctor"].timeout_s <= 120 and sum(s.timeout_s for s in two.values()) <= 1800


def test_missing_engines_skip_with_the_install_command_and_moe_falls_back_to_embedded():
    steps = plan_steps(Machine(gpus=1, vllm=False, sglang=False), WS)
    named = {s.name: s for s in steps}
    assert "pip install vllm" in named["check-sync dense, vLLM"].skip
    assert "make install-sglang-cpu" in named["check-sync dense, SGLang"].skip
    assert named["check-sync MoE, embedded, EP=1"].skip is None
    step = named["trainer step, MoE, r3 routing from embedded"]
    assert "rollout.engine=embedded" in step.argv and "actor.router_replay=r3" in TRAIN_STEP_OVERRIDES


def test_detail_lines():
    push = '{"bytes": 3000000000, "dtype": "bfloat16", "device": "cuda", "sync_gb_per_s": 10.0, "copy_gb_per_s": 200.0, "ratio": 20.0}'
    assert detail_of("weight push, 1.5b-shaped", "noise\n" + push, 0) == (
        "3.00 GB bfloat16 on cuda: sync 10.00 GB/s, device copy 200.00 GB/s (sync = 20.0x the copy's time)"
    )
    assert detail_of("check-sync dense, vLLM", "3. synced\nPASS: every tensor equal, log-prob mismatch within tolerance\n", 0).startswith("PASS")
    assert detail_of("doctor", "x\nmegatron-dapo: error: no GPU\n", 2) == "megatron-dapo: error: no GPU"
    assert detail_of("doctor", "", None) == "timed out"
    assert detail_of("doctor", "", 3) == "exit code 3"


def test_table_counts_every_verdict():
    table = format_table([StepResult("doctor", PASS, 3.2, "ok"), StepResult("push", FAIL, 9, "boom"), StepResult("sglang", SKIP, 0, "absent")])
    lines = table.splitlines()
    assert lines[0].split() == ["step", "result", "seconds", "detail"]
    assert "push" in lines[3] and "FAIL" in lines[3] and lines[-1] == "1 passed, 1 failed, 1 skipped"
