"""The sbatch path, for real: jobs go through a SLURM cluster started on localhost (see conftest.py).

- a 2-task job through slurm/common.sh: `srun` starts both ranks, resolve_launch_env reads SLURM's
  variables, init_distributed meets over gloo and an all_reduce sums both ranks' values; the same
  job checks common.sh's network set-up and vLLM cache directory;
- SIGTERM sent the way `#SBATCH --signal=TERM@N` sends it reaches every task, not the batch shell;
- a restarted (requeued) job resumes when, and only when, a checkpoint exists (else starts over);
- the 7B / 32B scripts, with only their resource lines changed, run up to the launch, where the
  batch shell's config check stops an impossible layout before any rank starts;
- the demo script runs `dapo_doctor` on both tasks (one table in the job log, a gloo all-reduce
  between them), then trains 2 steps over 2 gloo processes and writes metrics and a checkpoint;
- a failed doctor check (a GLOO_SOCKET_IFNAME this node lacks) stops the job before the next step.

Jobs are the expensive part (each task imports torch): one job serves every test that can read
what it needs from the same job.
"""

from __future__ import annotations

import json
import textwrap
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.slurm

REPO_ROOT = Path(__file__).resolve().parents[2]
SLURM_DIR = REPO_ROOT / "slurm"

# A job script as a user would write one around common.sh; `#SBATCH` lines as in demo_cpu.sbatch.
_JOB_HEADER = """\
#!/bin/bash
#SBATCH --nodes=1
#SBATCH --ntasks=2
#SBATCH --cpus-per-task=1
#SBATCH --time=00:05:00
{directives}set -euo pipefail
source "${SLURM_SUBMIT_DIR}/slurm/common.sh"
dapo_setup
"""

_RENDEZVOUS_WORKER = """\
import json, os, sys
import torch
import torch.distributed as dist
from megatron_dapo.distributed import ParallelLayout, init_distributed, resolve_launch_env, teardown

out_dir = sys.argv[1]
launch = resolve_launch_env()
# The same launch without the MASTER_* that common.sh exported: derived from SLURM's own variables.
bare = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT")}
derived = resolve_launch_env(bare)
ctx = init_distributed(ParallelLayout(tp=2), timeout_s=60, seed=3)
from megatron.core import parallel_state as ps

value = torch.tensor([10.0 ** ctx.rank])          # 1 and 10: the sum says both ranks took part
dist.all_reduce(value)
tp_value = torch.tensor([float(ctx.rank + 1)])
dist.all_reduce(tp_value, group=ps.get_tensor_model_parallel_group())
result = {
    "launch": launch.__dict__,
    "derived": derived.__dict__,
    "slurm": {k: os.environ.get(k) for k in ("SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", "SLURM_JOB_ID")},
    "backend": ctx.backend,
    "world": dist.get_world_size(),
    "sum": value.item(),
    "tp_rank": ps.get_tensor_model_parallel_rank(),
    "tp_sum": tp_value.item(),
    "pid": os.getpid(),
}
teardown()
with open(os.path.join(out_dir, f"rank{launch.rank}.json"), "w") as f:
    json.dump(result, f)
"""


def _write_job(path: Path, body: str, directives: tuple[str, ...] = ()) -> Path:
    """A job script: the header, extra `#SBATCH` options (sbatch reads them only before the first
    command), then `body`."""
    extra = "".join(f"#SBATCH {d}\n" for d in directives)
    path.write_text(_JOB_HEADER.replace("{directives}", extra) + textwrap.dedent(body))
    return path


@pytest.fixture(scope="module")
def rendezvous_job(slurm_cluster, tmp_path_factory):
    """A 2-task job: the rendezvous worker on both tasks, after common.sh's network set-up (the
    interface for gloo towards another node, pretended: a documentation address as the second node,
    reached through the default route) and its vLLM cache directory. As on a cluster, no cache root
    comes from outside (the test session sets one for its engines). Returns (job, result directory)."""
    tmp_path = tmp_path_factory.mktemp("rendezvous")
    worker = tmp_path / "worker.py"
    worker.write_text(_RENDEZVOUS_WORKER)
    script = _write_job(
        tmp_path / "rendezvous.sbatch",
        f"""\
        (
            export SLURM_JOB_NUM_NODES=2 SLURM_JOB_NODELIST="localhost,192.0.2.1"
            unset GLOO_SOCKET_IFNAME
            dapo_socket_ifname
            echo "CHOSEN=${{GLOO_SOCKET_IFNAME:-none}}"
        )
        echo "CACHE=$VLLM_CACHE_ROOT GLOO=${{GLOO_SOCKET_IFNAME:-unset}}"
        dapo_srun python "{worker}" "{tmp_path}"
        """,
    )
    job = slurm_cluster.submit(script, cwd=REPO_ROOT, env={"VLLM_CACHE_ROOT": ""}, timeout_s=120).assert_completed()
    return job, tmp_path


