"""`offpolicy bench weights --formats ...`: publishing a version in low-bit formats (weights.formats).

For each format (`native` first, as the reference; then fp8, mxfp4) on the bench's tensors (on the
device), in one publish mode (`--format-mode`, the weights bench's mode names):
- quantize: `formats.encode` alone (on the device, synchronised), the median of `--repeat` runs;
- publish: what the learner's publisher does for that format, `encode` + `WeightStore.publish`, timed
  together (after the same warm-up publishes as the weights bench's mode), vs the baseline: one pinned
  device-to-host copy of the same output bytes (on a CPU machine a host copy into a mapped buffer);
  ratio = copy / publish (the issue's goal: >= 0.8 with the quantization included);
- bytes: tensor bytes of the format's version, and their ratio to the native version's;
- load: what the torch engine does on a swap of that format (`formats.decode` on the device, dequantized,
  copied into preallocated tensors; the native format through `transfer.load_version`), the median of
  `--repeat` swaps after a first one (`first_load_seconds`: on a GPU it compiles MXFP4's dequantize).
The last version of each format is checked: its stored tensors equal what `encode` made.
"""

from __future__ import annotations

import time
from pathlib import Path

from offpolicy.bench.common import fmt, median, sync, timed


def measure(named: list, device, args, root: Path, cache, keep: int) -> list[dict]:
    """One row per format of `args.formats` (native first)."""
    import torch

    from offpolicy.weights import WeightStore, WeightVersion
    from offpolicy.weights.formats import NATIVE, decode, encode
    from offpolicy.weights.transfer import copy_bytes, flat_bytes, load_version

    checksum, flags = args.format_mode.split("+")[0], set(args.format_mode.split("+")[1:])
    reuse, registered = "reuse" in flags, "maps" in flags
    config = {"model_type": "gpt_oss" if args.shape == "gpt_oss" else "llama"}
    cuda = device.type == "cuda"
    rows, native_bytes = [], None
    for f in [NATIVE, *[x for x in args.formats if x != NATIVE]]:
        def enc():
            return encode(f, named, config, args.fp8_block)

        out, _ = enc()
        nbytes = sum(t.numel() * t.element_size() for _, t in out)
        native_bytes = native_bytes or nbytes
        host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=cuda)
        host.fill_(1)
        views, off = [], 0
        for _, t in out:
            n = t.numel() * t.element_size()
            views.append(host[off:off + n])
            off += n

        def copy_out():
            if cuda:
                for (_, t), v in zip(out, views):
                    v.copy_(flat_bytes(t.contiguous()), non_blocking=True)
            else:
                copy_bytes([(flat_bytes(t.contiguous()), v) for (_, t), v in zip(out, views)])

        copy_s = median(timed(copy_out, device, args.repeat))
        del host, views
        store = WeightStore(str(root), f"bench-format-{f}", keep=keep, checksum=checksum, reuse_files=reuse,
                            register_maps=registered, fmt=f)
        warm = 2 * (keep + 1) if registered else keep + 1 if reuse else 1
        seconds, version = [], 0
        for _ in range(warm + args.repeat):
            sync(device)
            t0 = time.perf_counter()
            tensors, cfg = enc()
            sync(device)
            store.publish(version, tensors, cfg)
            seconds.append(time.perf_counter() - t0)
            version += 1
        quant_s = median(timed(enc, device, args.repeat)) if f != NATIVE else 0.0  # warm by now
        path = store.dir / f"v{version - 1}"
        dtype = named[0][1].dtype
        dest = {name: torch.empty_like(t) for name, t in named}

        def load():
            with WeightVersion(path) as wv:
                if f == NATIVE:
                    load_version(dest, wv.path, maps=cache)
                else:
                    for name, t in decode(wv, dtype, device, maps=cache):
                        dest[name].copy_(t)

        first_load_s = timed(load, device, 1)[0]  # the first swap of a format pays one-off compilation on a GPU
        load_s = median(timed(load, device, args.repeat))
        with WeightVersion(path) as wv:
            stored = wv.tensors
            for name, t in out[:: max(1, len(out) // 8)]:
                if not torch.equal(stored[name], t.cpu()):
                    raise RuntimeError(f"{f}: stored tensor {name} differs from what encode made")
            del stored
        del dest, out
        publish_s = median(seconds[warm:])
        rows.append({"format": f, "mode": args.format_mode, "bytes": nbytes, "bytes_ratio": nbytes / native_bytes,
                     "quantize_seconds": quant_s, "publish_seconds": publish_s, "publish_all_seconds": seconds[warm:],
                     "warm_seconds": seconds[:warm], "gb_per_s": nbytes / publish_s / 1e9, "copy_seconds": copy_s,
                     "copy_gb_per_s": nbytes / copy_s / 1e9, "ratio": copy_s / publish_s, "load_seconds": load_s,
                     "first_load_seconds": first_load_s})
    return rows


def table_lines(result: dict) -> list[str]:
    lines = ["", "Formats (publish = quantize + write of that format's version; ratio = a pinned copy of the same "
             "output bytes / publish; load = the torch engine's swap, dequantizing on the device):", "",
             "| size | format | mode | bytes | vs native | quantize s | publish s | publish GB/s | copy GB/s | "
             "publish / copy | load s |", "| --- " * 11 + "|"]
    for r in result["rows"]:
        for x in r.get("formats", []):
            lines.append(f"| {r['gb']:g} GB | {x['format']} | {x['mode']} | {x['bytes']:,} | {x['bytes_ratio']:.3f} | "
                         f"{x['quantize_seconds']:.3f} | {x['publish_seconds']:.3f} | {fmt(x['gb_per_s'])} | "
                         f"{fmt(x['copy_gb_per_s'])} | {x['ratio']:.2f} | {x['load_seconds']:.3f} |")
    return lines
