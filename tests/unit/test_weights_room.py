"""offpolicy/weights/room.py: the start-up warning when the versions a run keeps in /dev/shm outgrow the host's
available memory. Real stores in /dev/shm, the real /proc/mounts; fake meminfo and mounts files for the parsers."""

from __future__ import annotations

import torch

from offpolicy.weights.formats import store_run
from offpolicy.weights.room import mem_available, on_tmpfs, shortfall, shortfall_message, version_bytes
from offpolicy.weights.store import WeightStore

MB = 1_000_000


def publish(root: str, run: str, fmt: str = "native", mb: int = 4) -> None:
    WeightStore(root, store_run(run, fmt), keep=2).publish(0, [("w", torch.zeros(mb * MB // 4))], {})


def test_mem_available_reads_meminfo_and_says_none_where_it_cannot(tmp_path):
    f = tmp_path / "meminfo"
    f.write_text("MemTotal:       527442588 kB\nMemFree:  1000 kB\nMemAvailable:   481234567 kB\n")
    assert mem_available(f) == 481234567 * 1024
    assert mem_available(tmp_path / "none") is None
    f.write_text("MemTotal: 1 kB\n")
    assert mem_available(f) is None


def test_the_longest_mount_point_above_a_path_decides_tmpfs(tmp_path):
    mounts = tmp_path / "mounts"
    mounts.write_text("/dev/vda / ext4 rw 0 0\ntmpfs /dev/shm tmpfs rw 0 0\n/dev/vdb /dev/shm/disk ext4 rw 0 0\n"
                      "tmpfs /mnt/my\\040shm tmpfs rw 0 0\n")
    assert on_tmpfs("/dev/shm/offpolicy", mounts) and on_tmpfs("/dev/shm", mounts)
    assert not on_tmpfs("/dev/shm/disk/offpolicy", mounts)
    assert not on_tmpfs("/dev/shmx", mounts) and not on_tmpfs("/tmp/offpolicy", mounts)
    assert on_tmpfs("/mnt/my shm/x", mounts)
    assert not on_tmpfs("/dev/shm", tmp_path / "none")


def test_shortfall_counts_keep_more_versions_with_a_margin():
    assert shortfall(40 * MB, 2, 100 * MB) == 0  # 84 MB fit
    assert shortfall(40 * MB, 3, 100 * MB) == 26 * MB  # 126 MB do not
    assert shortfall(40 * MB, 2, 80 * MB) == 4 * MB  # the 5 % margin


def test_a_store_that_will_outgrow_the_host_is_named_with_its_sizes_and_fixes(shm_root):
    publish(shm_root, "r", mb=4)
    publish(shm_root, "r", "mxfp4", mb=1)
    one = version_bytes(shm_root, "r", 0, ["mxfp4"])
    assert 5 * MB <= one < 5 * MB + 64 * 1024  # both formats' files (the manifest and config are small)
    assert version_bytes(shm_root, "r", 0, []) < 4 * MB + 64 * 1024
    said = shortfall_message(shm_root, "r", 0, ["mxfp4"], keep=2, available=6 * MB)
    assert said is not None and "weights.keep=2" in said and "native, mxfp4" in said and shm_root in said
    assert "optimizer_offload=0" in said and "weights.native=checkpoints" in said and "out-of-memory killer" in said
    assert shortfall_message(shm_root, "r", 0, ["mxfp4"], keep=2, available=20 * MB) is None
    assert shortfall_message(shm_root, "r", 1, [], keep=2, available=1) is None  # no such version: nothing to say


def test_a_store_on_disk_is_not_host_memory(tmp_path):
    root = str(tmp_path / "store")
    publish(root, "r")
    mounts = tmp_path / "mounts"
    mounts.write_text(f"/dev/vda / ext4 rw 0 0\ntmpfs {tmp_path / 'store'} tmpfs rw 0 0\n")
    assert shortfall_message(root, "r", 0, [], keep=2, available=1, mounts=mounts) is not None
    mounts.write_text("/dev/vda / ext4 rw 0 0\n")
    assert shortfall_message(root, "r", 0, [], keep=2, available=1, mounts=mounts) is None
