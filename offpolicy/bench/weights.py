"""Weights benchmark: publishing and loading a version vs plain copies of the same bytes, same run.

For each size, a model-shaped set of bf16 tensors (Llama-like layers: four 4096 x 4096 projections and
three 4096 x 14336 MLP matrices each) lives on the device (the GPU if there is one, else host memory).
- publish: `WeightStore.publish` of a new version into /dev/shm (`--repeat` timed versions after
  warm-up ones: one, which also pins the staging buffers; three with `reuse_files`, whose third
  publish is the first to free files for reuse; six with `+maps`, whose publishes 4-6 take back the
  files of 1-3 and page-lock them, so the timed ones all go through registered maps), in each
  `--modes` (weights.checksum, '+reuse' weights.reuse_files, '+maps' weights.register_maps; a mode
  without '+maps' runs with register_maps off, so 'none+reuse' vs 'none+reuse+maps' is the staged vs
  the registered path in one run), vs the baseline: one device-to-host copy of every tensor into a
  pinned host buffer (on a CPU machine: a host copy into a buffer written once before, so its pages
  are mapped);
- load: what the rollout engine does on a swap, `WeightVersion` + `transfer.load_version` into
  preallocated tensors on the device, twice: staged (register_maps off) and through registered maps
  (after two untimed loads: a reader registers a file on its second sighting; in this process the
  writer may have registered it already), vs the baseline: a host-to-device copy of the same bytes
  from a pinned buffer (on a CPU machine: a host copy between two mapped buffers).
The load is the stall a rollout sees per swap: it generates nothing meanwhile. Each publish and load
reports which path ran (files copied through a registered map vs staged) and its time split into
stages (`offpolicy.weights.profile`): wall phases (tensors grouped, files opened with their headers,
the copies, index/config/manifest, rename, collect) and, inside the copies, busy seconds summed over
the copy threads (waiting for D2H / H2D copies, pwrite / preadv, sha256, page-locking). Registering
happens only where the GPU copies: on a CPU machine '+maps' runs the staged path ("staged").
The last published version is checked against its manifest (sizes, checksums when it has them) and
the source tensors, and the loaded tensors (zeroed before) equal to the published ones. Medians of
`--repeat` timed runs. A third baseline is the floor of any publish into fresh shared memory:
writing the same bytes (up to 4 GB) into new files there, with one `pwrite` stream, one file per
thread, and threads writing through one shared map.
`--formats fp8 mxfp4` adds the low-bit formats (`offpolicy.bench.weight_formats`: quantize, publish
and load per format against a pinned copy of the same output bytes); `--shape gpt_oss` makes the
tensors GPT-OSS-20B-shaped layers (hidden 2880, 64 x 64 attention heads, `--experts` MoE experts of
2880 x 5760 and 2880 x 2880), which mxfp4 needs.
"""

from __future__ import annotations

import argparse
import shutil
import time
import uuid
from pathlib import Path

from offpolicy.bench.common import fmt, median, sync, timed

HIDDEN, MLP = 4096, 14336
OSS_HIDDEN, OSS_HEADS, OSS_KV, OSS_HEAD_DIM = 2880, 64, 8, 64  # GPT-OSS-20B
MODES = ("none", "sha256", "none+reuse", "sha256+reuse", "none+reuse+maps", "sha256+reuse+maps")
DEFAULT_MODES = ["none", "sha256", "none+reuse", "none+reuse+maps", "sha256+reuse+maps"]
KEEP = 2  # versions the bench's stores keep
# publish stages in the table: wall phases, then busy thread-seconds inside the copies
WALL = [("files", "publish.files"), ("copy", "publish.write"), ("meta", "publish.meta"),
        ("rename", "publish.rename"), ("collect", "publish.collect")]
BUSY = [("D2H wait", "write.d2h_wait", "write.dma_wait"), ("pwrite", "write.pwrite"), ("sha256", "write.hash"),
        ("page-lock", "maps.register")]
