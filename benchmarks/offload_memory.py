"""Host memory of the optimizer on the host (learner.megatron.optimizer_offload), phase by phase, on one GPU.

Builds the Megatron learner (the GPT-OSS slice, `--layers` of GPT-OSS-20B's layers, seeded weights) with the
given config overrides and prints one JSON line per phase: the host's used memory (/proc/meminfo MemTotal -
MemAvailable), this process's RSS, the optimizer's host state as `offload.host_bytes` counts it, and the bytes per
parameter this rank updates of the first two. What the memory model (`memory.HOST_BYTES_PER_PARAM`) must match.

    python benchmarks/offload_memory.py --layers 2 --set learner.megatron.optimizer_offload=1.0 \
        --set learner.megatron.grad_reduce_in_fp32=false
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def meminfo() -> dict[str, float]:
    fields = {}
    for line in Path("/proc/meminfo").read_text().splitlines():
        k, v = line.split(":", 1)
        fields[k] = int(v.split()[0]) * 1024
    return fields


def rss() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--model", default=None, metavar="DIR", help="model.path (e.g. benchmarks/startup.py --make's MXFP4 "
                   "checkpoint) instead of the seeded slice: what loading it leaves on the host shows in `built`")
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE")
    args = p.parse_args()
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29517")
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    os.environ.setdefault("LOCAL_RANK", "0")
    import torch

    from offpolicy.bench.synthetic import synthetic_batch
    from offpolicy.config import load_config
    from offpolicy.learner.backends.megatron import offload
    from offpolicy.learner.backends.megatron.backend import MegatronBackend
    from offpolicy.learner.backends.megatron.memory import gpt_oss_slice

    base = meminfo()
    used0 = base["MemTotal"] - base["MemAvailable"]
    hf = json.loads((Path(args.model) / "config.json").read_text()) if args.model else gpt_oss_slice(args.layers)
    model = [f"model.path={args.model}"] if args.model else [f"model.arch={json.dumps(hf)}"]
    cfg = load_config(None, [*model, "model.dtype=bfloat16", "learner.backend=megatron",
                             "learner.device=cuda", "rollout.n_samples=8", "rollout.max_new_tokens=384",
                             "learner.batch_groups=4", "learner.micro_batch_groups=4",
                             "learner.megatron.max_tokens_per_gpu=8192", *args.set])
    owned = None

    def report(phase: str, backend=None) -> None:
        nonlocal owned
        m = meminfo()
        used = m["MemTotal"] - m["MemAvailable"] - used0
        out = dict(phase=phase, host_used_gib=round(used / 2**30, 2), rss_gib=round(rss() / 2**30, 2),
                   gpu_gib=round(torch.cuda.memory_allocated() / 2**30, 2) if torch.cuda.is_available() else None)
        if backend is not None:
            owned = owned or sum(p.numel() for p in backend.model.parameters())
            state = offload.host_bytes(backend.opt)
            out.update(params=owned, host_state_gib=round(state / 2**30, 2),
                       host_used_bytes_per_param=round(used / owned, 2), state_bytes_per_param=round(state / owned, 2))
        print(json.dumps(out), flush=True)

    report("start")
    t = time.perf_counter()
    backend = MegatronBackend(cfg)
    report(f"built ({time.perf_counter() - t:.1f} s)", backend)
    groups, adv = synthetic_batch(seed=0, groups=4, n=8, prompt=128, response=384, vocab=int(hf["vocab_size"]))
    for i in range(args.steps):
        t = time.perf_counter()
        backend.train_step(groups, adv)
        torch.cuda.synchronize()
        report(f"step {i + 1} ({time.perf_counter() - t:.1f} s)", backend)
    backend.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
