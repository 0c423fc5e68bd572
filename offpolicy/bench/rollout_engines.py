"""`offpolicy bench rollout --engines ...`: rollout engines side by side, generation and weight swaps.

Every engine gets the same model (built from `--config`'s model section, or the shape flags), the same
prompts and the same sampling (`--n` samples per prompt, temperature 1, up to `--new-tokens` tokens, the
tokenizer's EOS stops a sample), and the same weight versions: `--versions` perturbed copies of the model
published in a real weight store (HF directories: config.json + safetensors). Engines:
- `torch`: the embedded `TorchEngine` (the rollout daemon's default engine, `rollout.*` as configured);
- `hf`: plain transformers, `model.generate(do_sample=True, top_k=0)` on the same left-padded batch, a
  swap being `load_state_dict` of the version's tensors;
- `vllm`: `VLLMEngine` in http mode against a vLLM server this bench launches with
  `offpolicy.engines.vllm.launch.server_command` (log in OUT/vllm-server.log); the swap is the engine's
  pause / load / fingerprint proof / resume. A second engine with `rollout.vllm.verify=false` then loads
  the same versions on the same server (no proof); its first load is a rebuild (the server holds a
  version it did not see start), reported apart;
- `vllm-engine`: `VLLMEngine` in engine mode (vllm.LLM in this process), verified.
Per engine: version 0 is loaded first (for `vllm-engine` that starts vLLM; reported as start seconds),
one warm-up generate, then per version 1..V: load (timed), `--repeat` timed generate calls. Tokens are
the tokens returned (EOS included); tokens/s is the median over calls, swap seconds the median over
versions. Ratios are against the torch engine of the same run.
"""

from __future__ import annotations

import argparse
import gc
import os
import shutil
import subprocess
import tempfile
import time
import urllib.request
import uuid
from pathlib import Path

from offpolicy.bench import fmt, median

ENGINES = ("torch", "hf", "vllm", "vllm-engine")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--engines", nargs="+", choices=ENGINES, help="compare these rollout engines on the same prompts, "
                   "sampling and weight versions (tokens/s, swap seconds per version); without it the bench "
                   "compares the torch engine's cache variants with transformers generate")
    p.add_argument("--config", help="--engines: take the model (and rollout.vllm settings) from this config file "
                   "instead of the shape flags, e.g. configs/quickstart-vllm.yaml")
    p.add_argument("--versions", type=int, default=3, help="--engines: weight versions loaded after version 0")
    p.add_argument("--prompt-len", default="32:64", help="--engines: prompt lengths drawn from LO:HI tokens")
    p.add_argument("--vllm-compile", action="store_true", help="--engines: vLLM without enforce_eager "
                   "(torch.compile; slower start)")
    p.add_argument("--root", help="--engines: weight store root for the versions (default: a fresh directory "
                   "in /dev/shm, removed afterwards)")