LOAD_WALL = [("open", "load.open"), ("copy", "load.read"), ("sync", "load.sync")]
LOAD_BUSY = [("preadv", "read.preadv"), ("H2D wait", "slot_wait", "read.dma_wait"), ("page-lock", "maps.register")]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--sizes", type=float, nargs="+", help="version sizes in GB (default: 1 4 16 on a GPU, "
                   "0.25 1 on a CPU machine)")
    p.add_argument("--device", default="auto", help="where the tensors live: auto, cpu, cuda")
    p.add_argument("--repeat", type=int, default=3, help="timed runs per measurement (median)")
    p.add_argument("--modes", nargs="+", default=DEFAULT_MODES, choices=MODES,
                   help="publish modes: weights.checksum, '+reuse' for weights.reuse_files, '+maps' for "
                   "weights.register_maps (off in the others)")
    p.add_argument("--root", default="/dev/shm/offpolicy-bench", help="weight store root (shared memory)")
    p.add_argument("--formats", nargs="*", default=[], choices=("fp8", "mxfp4"),
                   help="low-bit formats to publish too (weights.formats), each measured against native")
    p.add_argument("--format-mode", default="none+reuse+maps", choices=MODES, help="publish mode of the formats")
    p.add_argument("--fp8-block", type=int, nargs=2, default=[128, 128], help="weights.fp8_block_size")
    p.add_argument("--shape", default="llama", choices=("llama", "gpt_oss"),
                   help="layer shapes: Llama-like 4096/14336, or GPT-OSS-20B (MoE experts; mxfp4 needs it)")
    p.add_argument("--experts", type=int, default=32, help="--shape gpt_oss: experts per layer (20B: 32)")


def run(args: argparse.Namespace) -> dict:
    import torch

    from offpolicy.models.build import resolve_device

    device = resolve_device(args.device)
    if "mxfp4" in args.formats and args.shape != "gpt_oss":
        raise SystemExit("offpolicy bench weights: mxfp4 quantizes GPT-OSS MoE experts: add --shape gpt_oss")
    sizes = args.sizes or ([1, 4, 16] if device.type == "cuda" else [0.25, 1])
    rows = [_measure(int(gb * 1e9), device, args) for gb in sizes]
    try:
        Path(args.root).rmdir()  # ours, when it was not there before and is empty now
    except OSError:
        pass  # not empty: somebody else's stores are in it
    return {"device": str(device), "dtype": "bfloat16", "threads": _threads(), "repeat": args.repeat,
            "torch": torch.__version__, "shape": args.shape, "rows": rows}


