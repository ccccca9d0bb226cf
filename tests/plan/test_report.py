"""The table `megatron-dapo plan` prints (plan/report.py), for a dense model and a mixture of experts."""

from __future__ import annotations

from megatron_dapo import plan as mp
from tests.support.plans import OFFLOAD_ALL, plan_for

BATCH_OF_3 = ["trainer.train_batch_size=3", "trainer.gen_batch_size=3", "trainer.ppo_mini_batch_size=3"]  # splits over 3 ranks


def test_offload_table_lines():
    table = mp.format_plan(plan_for(["parallel.tp=4", "parallel.sequence_parallel=true", "rollout.tp=2", "rollout.engine=vllm", *OFFLOAD_ALL]))
    assert "actor offload while generating (actor.offload_*)" in table and "params, grads, optimizer" in table
    assert "host memory, pinned (per GPU, per node)" in table
    assert "weight sync: params + kept + engine weights + bucket" in table
    # (79.1 GiB - 6 reserve - 0.94 gathered results) / 79.1 = 0.912, rounded down
    assert "largest rollout.gpu_memory_utilization: 0.91 with this offload (" in table
    assert "with the actor resident, 0.91 with params, grads and optimizer offloaded" in table
    assert "79.1 GiB per GPU (H100 80GB as reported)" in table
    assert "profiled activation peak (16384 tokens, 1024 seqs)" in table and "in the pool" in table
    assert "KV cache (pool - weights - activation peak)" in table
    assert "result buffers while generating (gathered rollouts)" in table


def test_moe_table_shows_experts_apart_from_the_dense_part():
    plan = plan_for(["parallel.tp=2", "parallel.sequence_parallel=true", "parallel.ep=8"], model="qwen3-30b-a3b")
    table = mp.format_plan(plan)
    part = plan.moe.stages[0]
    assert "(Qwen3MoeForCausalLM, 30.53B parameters, 3.35B active)" in table
    assert "CP=1 DP=8 EP=8; sequence parallel on" in table
    assert "mixture of experts: 128 experts per layer, top-8 per token; 28.99B of the 30.53B parameters are experts" in table
    assert "16 experts per GPU (EP=8), each split over expert-TP=2 (= TP); expert DP=1" in table
    dense_row = next(line for line in table.splitlines() if line.strip().startswith("dense (0."))
    expert_row = next(line for line in table.splitlines() if line.strip().startswith("experts (1."))
    assert f"{part.dense_distributed_optimizer.total / mp.GIB:8.2f} GiB" in dense_row
    assert f"{part.expert_distributed_optimizer.total / mp.GIB:8.2f} GiB" in expert_row
    assert f"{part.expert_plain_optimizer.total / mp.GIB:8.2f} GiB" in expert_row
    assert "dense: attention, embeddings, norms, router; the distributed optimizer shards its state over DP x CP = 8" in table
    assert "of which token dispatch (alltoall, in + out)" in table and "64.0 KiB" in table
    dense_table = mp.format_plan(plan_for(["parallel.tp=4", "parallel.sequence_parallel=true"]))
    for moe_only in ("active)", "EP=", "mixture of experts", "actor by part", "token dispatch"):
        assert moe_only not in dense_table


def test_cli_plans_a_mixture_of_experts_from_its_config_json(tmp_path, capsys):
    """`megatron-dapo plan` on a Qwen2-MoE directory (shared expert): JSON with the expert section; a bad
    EP is the command line's configuration error (exit 2)."""
    import json

    from megatron_dapo.cli.main import main
    from tests.support.tiny_models import tiny_moe_config

    config = tiny_moe_config("qwen2_moe").to_dict()
    (tmp_path / "config.json").write_text(json.dumps(config))
    args = ["plan", f"model.hf_dir={tmp_path}", "--gpus-per-node", "2", "parallel.ep=2"]
    assert main([*args, "--json"]) in (0, 3)
    out = json.loads(capsys.readouterr().out)
    moe = out["moe"]
    assert (moe["ep"], moe["expert_dp"], moe["experts_per_rank"], moe["shared_expert"]) == (2, 1, 2, True)
    stage = moe["stages"][0]
    assert stage["expert_parameters"] == 2 * 2 * 3 * 64 * 32  # 2 layers x 2 local experts of width 32
    assert out["stages"][0]["parameters"] == stage["dense_parameters"] + stage["expert_parameters"]
    main(args)
    assert "dense: attention, embeddings, norms, router, shared expert;" in capsys.readouterr().out
    assert main(["plan", f"model.hf_dir={tmp_path}", "--gpus-per-node", "3", "parallel.ep=3", *BATCH_OF_3]) == 2
    assert "megatron-dapo: error: parallel.ep=3 does not divide the model's num_experts=4" in capsys.readouterr().err

