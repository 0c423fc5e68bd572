"""Megatron learner start-up from a checkpoint directory (`model.path`), and the checkpoint to start from.

Two modes:
- `--make DIR --layers N [--format mxfp4|bf16]`: writes a GPT-OSS-20B-shaped checkpoint with N layers and
  random weights (each tensor drawn on the GPU by `offpolicy.models.build.initial_tensor`; experts quantized
  to MXFP4 by `offpolicy.weights.formats.encode`, the release's `_blocks`/`_scales` layout that
  `from_pretrained` reads), one safetensors shard per layer plus `model.safetensors.index.json` and
  `config.json`. Prints the bytes written and the seconds.
- `--model DIR` (under torchrun, one process a GPU; `--tp/--ep/--etp` as learner.megatron): builds the
  learner backend (`MegatronBackend`, model.path=DIR) and prints, on rank 0, one JSON line with its
  start-up report (`startup`: setup, build, load, wrap and ready seconds, each the slowest rank's) and
  what rank 0 read (`read_gb`).

    python benchmarks/startup.py --make /tmp/gptoss12 --layers 12
    torchrun --standalone --nproc-per-node 2 benchmarks/startup.py --model /tmp/gptoss12 --ep 2
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path


def make(out: Path, layers: int, fmt: str, seed: int = 0) -> dict:
    import torch
    from safetensors.torch import save_file

    from offpolicy.config import ModelConfig
    from offpolicy.learner.backends.megatron.memory import gpt_oss_slice
    from offpolicy.models.build import arch_plan, initial_tensor
    from offpolicy.weights import mxfp4
    from offpolicy.weights.formats import encode

    t0 = time.perf_counter()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    hf_cfg, shapes, std = arch_plan(ModelConfig(arch=gpt_oss_slice(layers)))
    out.mkdir(parents=True, exist_ok=True)
    groups: dict[str, list[str]] = {}
    for name in shapes:  # one shard per layer, the rest (embedding, final norm, output layer) in one more
        key = name.split(".")[2] if name.startswith("model.layers.") else "rest"
        groups.setdefault(key, []).append(name)
    weight_map, total, config = {}, 0, dict(hf_cfg)
    for i, (key, names) in enumerate(groups.items()):
        named = [(n, initial_tensor(n, shapes[n], seed=seed, std=std, device=device).to(torch.bfloat16))
                 for n in names]
        tensors = named
        if fmt == "mxfp4" and any(mxfp4.is_expert_weight(n) for n, _ in named):  # a layer's experts: blocks + scales
            tensors, config = encode(fmt, named, hf_cfg)
        file = f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors"
        cpu = {n: t.contiguous().cpu() for n, t in tensors}
        save_file(cpu, str(out / file), metadata={"format": "pt"})
        total += sum(t.numel() * t.element_size() for t in cpu.values())
        weight_map.update({n: file for n in cpu})
        print(f"  {file}: {key}, {len(cpu)} tensors", flush=True)
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": total},
                                                                  "weight_map": weight_map}, indent=1))
    (out / "config.json").write_text(json.dumps(config, indent=1))
    return dict(path=str(out), layers=layers, format=fmt, bytes=total, seconds=time.perf_counter() - t0)


def start(args: argparse.Namespace) -> None:
    import os

    import torch
    import torch.distributed as dist

    from offpolicy.config import load_config
    from offpolicy.learner.backends.megatron.backend import MegatronBackend

    cuda = torch.cuda.is_available() and not args.cpu
    if not cuda:
        sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
        from tests.megatron_cpu_shim import install

        install()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    t0 = time.perf_counter()
    backend = MegatronBackend(load_config(None, [
        f"model.path={args.model}", f"model.dtype={args.dtype}", "learner.backend=megatron",
        f"learner.device={'cuda' if cuda else 'cpu'}", f"learner.megatron.tp={args.tp}",
        f"learner.megatron.ep={args.ep}", f"learner.megatron.etp={args.etp}",
        f"learner.megatron.sequence_parallel={'true' if args.tp > 1 else 'false'}"]))
    wall = time.perf_counter() - t0
    if backend.par.rank == 0:
        peak = torch.cuda.max_memory_allocated() / 2**30 if cuda else None
        print(json.dumps(dict(model=args.model, world=world, tp=args.tp, ep=args.ep, etp=args.etp, dtype=args.dtype,
                              startup=backend.startup, ready_s=backend.startup["ready"], wall_s=wall,
                              read_gb=backend.loaded["bytes"] / 1e9, peak_mem_gib=peak)), flush=True)
        backend.close()
    else:
        backend.serve()
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], epilog=__doc__.split("\n\n", 1)[1],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--make", type=Path, default=None, help="write a GPT-OSS-20B-shaped checkpoint into this directory")
    p.add_argument("--layers", type=int, default=12, help="layers of the checkpoint --make writes")
    p.add_argument("--format", choices=["mxfp4", "bf16"], default="mxfp4", help="expert format of --make")
    p.add_argument("--model", default=None, help="checkpoint directory the learner starts from (model.path)")
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--ep", type=int, default=1)
    p.add_argument("--etp", type=int, default=1)
    p.add_argument("--dtype", default="bfloat16", help="model.dtype")
    p.add_argument("--cpu", action="store_true", help="gloo on the CPU through the test-only shim")
    args = p.parse_args()
    if args.make is not None:
        print(json.dumps(make(args.make, args.layers, args.format)), flush=True)
    elif args.model is not None:
        start(args)
    else:
        p.error("give --make DIR or --model DIR")


if __name__ == "__main__":
    main()
