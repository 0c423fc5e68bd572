"""Shared-memory segments a SIGKILLed process left behind are found and removed; a live process's are kept
(offpolicy/plumbing/segments.py), with real segments (Python's multiprocessing.shared_memory) and real processes."""

from __future__ import annotations

import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from offpolicy.plumbing import segments

MAKE = """
import sys, time
from multiprocessing import resource_tracker, shared_memory
shm = shared_memory.SharedMemory(name=sys.argv[1], create=True, size=1 << 20)
resource_tracker.unregister(shm._name, "shared_memory")  # as an engine that cleans up only when it exits cleanly
print("ready", flush=True)
time.sleep(60)
"""


def start(name: str) -> subprocess.Popen:
    p = subprocess.Popen([sys.executable, "-c", MAKE, name], stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "ready"
    return p


@pytest.mark.skipif(not Path("/dev/shm").is_dir() or not Path("/proc/self/maps").exists(), reason="Linux /dev/shm")
def test_a_killed_processs_segment_goes_and_a_live_ones_stays():
    tag = f"psm_offtest{uuid.uuid4().hex[:8]}"
    since = time.time() - 1
    dead, live = start(f"{tag}a"), start(f"{tag}b")
    try:
        dead.kill()
        dead.wait()
        prefix = tag
        assert [p.name for p in segments.orphans(since, prefix)] == [f"{tag}a"]  # b is mapped by its process
        assert segments.orphans(time.time() + 60, prefix) == []  # made before `since`: not that process's leftovers
        assert segments.remove_orphans(since, prefix) == 1 << 20
        assert not (segments.SHM / f"{tag}a").exists() and (segments.SHM / f"{tag}b").exists()
    finally:
        live.kill()
        live.wait()
        for p in segments.SHM.glob(f"{tag}*"):
            p.unlink()


BIND = """
import socket, sys, time
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
s.bind(sys.argv[1])
s.listen()
print("ready", flush=True)
time.sleep(60)
"""


def bound(path: Path) -> subprocess.Popen:
    p = subprocess.Popen([sys.executable, "-c", BIND, str(path)], stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "ready"
    return p


@pytest.mark.skipif(not Path("/proc/net/unix").exists(), reason="Linux /proc/net/unix")
def test_the_ipc_socket_a_killed_process_bound_goes_and_a_live_ones_stays(tmp_path, monkeypatch):
    """vLLM binds ZeroMQ IPC sockets at <tmp>/<uuid4>; SIGKILLed, it leaves the files. Only a uuid4-named socket no
    process has bound, made since `since`, is removed: a live one, another name, a plain file stay."""
    since = time.time() - 1
    dead_path, live_path = (tmp_path / str(uuid.uuid4()) for _ in range(2))
    other_path = tmp_path / "engine.sock"
    plain = tmp_path / str(uuid.uuid4())
    plain.write_text("not a socket")
    procs = [bound(p) for p in (dead_path, live_path, other_path)]
    try:
        procs[0].kill()
        procs[0].wait()
        procs[2].kill()
        procs[2].wait()
        assert segments.orphan_sockets(since, tmp_path) == [dead_path]  # the live one is bound; the others not ours
        assert segments.orphan_sockets(time.time() + 60, tmp_path) == []  # made before `since`
        monkeypatch.setenv("VLLM_RPC_BASE_PATH", str(tmp_path))  # where vLLM binds them when it is set
        assert segments.orphan_sockets(since) == [dead_path]
        assert segments.remove_orphans(since, f"psm_none{uuid.uuid4().hex[:8]}", sockets=tmp_path) == 0
        assert not dead_path.exists() and live_path.exists() and other_path.exists() and plain.exists()
    finally:
        for p in procs:
            p.kill()
            p.wait()