def run(args: argparse.Namespace, shape: list[str]) -> dict:
    """`shape`: the config overrides of the shape flags' model (used without --config)."""
    import numpy as np
    import torch

    from offpolicy.config import load_config
    from offpolicy.engines import SamplingParams
    from offpolicy.models import build_model, resolve_device
    from offpolicy.weights import WeightStore

    device = resolve_device(args.device)
    dtype = args.dtype if args.dtype != "auto" else ("bfloat16" if device.type == "cuda" else "float32")
    def config(*extra: str):
        return load_config(args.config, [*_overrides(args, shape, dtype, device), *extra])

    cfg = config()
    base = build_model(cfg.model, torch.device("cpu"))
    arch = base.config
    lo, hi = (int(x) for x in args.prompt_len.split(":"))
    if hi + args.new_tokens > arch.max_position_embeddings:
        raise SystemExit(f"--prompt-len up to {hi} + --new-tokens {args.new_tokens} is more than the model's "
                         f"max_position_embeddings {arch.max_position_embeddings}: shorten them")
    rng = np.random.default_rng(0)
    low, high = (14, arch.vocab_size) if arch.vocab_size > 64 else (0, 10)  # never PAD/BOS/EQ/EOS (10-13)
    prompts = [[11, *rng.integers(low, high, int(rng.integers(lo, hi + 1)) - 1).tolist()] for _ in range(args.prompts)]
    params = SamplingParams(n=args.n, temperature=1.0, max_new_tokens=args.new_tokens)
    n_params = sum(p.numel() for p in base.parameters())
    root = args.root or str(Path("/dev/shm" if Path("/dev/shm").is_dir() else tempfile.gettempdir())
                            / f"offpolicy-bench-{uuid.uuid4().hex[:8]}")
    store = WeightStore(root, "bench", keep=args.versions + 2, checksum="none")
    results: dict[str, dict] = {}
    try:
        paths = _publish_versions(store, base, args.versions)
        for name in args.engines:
            runner = {"torch": _torch, "hf": _hf, "vllm": _vllm_http, "vllm-engine": _vllm_engine}[name]
            results[name] = runner(config, args, device, prompts, params, paths)
            gc.collect()
    finally:
        shutil.rmtree(root, ignore_errors=True)
    if "torch" in results:
        for r in results.values():
            r["tokens_per_s_vs_torch"] = r["tokens_per_s"] / results["torch"]["tokens_per_s"]
            r["swap_s_vs_torch"] = r["swap_seconds"] / results["torch"]["swap_seconds"]
    return {"mode": "engines", "device": str(device), "dtype": dtype, "params": n_params,
            "params_m": round(n_params / 1e6, 2), "layers": arch.num_hidden_layers, "hidden": arch.hidden_size,
            "heads": arch.num_attention_heads, "vocab": arch.vocab_size, "prompts": args.prompts, "n": args.n,
            "rows": args.prompts * args.n, "new_tokens": args.new_tokens, "prompt_len": [lo, hi],
            "versions": args.versions, "config": args.config, "torch": torch.__version__,
            "transformers": _version("transformers"), "vllm": _version("vllm"),
            "torch_threads": torch.get_num_threads(), "results": results}


def _overrides(args, shape: list[str], dtype: str, device) -> list[str]:
    lo, hi = (int(x) for x in args.prompt_len.split(":"))
    return [*([] if args.config else shape), f"model.dtype={dtype}", f"rollout.device={device}",
            f"rollout.vllm.enforce_eager={str(not args.vllm_compile).lower()}",
            f"rollout.vllm.max_model_len={hi + args.new_tokens}"]


def _version(module: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    for dist in (module, f"{module}-cpu"):
        try:
            return version(dist)
        except PackageNotFoundError:
            continue
    return None


def _publish_versions(store, base, versions: int) -> list[Path]:
    """Versions 0..V in the store: version 0 the model itself, version v the model + 0.02 * N(0, 1) (seed v)."""
    import copy

    import torch

    from offpolicy.models import hf_state
    from offpolicy.weights.store import version_dir

    paths = []
    for v in range(versions + 1):
        model = copy.deepcopy(base)
        g = torch.Generator().manual_seed(v)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn(p.shape, generator=g).to(p.dtype) * (0.02 if v else 0.0))
        store.publish(v, hf_state(model), model.config.to_dict())
        paths.append(version_dir(store.root, store.run, v))
    return paths


def _measure(load, generate, paths: list[Path], repeat: int) -> dict:
    """Version 0, a warm-up generate, then per version: a timed load and `repeat` timed generates."""
    from offpolicy.weights import WeightVersion

    with WeightVersion(paths[0]) as wv:
        first = load(wv)
    t0 = time.perf_counter()
    generate()
    warmup = time.perf_counter() - t0
    swaps, calls = [], []
    for path in paths[1:]:
        with WeightVersion(path) as wv:
            swaps.append(load(wv))
        for _ in range(repeat):
            t0 = time.perf_counter()
            tokens = generate()
            calls.append((time.perf_counter() - t0, tokens))
    seconds = median([s for s, _ in calls])
    tokens = median([n for _, n in calls])
    return {"first_load_seconds": first, "warmup_seconds": warmup, "swap_seconds": median(swaps), "swaps": swaps,
            "seconds": seconds, "tokens": tokens, "tokens_per_s": tokens / seconds,
            "calls": [s for s, _ in calls], "call_tokens": [n for _, n in calls]}


