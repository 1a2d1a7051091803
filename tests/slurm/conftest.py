"""Fixtures of the Slurm tests: a one-node Slurm cluster for the session (installed on first use, daemons
stopped at the end), and the quickly warmed-up demo base of the end-to-end tests."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.e2e.conftest import quick_base_dir  # noqa: F401  (the demo base the run trains)
from tests.slurm.cluster import SlurmCluster, ensure_installed


@pytest.fixture(scope="session")
def slurm_installed() -> None:
    reason = ensure_installed()
    if reason:
        pytest.skip(reason)


@pytest.fixture(scope="session")
def slurm_session(slurm_installed: None, tmp_path_factory: pytest.TempPathFactory) -> Iterator[SlurmCluster]:
    cluster = SlurmCluster(tmp_path_factory.mktemp("slurm"))
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()
    left = cluster.leftover_pids()
    assert not left, f"processes of the test cluster still running: {left}"


@pytest.fixture
def slurm_cluster(slurm_session: SlurmCluster) -> Iterator[SlurmCluster]:
    """The session's cluster, its queue emptied after the test (a failed test leaves no job holding CPUs)."""
    yield slurm_session
    slurm_session.cancel_all()


@pytest.fixture
def slurm_conf_only(slurm_installed: None, tmp_path: Path) -> dict[str, str]:
    """A slurm.conf that lets client commands (scontrol show hostnames) run without daemons."""
    conf = tmp_path / "slurm.conf"
    conf.write_text("ClusterName=dry\nSlurmctldHost=localhost\nNodeName=n[1-8] CPUs=8\n"
                    "PartitionName=p Nodes=n[1-8] Default=YES\n")
    return {"SLURM_CONF": str(conf)}
