"""Shared fixtures: free ports, a private weight-store root in shared memory, published versions of the quickstart's
model, daemon commands."""

from __future__ import annotations

import json
import shutil
import sys
import uuid
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
QUICKSTART = str(ROOT / "configs" / "quickstart.yaml")


def free_ports(n: int) -> list[int]:
    """Ports for a test's daemons to listen on: below the ephemeral range, which a connection of another process could
    take before the daemon binds (`offpolicy.plumbing.ports`)."""
    from offpolicy.plumbing.ports import free_ports as below_ephemeral

    return below_ephemeral(n)


def sglang_port() -> int:
    """A free port for `sglang.launch_server --port`: SGLang 0.5.14 derives its gRPC port as the port + 10000 (unless
    SGLANG_GRPC_PORT is set) and refuses to start where that passes 65535 (a port from the ephemeral range, up to 60999
    on Linux, did one time in five; `free_ports` picks below that range, checked here all the same)."""
    (port,) = free_ports(1)
    if port + 10000 > 65535:  # only where the kernel's ephemeral range leaves no room below it (ports.listening_range)
        raise RuntimeError(f"free port {port} is above 55535, which SGLang 0.5.14 refuses: set SGLANG_GRPC_PORT")
    return port


@pytest.fixture
def shm_root():
    """A store root in /dev/shm of its own (removed afterwards)."""
    base = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path("/tmp")
    root = base / f"offpolicy-test-{uuid.uuid4().hex[:10]}"
    yield str(root)
    shutil.rmtree(root, ignore_errors=True)


@pytest.fixture
def published(shm_root):
    """publish(run, formats, versions=2, arch=None, block=(32, 32), moved=False) -> {fmt: [version paths]}: versions
    of the quickstart's model in `shm_root`, natively and in `formats` (`arch`: another architecture as a dict, or
    an override of the quickstart's as a string); with `moved` each version's weights differ from the last one's,
    else all versions hold the same weights."""
    import torch

    from offpolicy.config import WeightsConfig, load_config
    from offpolicy.models.build import build_model, hf_config, hf_state
    from offpolicy.weights import version_dir
    from offpolicy.weights.formats import store_run
    from offpolicy.weights.publisher import Publisher

    def publish(run: str, formats: list[str], versions: int = 2, arch: dict | str | None = None, block=(32, 32),
                moved: bool = False) -> dict[str, list[str]]:
        overrides = ["learner.device=cpu"] + ([arch] if isinstance(arch, str) else
                                              ["model.arch=" + json.dumps(arch)] if arch else [])
        model = build_model(load_config(QUICKSTART, overrides).model, torch.device("cpu"))
        b = Publisher(WeightsConfig(root=shm_root, keep=10, formats=formats, fp8_block_size=block), run)
        for v in range(versions):
            if v and moved:
                with torch.no_grad():
                    for p in model.parameters():
                        p.add_(0.01 * v)
            b.publish(v, lambda: hf_state(model), hf_config(model))
        return {f: [str(version_dir(shm_root, store_run(run, f), v)) for v in range(versions)]
                for f in ("native", *formats)}

    return publish


@pytest.fixture
def run_overrides(tmp_path, shm_root):
    """Overrides that give a run its own directory, store root and ports; metrics ports in `.ports`."""
    from offpolicy.plumbing.ports import free_block

    # metrics.port, then its daemons' (+1 + i for rollouts, the eval daemon's and the launcher's after them): a block,
    # so that no later free_ports of the test walks into them
    work, announce, metrics = *free_ports(2), free_block(8)

    class Overrides(list):
        pass

    o = Overrides([f"run.dir={tmp_path / 'runs'}", f"weights.root={shm_root}", f"transport.work_port={work}",
                   f"transport.announce_port={announce}", "metrics.port=0"])
    o.work_port, o.announce_port, o.metrics_port, o.run_dir = work, announce, metrics, tmp_path / "runs"
    return o


def daemon_cmd(module: str, *args: str) -> list[str]:
    return [sys.executable, "-m", f"offpolicy.services.{module}", *args]


@pytest.fixture(autouse=True)
def _torch_reductions_restored():
    """The stand-in SGLang's patch of torch's reductions (tests/sglang_inprocess.py `monkey_patch_torch_reductions`,
    process-wide as SGLang's) undone after each test that ran it in this process."""
    yield
    standin = sys.modules.get("tests.sglang_inprocess")
    if standin is not None:
        standin.restore_torch_reductions()
