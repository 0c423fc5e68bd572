"""Reading a shard file onto the GPU: each way the rollouts' stagings can take, against the bus, in one run on one GPU:

    python benchmarks/maps_read.py [--gb 4] [--repeat 3]

One shared-memory file of random bytes (/dev/shm, as the weight store's), read into one GPU buffer by
- `pinned H2D`: a copy from a page-locked torch tensor (the bus's rate, the baseline of every ratio);
- `pageable H2D`: a copy from the file's plain map (what CUDA does with memory it has not page-locked);
- `reader, pinned buffers`: offpolicy's reader (`transfer.read_files` without maps: `preadv` into pinned buffers);
- `map, read-only`: the file's registered map as the rollouts take it (`maps.MapCache`, `writable=False`:
  cudaHostRegisterReadOnly), through `read_files` as a staging reads it;
- `map, read-write`: the same file registered read-write (as the learner's publish registers it), the same read.
Printed: GB/s, the ratio to pinned H2D, and whether torch sees each map as page-locked (`is_pinned`). On two H200s
the rollouts' stagings ran at ~10 GB/s in the twenty-sixth session (docs/benchmarks.md), where the learner's publish
writes through read-write maps at ~53 GB/s: this says which way is slow.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import uuid
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from offpolicy.weights import maps  # noqa: E402
from offpolicy.weights.transfer import read_files  # noqa: E402


def timed(f, repeat: int) -> float:
    f()  # warm-up
    torch.cuda.synchronize()
    runs = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        f()
        torch.cuda.synchronize()
        runs.append(time.perf_counter() - t0)
    return statistics.median(runs)


def registered(path: Path, device: torch.device, writable: bool) -> tuple[maps.MapCache, maps.Mapped]:
    """A cache holding `path` registered (seen twice: a file is registered on its second sighting)."""
    cache = maps.MapCache(versions=2)
    fd = os.open(path, os.O_RDWR if writable else os.O_RDONLY)
    try:
        assert cache.take(fd, device, writable) is None  # first sighting
        entry = cache.take(fd, device, writable)
        assert entry is not None, "the registration failed (see the warning above)"
        cache.give([entry], entry.size)
    finally:
        os.close(fd)
    return cache, entry


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gb", type=float, default=4.0, help="the file's size (GB)")
    ap.add_argument("--repeat", type=int, default=3, help="timed reads per way (median)")
    args = ap.parse_args()
    device = torch.device("cuda", 0)
    size = int(args.gb * 1e9) // 4096 * 4096
    path = Path("/dev/shm") / f"offpolicy-maps-read-{uuid.uuid4().hex[:8]}"
    data = torch.randint(0, 256, (size,), dtype=torch.uint8)
    path.write_bytes(data.numpy().tobytes())
    dst = torch.empty(size, dtype=torch.uint8, device=device)
    pinned = data.pin_memory()
    rows = []
    try:
        rows.append(("pinned H2D", timed(lambda: dst.copy_(pinned, non_blocking=True), args.repeat), "-"))
        plain = torch.from_file(str(path), shared=False, size=size, dtype=torch.uint8)
        rows.append(("pageable H2D", timed(lambda: dst.copy_(plain, non_blocking=True), args.repeat), "-"))
        fd = os.open(path, os.O_RDONLY)

        def read(cache) -> None:
            read_files([(fd, [(0, dst)])], maps=cache)

        rows.append(("reader, pinned buffers", timed(lambda: read(None), args.repeat), "-"))
        for writable in (False, True):
            cache, entry = registered(path, device, writable)
            name = f"map, {'read-write' if writable else 'read-only'}"
            rows.append((name, timed(lambda: read(cache), args.repeat), str(entry.tensor.is_pinned())))
            assert torch.equal(dst[:1 << 20].cpu(), data[:1 << 20]), f"{name}: the bytes read differ"
            cache.clear()
        os.close(fd)
    finally:
        path.unlink(missing_ok=True)
    bus = rows[0][1]
    print(f"{size / 1e9:.2f} GB onto {torch.cuda.get_device_name(device)}, median of {args.repeat}:\n\n"
          "| way | s | GB/s | vs pinned H2D | torch sees it pinned |\n| --- | --- | --- | --- | --- |")
    for name, seconds, pinned_said in rows:
        print(f"| {name} | {seconds:.3f} | {size / 1e9 / seconds:.1f} | {bus / seconds:.2f} | {pinned_said} |")


if __name__ == "__main__":
    main()
