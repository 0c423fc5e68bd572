"""Fixtures for the deployment tests: a real one-node Slurm (deploy/slurm/local-cluster.sh), binaries
that must be installed or the test is skipped with the command that installs them, port blocks."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.conftest import ROOT

DEPLOY = ROOT / "deploy"
LOCAL_CLUSTER = DEPLOY / "slurm" / "local-cluster.sh"


def which(name: str) -> str | None:
    """A binary on PATH or in /usr/sbin (where Debian puts the daemons; not on every user's PATH)."""
    return shutil.which(name) or shutil.which(name, path="/usr/sbin")


def need(*binaries: str, package: str) -> None:
    missing = [b for b in binaries if not which(b)]
    if missing:
        pytest.skip(f"{', '.join(missing)} not installed: apt-get install {package} (.ci/run does)")


def port_block(n: int) -> int:
    """The first port p of n consecutive free ports p..p+n-1 (metrics.port + 1 + i for rollouts), below the
    ephemeral range (`offpolicy.plumbing.ports`)."""
    from offpolicy.plumbing.ports import free_block

    return free_block(n)


@dataclass
class Slurm:
    dir: Path
    env: dict[str, str]

    def run(self, *cmd: str, timeout: float = 30) -> str:
        r = subprocess.run(list(cmd), env=self.env, capture_output=True, text=True, timeout=timeout)
        if r.returncode:
            raise AssertionError(f"{' '.join(cmd)} failed ({r.returncode}): {r.stderr.strip()}")
        return r.stdout

    def logs(self) -> str:
        return "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-3000:]}" for p in sorted((self.dir / "log").glob("*")))


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    """A two-node Slurm on this machine (munged, slurmctld, two slurmd as root), stopped afterwards."""
    need("slurmctld", "slurmd", "sbatch", "scontrol", package="slurm-wlm")
    need("munged", "mungekey", package="munge")
    if os.geteuid() != 0:
        pytest.skip("a local Slurm needs root: slurmd starts jobs as their user")
    d = tmp_path_factory.mktemp("slurm")
    ctld = port_block(3)  # slurmctld and two slurmd ports; Debian's defaults 6817-6818 may be taken
    r = subprocess.run([str(LOCAL_CLUSTER), "start", str(d), "--nodes", "2", "--ctld-port", str(ctld),
                        "--slurmd-port", str(ctld + 1)], capture_output=True, text=True, timeout=120)
    bin_dir = str(Path(sys.executable).parent)  # the venv: offpolicy-learner, offpolicy-rollout, python3
    env = {**os.environ, "SLURM_CONF": str(d / "slurm.conf"),
           "PATH": os.pathsep.join([bin_dir, os.environ.get("PATH", ""), "/usr/sbin"])}
    cluster = Slurm(d, env)
    try:
        assert r.returncode == 0, f"local-cluster.sh start failed: {r.stderr}\n{cluster.logs()}"
        yield cluster
    finally:
        subprocess.run([str(LOCAL_CLUSTER), "stop", str(d)], capture_output=True, timeout=60)
