"""`offpolicy bench rollout --engines ...`: rollout engines side by side, generation and weight swaps.

Every engine gets the same model (built from `--config`'s model section, or the shape flags), the same
prompts and the same sampling (`--n` samples per prompt, temperature 1, up to `--new-tokens` tokens, the
tokenizer's EOS stops a sample), and the same weight versions: `--versions` perturbed copies of the model
published in a real weight store (HF directories: config.json + safetensors). Engines:
- `torch`: the embedded `TorchEngine` (the rollout daemon's default engine, `rollout.*` as configured);
- `hf`: plain transformers, `model.generate(do_sample=True, top_k=0)` on the same left-padded batch, a
  swap being `load_state_dict` of the version's tensors;
- `vllm`: `VLLMEngine` in http mode against a vLLM server this bench launches with
  `offpolicy.rollout.engines.vllm.launch.server_command` (log in OUT/vllm-server.log); the swap is the engine's
  pause / load / fingerprint proof / resume. A second engine with `rollout.vllm.verify=false` then loads
  the same versions on the same server (no proof); its first load is a rebuild (the server holds a
  version it did not see start), reported apart;
- `vllm-engine`: `VLLMEngine` in engine mode (vllm.LLM in this process), verified.
All engines are started first; each loads version 0 (for `vllm-engine` that starts vLLM, reported as
its start seconds) and makes one warm-up call. Then, version by version (1..V), each engine in turn
loads the version (timed) and makes `--repeat` timed generate calls: the engines are interleaved, so a
busy machine's load drifts over all of them alike. Tokens are the tokens returned (EOS included);
tokens/s is the median over calls, swap seconds the median over versions. Ratios are against the torch
engine of the same run. `rollout_vllm` holds the vLLM contenders.
"""

from __future__ import annotations

import argparse
import contextlib
import shutil
import signal
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from offpolicy.bench import rollout_vllm
from offpolicy.bench.common import fmt, median

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
    p.add_argument("--threads", type=int, default=1, help="--engines: torch threads of the torch engine and "
                   "transformers on a CPU (a rollout daemon's run.torch_threads; vLLM on a CPU binds its own: one "
                   "core of two); 0 = torch's default")
    p.add_argument("--root", help="--engines: weight store root for the versions (default: a fresh directory "
                   "in /dev/shm, removed afterwards)")


def run(args: argparse.Namespace, shape: list[str]) -> dict:
    """`shape`: the config overrides of the shape flags' model (used without --config)."""
    import numpy as np
    import torch

    from offpolicy.config import load_config
    from offpolicy.models.build import build_model, resolve_device
    from offpolicy.rollout.engines import SamplingParams
    from offpolicy.weights import WeightStore

    device = resolve_device(args.device)
    if device.type == "cpu" and args.threads:
        torch.set_num_threads(args.threads)  # as a daemon with run.torch_threads; vLLM binds its own threads
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
    try:
        paths = _publish_versions(store, base, args.versions)
        with contextlib.ExitStack() as stack:
            stack.callback(signal.signal, signal.SIGTERM, signal.signal(signal.SIGTERM, _exit))  # a terminated
            # bench still closes its engines and stops the vLLM server it launched
            setups = {"torch": _torch, "hf": _hf, "vllm": rollout_vllm.http, "vllm-engine": rollout_vllm.in_process}
            contenders = {}
            for name in args.engines:
                made = setups[name](config, args, device, prompts, params, stack)
                contenders[name] = made if isinstance(made, Contender) else Contender(*made)
            results = _measure(contenders, paths, args.repeat)
            for name, c in contenders.items():
                results[name].update(c.info)
                if c.after is not None:
                    results[name].update(c.after(paths))
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


def _exit(signum, frame) -> None:
    sys.exit(128 + signum)


def _overrides(args, shape: list[str], dtype: str, device) -> list[str]:
    lo, hi = (int(x) for x in args.prompt_len.split(":"))
    return [*([] if args.config else shape), f"model.dtype={dtype}", f"rollout.device={device}",
            f"rollout.vllm.enforce_eager={str(not args.vllm_compile).lower()}",
            f"rollout.vllm.max_model_len={hi + args.new_tokens}", f"rollout.max_new_tokens={args.new_tokens}",
            f"rollout.n_samples={args.n}"]


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

    from offpolicy.models.build import hf_state
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


@dataclass
class Contender:
    load: Callable[[Any], float]  # WeightVersion -> seconds
    generate: Callable[[], int]  # one batch -> tokens returned
    info: dict = field(default_factory=dict)  # set up facts for the result (start seconds, command, ...)
    after: Callable[[list[Path]], dict] | None = None  # more measurements once the interleaved ones are done


def _measure(contenders: dict[str, Contender], paths: list[Path], repeat: int) -> dict[str, dict]:
    """Version 0 and a warm-up call each, then per version each engine in turn: a timed load, `repeat` calls."""
    from offpolicy.weights import WeightVersion

    out: dict[str, dict] = {name: {"swaps": [], "calls": [], "call_tokens": []} for name in contenders}
    for name, c in contenders.items():
        with WeightVersion(paths[0]) as wv:
            out[name]["first_load_seconds"] = c.load(wv)
        t0 = time.perf_counter()
        c.generate()
        out[name]["warmup_seconds"] = time.perf_counter() - t0
    for path in paths[1:]:
        for name, c in contenders.items():
            with WeightVersion(path) as wv:
                out[name]["swaps"].append(c.load(wv))
            for _ in range(repeat):
                t0 = time.perf_counter()
                tokens = c.generate()
                out[name]["calls"].append(time.perf_counter() - t0)
                out[name]["call_tokens"].append(tokens)
    for r in out.values():
        r["seconds"], r["tokens"], r["swap_seconds"] = median(r["calls"]), median(r["call_tokens"]), median(r["swaps"])
        r["tokens_per_s"] = r["tokens"] / r["seconds"]
    return out


def count(groups) -> int:
    return sum(len(c.tokens) for g in groups for c in g)


def _torch(config, args, device, prompts, params, stack) -> Contender:
    from offpolicy.rollout.engines.torch_engine import TorchEngine

    eng = TorchEngine(config(), seed=0)
    return Contender(eng.load, lambda: count(eng.generate(prompts, params)),
                     {"static_cache": bool(eng.static_cache), "compile": bool(eng.compile)})


def _hf(config, args, device, prompts, params, stack) -> Contender:
    from offpolicy.models.build import build_model

    model = build_model(config().model, device)

    def load(wv) -> float:
        t0 = time.perf_counter()
        missing, unexpected = model.load_state_dict(wv.tensors, strict=False)
        if unexpected or [k for k in missing if not (k.startswith("lm_head") and model.config.tie_word_embeddings)]:
            raise ValueError(f"version {wv.version} does not fit: missing {missing[:4]}, unexpected {unexpected[:4]}")
        return time.perf_counter() - t0

    return Contender(load, lambda: _hf_generate(model, prompts, params, device))


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