def table(result: dict) -> str:
    dev = result["device"]
    copy_out = "pinned D2H" if dev.startswith("cuda") else "host copy"
    copy_in = "pinned H2D" if dev.startswith("cuda") else "host copy"
    lines = [f"tensors on {dev}, bf16, {result['threads']} copy threads, medians of {result['repeat']} runs", "",
             f"| size | {copy_out} GB/s | fresh /dev/shm write GB/s | publish GB/s (mode) | publish / copy | "
             f"{copy_in} GB/s | load GB/s: staged ; maps | load / copy | stall per swap s | first publish s |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in result["rows"]:
        pubs = " ; ".join(f"{fmt(p['gb_per_s'])} ({p['mode']})" for p in r["publish"])
        ratios = " ; ".join(f"{p['ratio']:.2f}" for p in r["publish"])
        firsts = " ; ".join(f"{p['first_seconds']:.2f}" for p in r["publish"])
        floor = max(r["fresh_shm_write_gb_per_s"].values())
        loads = " ; ".join(fmt(x["gb_per_s"]) for x in r["loads"])
        load_ratios = " ; ".join(f"{x['ratio']:.2f}" for x in r["loads"])
        stalls = " ; ".join(f"{x['seconds']:.3f}" for x in r["loads"])
        lines.append(f"| {r['gb']:g} GB | {fmt(r['copy_out_gb_per_s'])} | {fmt(floor)} | {pubs} | {ratios} | "
                     f"{fmt(r['copy_in_gb_per_s'])} | {loads} | {load_ratios} | {stalls} | {firsts} |")
    lines += ["", "Warm-up publishes, s (the first is cold; with reuse, publishes from the 4th on go into "
              "recycled files; with maps the 4th-6th also page-lock them):"]
    for r in result["rows"]:
        for p in r["publish"]:
            lines.append(f"- {r['gb']:g} GB {p['mode']}: " + ", ".join(f"{x:.3f}" for x in p["warm_seconds"]))
    lines += ["", "Where the time goes, seconds per publish / load (means of the timed runs): wall phases, then "
              "busy seconds summed over the copy threads (they overlap). path: files copied through a "
              "registered map (maps) or staged.", "",
              "| size | publish mode | path | s | " + " | ".join(n for n, _ in WALL) + " | other | "
              + " | ".join(b[0] for b in BUSY) + " |", "| --- " * (5 + len(WALL) + len(BUSY)) + "|"]
    for r in result["rows"]:
        for p in r["publish"]:
            lines.append(_stage_row(f"{r['gb']:g} GB | {p['mode']} | {p['path']}", p, WALL, BUSY))
    lines += ["", "| size | load | path | s | " + " | ".join(n for n, _ in LOAD_WALL) + " | other | "
              + " | ".join(b[0] for b in LOAD_BUSY) + " |", "| --- " * (5 + len(LOAD_WALL) + len(LOAD_BUSY)) + "|"]
    for r in result["rows"]:
        for x in r["loads"]:
            lines.append(_stage_row(f"{r['gb']:g} GB | {x['mode']} | {x['path']}", x, LOAD_WALL, LOAD_BUSY))
    if any(r.get("formats") for r in result["rows"]):
        from offpolicy.bench.weight_formats import table_lines

        lines += table_lines(result)
    return "\n".join(lines)


def _stage_row(head: str, m: dict, wall, busy) -> str:
    st = m["stages"]
    total = m["mean_seconds"]
    walls = [st.get(key, 0.0) for _, key in wall]
    cells = [f"{x:.3f}" for x in walls] + [f"{max(0.0, total - sum(walls)):.3f}"]
    cells += [f"{sum(st.get(k, 0.0) for k in keys):.3f}" for _, *keys in busy]
    return f"| {head} | {total:.3f} | " + " | ".join(cells) + " |"


def _path(counts: dict) -> str:
    """Which path the files of the timed runs took."""
    direct, staged = counts.get("files.direct", 0), counts.get("files.staged", 0)
    if not direct:
        return "staged"
    return "maps" if not staged else f"maps {direct}/{direct + staged} files"


def _threads() -> int:
    from offpolicy.weights.transfer import THREADS

    return THREADS


def layer_shapes(shape: str = "llama", experts: int = 32) -> list[tuple[str, tuple[int, ...]]]:
    """HF checkpoint names (after `model.layers.N.`) and shapes of one layer's tensors."""
    if shape == "llama":
        return [("self_attn.q_proj.weight", (HIDDEN, HIDDEN)), ("self_attn.k_proj.weight", (HIDDEN, HIDDEN)),
                ("self_attn.v_proj.weight", (HIDDEN, HIDDEN)), ("self_attn.o_proj.weight", (HIDDEN, HIDDEN)),
                ("mlp.gate_proj.weight", (MLP, HIDDEN)), ("mlp.up_proj.weight", (MLP, HIDDEN)),
                ("mlp.down_proj.weight", (HIDDEN, MLP)), ("input_layernorm.weight", (HIDDEN,))]
    h, q, kv = OSS_HIDDEN, OSS_HEADS * OSS_HEAD_DIM, OSS_KV * OSS_HEAD_DIM
    return [("self_attn.q_proj.weight", (q, h)), ("self_attn.q_proj.bias", (q,)), ("self_attn.k_proj.weight", (kv, h)),
            ("self_attn.k_proj.bias", (kv,)), ("self_attn.v_proj.weight", (kv, h)), ("self_attn.v_proj.bias", (kv,)),
            ("self_attn.o_proj.weight", (h, q)), ("self_attn.o_proj.bias", (h,)), ("self_attn.sinks", (OSS_HEADS,)),
            ("mlp.router.weight", (experts, h)), ("mlp.router.bias", (experts,)),
            ("mlp.experts.gate_up_proj", (experts, h, 2 * h)), ("mlp.experts.gate_up_proj_bias", (experts, 2 * h)),
            ("mlp.experts.down_proj", (experts, h, h)), ("mlp.experts.down_proj_bias", (experts, h)),
            ("input_layernorm.weight", (h,)), ("post_attention_layernorm.weight", (h,))]


def model_tensors(nbytes: int, device, shape: str = "llama", experts: int = 32) -> list[tuple[str, object]]:
    """HF-named bf16 tensors of about `nbytes` (whole layers of `layer_shapes`, then square blocks of the
    hidden size), not zeros."""
    import torch

    from math import prod

    shapes = layer_shapes(shape, experts)
    hidden = HIDDEN if shape == "llama" else OSS_HIDDEN
    layer = sum(prod(s) for _, s in shapes) * 2
    g = torch.Generator(device=device).manual_seed(0)
    seed = torch.rand(HIDDEN * HIDDEN, generator=g, device=device).to(torch.bfloat16)
    out, total, i = [], 0, 0

    def tensor(shape):
        t = torch.empty(shape, dtype=torch.bfloat16, device=device).view(-1)
        for off in range(0, t.numel(), seed.numel()):  # cheap on a CPU: tiles of one random block
            n = min(seed.numel(), t.numel() - off)
            t[off:off + n] = seed[:n] + off % 7
        return t.view(shape)

    while total + layer <= nbytes:
        for name, s in shapes:
            out.append((f"model.layers.{i}.{name}", tensor(s)))
        total, i = total + layer, i + 1
    j = 0
    while total + hidden * hidden * 2 <= nbytes or not out:
        out.append((f"model.extra.{j}.weight", tensor((hidden, hidden))))
        total, j = total + hidden * hidden * 2, j + 1
    return out


def _measure(nbytes: int, device, args) -> dict:
    import torch

    from offpolicy.weights import WeightStore, WeightVersion, maps, profile
    from offpolicy.weights.transfer import copy_bytes, flat_bytes, load_version

    named = model_tensors(nbytes, device, args.shape, args.experts)
    total = sum(t.numel() * t.element_size() for _, t in named)
    cuda = device.type == "cuda"
    host = torch.empty(total, dtype=torch.uint8, pin_memory=cuda)
    host.fill_(1)  # mapped before the clock starts
    views, off = [], 0
    for _, t in named:
        views.append(host[off:off + t.numel() * 2])
        off += t.numel() * 2

    def copy_out():
        if cuda:
            for (_, t), v in zip(named, views):
                v.copy_(flat_bytes(t), non_blocking=True)
        else:
            copy_bytes([(flat_bytes(t), v) for (_, t), v in zip(named, views)])

    copy_out_s = median(timed(copy_out, device, args.repeat))
    dest = {name: torch.empty_like(t) for name, t in named}
    dest_flat = [flat_bytes(t) for t in dest.values()]

    def copy_in():
        if cuda:
            for d, v in zip(dest_flat, views):
                d.copy_(v, non_blocking=True)
        else:
            copy_bytes(list(zip(views, dest_flat)))

    copy_in_s = median(timed(copy_in, device, args.repeat))
    root = Path(args.root) / uuid.uuid4().hex[:8]
    publish, version = [], 0
    cache = maps.shared(KEEP + 2)
    try:
        floor = _fresh_write(host, root / "floor")
        for mode in args.modes:
            shutil.rmtree(root, ignore_errors=True)  # /dev/shm holds the versions of one mode at a time
            cache.sweep()  # maps of the files just deleted are unregistered now, not at the sweeper's next round
            checksum, flags = mode.split("+")[0], set(mode.split("+")[1:])
            reuse, registered = "reuse" in flags, "maps" in flags
            store = WeightStore(str(root), f"bench-{checksum}", keep=KEEP, checksum=checksum, reuse_files=reuse,
                                register_maps=registered)
            # with keep=2 the third publish is the first to free files for reuse; with maps publishes
            # 4-6 register the files of 1-3 (their second sighting), so 7 on go through maps only
            warm = 2 * (KEEP + 1) if registered else KEEP + 1 if reuse else 1
            seconds = []
            with profile.profile() as warmup:
                for _ in range(warm):
                    sync(device)
                    seconds.append(store.publish(version, iter(named), {"model_type": "llama"}).seconds)
                    version += 1
            with profile.profile() as prof:
                for _ in range(args.repeat):
                    sync(device)
                    seconds.append(store.publish(version, iter(named), {"model_type": "llama"}).seconds)
                    version += 1
            publish_s = median(seconds[warm:])
            publish.append({"mode": mode, "checksum": checksum, "reuse_files": reuse, "register_maps": registered,
                            "path": _path(prof.counts), "seconds": seconds[warm:], "first_seconds": seconds[0],
                            "warm_seconds": seconds[:warm], "gb_per_s": total / publish_s / 1e9,
                            "ratio": copy_out_s / publish_s, "mean_seconds": sum(seconds[warm:]) / args.repeat,
                            "stages": _per_call(prof, args.repeat), "counts": prof.counts,
                            "warm_counts": warmup.counts})
        _check_version(store, version - 1, named)
        path = store.dir / f"v{version - 1}"
        loads = []
        for mode, with_maps in (("staged", None), ("maps", cache)):
            for d in dest_flat:
                d.zero_()
            sync(device)

            def load():  # what TorchEngine.load does
                with WeightVersion(path) as wv:
                    load_version(dest, wv.path, maps=with_maps)

            with profile.profile() as warmup:
                if with_maps is not None:
                    load()  # first sighting of its files (unless this process wrote them through maps)
                    load()  # second: registered now
            with profile.profile() as prof:
                times = timed(load, device, args.repeat)
            load_s = median(times)
            for name, t in named[:: max(1, len(named) // 8)]:
                if not torch.equal(dest[name], t):
                    raise RuntimeError(f"loaded tensor {name} differs from the published one ({mode})")
            loads.append({"mode": mode, "path": _path(prof.counts), "seconds": load_s, "all_seconds": times,
                          "gb_per_s": total / load_s / 1e9, "ratio": copy_in_s / load_s,
                          "mean_seconds": sum(times) / len(times), "stages": _per_call(prof, args.repeat),
                          "counts": prof.counts, "warm_counts": warmup.counts})
        formats = []
        if args.formats:
            from offpolicy.bench.weight_formats import measure

            shutil.rmtree(root, ignore_errors=True)
            cache.sweep()
            del dest, dest_flat, host, views
            formats = measure(named, device, args, root, cache, KEEP)
    finally:
        shutil.rmtree(root, ignore_errors=True)
        cache.clear()
    staged = loads[0]
    return {"gb": round(total / 1e9, 2), "bytes": total, "tensors": len(named),
            "copy_out_seconds": copy_out_s, "copy_out_gb_per_s": total / copy_out_s / 1e9,
            "copy_in_seconds": copy_in_s, "copy_in_gb_per_s": total / copy_in_s / 1e9, "publish": publish,
            "load_seconds": staged["seconds"], "load_gb_per_s": staged["gb_per_s"], "load_ratio": staged["ratio"],
            "stall_seconds": staged["seconds"], "loads": loads, "fresh_shm_write_gb_per_s": floor, "formats": formats}


def _per_call(prof, n: int) -> dict[str, float]:
    return {k: v / n for k, v in sorted(prof.seconds.items())}


def _check_version(store, version: int, named) -> None:
    """The last published version holds the tensors, and its shards match their sha256 in the manifest."""
    import torch

    from offpolicy.weights import WeightVersion

    with WeightVersion(store.dir / f"v{version}", verify=True) as wv:
        tensors = wv.tensors
        for name, t in named[:: max(1, len(named) // 8)]:
            if not torch.equal(tensors[name], t.cpu()):
                raise RuntimeError(f"published tensor {name} differs from the source")
        del tensors


def _fresh_write(host, where: Path) -> dict:
    """GB/s of writing (up to 4 GB of) `host` into new files in shared memory, three ways: the floor a
    publish pays for pages that were never touched (each is allocated, and zeroed when faulted)."""
    import mmap
    import os

    import numpy as np

    from offpolicy.weights.transfer import THREADS

    src = host[: min(host.numel(), 4 * 10**9)].numpy()
    n, parts = src.nbytes, THREADS
    cut = [n * i // parts for i in range(parts + 1)]
    where.mkdir(parents=True)
    out = {}

    def timed(name, fn):
        t0 = time.perf_counter()
        fn()
        out[name] = n / (time.perf_counter() - t0) / 1e9
        for f in where.iterdir():
            f.unlink()

    def pwrite_one():
        fd = os.open(where / "one", os.O_RDWR | os.O_CREAT, 0o600)
        for i in range(parts):
            os.pwrite(fd, memoryview(src[cut[i]:cut[i + 1]]), cut[i])
        os.close(fd)

    def pwrite_files():
        def one(i):
            fd = os.open(where / f"part{i}", os.O_RDWR | os.O_CREAT, 0o600)
            os.pwrite(fd, memoryview(src[cut[i]:cut[i + 1]]), 0)
            os.close(fd)
        _pool(one, range(parts))

    def mmap_threads():
        fd = os.open(where / "map", os.O_RDWR | os.O_CREAT, 0o600)
        os.ftruncate(fd, n)
        mm = mmap.mmap(fd, n)
        dst = np.frombuffer(mm, dtype=np.uint8)
        _pool(lambda i: np.copyto(dst[cut[i]:cut[i + 1]], src[cut[i]:cut[i + 1]]), range(parts))
        del dst
        mm.close()
        os.close(fd)

    timed("pwrite_one_file", pwrite_one)
    timed("pwrite_file_per_thread", pwrite_files)
    timed("mmap_one_file_threads", mmap_threads)
    where.rmdir()
    return out


def _pool(fn, items) -> None:
    from concurrent.futures import ThreadPoolExecutor

    from offpolicy.weights.transfer import THREADS

    with ThreadPoolExecutor(THREADS) as pool:
        for f in [pool.submit(fn, i) for i in items]:
            f.result()
