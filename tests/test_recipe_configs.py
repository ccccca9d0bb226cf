"""The DAPO recipes (Qwen2.5-7B, Qwen2.5-32B, the mixture of experts Qwen3-30B-A3B): they load, fit
the world they are written for, carry the paper's settings, require Transformer Engine, and fit
H100 80GB GPUs (79.1 GiB as torch reports them) by the memory planner, whose figures their comments
quote."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from megatron_dapo import plan as mp
from megatron_dapo.config import ConfigError, load_config

CONFIGS = Path(__file__).resolve().parents[1] / "configs"

# recipe file -> (built-in model, nodes of 8 GPUs it is laid out for: slurm/dapo_*.sbatch)
RECIPES = {
    "dapo_qwen2.5_7b.yaml": ("qwen2.5-7b", 2),
    "dapo_qwen2.5_32b.yaml": ("qwen2.5-32b", 4),
    "dapo_qwen3_30b_a3b.yaml": ("qwen3-30b-a3b", 2),
}
MOE_RECIPES = sorted(name for name, (model, _) in RECIPES.items() if mp.known_model(model).is_moe)
# asynchronous recipe (issue 27) -> (the synchronous recipe it changes, nodes of 8 GPUs, of them the engines' GPUs)
ASYNC_RECIPES = {
    "dapo_qwen2.5_32b_async.yaml": ("dapo_qwen2.5_32b.yaml", 6, 32),
    "dapo_qwen3_30b_a3b_async.yaml": ("dapo_qwen3_30b_a3b.yaml", 3, 8),
}


def test_every_recipe_and_its_sbatch_script_are_covered():
    recipes = {path.name for path in CONFIGS.glob("dapo_*.yaml")}
    assert recipes == set(RECIPES) | set(ASYNC_RECIPES)
    slurm = CONFIGS.parent / "slurm"
    for name in recipes:
        script = (slurm / name.replace(".yaml", ".sbatch")).read_text()
        nodes = int(re.search(r"^#SBATCH --nodes=(\d+)$", script, re.M).group(1))
        assert nodes == (RECIPES[name][1] if name in RECIPES else ASYNC_RECIPES[name][1]), name
        assert f"dapo_train configs/{name} " in script and "--ntasks-per-node=8" in script and "--gpus-per-node=8" in script
    assert MOE_RECIPES == ["dapo_qwen3_30b_a3b.yaml"]


@pytest.fixture(autouse=True)
def _no_model_dir(monkeypatch):
    monkeypatch.delenv("MODEL_DIR", raising=False)
    monkeypatch.delenv("DATA_DIR", raising=False)


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_recipe_has_the_paper_settings(name):
    cfg = load_config(CONFIGS / name)
    a, r, o, t = cfg.algorithm, cfg.rollout, cfg.optimizer, cfg.trainer
    assert o.lr == 1e-6
    assert o.warmup_steps == 20  # the paper's linear warm-up (rollout steps); verl's public recipe: 10
    assert o.weight_decay == 0.1
    assert (a.clip_low, a.clip_high) == (0.2, 0.28)
    assert t.train_batch_size == 512 and r.n == 16
    assert t.gen_batch_size == 3 * t.train_batch_size
    assert r.max_response_length == 20480
    assert a.overlong_buffer.enable and a.overlong_buffer.len == 4096 and a.overlong_buffer.penalty_factor == 1.0
    assert t.ppo_mini_batch_size == 32
    assert r.temperature == 1.0 and r.top_p == 1.0 and r.top_k == -1
    assert a.loss_agg_mode == "token-mean"
    assert not a.kl.use_kl_loss
    assert a.filter_groups.enable and a.filter_groups.metric == "acc"
    assert r.max_prompt_length == 2048
    assert a.entropy_coeff == 0.0 and o.grad_clip == 1.0


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_recipe_model_dir_is_a_placeholder_to_override(name, monkeypatch, tmp_path):
    model_name, _ = RECIPES[name]
    cfg = load_config(CONFIGS / name)
    assert cfg.model.hf_dir.startswith("/path/to/")  # nothing there: the run must be pointed at a model
    assert cfg.data.train_files == ["data/dapo-math-17k.parquet"]

    # With MODEL_DIR set, the model's config.json is read and the layout checked against its shape.
    model_dir = tmp_path / model_name
    model_dir.mkdir()
    (model_dir / "config.json").write_text(json.dumps(mp.KNOWN_MODELS[model_name]))
    monkeypatch.setenv("MODEL_DIR", str(model_dir))
    monkeypatch.setenv("DATA_DIR", "/data/dapo")
    cfg = load_config(CONFIGS / name)
    assert cfg.model.hf_dir == str(model_dir)
    assert cfg.data.val_files == ["/data/dapo/aime-2024.parquet"]
    # ... so a layout the model cannot take fails at load time.
    with pytest.raises(ConfigError, match="does not divide the model's num_attention_heads"):
        load_config(CONFIGS / name, ["parallel.tp=3"])
    # An explicit override wins over the environment.
    assert load_config(CONFIGS / name, ["model.hf_dir=/models/x"]).model.hf_dir == "/models/x"


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_recipe_fits_its_world(name):
    _, nodes = RECIPES[name]
    cfg = load_config(CONFIGS / name).resolve_world(nodes * 8)
    p = cfg.parallel
    assert p.tp <= 8  # tensor parallelism stays inside one 8-GPU NVLink node
    assert p.dp == nodes * 8 // (p.tp * p.pp * p.cp)
    assert p.sequence_parallel and p.use_distributed_optimizer
    assert cfg.trainer.max_tokens_per_micro_batch >= cfg.rollout.max_prompt_length + cfg.rollout.max_response_length
    with pytest.raises(ConfigError):
        load_config(CONFIGS / name).resolve_world(nodes * 8 + 4)


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_recipe_fits_h100_gpus_and_quotes_the_planner(name):
    model_name, nodes = RECIPES[name]
    cfg = load_config(CONFIGS / name)
    plan = mp.plan_memory(cfg, mp.known_model(model_name), mp.ClusterShape(nodes=nodes), model_name=model_name)
    assert plan.fits, mp.format_plan(plan)
    assert cfg.trainer.max_tokens_per_micro_batch <= plan.max_tokens_per_micro_batch
    assert cfg.rollout.gpu_memory_utilization <= plan.rollout.max_gpu_memory_utilization
    assert plan.rollout.concurrent_full_sequences >= 8
    # Headroom beyond the planner's own reserve: 2 GiB while generating, 10 GiB while training.
    assert plan.gpu_memory - plan.rollout.phase_total >= 2 * mp.GIB
    assert plan.gpu_memory - max(s.training_total for s in plan.stages) >= 10 * mp.GIB

    # The planner figures quoted in the recipe's comments are the planner's current output.
    text = (CONFIGS / name).read_text()
    table = mp.format_plan(plan)
    quoted = re.search(r"largest trainer\.max_tokens_per_micro_batch: (\d+)", text)
    assert quoted and f"largest trainer.max_tokens_per_micro_batch: {quoted.group(1)} " in table
    stage = plan.stages[plan.binding_stage]
    d, n = stage.actor_distributed_optimizer, stage.actor_plain_optimizer
    r = plan.rollout
    assert plan.gpu_memory == pytest.approx(79.1 * mp.GIB)  # an H100 80GB as torch reports it
    expected_lines = [
        "79.1 GiB per GPU: what an H100 80GB reports; 6 GiB reserve",
        f"{d.total / mp.GIB:.2f} GiB / {n.total / mp.GIB:.2f} GiB",
        f"rollout: weights {r.weights / mp.GIB:.2f} GiB, activation peak {r.activation_peak / mp.GIB:.2f} GiB (in the pool)",
        f"KV pool {r.kv_cache / mp.GIB:.2f} GiB ({r.concurrent_full_sequences} full-length",
        f"result buffers {r.result_buffers / mp.GIB:.2f} GiB",
        f"{stage.activation_per_token_no_recompute / 1024:.1f} KiB (no recompute), "
        f"{stage.activation_per_token_full_recompute / 1024:.1f} KiB (full recompute)",
        f"{r.phase_total / mp.GIB:.2f} GiB   fits",
        f"generation:  kept actor state (none) + pool + results + reserve   {r.generation_total / mp.GIB:.2f} GiB   fits",
        f"weight sync: params + engine weights + bucket + reserve           {r.sync_total / mp.GIB:.2f} GiB   fits",
        f"{max(s.training_total for s in plan.stages) / mp.GIB:.2f} GiB   fits",
        f"host memory {r.host_per_gpu / mp.GIB:.2f} GiB per GPU, {r.host_per_node / mp.GIB:.2f} GiB per node",
        f"largest rollout.gpu_memory_utilization: {mp.format_utilization(r.max_gpu_memory_utilization)} with this offload "
        f"({r.concurrent_full_sequences_at_max} full-length sequences per engine); "
        f"{mp.format_utilization(r.max_gpu_memory_utilization_resident)} with the actor resident",
    ]
    for line in expected_lines:
        assert line in text, line
    # Every host-memory figure the comments quote is the planner's (not only one of them).
    quoted_host = re.findall(r"([\d.]+) GiB per GPU, ([\d.]+) GiB per node", text)
    assert quoted_host and set(quoted_host) == {(f"{r.host_per_gpu / mp.GIB:.2f}", f"{r.host_per_node / mp.GIB:.2f}")}, quoted_host
    # ... and the utilisation the rollout section names as the planner's limit.
    assert f"(planner: at most {mp.format_utilization(r.max_gpu_memory_utilization)})" in text


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_recipe_requires_transformer_engine(name):
    """The plan assumes TE's fused kernels and packed micro-batches: a recipe must not quietly run without."""
    assert load_config(CONFIGS / name).model.transformer_engine == "on"


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_recipe_offloads_the_actor_while_generating(name):
    """The anchors' rollout memory discipline (verl, slime): actor state to host memory, sleep level 2,
    and the pool that frees: more full-length sequences per engine than next to a resident actor."""
    model_name, nodes = RECIPES[name]
    cfg = load_config(CONFIGS / name)
    assert cfg.actor.offload_params and cfg.actor.offload_grads and cfg.actor.offload_optimizer
    assert cfg.rollout.free_cache_engine and cfg.rollout.sleep_level == 2
    plan = mp.plan_memory(cfg, mp.known_model(model_name), mp.ClusterShape(nodes=nodes), model_name=model_name)
    r = plan.rollout
    assert r.actor_kept == 0 and r.offloaded == ["params", "grads", "optimizer"]
    # The utilisation is above what a resident actor allows: the recipe depends on the offload.
    assert r.max_gpu_memory_utilization_resident < cfg.rollout.gpu_memory_utilization <= r.max_gpu_memory_utilization
    resident = mp.plan_memory(
        load_config(CONFIGS / name, ["actor.offload_params=false", "actor.offload_grads=false", "actor.offload_optimizer=false",
                                     f"rollout.gpu_memory_utilization={mp.format_utilization(r.max_gpu_memory_utilization_resident)}"]),
        mp.known_model(model_name), mp.ClusterShape(nodes=nodes),
    )  # fmt: skip
    assert resident.fits and r.concurrent_full_sequences > resident.rollout.concurrent_full_sequences


