"""Rollout benchmark: the embedded torch engine vs `transformers` `generate` on the same model, same run.

The model is a Llama built from a config (default about 110M parameters: 12 layers, hidden 768, MLP
2048, vocabulary 32,000, tied embeddings; no download), bf16 on a GPU, float32 on a CPU. A batch of
`--prompts` prompts x `--n` samples (64 rows by default) of random prompt tokens of 32..64 tokens,
left padded, generates `--new-tokens` tokens per row with plain sampling (temperature 1):
- `generate`: `model.generate(do_sample=True, top_k=0, min_new_tokens=max_new_tokens)` (HF's
  dynamic cache; its EOS is held off so every row makes all its tokens);
- `engine`: `TorchEngine.generate` as a rollout daemon calls it (per-token behaviour logprobs
  included), with the dynamic KV cache, with `rollout.static_cache` (a CUDA graph per decode step
  on a GPU) and, with `--compile`, also `rollout.compile` (the step compiled by torch.compile first).
  Tokens counted are the tokens it returned (a row that samples EOS stops early).
One warm-up call each (it captures the graph, compiles; its time is reported), then the median of
`--repeat` timed calls.

With `--engines torch hf vllm vllm-engine` (any of them) it compares rollout engines instead, generation
and weight swaps: `rollout_engines` says how.
"""

from __future__ import annotations

import argparse
import time

from offpolicy.bench import rollout_engines
from offpolicy.bench.common import fmt, median


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--prompts", type=int, default=8, help="prompts per batch")
    p.add_argument("--n", type=int, default=8, help="samples per prompt (rows = prompts x n)")
    p.add_argument("--new-tokens", type=int, default=256, help="tokens generated per row")
    add_model_arguments(p)
    p.add_argument("--dtype", default="auto", help="auto (bfloat16 on a GPU, float32 on a CPU) or a dtype name")
    p.add_argument("--repeat", type=int, default=3, help="timed calls per engine (median)")
    p.add_argument("--generate-repeat", type=int, default=1, help="timed calls of transformers generate")
    p.add_argument("--compile", action="store_true", help="also measure rollout.compile (torch.compile, slow start)")
    rollout_engines.add_arguments(p)


def add_model_arguments(p: argparse.ArgumentParser) -> None:
    """The benchmark model's shape and device (shared with the pipeline benchmark)."""
    p.add_argument("--layers", type=int, default=12, help="decoder layers")
    p.add_argument("--hidden", type=int, default=768, help="hidden size (heads of 64)")
    p.add_argument("--mlp", type=int, default=2048, help="MLP size")
    p.add_argument("--vocab", type=int, default=32000, help="vocabulary size")
    p.add_argument("--device", default="auto", help="auto, cpu or cuda")


