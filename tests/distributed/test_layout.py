"""The layout rules (sizes, model shape, world size, rollout TP, batch split) and their messages;
ParallelLayout: derived data-parallel size, rank groups, layer placement."""

from __future__ import annotations

import pytest

from megatron_dapo.distributed.layout import (
    LayoutError,
    ParallelLayout,
    check_batch_split,
    check_model_shape,
    check_rollout_tp,
    check_sizes,
    check_world_size,
    divisors,
)
from megatron_dapo.errors import InputError


def test_divisors():
    assert divisors(16) == [1, 2, 4, 8, 16]
    assert divisors(7) == [1, 7]


def test_a_broken_rule_is_bad_input():
    """The one error handler reports it in one line with exit 2; callers that catch ValueError still do."""
    assert issubclass(LayoutError, InputError) and issubclass(LayoutError, ValueError)


def test_tp_must_divide_heads_message_names_key_and_fix():
    with pytest.raises(LayoutError) as err:
        ParallelLayout(tp=3).validate(num_attention_heads=16)
    assert str(err.value) == (
        "'parallel.tp'=3 does not divide the model's num_attention_heads=16: use parallel.tp in {1, 2, 4, 8, 16}"
    )


def test_tp_must_divide_query_groups():
    with pytest.raises(LayoutError, match=r"'parallel.tp'=4 does not divide the model's num_key_value_heads=2 .*\{1, 2\}"):
        ParallelLayout(tp=4).validate(num_attention_heads=16, num_query_groups=2)


def test_model_shape_against_tp_pp_and_vpp():
    """A model of 16 heads, 4 query groups and 6 layers."""
    shape = dict(num_attention_heads=16, num_query_groups=4, num_layers=6)
    with pytest.raises(LayoutError, match=r"'parallel.tp'=3 does not divide the model's num_attention_heads=16"):
        check_model_shape(3, 1, None, **shape)
    with pytest.raises(LayoutError, match=r"num_key_value_heads=4 .*use parallel.tp in \{1, 2, 4\}"):
        check_model_shape(8, 1, None, **shape)
    with pytest.raises(LayoutError, match="num_hidden_layers=6 is not divisible by parallel.pp x parallel.vpp = 4"):
        check_model_shape(1, 4, None, **shape)
    check_model_shape(4, 3, None, **shape)
    check_model_shape(5, 7, None)  # nothing known about the model: nothing to check


def test_world_must_be_multiple_of_model_parallel_size():
    with pytest.raises(LayoutError, match=r"world size 6 is not divisible by .* = 4: launch a multiple of 4"):
        ParallelLayout(tp=2, pp=2).validate(world_size=6)
    ParallelLayout(tp=2, pp=2).validate(world_size=8)
    with pytest.raises(LayoutError, match=r"world size 3 is not divisible.*their product must be in \{1, 3\}"):
        check_world_size(3, 2, 1, 1)
    assert check_world_size(4, 2, 1, 1) == 2
    assert check_world_size(16, 2, 2, 2) == 2


@pytest.mark.parametrize("world_size", [0, -2])
def test_world_size_below_one_is_refused(world_size):
    with pytest.raises(LayoutError, match=rf"world size {world_size}: a run needs at least one process"):
        check_world_size(world_size, 1, 1, 1)
    with pytest.raises(LayoutError, match=rf"world size {world_size}: a run needs at least one process"):
        check_rollout_tp(world_size, 1)


def test_rollout_tp_must_divide_the_world():
    with pytest.raises(LayoutError, match=r"'rollout.tp'=4 must divide the world size 6: .*use rollout.tp in \{1, 2, 3, 6\}"):
        check_rollout_tp(6, 4)
    with pytest.raises(LayoutError, match=r"'rollout.tp' must be >= 1, got 0"):
        check_rollout_tp(8, 0)
    check_rollout_tp(8, 4)


def test_batches_split_over_data_parallel_ranks():
    """trainer.ppo_mini_batch_size=2 x rollout.n=3 = 6 sequences per mini-batch."""
    batches = dict(ppo_mini_batch_size=2, n=3, micro_batch_size=1, max_tokens_per_micro_batch=0, gen_batch_size=4,
                   train_batch_size=4)  # fmt: skip
    with pytest.raises(LayoutError, match="cannot be split evenly over 4 data-parallel ranks"):
        check_batch_split(4, **batches)
    check_batch_split(2, **batches)
    with pytest.raises(LayoutError, match="'trainer.micro_batch_size'=2"):
        check_batch_split(2, **{**batches, "micro_batch_size": 2})
    check_batch_split(2, **{**batches, "micro_batch_size": 2, "max_tokens_per_micro_batch": 4096})  # token budget


