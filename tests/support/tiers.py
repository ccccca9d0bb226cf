"""Which test files run where: the second stack's launch files and the longest-first order (paths
relative to tests/).

tests/conftest.py applies both (the `second_stack` marker, the collection order); the fast tier's
rule (which tests count as launch tests) is there too, since it reads the collected items.
tests/test_test_selection.py checks that every file listed exists.
"""

from __future__ import annotations

# The second stack of `make test` (Python 3.12 + megatron-core 0.19.x, what clusters run) runs the
# fast tier and these launch files: every numerical comparison against an independent reference
# that a Megatron-Core or Python release could break (conversion round trips, HF logits at every
# layout, TP/PP/CP/EP equalities, resume equal to an uninterrupted run, the engines' log-probs
# against HF, weight sync). The CLI wrapper of the conversion (test_convert_cli.py: errors, an
# interrupted conversion) and the separate placement's bridge (test_check_sync_separate.py) run on
# the first stack only. `pytest -m "not launch or second_stack"` selects them.
SECOND_STACK_FILES = (
    "checkpoint/test_convert_roundtrip.py",
    "checkpoint/test_convert_moe.py",
    "checkpoint/test_checkpoint_resume.py",
    "checkpoint/test_checkpoint_damage.py",
    "model/test_megatron_vs_hf.py",
    "model/test_moe_vs_hf.py",
    "distributed/test_context_parallel_dist.py",
    "distributed/test_init_distributed.py",
    "actor/test_actor_parallel.py",
    "actor/test_moe_update.py",
    "trainer/test_output_dir.py",
    "rollout/engines/test_vllm_engine.py",
    "rollout/engines/test_sglang_engine.py",
    "rollout/sync/test_check_sync.py",
)


# The longest files first (docs/TEST_DURATIONS.md), each kept whole and in its own order: `make test`
# runs two files at a time (pytest-xdist, --dist loadfile), and a long file started last would run
# alone at the end while the other worker has nothing left.
LONGEST_FIRST = (
    "trainer/test_train_cli.py",
    "rollout/sync/test_weight_sync.py",
    "trainer/test_moe_train.py",
    "smoke/test_smoke_command.py",
    "trainer/test_bad_input.py",
    "slurm/test_preemption_vllm.py",
    "trainer/test_async_training.py",
    "rollout/sync/test_check_sync_moe.py",
    "trainer/test_router_replay_train.py",
    "rollout/engines/test_spmd_call_off.py",
    "trainer/test_separate_engines.py",
    "rollout/engines/test_vllm_engine.py",
    "distributed/test_liveness_gather.py",
    "rollout/sync/test_sglang_check_sync.py",
    "slurm/test_sbatch.py",
    "checkpoint/test_convert_cli.py",
    "rollout/engines/test_spmd_vllm.py",
    "rollout/engines/test_spmd_shm.py",
    "rollout/engines/test_vllm_resume.py",
    "checkpoint/test_checkpoint_resume.py",
    "rollout/sync/test_check_sync.py",
    "actor/test_actor_parallel.py",
    "trainer/test_preemption_call_off.py",
    "rollout/sync/test_push_memory.py",
    "trainer/test_preemption.py",
    "actor/test_moe_update.py",
    "rollout/engines/test_sglang_engine.py",
    "trainer/test_sglang_train.py",
    "rollout/engines/test_sglang_parallel_start.py",
    "trainer/test_separate_sync.py",
    "trainer/test_handover_barrier.py",
    "rollout/sync/test_check_sync_separate.py",
)
