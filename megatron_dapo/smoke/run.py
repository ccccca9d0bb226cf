"""Run the smoke check's steps (`plan.plan_steps`), each as its own process, and tabulate them.

Each step is a real command of this package (`doctor`, `check-sync`, `demo`, the push measurement)
started with this Python, its output kept in a log file of the workspace, its exit code and time
recorded; a step that fails or times out does not stop the others. The table's detail column is
the line that says most: the verdict of check-sync, the push figures, or the last line of output.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional, Sequence

from megatron_dapo.smoke.plan import Step

__all__ = ["StepResult", "detail_of", "format_table", "run_steps"]

PASS, FAIL, SKIP = "PASS", "FAIL", "SKIP"


@dataclass(frozen=True)
class StepResult:
    name: str
    status: str
    seconds: float
    detail: str
    log: Optional[Path] = None


def detail_of(name: str, output: str, code: Optional[int]) -> str:
    """The one line of a step's output that says most (pure)."""
    lines = [line.strip() for line in output.splitlines() if line.strip()]
    if code is None:
        return "timed out"
    if name.startswith("weight push"):
        for line in reversed(lines):
            if line.startswith("{"):
                try:
                    push = json.loads(line)
                except ValueError:
                    break
                return (f"{push['bytes'] / 1e9:.2f} GB {push['dtype']} on {push['device']}: sync {push['sync_gb_per_s']:.2f} GB/s, "
                        f"device copy {push['copy_gb_per_s']:.2f} GB/s (sync = {push['ratio']:.1f}x the copy's time)")  # fmt: skip
    for marker in ("PASS", "FAIL", "megatron-dapo: error", "validation accuracy", "Traceback"):
        found = [line for line in lines if line.startswith(marker) or marker in line[:40]]
        if found:
            return found[-1][:160]
    return lines[-1][:160] if lines else f"exit code {code}"


def run_steps(steps: Sequence[Step], log_dir: Path, say: Callable[[str], None] = print) -> list[StepResult]:
    """Run every step that is not skipped, in order; one `StepResult` each."""
    log_dir.mkdir(parents=True, exist_ok=True)
    results = []
    for index, step in enumerate(steps, 1):
        if step.skip is not None:
            results.append(StepResult(step.name, SKIP, 0.0, step.skip))
            say(f"[{index}/{len(steps)}] {step.name}: SKIP ({step.skip})")
            continue
        say(f"[{index}/{len(steps)}] {step.name} ...")
        log = log_dir / f"{index:02d}-{step.name.split(',')[0].replace(' ', '-')}.log"
        env = {**os.environ, **step.env}
        started = time.perf_counter()
        code: Optional[int]
        try:
            done = subprocess.run([sys.executable, "-m", *step.argv], env=env, capture_output=True, text=True, timeout=step.timeout_s)
            code, output = done.returncode, done.stdout + done.stderr
        except subprocess.TimeoutExpired as expired:
            code = None
            output = (expired.stdout or b"").decode(errors="replace") if isinstance(expired.stdout, bytes) else (expired.stdout or "")
        seconds = time.perf_counter() - started
        log.write_text(f"$ python -m {' '.join(step.argv)}\n{output}")
        status = PASS if code == 0 else FAIL
        result = StepResult(step.name, status, seconds, detail_of(step.name, output, code), log)
        results.append(result)
        say(f"    {status} in {seconds:.0f} s: {result.detail}")
    return results


def format_table(results: Sequence[StepResult]) -> str:
    """One summary table: step, verdict, seconds, detail."""
    width = max([len(r.name) for r in results] + [4])
    lines = [f"{'step':<{width}}  result  seconds  detail", f"{'-' * width}  ------  -------  ------"]
    for r in results:
        lines.append(f"{r.name:<{width}}  {r.status:<6}  {r.seconds:7.0f}  {r.detail}")
    passed = sum(r.status == PASS for r in results)
    failed = sum(r.status == FAIL for r in results)
    skipped = sum(r.status == SKIP for r in results)
    lines.append(f"{passed} passed, {failed} failed, {skipped} skipped")
    return "\n".join(lines)
