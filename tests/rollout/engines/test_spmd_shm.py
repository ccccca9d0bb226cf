"""Two SPMD vLLM jobs on one machine at once (vLLM's CPU build, TP 2 each, `_vllm_spmd_probe.shm_job`).

vLLM's CPU communicator names its /dev/shm segments after the distributed init method, which the
external launcher fixes to "env://": every job used the same names ("create shm in SHMManager
failed. errno: 17" for the second, and a killed job's segments blocked later ones). Each engine now
gets a prefix of its own (`vllm_launch`): both jobs must pass, the names (vLLM's own
`make_group_name` with the prefix each engine got) must differ between the jobs and agree within
one, and no segment may be left in /dev/shm once an engine is up. (vLLM's AVX2 CPU kernels lack the
SHM communicator - then vLLM falls back to torch.distributed and creates no segment, and the
collision cannot happen; the names vLLM would use are checked either way, and `shm_communicator` in
the results says which case ran.)
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from tests.support.tiny_models import save_tiny_model
from tests.support.torchrun_utils import run_torchrun_function

PROBE = Path(__file__).parent / "_vllm_spmd_probe.py"


def test_two_spmd_jobs_at_once(require_vllm, tmp_path):
    model = save_tiny_model("qwen3", tmp_path / "qwen3")
    kwargs = {"model_dir": str(model), "seed": 3}
    with ThreadPoolExecutor(max_workers=2) as pool:
        jobs = [pool.submit(run_torchrun_function, PROBE, "shm_job", nproc=2, kwargs=kwargs, timeout=1200) for _ in range(2)]
        results = [job.result() for job in jobs]
    for result in results:
        result.check()
        assert all("error" not in rank for rank in result.rank_results), [r.get("error") for r in result.rank_results]
    prefixes = [{rank["prefix"] for rank in result.rank_results} for result in results]
    assert all(len(p) == 1 for p in prefixes), prefixes  # one name per engine, agreed by its ranks
    (first,), (second,) = prefixes
    assert first != second and first.startswith("mdapo_spmd_") and second.startswith("mdapo_spmd_")
    names = [result.rank_results[0]["group_name"] for result in results]
    assert names[0] != names[1] and all(name.endswith("-tp:0-[0-1]-cpushm") for name in names), names
    for result in results:
        for rank in result.rank_results:
            assert rank["left_after_start"] == [] and rank["left_after_shutdown"] == []
    # Same model, same seed, independent jobs: the same tokens on every rank of both.
    responses = [rank["responses"] for result in results for rank in result.rank_results]
    assert all(r == responses[0] for r in responses)