@pytest.mark.parametrize("name", MOE_RECIPES)
def test_moe_recipe_layout_and_its_quoted_expert_figures(name):
    """Expert parallelism within the model and the world, and the planner's expert lines the header quotes."""
    model_name, nodes = RECIPES[name]
    cfg = load_config(CONFIGS / name).resolve_world(nodes * 8)
    model = mp.known_model(model_name)
    p = cfg.parallel
    assert p.ep > 1 and model.num_experts % p.ep == 0 and (p.dp * p.cp) % p.ep == 0
    plan = mp.plan_memory(cfg, model, mp.ClusterShape(nodes=nodes), model_name=model_name)
    moe, r = plan.moe, plan.rollout
    part = moe.stages[plan.binding_stage]
    text = (CONFIGS / name).read_text()
    expected_lines = [
        f"parameters: {plan.hf_parameters / 1e9:.2f}B, {moe.active_parameters / 1e9:.2f}B active per token; "
        f"{moe.experts_per_rank} experts per GPU (EP={moe.ep}), expert DP={moe.expert_dp}",
        f"of which token dispatch ({moe.dispatcher}, in + out) {moe.dispatch_bytes_per_token / 1024:.1f} KiB",
        f"{r.kv_bytes_per_token / 1024:.1f} KiB/token",
    ]
    for line in expected_lines:
        assert line in text, line
    # The actor state by part: "dense (0.777B parameters)   5.43 GiB / 13.03 GiB" (dist. optimizer / none).
    for label, count, memory in [
        ("dense", part.dense_parameters, (part.dense_distributed_optimizer, part.dense_plain_optimizer)),
        ("experts", part.expert_parameters, (part.expert_distributed_optimizer, part.expert_plain_optimizer)),
    ]:
        quoted = re.search(rf"^#     {label} \(([\d.]+)B parameters\) +([\d.]+) GiB / ([\d.]+) GiB$", text, re.M)
        assert quoted, label
        assert quoted.groups() == (f"{count / 1e9:.3f}", *(f"{m.total / mp.GIB:.2f}" for m in memory)), label
    stage = plan.stages[plan.binding_stage]
    headroom = plan.gpu_memory - max(s.training_total for s in plan.stages)
    assert f"{headroom / mp.GIB:.1f} GiB under the GPU's memory" in text
    assert f"without\n#   recompute a micro-batch holds {stage.max_tokens_no_recompute} tokens" in text

    # The alternatives the header weighs, as the planner sees them: TP=4 x EP=4 on the same GPUs, and one node.
    def alternative(overrides, alternative_nodes):
        alt_cfg = load_config(CONFIGS / name, overrides)
        return mp.plan_memory(alt_cfg, model, mp.ClusterShape(nodes=alternative_nodes), model_name=model_name)

    wider = alternative(["parallel.tp=4", "parallel.ep=4"], nodes)
    assert wider.fits
    assert f"({wider.stages[0].actor.total / mp.GIB:.1f} GiB of actor state, a {wider.max_tokens_per_micro_batch}-token" in text
    one_node = {(tp, ep): alternative([f"parallel.tp={tp}", f"parallel.ep={ep}", "trainer.max_tokens_per_micro_batch=22528"], 1)
                for tp, ep in [(1, 8), (2, 4), (4, 2), (1, 4), (2, 2)]}  # fmt: skip
    assert [layout for layout, one in one_node.items() if one.fits] == [(4, 2)]
    least = min(one.moe.stages[0].expert_distributed_optimizer.total for one in one_node.values())
    assert f"take at least {least / mp.GIB:.2f} GiB per GPU" in text
    assert f"with a\n#   {one_node[4, 2].max_tokens_per_micro_batch}-token micro-batch budget" in text


