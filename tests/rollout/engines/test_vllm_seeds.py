"""Seeding and output conversion of the vLLM engine, on a real SPMD engine (vLLM's CPU build, one
rank, `_vllm_spmd_probe.seed_job`).

* Engine-level seeds (`seed_per_prompt=False`, what training uses): the same seed gives the same
  tokens and log-probs whatever ran before (the sampler is reseeded per call) and on a fresh engine
  (as a resumed run builds it); another seed gives other tokens; the trainer's own RNG is the same
  after a generate as before.
* Per-prompt seeds (validation, tests): a prompt's responses do not depend on the rest of the batch.
* Conversion: vLLM's flat log-probs and its per-position mappings give the same `GenerationOutput`,
  equal to a token-by-token reference; `collect=False` returns nothing.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.tiny_models import save_tiny_model
from tests.support.torchrun_utils import run_torchrun_function

PROBE = Path(__file__).parent / "_vllm_spmd_probe.py"


@pytest.fixture(scope="module")
def seeds(require_vllm, tmp_path_factory) -> dict:
    model = save_tiny_model("qwen3", tmp_path_factory.mktemp("seeds") / "qwen3")
    result = run_torchrun_function(PROBE, "seed_job", nproc=1, kwargs={"model_dir": str(model)}, timeout=900)
    result.check()
    (out,) = result.rank_results
    assert "error" not in out, out.get("error")
    return out


def test_engine_level_seed_repeats_whatever_ran_before(seeds):
    first, again = seeds["engine_seed_7"], seeds["engine_seed_7_again"]
    assert first == again  # tokens, log-probs, finish reasons: exactly
    assert first["responses"] != seeds["engine_seed_9"]["responses"]
    assert len(set(map(tuple, first["responses"]))) > len(first["responses"]) // 2  # samples differ from each other


def test_a_fresh_engine_repeats_an_engine_level_seed(seeds):
    """What a resumed run does: a new engine, the same seed for the same generation batch."""
    assert seeds["fresh_engine_seed_7"] == seeds["engine_seed_7"]


def test_generate_leaves_the_trainers_rng_alone(seeds):
    assert seeds["trainer_rng_unchanged"] is True


def test_per_prompt_seeds_do_not_depend_on_the_batch(seeds):
    full, alone = seeds["per_prompt_all"], seeds["per_prompt_third_alone"]
    rows = [i for i, p in enumerate(full["prompt_index"]) if p == 2]
    assert [full["responses"][i] for i in rows] == alone["responses"]
    for i, lp in zip(rows, alone["log_probs"]):
        assert full["log_probs"][i] == pytest.approx(lp, abs=1e-5)  # batched kernels may differ in the last bits
    assert full["responses"] != seeds["engine_seed_7"]["responses"]


def test_conversion_is_unchanged(seeds):
    assert seeds["flat_is_flat"] == "FlatLogprobs"
    assert seeds["converted_flat"] == seeds["reference"]
    assert seeds["converted_per_position"] == seeds["reference"]
    assert seeds["not_collected"] is None
    assert sum(len(r) for r in seeds["reference"]["responses"]) > 20
