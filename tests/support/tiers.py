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
# against HF, weight sync). `pytest -m "not launch or second_stack"` selects them.
SECOND_STACK_FILES = (
    "checkpoint/test_convert_roundtrip.py",
    "checkpoint/test_convert_moe.py",
    "checkpoint/test_convert_cli.py",
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
    "trainer/test_router_replay_train.py",
    "slurm/test_sbatch.py",
    "rollout/engines/test_vllm_resume.py",
    "trainer/test_async_training.py",
    "rollout/engines/test_vllm_engine.py",
    "rollout/engines/test_spmd_vllm.py",
    "trainer/test_bad_input.py",
    "rollout/sync/test_check_sync.py",
    "rollout/sync/test_check_sync_moe.py",
    "rollout/engines/test_spmd_call_off.py",
    "rollout/engines/test_spmd_shm.py",
    "rollout/sync/test_push_memory.py",
    "trainer/test_output_dir.py",
    "rollout/sync/test_sglang_check_sync.py",
    "rollout/engines/test_sglang_routing.py",
    "trainer/test_preemption.py",
    "rollout/engines/test_vllm_moe.py",
    "actor/test_moe_update.py",
    "actor/test_router_replay.py",
    "rollout/engines/test_embedded_routing.py",
)