# ------------------------------------------------------------------ the asynchronous recipes (issue 27)

ASYNC_KEYS = {
    "actor.offload_params", "actor.offload_grads", "actor.offload_optimizer", "actor.router_replay",
    "rollout.placement", "rollout.num_gpus", "rollout.tp", "rollout.gpu_memory_utilization",
    "algorithm.tis_cap", "trainer.max_staleness", "trainer.output_dir", "trainer.experiment_name",
}  # fmt: skip


def _flat(value, prefix=""):
    if isinstance(value, dict):
        out = {}
        for key, item in value.items():
            out.update(_flat(item, f"{prefix}{key}."))
        return out
    return {prefix[:-1]: value}


@pytest.mark.parametrize("name", sorted(ASYNC_RECIPES))
def test_async_recipe_is_its_synchronous_recipe_with_the_async_keys_changed(name):
    """`base:` keeps the paper's settings and the synchronous layout's reasoning in one place: only
    the placement, the staleness, the correction and what no longer shares a GPU differ."""
    import dataclasses

    base_name, _, _ = ASYNC_RECIPES[name]
    sync, run = (_flat(dataclasses.asdict(load_config(CONFIGS / n))) for n in (base_name, name))
    changed = {key for key in sync if sync[key] != run[key]}
    assert changed <= ASYNC_KEYS, changed - ASYNC_KEYS
    assert {"rollout.placement", "trainer.max_staleness", "algorithm.tis_cap"} <= changed
    cfg = load_config(CONFIGS / name)
    assert cfg.rollout.placement == "separate" and cfg.trainer.max_staleness == 1 and cfg.algorithm.tis_cap == 2.0
    assert not cfg.actor.offload_any  # no engine shares the trainer's GPUs
    assert cfg.actor.router_replay != "r3"  # refused with max_staleness > 0 (the routing is not carried over)