def test_srun_rendezvous_and_all_reduce(rendezvous_job):
    job, tmp_path = rendezvous_job
    expected_port = 22000 + job.job_id % 10000  # common.sh and slurm_master_port use the same formula
    results = {}
    for rank in (0, 1):
        path = tmp_path / f"rank{rank}.json"
        assert path.exists(), f"rank {rank} wrote nothing\n{job.describe()}"
        results[rank] = json.loads(path.read_text())
    for rank, r in results.items():
        assert r["slurm"] == {
            "SLURM_PROCID": str(rank), "SLURM_NTASKS": "2", "SLURM_LOCALID": str(rank), "SLURM_JOB_ID": str(job.job_id),
        }  # fmt: skip
        for launch in (r["launch"], r["derived"]):
            assert launch == {
                "rank": rank, "world_size": 2, "local_rank": rank, "master_addr": "localhost",
                "master_port": expected_port, "source": "slurm",
            }  # fmt: skip
        assert (r["backend"], r["world"]) == ("gloo", 2)
        assert r["sum"] == 11.0
        assert r["tp_rank"] == rank and r["tp_sum"] == 3.0
    assert results[0]["pid"] != results[1]["pid"]
    assert "rendezvous localhost:" in job.output()


def test_common_sh_picks_the_gloo_interface_and_a_node_local_vllm_cache(rendezvous_job):
    """The interface for gloo towards another node is the one the doctor's own `interface_for_peers`
    finds; vLLM's cache is one node-local directory; on one node gloo is left alone."""
    from megatron_dapo.distributed.socket_interfaces import interface_for_peers

    job, _ = rendezvous_job
    output = job.output()
    assert f"CHOSEN={interface_for_peers(['192.0.2.1']) or 'none'}" in output, job.describe()
    assert "CACHE=/tmp/megatron-dapo-vllm-cache-" in output and "GLOO=unset" in output


def test_sigterm_reaches_every_task_not_the_batch_shell(slurm_cluster, tmp_path):
    """`--signal=TERM@N` without `B:` signals the job steps; scancel --signal does the same now.

    The trainer's SIGTERM handler (checkpoint, then exit) depends on this delivery; the batch
    shell must keep running so that srun's end is seen and the job ends cleanly.
    """
    task = tmp_path / "task.py"
    task.write_text(
        textwrap.dedent(
            f"""\
            import os, signal, sys, time
            rank = os.environ["SLURM_PROCID"]
            def on_term(signum, frame):
                open(os.path.join({str(tmp_path)!r}, "term" + rank), "w").write("checkpoint would go here")
                sys.exit(0)
            signal.signal(signal.SIGTERM, on_term)
            open(os.path.join({str(tmp_path)!r}, "ready" + rank), "w").close()
            time.sleep(120)
            sys.exit(3)  # never reached when the signal arrives
            """
        )
    )
    script = _write_job(
        tmp_path / "signal.sbatch",
        f"""\
        trap 'echo "batch shell got TERM"' TERM
        dapo_srun python "{task}"
        echo "batch shell after srun: rc=$?"
        """,
    )
    submission = slurm_cluster.submit_async(script, cwd=REPO_ROOT)
    job_id = submission.wait_until_running()
    deadline = time.monotonic() + 60
    while not all((tmp_path / f"ready{rank}").exists() for rank in (0, 1)) and time.monotonic() < deadline:
        time.sleep(0.2)
    slurm_cluster.run("scancel", "--signal=TERM", str(job_id))
    job = submission.wait(timeout_s=60).assert_completed()

    assert (tmp_path / "term0").exists() and (tmp_path / "term1").exists(), job.describe()
    output = job.output()
    assert "batch shell after srun: rc=0" in output
    assert "batch shell got TERM" not in output


