"""The test suite's shared helpers: plain modules, no tests and no pytest fixtures.

Everything a test, a conftest, a worker script started by torchrun or a subprocess, or a benchmark
shares lives here and is imported one way, from the repository root:

    from tests.support.tiny_models import save_tiny_model
    from tests.support.torchrun_utils import run_torchrun_function

(the repository root, not tests/, is on sys.path: tests/conftest.py puts it there for pytest,
`torchrun_utils` on every child's PYTHONPATH, benchmarks insert it themselves). Fixtures stay in
the conftest.py files, which import their helpers from here; a test module never imports from
another test module or from a conftest.

Launching:
    torchrun_utils    run a function or script on N ranks (torchrun, SLURM-style srun, the zygote),
                      launch slots, `two_at_a_time`, per-rank results (`write_rank_result`, `reporting`)
    rank_zygote       forks ranks from a process that has imported torch / Megatron-Core already
    harness_worker    functions the harness's own tests (tests/test_torchrun_utils.py) start
    ci                `under_ci`, `skip_or_fail`: under CI a missing optional part fails, never skips
    tiers             which tests the fast tier leaves out, SECOND_STACK_FILES, LONGEST_FIRST
    trainer_runs      the trainer CLI in a subprocess (`run_cli`, `cli`), FAST settings, metrics checks
    check_sync_runs   `megatron-dapo check-sync` in a subprocess, its printed mismatch
    slurm_cluster     the throw-away localhost SLURM cluster of tests/slurm
Models and data:
    tiny_models       tiny randomly initialised HF models (dense, MoE), saved or built in memory
    vllm_engines      the tests' vLLM CPU engines
    fake_sglang       a fake `sglang` package that records the adapter's calls
    shard_shapes      a small GQA model's HF tensor shapes (TP-shard tests)
    actor_steps       the actor tests' config, 7-sequence batch, actor builder and exports
    samples           random rollout `Samples` and their JSON-comparable form
    counting_reader   an HF weight reader that counts the bytes it reads
    questions         the prompt-data tests' questions
    reward_functions  tokenizer and reward functions for the reward tests (importable by workers)
    plans             plans of the built-in model shapes (planner tests)
    plan_references   independent references the planner is checked against (Megatron-LM's formula)
    storage_ledger    counts the tensor memory a piece of code allocates (weight-push memory test)
"""