@pytest.mark.parametrize("name", sorted(ASYNC_RECIPES))
def test_async_recipe_splits_its_nodes_whole_and_fits_both_pools(name):
    base_name, nodes, engine_gpus = ASYNC_RECIPES[name]
    model_name, _ = RECIPES[base_name]
    cfg = load_config(CONFIGS / name)
    assert cfg.rollout.num_gpus == engine_gpus and engine_gpus % 8 == 0  # whole nodes of engines
    layout = cfg.parallel_layout(nodes * 8)
    assert layout.world_size == nodes * 8 - engine_gpus and layout.world_size % 8 == 0
    assert layout.engine_leaders()[0] == layout.world_size and layout.rollout_engines == engine_gpus // cfg.rollout.tp
    with pytest.raises(ConfigError):
        load_config(CONFIGS / name).resolve_world(nodes * 8 - 4)

    plan = mp.plan_memory(cfg, mp.known_model(model_name), mp.ClusterShape(nodes=nodes), model_name=model_name)
    assert plan.fits and plan.placement == "separate" and plan.rollout_gpus == engine_gpus, mp.format_plan(plan)
    r = plan.rollout
    assert r.actor_kept == 0 and not r.offloaded and r.host_per_gpu == 0  # nothing of the actor on an engine's GPU
    assert cfg.rollout.gpu_memory_utilization <= r.max_gpu_memory_utilization
    assert plan.gpu_memory - r.phase_total >= 2 * mp.GIB
    assert plan.gpu_memory - max(s.training_total for s in plan.stages) >= 10 * mp.GIB

    # The planner figures quoted in the header are its current output.
    text = (CONFIGS / name).read_text()
    table = mp.format_plan(plan)
    quoted_lines = re.findall(r"^#   (rollout\.placement=separate: .*|.*GPU, .*fits|largest .*)$", text, re.M)
    assert len(quoted_lines) == 6, quoted_lines
    for quoted in quoted_lines:
        figures = re.sub(r"\s+", " ", quoted.replace("   fits", "")).strip()
        assert figures in re.sub(r"\s+", " ", table), figures
    assert f"{plan.stages[plan.binding_stage].actor_distributed_optimizer.total / mp.GIB:.2f} GiB / " in text
    assert f"weights {r.weights / mp.GIB:.2f} GiB, KV pool {r.kv_cache / mp.GIB:.2f} GiB ({r.concurrent_full_sequences} full-length" in text