def test_requeued_job_resumes_only_from_an_existing_checkpoint(slurm_cluster, tmp_path):
    """A real `scontrol requeue`: the restarted job (SLURM_RESTART_COUNT=1) passes --resume to the
    trainer because a checkpoint exists; without one it passes --overwrite (its first attempt's logs
    would make the trainer refuse the directory), and a first run passes neither."""
    out = tmp_path / "out"
    script = _write_job(
        tmp_path / "resume.sbatch",
        f"""\
        show() {{
            dapo_train_command configs/tiny_cpu.yaml "trainer.output_dir={out}" "$@"
            echo "CASE $label: ${{DAPO_TRAIN_CMD[*]}}"
        }}
        if [ "${{SLURM_RESTART_COUNT:-0}}" = 0 ]; then
            label=first-run show
            label=explicit show --resume
            label=restart-without-checkpoint SLURM_RESTART_COUNT=1 show
            # What a preempted trainer leaves behind, then the preemption itself.
            mkdir -p "{out}/checkpoints/step_000002" && echo step_000002 > "{out}/checkpoints/latest"
            scontrol requeue "$SLURM_JOB_ID"
            sleep 120
            exit 1
        fi
        label=after-requeue show
        """,
        directives=("--requeue", "--open-mode=append"),
    )
    job = slurm_cluster.submit(script, cwd=REPO_ROOT, timeout_s=90).assert_completed()
    assert job.record.get("Restarts") == "1", job.describe()
    cases = dict(line[len("CASE "):].split(": ", 1) for line in job.output().splitlines() if line.startswith("CASE "))
    base = "python -m megatron_dapo.cli train --config configs/tiny_cpu.yaml"
    assert cases == {
        "first-run": f"{base} trainer.output_dir={out}",
        "explicit": f"{base} --resume trainer.output_dir={out}",
        "restart-without-checkpoint": f"{base} --overwrite trainer.output_dir={out}",
        "after-requeue": f"{base} --resume trainer.output_dir={out}",
    }, job.describe()
    assert "resuming from " + str(out / "checkpoints" / "step_000002") in job.output()


@pytest.mark.parametrize(
    "script_name, overrides, named",
    [
        ("dapo_qwen2.5_7b.sbatch", ["parallel.tp=4"], "parallel.tp"),
        ("dapo_qwen2.5_32b.sbatch", ["parallel.tp=4"], "parallel.tp"),
        # The async script's world split: 2 engine ranks leave no trainer rank of the 2 tasks.
        ("dapo_qwen2.5_32b_async.sbatch", ["rollout.placement=separate", "rollout.num_gpus=2", "trainer.max_staleness=1",
                                           "algorithm.tis_cap=2.0"], "leaves no rank to train on"),
    ],
)  # fmt: skip
def test_gpu_scripts_check_the_layout_before_launching(slurm_cluster, tmp_path, script_name, overrides, named):
    """The GPU scripts unchanged, only resources overridden to fit this node (no GPUs here).

    The tiny config with a layout that 2 processes cannot take (tensor parallel 4; all of them for
    the engines): the batch shell's config check must stop the job with the config error before
    srun starts a rank.
    """
    job = slurm_cluster.submit(
        SLURM_DIR / script_name,
        args=[*overrides, f"trainer.output_dir={tmp_path / 'out'}"],
        sbatch_args=["--nodes=1", "--ntasks-per-node=2", "--cpus-per-task=1", "--gpus-per-node=0", "--time=5"],
        cwd=REPO_ROOT,
        env={"CONFIG": "configs/tiny_cpu.yaml"},
        timeout_s=120,
    )
    assert job.state == "FAILED" and job.exit_code == "1:0", job.describe()
    output = job.output()
    assert "rendezvous localhost:" in output, job.describe()  # dapo_setup ran in the GPU script
    assert named in output and "configuration check failed" in output, job.describe()
    assert "train --config" not in output, job.describe()  # no rank was launched
    assert not (tmp_path / "out").exists()


