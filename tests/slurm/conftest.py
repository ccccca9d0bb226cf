"""Fixtures of the SLURM tests: one throw-away localhost cluster per test session.

The `slurm` marker is registered here (select or deselect with `-m slurm` / `-m "not slurm"`).
If SLURM is missing and cannot be installed (not root, no package registry), the tests fail when
CI is set (`tests/support/ci.py`: the sbatch path must always be tested there) and are skipped
otherwise. The cluster itself: tests/support/slurm_cluster.py.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import pytest

from tests.support.ci import skip_or_fail
from tests.support.slurm_cluster import SlurmCluster, SlurmUnavailable, ensure_installed


def pytest_configure(config):
    config.addinivalue_line("markers", "slurm: runs jobs through a real SLURM cluster started on localhost")


@pytest.fixture(scope="session")
def slurm_cluster(request):
    """A started `SlurmCluster` (munged, slurmctld, slurmd on localhost); stopped after the session."""
    try:
        ensure_installed()
        if os.geteuid() != 0:
            raise SlurmUnavailable("the throw-away cluster runs its daemons as root and this is not root")
    except SlurmUnavailable as exc:
        skip_or_fail(f"SLURM unavailable: {exc}")
    # Not under pytest's tmp_path: its parents are mode 0700, and munged refuses a socket whose
    # parent directories are not searchable by all. /tmp (1777) is accepted.
    root = Path(tempfile.mkdtemp(prefix="megatron-dapo-slurm-", dir="/tmp" if os.path.isdir("/tmp") else None))
    cluster = SlurmCluster(root)
    failed = True
    try:
        cluster.start()
        yield cluster
        failed = bool(request.session.testsfailed)
    finally:
        if failed:
            reporter = request.config.pluginmanager.get_plugin("terminalreporter")
            if reporter is not None:
                reporter.write_line(f"\n[slurm] daemon logs after a failure (kept in {root}):\n" + cluster.logs())
        cluster.stop()
        leftover = cluster.running_daemons()
        if not failed and not leftover:
            shutil.rmtree(root, ignore_errors=True)
        if leftover:
            pytest.fail(f"SLURM daemons still running after stop: {leftover}", pytrace=False)
