"""Config loading: YAML + dotted overrides, strict keys and types, impossible combinations."""

import json
from pathlib import Path

import pytest

from megatron_dapo.config import Config, ConfigError, config_to_dict, load_config, skipped_model_checks

CONFIGS = Path(__file__).resolve().parents[1] / "configs"


def write_yaml(tmp_path, text):
    path = tmp_path / "cfg.yaml"
    path.write_text(text)
    return path


def test_defaults_are_the_dapo_paper_settings():
    cfg = load_config()
    assert isinstance(cfg, Config)
    a = cfg.algorithm
    assert (a.clip_low, a.clip_high, a.loss_agg_mode) == (0.2, 0.28, "token-mean")
    assert a.filter_groups.enable and a.filter_groups.metric == "acc"
    assert (a.overlong_buffer.len, a.overlong_buffer.penalty_factor) == (4096, 1.0)
    assert cfg.rollout.max_response_length == 20480 and cfg.rollout.n == 16
    assert not a.kl.use_kl_loss
    assert cfg.optimizer.lr == 1e-6 and cfg.optimizer.weight_decay == 0.1
    # The actor stays resident unless asked (actor.offload_*).
    assert not (cfg.actor.offload_params or cfg.actor.offload_grads or cfg.actor.offload_optimizer)
    assert not cfg.actor.offload_any and load_config(None, ["actor.offload_grads=true"]).actor.offload_any


def test_yaml_and_overrides_are_typed(tmp_path):
    path = write_yaml(
        tmp_path,
        "trainer:\n  total_steps: 3\n  train_batch_size: 4\n  gen_batch_size: 8\n  ppo_mini_batch_size: 2\n"
        "rollout:\n  max_response_length: 64\nalgorithm:\n  overlong_buffer:\n    len: ${rollout.max_response_length}\n",
    )
    cfg = load_config(path, ["trainer.total_steps=10", "optimizer.lr=3", "algorithm.clip_c=null", "data.train_files=a.jsonl"])
    assert cfg.trainer.total_steps == 10
    assert cfg.optimizer.lr == 3.0 and isinstance(cfg.optimizer.lr, float)  # ints accepted for floats
    assert cfg.algorithm.clip_c is None
    assert cfg.algorithm.overlong_buffer.len == 64  # interpolation resolved
    assert cfg.data.train_files == ["a.jsonl"]  # a single path is a list of one
    assert config_to_dict(cfg)["trainer"]["total_steps"] == 10


@pytest.mark.parametrize(
    "override, expected",
    [
        ("trainer.total_step=1", "Did you mean 'trainer.total_steps'"),
        ("algorithm.filter_groups.enabl=true", "'algorithm.filter_groups.enable'"),
        ("foo.bar=1", "unknown config key 'foo'"),
        ("trainer.total_steps.x=1", "is a value, not a section"),
        ("trainer.total_steps=1.5", "'trainer.total_steps' must be int"),
        ("trainer.total_steps=true", "'trainer.total_steps' must be int"),
        ("algorithm.filter_groups.enable=3", "must be bool"),
        ("rollout.engine=vlm", "Did you mean 'vllm'"),
        ("algorithm.kl=3", "'algorithm.kl' must be a mapping"),
        ("parallel.dp=2", "derived from the world size"),
        ("trainer.total_steps", "key=value"),
        ("actor.offload_param=true", "Did you mean 'actor.offload_params'"),
        ("actor.offload_optimizer=1", "'actor.offload_optimizer' must be bool"),
    ],
)
def test_bad_keys_and_types_name_the_key(override, expected):
    with pytest.raises(ConfigError, match=expected.replace("(", r"\(").replace(".", r"\.").replace("'", "'")):
        load_config(None, [override])


def test_bare_on_and_off_are_the_words_where_the_choices_are_words(tmp_path):
    """YAML 1.1 reads `on` / `off` as booleans: `transformer_engine: on` must still mean "on"."""
    path = tmp_path / "te.yaml"
    path.write_text("model:\n  transformer_engine: on\n")
    assert load_config(path).model.transformer_engine == "on"
    assert load_config(path, ["model.transformer_engine=off"]).model.transformer_engine == "off"
    assert load_config(path, ["actor.router_replay=off"]).actor.router_replay == "off"
    with pytest.raises(ConfigError, match="'actor.router_replay' must be one of 'off', 'r2', 'r3', got True"):
        load_config(path, ["actor.router_replay=on"])
    assert load_config(None, ["model.transformer_engine=auto"]).model.transformer_engine == "auto"
    with pytest.raises(ConfigError, match="'rollout.engine' must be one of"):  # no on/off among the choices
        load_config(None, ["rollout.engine=true"])