@pytest.fixture(scope="module")
def demo_job(slurm_cluster, tmp_path_factory):
    """The real demo script, 2 tasks (TP=2 over gloo), 2 short steps. Returns (job, output directory)."""
    tmp_path = tmp_path_factory.mktemp("demo_job")
    output_dir = tmp_path / "demo"
    overrides = [
        f"--workspace={tmp_path / 'workspace'}",
        "parallel.tp=2",
        "sft.total_steps=2",
        "sft.batch_size=8",
        f"trainer.output_dir={output_dir}",
        "trainer.total_steps=2",
        "trainer.save_every=2",
        "trainer.eval_every=0",
        "trainer.val_before_train=false",
        "trainer.loggers=[console,jsonl]",
        # Small, fixed-cost steps: this tests the launch, not dynamic sampling.
        "algorithm.filter_groups.enable=false",
        "rollout.n=4",
        "trainer.gen_batch_size=4",
        "trainer.train_batch_size=4",
        "trainer.ppo_mini_batch_size=4",
        "trainer.micro_batch_size=4",
        "rollout.max_response_length=32",
        "algorithm.overlong_buffer.len=8",
    ]
    job = slurm_cluster.submit(SLURM_DIR / "demo_cpu.sbatch", args=overrides, cwd=REPO_ROOT, timeout_s=480)
    job.assert_completed()
    return job, output_dir


def test_demo_cpu_sbatch_trains_and_checkpoints(demo_job):
    job, output_dir = demo_job

    # The doctor ran first, on both tasks, and its table is in the job log.
    output = job.output()
    assert output.count("megatron-dapo doctor: 2 task(s) on 1 node(s)") == 1, job.describe()
    assert "launcher slurm" in output and "-> exit 0" in output, job.describe()
    assert _row(output, "gloo all-reduce").split()[2:4] == ["pass", "all"], job.describe()
    assert output.index("megatron-dapo doctor:") < output.index("== phase 1"), job.describe()

    metrics_file = output_dir / "metrics.jsonl"
    assert metrics_file.exists(), job.describe()
    lines = [json.loads(line) for line in metrics_file.read_text().splitlines() if line.strip()]
    assert sorted({line["step"] for line in lines}) == [1, 2], job.describe()
    latest = output_dir / "checkpoints" / "latest"
    assert latest.exists(), job.describe()
    assert (output_dir / "checkpoints" / latest.read_text().strip()).is_dir()


def _row(output: str, check: str) -> str:
    """The doctor table's row of `check` (first match)."""
    return next(line for line in output.splitlines() if line.strip().startswith(check))


def test_doctor_on_every_task_with_a_gloo_all_reduce(demo_job):
    """`dapo_doctor` as the scripts run it (here the demo's): srun, one doctor per task, one merged
    table, then the script goes on."""
    job, _ = demo_job
    output = job.output()
    assert output.count("megatron-dapo doctor: 2 task(s) on 1 node(s)") == 1, job.describe()  # rank 0 prints
    assert "launcher slurm" in output and "config configs/tiny_cpu.yaml" in output
    row = _row(output, "gloo all-reduce")
    assert row.split()[2:4] == ["pass", "all"] and "2 ranks on 1 node(s): 16 MiB in" in row and "GB/s" in row, row
    assert _row(output, "config").split()[1:3] == ["pass", "all"] and "world=2 = tp 2" in output
    assert "-> exit 0" in output
    assert output.index("megatron-dapo doctor:") < output.index("== phase 1"), job.describe()


def test_a_failed_doctor_stops_the_job(slurm_cluster, tmp_path):
    script = _write_job(
        tmp_path / "doctor-fails.sbatch",
        f"""\
        export GLOO_SOCKET_IFNAME=nosuchif0
        dapo_doctor configs/tiny_cpu.yaml --resume "trainer.output_dir={tmp_path / 'out'}"  # trainer options pass through
        echo "after the doctor"
        """,
    )
    job = slurm_cluster.submit(script, cwd=REPO_ROOT, timeout_s=300)
    assert job.state == "FAILED" and job.exit_code == "1:0", job.describe()
    output = job.output()
    assert "nosuchif0 does not exist on this node" in output, job.describe()
    assert "the doctor found a problem" in output and "after the doctor" not in output, job.describe()