def model_overrides(args) -> list[str]:
    """Config overrides of the benchmark model (shared with the pipeline benchmark)."""
    heads = max(1, args.hidden // 64)
    return ["model.arch.model_type=llama", f"model.arch.vocab_size={args.vocab}", f"model.arch.hidden_size={args.hidden}",
            f"model.arch.intermediate_size={args.mlp}", f"model.arch.num_hidden_layers={args.layers}",
            f"model.arch.num_attention_heads={heads}", f"model.arch.num_key_value_heads={heads}",
            "model.arch.max_position_embeddings=4096", "model.arch.tie_word_embeddings=true",
            "model.arch.bos_token_id=11", "model.arch.eos_token_id=13", "model.arch.pad_token_id=10",
            "model.tokenizer=digits"]


def run(args: argparse.Namespace) -> dict:
    if args.engines:
        return rollout_engines.run(args, model_overrides(args))
    import numpy as np
    import torch

    from offpolicy.config import load_config
    from offpolicy.models.build import resolve_device
    from offpolicy.rollout.engines import SamplingParams
    from offpolicy.rollout.engines.torch_engine import TorchEngine

    device = resolve_device(args.device)
    dtype = args.dtype if args.dtype != "auto" else ("bfloat16" if device.type == "cuda" else "float32")
    base = [*model_overrides(args), f"model.dtype={dtype}", f"rollout.device={device}"]
    rng = np.random.default_rng(0)
    prompts = [rng.integers(14, args.vocab, int(rng.integers(32, 65))).tolist() for _ in range(args.prompts)]
    params = SamplingParams(n=args.n, max_new_tokens=args.new_tokens)
    rows = args.prompts * args.n
    engines = {}
    variants = [("engine", False, False), ("engine_static", True, False)] + \
        ([("engine_compiled", True, True)] if args.compile else [])
    for name, static, compiled in variants:
        eng = TorchEngine(load_config(None, [*base, f"rollout.static_cache={str(static).lower()}",
                                             f"rollout.compile={str(compiled).lower()}"]), seed=0)
        try:
            warmup, _ = _timed(device, lambda: eng.generate(prompts, params))  # graph capture, compilation
        except RuntimeError as e:  # a capture or compilation the platform refuses: report it, measure the rest
            engines[name] = {"error": f"{type(e).__name__}: {e}"[:2000]}
            continue
        runs = []
        for _ in range(args.repeat):
            seconds, out = _timed(device, lambda: eng.generate(prompts, params))
            runs.append((seconds, sum(len(c.tokens) for g in out for c in g)))
        engines[name] = {**_summary(runs), "warmup_seconds": warmup}
        model = eng.model  # the same weights in both engines (same config and seed)
        del eng
    n_params = sum(p.numel() for p in model.parameters())
    _generate(model, prompts, args.n, min(8, args.new_tokens), device)  # warm-up
    gen_runs = [_generate(model, prompts, args.n, args.new_tokens, device) for _ in range(args.generate_repeat)]
    engines["generate"] = _summary(gen_runs)
    base_tps = engines["generate"]["tokens_per_s"]
    for e in engines.values():
        if "error" not in e:
            e["speedup_vs_generate"] = e["tokens_per_s"] / base_tps
    return {"device": str(device), "dtype": dtype, "params": n_params, "params_m": round(n_params / 1e6, 1), "rows": rows,
            "new_tokens": args.new_tokens, "layers": args.layers, "hidden": args.hidden, "vocab": args.vocab,
            "torch": torch.__version__, "transformers": _transformers_version(), "results": engines}


def table(result: dict) -> str:
    if result.get("mode") == "engines":
        return rollout_engines.table(result)
    lines = [f"{result['params_m']}M-parameter Llama ({result['layers']} layers, hidden {result['hidden']}), "
             f"{result['dtype']} on {result['device']}, {result['rows']} rows x {result['new_tokens']} new tokens", "",
             "| generator | tokens/s | s per call | ms per decode step | x generate |", "| --- | --- | --- | --- | --- |"]
    names = {"generate": "transformers generate", "engine": "torch engine (dynamic cache)",
             "engine_static": "torch engine, static_cache (CUDA graph on a GPU)",
             "engine_compiled": "torch engine, static_cache + compile"}
    for key in [k for k in names if k in result["results"]]:
        e = result["results"][key]
        if "error" in e:
            lines.append(f"| {names[key]} | failed: {e['error'][:200]} | | | |")
            continue
        lines.append(f"| {names[key]} | {fmt(e['tokens_per_s'])} | {e['seconds']:.3f} | "
                     f"{1e3 * e['seconds'] / result['new_tokens']:.2f} | {e['speedup_vs_generate']:.1f} |")
    return "\n".join(lines)


def _timed(device, fn):
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - t0, out


def _summary(runs: list[tuple[float, int]]) -> dict:
    seconds = median([s for s, _ in runs])
    tokens = median([n for _, n in runs])
    return {"seconds": seconds, "tokens": tokens, "tokens_per_s": tokens / seconds, "runs": [s for s, _ in runs]}


def _generate(model, prompts: list[list[int]], n: int, new_tokens: int, device) -> tuple[float, int]:
    """One timed `model.generate` call of the same batch; (seconds, tokens generated)."""
    import torch

    rows = [p for p in prompts for _ in range(n)]
    width = max(len(p) for p in rows)
    ids = torch.full((len(rows), width), 10, dtype=torch.long)
    attn = torch.zeros_like(ids)
    for i, p in enumerate(rows):
        ids[i, width - len(p):] = torch.tensor(p)
        attn[i, width - len(p):] = 1
    ids, attn = ids.to(device), attn.to(device)
    with torch.no_grad():
        seconds, out = _timed(device, lambda: model.generate(
            input_ids=ids, attention_mask=attn, do_sample=True, top_k=0, top_p=1.0, temperature=1.0,
            max_new_tokens=new_tokens, min_new_tokens=new_tokens, pad_token_id=10, eos_token_id=13))
    return seconds, int((out.shape[1] - width) * len(rows))


def _transformers_version() -> str:
    import transformers

    return transformers.__version__