def test_unknown_key_in_yaml(tmp_path):
    path = write_yaml(tmp_path, "rollout:\n  temprature: 0.7\n")
    with pytest.raises(ConfigError, match="Did you mean 'rollout.temperature'"):
        load_config(path)


def test_missing_or_malformed_file(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.yaml")
    with pytest.raises(ConfigError, match="mapping"):
        load_config(write_yaml(tmp_path, "- 1\n- 2\n"))


@pytest.mark.parametrize(
    "overrides, expected",
    [
        (["trainer.gen_batch_size=8", "trainer.train_batch_size=16"], "raise trainer.gen_batch_size"),
        (["rollout.max_response_length=100", "algorithm.overlong_buffer.len=200"], "shorten the buffer"),
        (["trainer.train_batch_size=10", "trainer.gen_batch_size=10", "trainer.ppo_mini_batch_size=4"], "not a multiple"),
        (["algorithm.clip_c=0.5"], "must be > 1 or null"),
        (["rollout.top_p=0"], "rollout.top_p"),
        (["rollout.temperature=0"], "rollout.temperature"),
        (["trainer.max_tokens_per_micro_batch=100"], "cannot hold one full sequence"),
        (["trainer.loggers=[console,foo]"], "unknown logger 'foo'"),
        (["reward.custom_function.path=mymodule"], "does not name the function"),
        (["reward.custom_function.name=f"], "'reward.custom_function.path' is not"),
    ],
)
def test_impossible_combinations(overrides, expected):
    with pytest.raises(ConfigError, match=expected):
        load_config(None, overrides)


def test_overlong_buffer_check_skipped_when_disabled():
    cfg = load_config(None, ["rollout.max_response_length=100", "algorithm.overlong_buffer.enable=false"])
    assert cfg.algorithm.overlong_buffer.len == 4096


def _model_dir(tmp_path, heads=16, kv=4, layers=6, architecture="Qwen2ForCausalLM"):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(
        json.dumps({"architectures": [architecture], "hidden_size": 64 * heads, "intermediate_size": 256,
                    "max_position_embeddings": 1024, "vocab_size": 1000, "num_attention_heads": heads,
                    "num_key_value_heads": kv, "num_hidden_layers": layers})  # fmt: skip
    )
    return str(model)


def test_model_shape_is_checked_at_load_from_the_models_config_json(tmp_path):
    """`distributed.layout.check_model_shape` with the heads, query groups and layers of model.hf_dir."""
    model = _model_dir(tmp_path)
    with pytest.raises(ConfigError, match=r"'parallel.tp'=3 does not divide the model's num_attention_heads=16"):
        load_config(None, [f"model.hf_dir={model}", "parallel.tp=3"])
    with pytest.raises(ConfigError, match=r"num_key_value_heads=4 .*use parallel.tp in \{1, 2, 4\}"):
        load_config(None, [f"model.hf_dir={model}", "parallel.tp=8"])
    with pytest.raises(ConfigError, match="num_hidden_layers=6 is not divisible by parallel.pp x parallel.vpp = 4"):
        load_config(None, [f"model.hf_dir={model}", "parallel.pp=4"])
    cfg = load_config(None, [f"model.hf_dir={model}", "parallel.tp=4", "parallel.pp=3"])
    assert cfg.parallel.tp == 4


def test_layout_rules_are_config_errors():
    """The rules are `distributed.layout`'s (their messages are tested there); the config applies them at
    load (sizes) and at `resolve_world` (world size, rollout TP, batch split), as ConfigErrors."""
    with pytest.raises(ConfigError, match="'parallel.tp' must be >= 1"):
        load_config(None, ["parallel.tp=0"])
    with pytest.raises(ConfigError, match="needs pipeline parallelism"):
        load_config(None, ["parallel.vpp=2"])
    cfg = load_config(
        None,
        ["parallel.tp=2", "trainer.train_batch_size=4", "trainer.gen_batch_size=4", "trainer.ppo_mini_batch_size=2",
         "rollout.n=3", "trainer.micro_batch_size=1"],
    )
    with pytest.raises(ConfigError, match="world size 0: a run needs at least one process"):
        cfg.resolve_world(0)
    with pytest.raises(ConfigError, match="world size 3 is not divisible"):
        cfg.resolve_world(3)
    with pytest.raises(ConfigError, match="cannot be split evenly over 4 data-parallel ranks"):
        cfg.resolve_world(8)
    assert cfg.parallel.dp is None
    assert cfg.resolve_world(4).parallel.dp == 2
    cfg.trainer.micro_batch_size = 2
    with pytest.raises(ConfigError, match="'trainer.micro_batch_size'=2"):
        cfg.resolve_world(4)
    cfg.trainer.micro_batch_size, cfg.rollout.tp = 1, 4
    with pytest.raises(ConfigError, match="'rollout.tp'=4 must divide the world size 2"):
        cfg.resolve_world(2)
    cfg.rollout.tp, cfg.rollout.n, cfg.trainer.gen_batch_size = 1, 4, 6
    with pytest.raises(ConfigError, match=r"'trainer.gen_batch_size'=6 prompts cannot be split evenly over 4"):
        cfg.resolve_world(8)


@pytest.mark.parametrize("path", sorted(CONFIGS.glob("*.yaml")), ids=lambda p: p.name)
def test_shipped_configs_load(path):
    load_config(path)


# ------------------------------------------------------------------ bad input, as a new user makes it


@pytest.mark.parametrize(
    "text, expected",
    [
        ("trainer:\n  total_steps: 5\n  total_steps: 6\n",
         r"cfg.yaml line 3: key 'trainer.total_steps' is given twice \(first on line 2\)"),
        ("rollout:\n  n: 4\ntrainer:\n  seed: 1\nrollout:\n  n: 8\n", r"line 5: key 'rollout' is given twice \(first on line 1\)"),
        ("trainer:\n  loggers: [console, jsonl\nmodel: {}\n",
         r"cfg.yaml line 3, column 6: invalid YAML: expected ',' or '\]'.*flow sequence on line 2"),
        ("trainer:\n  total_steps: 5\n bad_indent: 1\n", r"cfg.yaml line 3, column 2: invalid YAML"),
        ("trainer: {total_steps: 5\n", r"cfg.yaml line 2, column 1: invalid YAML"),
    ],
)
def test_yaml_mistakes_name_the_file_line_and_key(tmp_path, text, expected):
    with pytest.raises(ConfigError, match=expected):
        load_config(write_yaml(tmp_path, text))


def test_config_file_not_utf8(tmp_path):
    path = tmp_path / "cfg.yaml"
    path.write_bytes("trainer:\n  experiment_name: caf\u00e9\n".encode("latin-1"))
    with pytest.raises(ConfigError, match="cfg.yaml is not UTF-8 text"):
        load_config(path)


def test_model_config_json_that_is_not_json_names_the_file(tmp_path):
    model = Path(_model_dir(tmp_path))
    (model / "config.json").write_text('{"architectures": [\n')
    with pytest.raises(ConfigError, match=r"model/config.json is not valid JSON \(line 2, column 1"):
        load_config(None, [f"model.hf_dir={model}"])


def test_unsupported_architecture_is_refused_with_converts_message(tmp_path):
    from megatron_dapo.model.hf_config import SUPPORTED_ARCHITECTURES, UnsupportedModelError, read_hf_config

    model = _model_dir(tmp_path, architecture="MistralForCausalLM")
    with pytest.raises(UnsupportedModelError) as convert_says:  # what `megatron-dapo convert` reports
        read_hf_config(model)
    with pytest.raises(ConfigError) as config_says:
        load_config(None, [f"model.hf_dir={model}"])
    assert str(convert_says.value) in str(config_says.value)
    assert all(name in str(config_says.value) for name in SUPPORTED_ARCHITECTURES)


def test_skipped_model_checks_say_why(tmp_path):
    assert "'model.hf_dir' is empty" in skipped_model_checks(load_config(None, ["parallel.tp=3"]))
    assert "does not exist here" in skipped_model_checks(load_config(None, [f"model.hf_dir={tmp_path / 'nope'}"]))
    assert "has no config.json" in skipped_model_checks(load_config(None, [f"model.hf_dir={tmp_path}"]))
    assert skipped_model_checks(load_config(None, [f"model.hf_dir={_model_dir(tmp_path)}"])) is None


def test_expert_parallel_rules_are_config_errors(tmp_path):
    """`parallel.ep` against the model's experts at load and against the world at `resolve_world`
    (`distributed.layout`'s expert-parallel rules, their messages tested there)."""
    dense = _model_dir(tmp_path)
    moe = tmp_path / "moe"
    moe.mkdir()
    (moe / "config.json").write_text(
        json.dumps({"architectures": ["Qwen3MoeForCausalLM"], "hidden_size": 64, "intermediate_size": 256, "head_dim": 16,
                    "max_position_embeddings": 1024, "vocab_size": 1000, "num_attention_heads": 4, "num_key_value_heads": 2,
                    "num_hidden_layers": 2, "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32})  # fmt: skip
    )
    with pytest.raises(ConfigError, match="parallel.ep=0 must be a positive integer"):
        load_config(None, ["parallel.ep=0"])
    with pytest.raises(ConfigError, match="parallel.ep=2 needs a mixture-of-experts model"):
        load_config(None, [f"model.hf_dir={dense}", "parallel.ep=2"])
    with pytest.raises(ConfigError, match=r"parallel.ep=3 does not divide the model's num_experts=8: use parallel.ep in \{1, 2, 4, 8\}"):
        load_config(None, [f"model.hf_dir={moe}", "parallel.ep=3"])
    with pytest.raises(ConfigError, match="needs sequence parallelism"):
        load_config(None, [f"model.hf_dir={moe}", "parallel.tp=2"])
    cfg = load_config(None, [f"model.hf_dir={moe}", "parallel.ep=4", "trainer.ppo_mini_batch_size=2", "rollout.n=2"])
    with pytest.raises(ConfigError, match="parallel.ep must divide DP x CP = 2"):
        cfg.resolve_world(2)
    assert cfg.resolve_world(4).parallel.dp == 4 and cfg.parallel.ep == 4


def test_router_replay_needs_a_mixture_of_experts_model(tmp_path):
    from megatron_dapo.config import validate_model_shape

    cfg = Config()
    cfg.actor.router_replay = "r3"
    with pytest.raises(ConfigError, match="'actor.router_replay'=r3 replays mixture-of-experts routing, but 'model.hf_dir' holds a dense model \\(qwen2\\)"):
        validate_model_shape(cfg, {"model_type": "qwen2", "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 2})
    validate_model_shape(cfg, {"model_type": "qwen3_moe", "num_attention_heads": 4, "num_key_value_heads": 2,
                               "num_hidden_layers": 2, "num_experts": 4})  # fmt: skip


def test_which_engines_are_asked_for_routed_experts():
    from megatron_dapo.config import engine_returns_routing

    cfg = Config()
    assert engine_returns_routing(cfg, is_moe=True)  # the embedded engine: always on MoE models
    assert not engine_returns_routing(cfg, is_moe=False)
    for engine in ("vllm", "sglang"):
        cfg.rollout.engine = engine
        assert not engine_returns_routing(cfg, is_moe=True)  # it costs vLLM / SGLang: only when asked
        cfg.actor.router_replay = "r3"
        assert engine_returns_routing(cfg, is_moe=True) and not engine_returns_routing(cfg, is_moe=False)
        cfg.actor.router_replay, cfg.rollout.return_routed_experts = "r2", True
        assert engine_returns_routing(cfg, is_moe=True)
        cfg.rollout.return_routed_experts = False


# ------------------------------------------------------------------ `base:` (a recipe as its differences)


def test_a_config_file_changes_its_base(tmp_path):
    (tmp_path / "sync.yaml").write_text("trainer:\n  total_steps: 7\n  seed: 3\nrollout:\n  n: 4\n  stop: [a, b]\n")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "async.yaml").write_text("base: ../sync.yaml\ntrainer:\n  seed: 5\nrollout:\n  stop: [c]\n")
    (tmp_path / "sub" / "more.yaml").write_text("base: async.yaml\nrollout:\n  n: 8\n")
    cfg = load_config(tmp_path / "sub" / "more.yaml", ["trainer.total_steps=9"])
    assert (cfg.trainer.total_steps, cfg.trainer.seed, cfg.rollout.n, cfg.rollout.stop) == (9, 5, 8, ["c"])  # lists replaced whole


@pytest.mark.parametrize(
    "files, message",
    [
        ({"a.yaml": "base: missing.yaml\n"}, r"a.yaml: 'base: missing.yaml' does not exist \(looked for .*missing.yaml\)"),
        ({"a.yaml": "base: b.yaml\n", "b.yaml": "base: a.yaml\n"}, r"'base: a.yaml' comes back to a.yaml \(a.yaml -> b.yaml -> a.yaml\)"),
        ({"a.yaml": "base: [b.yaml]\n"}, r"'base' names the config file this one changes"),
        ({"a.yaml": "base: b.yaml\n", "b.yaml": "trainer:\n  nope: 1\n"}, r"nope"),
    ],
)
def test_a_bad_base_is_named(tmp_path, files, message):
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    with pytest.raises(ConfigError, match=message):
        load_config(tmp_path / "a.yaml")