def test_prompt_batches_split_over_replicas():
    batches = dict(ppo_mini_batch_size=1, n=4, micro_batch_size=1, max_tokens_per_micro_batch=0, gen_batch_size=6,
                   train_batch_size=4)  # fmt: skip
    with pytest.raises(LayoutError, match=r"'trainer.gen_batch_size'=6 prompts cannot be split evenly over 4"):
        check_batch_split(4, **batches)
    check_batch_split(2, **batches)
    with pytest.raises(LayoutError, match=r"'trainer.train_batch_size'=4 is not divisible by 8 data-parallel replicas"):
        check_batch_split(8, **{**batches, "gen_batch_size": 8, "n": 8})


def test_layers_must_split_over_pp_and_vpp():
    with pytest.raises(LayoutError, match=r"num_hidden_layers=28 is not divisible by parallel.pp x parallel.vpp = 3: use parallel.pp in"):
        ParallelLayout(pp=3).validate(num_layers=28)
    with pytest.raises(LayoutError, match=r"num_hidden_layers=28 is not divisible by parallel.pp x parallel.vpp = 2 x 3 = 6"):
        ParallelLayout(pp=2, vpp=3).validate(num_layers=28)
    ParallelLayout(pp=2, vpp=2).validate(num_layers=28)


def test_vpp_needs_pp_and_sizes_positive():
    with pytest.raises(LayoutError, match="'parallel.vpp'=2 needs pipeline parallelism"):
        ParallelLayout(vpp=2).validate()
    with pytest.raises(LayoutError, match=r"'parallel.cp' must be >= 1, got 0"):
        ParallelLayout(cp=0).validate()
    with pytest.raises(LayoutError, match=r"'parallel.tp' must be >= 1"):
        check_sizes(tp=0)
    with pytest.raises(LayoutError, match=r"'rollout.tp' must be >= 1, got 0"):
        check_sizes(rollout_tp=0)
    with pytest.raises(LayoutError, match=r"'parallel.vpp' must be null or >= 1, got 0"):
        check_sizes(pp=2, vpp=0)
    check_sizes(tp=2, pp=1, cp=2, vpp=1, rollout_tp=4)  # one chunk per stage is no interleaving


def test_dp_is_derived_and_needs_world():
    layout = ParallelLayout(tp=2, pp=2, cp=1)
    with pytest.raises(ValueError, match="derived from the world size"):
        _ = layout.dp
    assert layout.resolve(16).dp == 4
    with pytest.raises(ValueError):
        layout.resolve(6)


def test_megatron_vpp_drops_trivial_interleaving():
    assert ParallelLayout(pp=2, vpp=1).megatron_vpp is None
    assert ParallelLayout(pp=2, vpp=3).megatron_vpp == 3


def test_groups_follow_megatron_default_order():
    # tp fastest, then cp, dp, pp slowest ("tp-cp-ep-dp-pp").
    layout = ParallelLayout(tp=2, pp=2).resolve(8)
    assert layout.groups("tp") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert layout.groups("dp") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert layout.groups("pp") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    for rank in range(8):
        assert layout.rank_of(**layout.coordinates(rank)) == rank
    with_cp = ParallelLayout(tp=2, cp=2).resolve(8)
    assert with_cp.groups("cp") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert with_cp.groups("dp") == [[0, 4], [1, 5], [2, 6], [3, 7]]


def test_layers_of_stage_even_split_with_vpp():
    layout = ParallelLayout(pp=2, vpp=2)
    # 8 layers, 4 chunks of 2: stage 0 holds 0-1 and 4-5, stage 1 holds 2-3 and 6-7 (interleaved).
    assert list(layout.layers_of_stage(8, 0, 0)) == [0, 1]
    assert list(layout.layers_of_stage(8, 1, 0)) == [2, 3]
    assert list(layout.layers_of_stage(8, 0, 1)) == [4, 5]
    assert list(layout.layers_of_stage(8, 1, 1)) == [6, 7]


def test_describe_lists_groups_and_stages():
    text = ParallelLayout(tp=2, pp=2).resolve(8).describe(num_layers=8)
    assert text.splitlines()[0] == "world=8 = tp 2 x cp 1 x dp 2 x pp 2"
    assert "TP groups: [0, 1] [2, 3] [4, 5] [6, 7]" in text
    assert "PP groups: [0, 4] [1, 5] [2, 6] [3, 7]" in text
    assert "DP groups: [0, 2] [1, 3] [4, 6] [5, 7]" in text
    assert "PP stage 1: layers 4-7" in text
    assert "not resolved" in ParallelLayout(tp=2).describe()
    context_parallel = ParallelLayout(tp=2, cp=2).resolve(8).describe()
    assert "CP groups: [0, 2] [1, 3] [4, 6] [5, 7]" in context_parallel
    assert "padded to a multiple of 4" in context_parallel and "chunks r and 3-r" in context_parallel


