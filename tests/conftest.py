"""Shared fixtures: free ports, a private weight-store root in shared memory, daemon commands."""

from __future__ import annotations

import shutil
import socket
import sys
import uuid
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
QUICKSTART = str(ROOT / "configs" / "quickstart.yaml")


def free_ports(n: int) -> list[int]:
    socks, ports = [], []
    for _ in range(n):
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        socks.append(s)
        ports.append(s.getsockname()[1])
    for s in socks:
        s.close()
    return ports


@pytest.fixture
def shm_root():
    """A store root in /dev/shm of its own (removed afterwards)."""
    base = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path("/tmp")
    root = base / f"offpolicy-test-{uuid.uuid4().hex[:10]}"
    yield str(root)
    shutil.rmtree(root, ignore_errors=True)


@pytest.fixture
def run_overrides(tmp_path, shm_root):
    """Overrides that give a run its own directory, store root and ports; metrics ports in `.ports`."""
    work, announce, metrics = free_ports(3)

    class Overrides(list):
        pass

    o = Overrides([f"run.dir={tmp_path / 'runs'}", f"weights.root={shm_root}", f"transport.work_port={work}",
                   f"transport.announce_port={announce}", "metrics.port=0"])
    o.work_port, o.announce_port, o.metrics_port, o.run_dir = work, announce, metrics, tmp_path / "runs"
    return o


def daemon_cmd(module: str, *args: str) -> list[str]:
    return [sys.executable, "-m", f"offpolicy.services.{module}", *args]