def _count(groups) -> int:
    return sum(len(c.tokens) for g in groups for c in g)


def _torch(config, args, device, prompts, params, paths) -> dict:
    from offpolicy.engines.torch_engine import TorchEngine

    eng = TorchEngine(config(), seed=0)
    out = _measure(eng.load, lambda: _count(eng.generate(prompts, params)), paths, args.repeat)
    return {**out, "static_cache": bool(eng.static_cache), "compile": bool(eng.compile)}


def _hf(config, args, device, prompts, params, paths) -> dict:
    from offpolicy.models import build_model

    cfg = config()
    model = build_model(cfg.model, device)

    def load(wv) -> float:
        t0 = time.perf_counter()
        missing, unexpected = model.load_state_dict(wv.tensors, strict=False)
        if unexpected or [k for k in missing if not (k.startswith("lm_head") and model.config.tie_word_embeddings)]:
            raise ValueError(f"version {wv.version} does not fit: missing {missing[:4]}, unexpected {unexpected[:4]}")
        return time.perf_counter() - t0

    return _measure(load, lambda: _hf_generate(model, prompts, params, device), paths, args.repeat)


def _hf_generate(model, prompts, params, device) -> int:
    """One `model.generate` call of the batch; tokens each row made up to and including its first EOS."""
    import torch

    rows = [p for p in prompts for _ in range(params.n)]
    width = max(len(p) for p in rows)
    ids = torch.full((len(rows), width), 10, dtype=torch.long)
    attn = torch.zeros_like(ids)
    for i, p in enumerate(rows):
        ids[i, width - len(p):], attn[i, width - len(p):] = torch.tensor(p), 1
    with torch.no_grad():
        out = model.generate(input_ids=ids.to(device), attention_mask=attn.to(device), do_sample=True, top_k=0,
                             top_p=1.0, temperature=params.temperature, max_new_tokens=params.max_new_tokens,
                             pad_token_id=10, eos_token_id=13)
    new = out[:, width:].cpu()
    eos = (new == 13).int()
    ended = eos.cumsum(1) - eos > 0  # positions after a row's first EOS
    return int((~ended).sum())


def _recording(eng, records: list[dict]):
    """`eng.load`, keeping the method and proof of each swap (VLLMEngine.swaps)."""
    def load(wv) -> float:
        seconds = eng.load(wv)
        records.append({k: eng.swaps[-1][k] for k in ("method", "verified")})
        return seconds

    return load


def _vllm_http(config, args, device, prompts, params, paths) -> dict:
    from offpolicy.bench import free_port
    from offpolicy.engines.vllm import VLLMEngine
    from offpolicy.engines.vllm.launch import initial_model, server_command, server_env, server_url
    from offpolicy.weights import WeightVersion

    port = free_port()
    common = ["rollout.engine=vllm", "rollout.vllm.mode=http", f"rollout.vllm.server_port={port}",
              f"rollout.vllm.urls=[http://127.0.0.1:{port}]"]
    cfg = config(*common)
    log = Path(args.out) / "vllm-server.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        cmd = server_command(cfg, initial_model(cfg, Path(tmp)), 0, on_cpu=device.type == "cpu")
        t0 = time.perf_counter()
        with open(log, "w") as f:
            proc = subprocess.Popen(cmd, env={**os.environ, **server_env()}, stdout=f, stderr=subprocess.STDOUT,
                                    start_new_session=True)
        try:
            _wait_healthy(server_url(cfg, 0), proc, log, cfg.rollout.vllm.startup_timeout_s)
            ready = time.perf_counter() - t0
            records: list[dict] = []
            eng = VLLMEngine(cfg, seed=0)
            out = _measure(_recording(eng, records), lambda: _count(eng.generate(prompts, params)), paths, args.repeat)
            eng.close()
            plain = VLLMEngine(config(*common, "rollout.vllm.verify=false"), seed=0)
            unverified: list[dict] = []
            load = _recording(plain, unverified)
            seconds = []
            for path in paths:  # the first load is a rebuild: the server holds a version this engine did not see
                with WeightVersion(path) as wv:
                    seconds.append(load(wv))
            plain.close()
        finally:
            _stop(proc)
    return {**out, "server_ready_seconds": ready, "swap_methods": records, "command": cmd,
            "unverified": {"swap_seconds": median(seconds[1:]), "swaps": seconds[1:], "swap_methods": unverified[1:],
                           "first": {"seconds": seconds[0], **unverified[0]}}}