def test_from_config_reads_parallel_and_rollout_sections():
    from megatron_dapo.config import load_config

    cfg = load_config(None, ["parallel.tp=2", "parallel.pp=4", "parallel.vpp=2", "rollout.tp=2"])
    layout = ParallelLayout.from_config(cfg, world_size=16)
    assert (layout.tp, layout.pp, layout.vpp, layout.cp, layout.dp, layout.rollout_tp) == (2, 4, 2, 1, 2, 2)
    assert layout.placement == "leader"  # the embedded engine: "auto" is the leader placement


# ---------------------------------------------------------------------------------------------
# Expert parallelism (mixture-of-experts models)
# ---------------------------------------------------------------------------------------------

from megatron_dapo.distributed.layout import (  # noqa: E402  (this block's own imports)
    ExpertParallelError,
    check_expert_dispatcher,
    check_moe_sequence_parallel,
    expert_data_parallel_size,
    experts_per_rank,
    validate_expert_parallel,
)
from megatron_dapo.errors import InputError  # noqa: E402


def test_experts_must_divide_over_ep():
    assert experts_per_rank(128, 8) == 16 and experts_per_rank(4, 4) == 1 and experts_per_rank(0, 1) == 0
    with pytest.raises(ExpertParallelError) as err:
        experts_per_rank(60, 8)
    assert str(err.value) == "parallel.ep=8 does not divide the model's num_experts=60: use parallel.ep in {1, 2, 3, 4, 5, 6, 10, 12, 15, 20, 30, 60}"
    assert isinstance(err.value, InputError) and isinstance(err.value, ValueError)  # exit 2, one line
    with pytest.raises(ExpertParallelError, match="parallel.ep=2 needs a mixture-of-experts model"):
        experts_per_rank(0, 2)
    with pytest.raises(ExpertParallelError, match="parallel.ep=0 must be a positive integer"):
        experts_per_rank(4, 0)


@pytest.mark.parametrize(
    "world,ep,tp,pp,cp,expert_dp",
    [(8, 8, 1, 1, 1, 1), (8, 2, 2, 1, 1, 2), (8, 4, 2, 1, 1, 1), (16, 8, 2, 1, 1, 1), (8, 2, 1, 2, 2, 2), (4, 1, 1, 1, 1, 4)],
)
def test_expert_data_parallel_size(world, ep, tp, pp, cp, expert_dp):
    # world = TP x EP x expert-DP x PP, as Megatron's expert rank generator lays the same ranks out.
    assert expert_data_parallel_size(world, ep, tp, pp, cp) == expert_dp
    assert tp * ep * expert_dp * pp == world


def test_ep_times_tp_must_tile_a_pipeline_stage():
    # 8 ranks, TP=2, PP=2: a stage has DP x TP x CP = 2 x 2 x 1 = 4 ranks; EP=4 x TP=2 = 8 does not fit.
    with pytest.raises(ExpertParallelError) as err:
        expert_data_parallel_size(8, 4, tp=2, pp=2)
    assert str(err.value) == (
        "parallel.ep x parallel.tp = 4 x 2 = 8 does not divide the 4 ranks of a pipeline stage (DP x TP x CP = 2 x 2 x 1): "
        "parallel.ep must divide DP x CP = 2, use parallel.ep in {1, 2} or launch a multiple of 16 processes"
    )
    with pytest.raises(ExpertParallelError, match="parallel.ep must divide DP x CP = 6"):
        expert_data_parallel_size(12, 4, tp=2)
    with pytest.raises(ExpertParallelError, match="world size 6 is not divisible"):
        expert_data_parallel_size(6, 2, tp=4)


def test_dispatcher_choice():
    check_expert_dispatcher("alltoall", pp=4)
    check_expert_dispatcher("allgather", pp=1)
    with pytest.raises(ExpertParallelError, match="'flex' is not supported: use one of alltoall, allgather"):
        check_expert_dispatcher("flex")
    with pytest.raises(ExpertParallelError, match="allgather MoE token dispatcher does not take .* parallel.pp=2: use the alltoall"):
        check_expert_dispatcher("allgather", pp=2)
    check_expert_dispatcher("alltoall", ep=8)
    with pytest.raises(ExpertParallelError, match="allgather MoE token dispatcher needs micro-batches of one shape on its parallel.ep=2"):
        check_expert_dispatcher("allgather", ep=2)


