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