def _vllm_engine(config, args, device, prompts, params, paths) -> dict:
    from offpolicy.engines.vllm import VLLMEngine

    eng = VLLMEngine(config("rollout.engine=vllm", "rollout.vllm.mode=engine"), seed=0)
    records: list[dict] = []
    try:
        out = _measure(_recording(eng, records), lambda: _count(eng.generate(prompts, params)), paths, args.repeat)
    finally:
        eng.close()
    return {**out, "swap_methods": records}


def _wait_healthy(url: str, proc: subprocess.Popen, log: Path, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the vLLM server exited with {proc.returncode} before it was ready; {log}:\n"
                               f"{log.read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=5) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"the vLLM server at {url} was not healthy in {timeout:.0f} s (rollout.vllm.startup_timeout_s); "
                       f"see {log}")


def _stop(proc: subprocess.Popen) -> None:
    import signal

    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


NAMES = {"torch": "torch engine", "hf": "transformers generate", "vllm": "vLLM server (http), verified swaps",
         "vllm-engine": "vLLM in process (vllm.LLM), verified swaps"}


def table(result: dict) -> str:
    r = result
    lines = [f"{r['params_m']}M-parameter Llama ({r['layers']} layers, hidden {r['hidden']}, {r['heads']} heads, "
             f"vocabulary {r['vocab']}), {r['dtype']} on {r['device']}; {r['prompts']} prompts x {r['n']} samples, "
             f"up to {r['new_tokens']} new tokens (EOS stops), {r['versions']} versions; torch {r['torch']}, "
             f"transformers {r['transformers']}, vllm {r['vllm']}", "",
             "| engine | tokens/s | x torch | s per call | swap s per version | swap x torch | first load / start s |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    res = r["results"]
    for key in [k for k in ENGINES if k in res]:
        e = res[key]
        ratio = (f"{e['tokens_per_s_vs_torch']:.2f}", f"{e['swap_s_vs_torch']:.2f}") if "tokens_per_s_vs_torch" in e \
            else ("", "")
        first = e["first_load_seconds"] if key != "vllm" else e["server_ready_seconds"]
        lines.append(f"| {NAMES[key]} | {fmt(e['tokens_per_s'])} | {ratio[0]} | {e['seconds']:.3f} | "
                     f"{e['swap_seconds']:.4f} | {ratio[1]} | {first:.1f} |")
        if key == "vllm":
            u, t = e["unverified"], res.get("torch", {}).get("swap_seconds")
            lines.append(f"| vLLM server, swaps with rollout.vllm.verify=false | | | | {u['swap_seconds']:.4f} | "
                         f"{u['swap_seconds'] / t:.2f} | |" if t else
                         f"| vLLM server, swaps with rollout.vllm.verify=false | | | | {u['swap_seconds']:.4f} | | |")
    if "vllm" in res:
        u = res["vllm"]["unverified"]["first"]
        lines += ["", f"vLLM server: ready {res['vllm']['server_ready_seconds']:.1f} s after launch (its first load "
                  f"column); a {u['method']} load (an engine's first swap on a server that already held a version) "
                  f"took {u['seconds']:.3f} s."]
    return "\n".join(lines)