def test_validate_expert_parallel_checks_what_is_known():
    validate_expert_parallel(2)  # nothing known but ep itself
    validate_expert_parallel(2, world_size=4, tp=2)
    validate_expert_parallel(8, num_experts=128, world_size=16, tp=2, pp=1, dispatcher="alltoall")
    with pytest.raises(ExpertParallelError, match="num_experts=6"):
        validate_expert_parallel(4, num_experts=6)
    with pytest.raises(ExpertParallelError, match="needs a mixture-of-experts model"):
        validate_expert_parallel(2, num_experts=0)
    with pytest.raises(ExpertParallelError, match="parallel.ep must divide DP x CP = 1"):
        validate_expert_parallel(2, world_size=2, tp=2)
    with pytest.raises(ExpertParallelError, match="allgather"):
        validate_expert_parallel(1, pp=2, dispatcher="allgather")
    with pytest.raises(ExpertParallelError, match="set parallel.sequence_parallel=true"):
        validate_expert_parallel(2, num_experts=4, tp=2, sequence_parallel=False)
    validate_expert_parallel(1, num_experts=0, tp=2, sequence_parallel=False)  # dense: no MoE rule


def test_moe_training_at_tp_needs_sequence_parallel():
    check_moe_sequence_parallel(1, False)
    check_moe_sequence_parallel(4, True)
    with pytest.raises(ExpertParallelError) as err:
        check_moe_sequence_parallel(2, False)
    assert str(err.value) == (
        "training a mixture-of-experts model at parallel.tp=2 needs sequence parallelism: set parallel.sequence_parallel=true"
    )


def test_expert_groups_tp2_ep2_of_8():
    layout = ParallelLayout(tp=2, ep=2).resolve(8)
    assert layout.groups("expert_tp") == layout.groups("tp") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert layout.groups("ep") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert layout.groups("expert_dp") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert (layout.expert_tp, layout.expert_dp) == (2, 2)
    # Without EP the experts are replicated like every dense parameter: over the dense DP group.
    dense = ParallelLayout(tp=2).resolve(8)
    assert dense.groups("expert_dp") == dense.groups("dp") and dense.expert_dp == dense.dp == 4
    with pytest.raises(ValueError, match="unknown group kind 'expert'"):
        layout.groups("expert")
    with pytest.raises(ValueError, match="call resolve"):
        ParallelLayout(tp=2, ep=2).groups("ep")


def test_expert_groups_keep_pipeline_stages():
    layout = ParallelLayout(pp=2, ep=2).resolve(8)
    ep_groups = layout.groups("ep")
    assert ep_groups == [[0, 1], [2, 3], [4, 5], [6, 7]]
    stage = {rank: layout.coordinates(rank)["pp"] for rank in range(8)}
    assert all(len({stage[r] for r in group}) == 1 for group in ep_groups)  # an expert group never spans stages


# ---------------------------------------------------------------------------------------------
# The whole layout: built once from the config, every size in one object
# ---------------------------------------------------------------------------------------------


def _config(**overrides):
    from megatron_dapo.config import load_config

    return load_config(None, [f"{key}={value}" for key, value in overrides.items()])


def test_layout_from_config_holds_every_size():
    cfg = _config(**{"parallel.tp": 2, "parallel.ep": 2, "rollout.tp": 4, "rollout.engine": "vllm"})
    layout = ParallelLayout.from_config(cfg, 8)
    assert (layout.tp, layout.pp, layout.cp, layout.ep, layout.rollout_tp, layout.world_size) == (2, 1, 1, 2, 4, 8)
    assert (layout.dp, layout.expert_tp, layout.expert_dp) == (4, 2, 2)
    assert layout.placement == "spmd" and layout.rollout_engines == 2  # vLLM's "auto": one engine per rollout-TP group
    leader = ParallelLayout.from_config(_config(**{"parallel.tp": 4, "rollout.tp": 2, "rollout.engine": "sglang"}), 8)
    assert leader.placement == "leader" and leader.rollout_engines == 2  # one engine per actor replica (DP = 2)
    # Config.parallel_layout: the same layout, with the batch split checked and parallel.dp derived.
    assert cfg.parallel_layout(8) == layout and cfg.parallel.dp == 4
    assert "EP groups: [0, 2] [1, 3] [4, 6] [5, 7]" in layout.describe()


def test_layout_refuses_what_does_not_fit():
    with pytest.raises(ExpertParallelError, match="parallel.ep must divide DP x CP = 1"):
        ParallelLayout(tp=2, ep=2).resolve(2)
    with pytest.raises(LayoutError, match="'rollout.tp'=3 must divide the world size 8"):
        ParallelLayout(rollout_tp=3).resolve(8)
    with pytest.raises(LayoutError, match="'rollout.tp' must be >= 1, got 0"):
        ParallelLayout(rollout_tp=0).validate()
    with pytest.raises(ExpertParallelError, match="needs a mixture-of-experts model"):
        ParallelLayout(ep=2).validate(num_experts=0)
    with pytest.raises(LayoutError, match="made for 8 processes, the launch has 4"):
        ParallelLayout(tp=2).resolve(8).resolve(4)
    from megatron_dapo.distributed.layout import PlacementError

    with pytest.raises(PlacementError, match="placement is one of leader, spmd, separate"):
        ParallelLayout(placement="auto").validate()
