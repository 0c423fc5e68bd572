"""The torch engine's fp8 paths on one GPU (issue 53, `rollout.fp8_matmul`): what torch's scaled matmul buys over bf16.

(a) `linear` rows: one linear layer at GPT-OSS-20B's shapes (hidden 2880: q/k/v/o and the experts' gate_up / down as
    if they were dense) and Llama-3-8B's, at 1, 64, 512 and 4096 tokens: bf16 `F.linear`, the engine's `Fp8Linear`
    (activations quantized per 1 x 128 group + `scaled_mm`, 128 x 128 weight blocks), the `scaled_mm` alone on
    pre-quantized activations, the activation quantization alone, and `torch.compile`d `Fp8Linear` (`--compile`);
    medians over calls, ratios bf16 / fp8 (> 1: fp8 faster), the kernel's largest relative error against the float32
    reference of the same math. A shape the kernel does not take (GPT-OSS's inputs of 2880 = 22.5 x 128) is
    reported with the reason, and also timed zero-padded to multiples of 128 (`padded`: what a padding path would
    cost; the engine has none). GPT-OSS's o_proj output 2880 is not a multiple of 128 either.
(b) `engine` rows: `TorchEngine.generate` on models built from config (no download; random weights): a Llama-shaped
    one (hidden 2048, 8 layers) and a GPT-OSS-shaped one (hidden 2880, 4 layers, 32 experts top 4), with bf16
    (native), fp8 dequantized, fp8 scaled, fp8 auto (the engine's own choice and its reason) and, for GPT-OSS, mxfp4
    versions published by the learner's publisher (fp8 in 128 x 128 blocks for Llama, 64 x 64 for GPT-OSS, as
    `weights.fp8_block_size: auto` gives): tokens/s (median of `--repeat` calls after a warm-up), the ratio to bf16,
    and the mean / max |behaviour logprob - the bf16 model's logprob| of the same tokens (teacher-forced). A path
    the engine refuses (scaled for GPT-OSS) is a row with its reason. Each row also has its load's breakdown
    (`load_s` and `reload_s`: first and second load of the version; `load_stages`: seconds per stage, e.g.
    `load.read`, `lowbit.dequantize`; on a GPU the load's peak memory beyond the model and what stays reserved),
    the tokens and decode steps of a call, the milliseconds per step (`step_ms`: responses that stop early lower
    tokens/s, not it) and the process's threads and child processes while it generated; a `bf16-again` row times the
    bf16 engine once more after every other (run-order drift); for GPT-OSS two swapped controls follow (the mxfp4
    engine loads the bf16 version, the bf16 engine the mxfp4 one: whether a slower mxfp4 row is the engine's state or
    the values it holds; the fourteenth session's mxfp4 row was 0.66 with a bf16 drift of 0.999, and on the CPU the
    two engines hold the same tensors, layouts and kernels: tests/unit/test_torch_engine_lowbit.py), and a `summary`
    row gives each version over the faster bf16 measurement and over their mean, with the drift (the twelfth session's
    GPT-OSS bf16 rows were 10,078 and 13,557 tokens/s in one run: a ratio inside that spread tells nothing).

    python benchmarks/fp8_engine.py --out fp8.jsonl                 (one H200: both parts, a few minutes)
    python benchmarks/fp8_engine.py --device cpu --out /tmp/s.jsonl (tiny shapes: a smoke test of the script)

Every row is printed and written as one JSON line to --out.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
QUICKSTART = ROOT / "configs" / "quickstart.yaml"
SHAPES = {  # (out, in) of one linear
    "gptoss.q_proj": (4096, 2880), "gptoss.k_proj": (512, 2880), "gptoss.o_proj": (2880, 4096),
    "gptoss.experts.gate_up": (5760, 2880), "gptoss.experts.down": (2880, 2880),
    "llama8b.q_proj": (4096, 4096), "llama8b.k_proj": (1024, 4096), "llama8b.gate_proj": (14336, 4096),
    "llama8b.down_proj": (4096, 14336),
}
TOKENS = (1, 64, 512, 4096)
SPECIAL = dict(bos_token_id=11, eos_token_id=13, pad_token_id=10, tie_word_embeddings=False)
ARCHES = {
    "llama": dict(model_type="llama", vocab_size=32000, hidden_size=2048, intermediate_size=8192, num_hidden_layers=8,
                  num_attention_heads=16, num_key_value_heads=8, head_dim=128, max_position_embeddings=1024, **SPECIAL),
    "gptoss": dict(model_type="gpt_oss", vocab_size=32000, hidden_size=2880, intermediate_size=2880,
                   num_hidden_layers=4, num_attention_heads=64, num_key_value_heads=8, head_dim=64,
                   num_local_experts=32, num_experts_per_tok=4, sliding_window=128, max_position_embeddings=1024,
                   layer_types=["sliding_attention", "full_attention"] * 2, **SPECIAL),
}
TINY = {  # --device cpu
    "llama": dict(ARCHES["llama"], vocab_size=64, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                  num_attention_heads=2, num_key_value_heads=1, head_dim=64),
    "gptoss": dict(ARCHES["gptoss"], vocab_size=64, hidden_size=128, intermediate_size=128, num_hidden_layers=2,
                   num_attention_heads=2, num_key_value_heads=1, head_dim=64, num_local_experts=4,
                   num_experts_per_tok=2, sliding_window=32, layer_types=["sliding_attention", "full_attention"]),
}


def emit(out, row: dict) -> None:
    print(json.dumps(row), flush=True)
    out.write(json.dumps(row) + "\n")
    out.flush()


def timed(f, device: torch.device, n: int) -> float:
    """Median seconds of `f()` over `n` calls after two warm-ups."""
    for _ in range(2):
        f()
    times = []
    for _ in range(n):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        f()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - t0)
    return sorted(times)[n // 2]


def linears(args, device: torch.device, out) -> None:
    from offpolicy.rollout.engines.fp8_linear import (Fp8Linear, cuda_product, kernel_problems, quantize_activations,
                                                      reference_product)

    cuda = device.type == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    shapes = SHAPES if cuda else {"tiny.q_proj": (256, 128), "tiny.o_proj": (128, 256), "tiny.odd": (96, 192)}
    tokens = TOKENS if cuda else (1, 8)
    for name, (n, k) in shapes.items():
        for variant in ("as is", "padded"):
            nn, kk = (-(-n // 128) * 128, -(-k // 128) * 128) if variant == "padded" else (n, k)
            if variant == "padded" and (nn, kk) == (n, k):
                continue
            why = kernel_problems({name: (nn, kk)}, (128, 128)) if cuda else []
            dense = torch.nn.Linear(kk, nn, bias=False, device=device, dtype=dtype)
            torch.nn.init.normal_(dense.weight, std=0.02)
            lin = Fp8Linear.of(dense, (128, 128), "cuda" if cuda else "reference")
            compiled = torch.compile(lin, dynamic=True) if args.compile and cuda and not why else None
            for m in tokens:
                x = torch.randn(m, kk, device=device, dtype=dtype)
                row = {"part": "linear", "shape": name, "variant": variant, "out": nn, "in": kk, "tokens": m,
                       "device": str(device), "dtype": str(dtype).removeprefix("torch.")}
                with torch.no_grad():
                    row["bf16_ms"] = timed(lambda: dense(x), device, args.calls) * 1e3
                    row["quant_ms"] = timed(lambda: quantize_activations(x), device, args.calls) * 1e3
                    if why:
                        row["fp8"] = "not served: " + "; ".join(why)
                        emit(out, row)
                        continue
                    try:
                        row["fp8_ms"] = timed(lambda: lin(x), device, args.calls) * 1e3
                    except RuntimeError as e:  # cuBLASLt without the block-scaled recipe (NOT_SUPPORTED on an H200
                        # with torch 2.11+cu130): recorded, and the engine's `auto` plan keeps dequantizing
                        row["fp8"] = f"kernel refused: {str(e).splitlines()[0][:300]}"
                        emit(out, row)
                        continue
                    xq, xs = quantize_activations(x)
                    if cuda:
                        row["scaled_mm_ms"] = timed(lambda: cuda_product(xq, xs, lin.weight, lin.weight_scale_inv,
                                                                          None, dtype), device, args.calls) * 1e3
                    if compiled is not None:
                        row["fp8_compiled_ms"] = timed(lambda: compiled(x), device, args.calls) * 1e3
                    ref = reference_product(xq, xs, lin.weight, lin.weight_scale_inv, (128, 128))
                    row["err_vs_reference"] = float((lin(x).float() - ref).abs().max() / ref.abs().max())
                    exact = x.float() @ dense.weight.float().t()
                    row["err_vs_bf16"] = float((lin(x).float() - exact).norm() / exact.norm())
                row["bf16_over_fp8"] = row["bf16_ms"] / row["fp8_ms"]
                if "scaled_mm_ms" in row:
                    row["bf16_over_scaled_mm"] = row["bf16_ms"] / row["scaled_mm_ms"]
                if "fp8_compiled_ms" in row:
                    row["bf16_over_fp8_compiled"] = row["bf16_ms"] / row["fp8_compiled_ms"]
                emit(out, row)
            del dense, lin, compiled
            if cuda:
                torch.cuda.empty_cache()


def engines(args, device: torch.device, out) -> None:
    import numpy as np

    from offpolicy.config import WeightsConfig, load_config
    from offpolicy.models.build import build_model, hf_config, hf_state
    from offpolicy.rollout.engines import SamplingParams
    from offpolicy.rollout.engines.torch_engine import TorchEngine
    from offpolicy.weights import WeightVersion, version_dir
    from offpolicy.weights.formats import store_run
    from offpolicy.weights.publisher import Publisher

    cuda = device.type == "cuda"
    dtype = "bfloat16" if cuda else "float32"
    arches = ARCHES if cuda else TINY
    root = Path(tempfile.mkdtemp(prefix="fp8-engine-", dir="/dev/shm" if Path("/dev/shm").is_dir() else None))
    try:
        for family in args.models:
            arch = arches[family]
            block = 128 if family == "llama" else 64  # weights.fp8_block_size: auto for these shapes
            formats = ["fp8", "mxfp4"] if family == "gptoss" else ["fp8"]

            def config(*extra: str):
                return load_config(QUICKSTART, [
                    "model.arch=" + json.dumps(arch), f"model.dtype={dtype}", f"rollout.device={device}",
                    f"learner.device={device}", f"rollout.n_samples={args.n}", f"rollout.groups_per_lease={args.prompts}",
                    f"rollout.max_new_tokens={args.new_tokens}", "rollout.double_buffer=false",
                    f"rollout.compile={str(args.compile).lower()}", f"weights.formats=[{', '.join(formats)}]",
                    f"weights.fp8_block_size=[{block}, {block}]", *extra])

            src = build_model(config().model, device)
            pub = Publisher(WeightsConfig(root=str(root), keep=2, formats=formats, fp8_block_size=(block, block)),
                            family)
            pub.publish(1, lambda: hf_state(src), hf_config(src))
            del src
            rng = np.random.default_rng(0)
            prompts = [[11, *rng.integers(14, arch["vocab_size"], int(rng.integers(32, 65)) - 1).tolist()]
                       for _ in range(args.prompts)]
            params = SamplingParams(n=args.n, temperature=1.0, max_new_tokens=args.new_tokens)
            runs = [("bf16", "native", "auto"), ("fp8-dequantize", "fp8", "dequantize"), ("fp8-scaled", "fp8", "scaled"),
                    ("fp8-auto", "fp8", "auto")] + ([("mxfp4", "mxfp4", "auto")] if "mxfp4" in formats else [])
            base, kept, rates = None, None, {}
            for label, fmt, mode in runs:
                row = {"part": "engine", "model": family, "versions": label, "device": str(device), "dtype": dtype,
                       "rows": args.prompts * args.n, "new_tokens": args.new_tokens, "fp8_block": [block, block]}
                try:
                    engine = TorchEngine(config(f"rollout.weights_format={fmt}", f"rollout.fp8_matmul={mode}"), seed=0)
                except ValueError as e:  # rollout.fp8_matmul=scaled where the kernel does not serve the model
                    emit(out, {**row, "refused": str(e)})
                    continue
                row.update(fp8_plan=engine.fp8.mode, fp8_reason=engine.fp8.reason, fp8_linears=len(engine.fp8.modules))
                with WeightVersion(version_dir(root, store_run(family, fmt), 1)) as wv:
                    row.update(loads(engine, wv, device))
                seeds = list(range(len(prompts)))
                row.update(rate(engine, prompts, params, seeds, args.repeat, device))
                comps = row.pop("comps")
                if base is None:
                    base = engine
                    row["vs_bf16"] = 1.0
                else:
                    row["vs_bf16"] = row["tokens_per_s"] / bf16_rate
                    row.update(logprob_diff(base.model, prompts, comps, device))
                rates[label] = row["tokens_per_s"]
                if label == "bf16":
                    bf16_rate = row["tokens_per_s"]
                elif label == "mxfp4":
                    kept = engine  # for the swapped controls below
                else:
                    engine.close()
                    del engine
                emit(out, row)
                if cuda:
                    torch.cuda.empty_cache()
            # control: the bf16 engine timed again after the others (drift, or what a low-bit load left behind)
            again = rate(base, prompts, params, list(range(len(prompts))), args.repeat, device)
            again.pop("comps")
            head = {"part": "engine", "model": family, "device": str(device), "dtype": dtype,
                    "rows": args.prompts * args.n, "new_tokens": args.new_tokens}
            emit(out, {**head, "versions": "bf16-again", **again, "vs_bf16": again["tokens_per_s"] / bf16_rate})
            if kept is not None:  # which of the two differs, the mxfp4 engine or the values it holds: each with the other's
                for label, engine, fmt in (("mxfp4-engine-bf16-values", kept, "native"),
                                           ("bf16-engine-mxfp4-values", base, "mxfp4")):
                    with WeightVersion(version_dir(root, store_run(family, fmt), 1)) as wv:
                        engine.load(wv)
                    swapped = rate(engine, prompts, params, list(range(len(prompts))), args.repeat, device)
                    swapped.pop("comps")
                    emit(out, {**head, "versions": label, **swapped, "vs_bf16": swapped["tokens_per_s"] / bf16_rate})
                kept.close()
                del kept
            emit(out, summary(family, rates, bf16_rate, again["tokens_per_s"]))
            base.close()
            del base
    finally:
        shutil.rmtree(root, ignore_errors=True)


def summary(family: str, rates: dict[str, float], bf16_first: float, bf16_again: float) -> dict:
    """Each version's tokens/s over the faster of the two bf16 measurements (`vs_bf16_best`: a low-bit path is not
    credited with the bf16 engine's slower run) and over their mean, with the bf16 drift (again / first): a ratio
    inside the drift does not tell the paths apart."""
    best, mean = max(bf16_first, bf16_again), (bf16_first + bf16_again) / 2
    return {"part": "summary", "model": family, "bf16_drift": bf16_again / bf16_first,
            "vs_bf16_best": {k: v / best for k, v in rates.items() if k != "bf16"},
            "vs_bf16_mean": {k: v / mean for k, v in rates.items() if k != "bf16"}}


def loads(engine, wv, device: torch.device) -> dict:
    """A first and a second load of `wv` (`load_s`, `reload_s`: the first pays one-time costs), the first one's
    stages (`load_stages`: weights/profile.py's seconds, e.g. `load.read`, `lowbit.dequantize`; `load_counts`: which
    read path ran) and, on a GPU, the memory it took beyond what was allocated before (`load_peak_extra_gib`) and
    what is allocated and reserved after it (a load that leaves a model's worth reserved shows here)."""
    from offpolicy.weights.profile import profile

    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
    with profile() as p:
        row = {"load_s": engine.load(wv)}
    row.update(load_stages={k: round(v, 4) for k, v in sorted(p.seconds.items())}, load_counts=dict(p.counts))
    if cuda:
        row.update(load_peak_extra_gib=(torch.cuda.max_memory_allocated(device) - before) / 2 ** 30,
                   allocated_gib=torch.cuda.memory_allocated(device) / 2 ** 30,
                   reserved_gib=torch.cuda.memory_reserved(device) / 2 ** 30)
    row["reload_s"] = engine.load(wv)
    return row


def rate(engine, prompts, params, seeds, repeat: int, device: torch.device) -> dict:
    """tokens/s of `engine.generate` (median of `repeat` calls after a warm-up), the tokens of a call (fewer than
    rows x new_tokens when responses stop early: the same decode steps then count fewer tokens), and the process's
    threads and child processes while it generated (a compile's workers would show here); `steps`, the decode steps of
    a call, and `step_ms`, the median call's milliseconds per step (tokens/s also falls when responses stop early:
    step_ms does not); `comps`: the last call's."""
    engine.generate(prompts, params, seeds=seeds)  # warm-up: graphs captured, kernels chosen
    times, comps = [], None
    for _ in range(repeat):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        comps = engine.generate(prompts, params, seeds=seeds)
        times.append(time.perf_counter() - t0)
    tokens = sum(len(c.tokens) for group in comps for c in group)
    steps = max(len(c.tokens) for group in comps for c in group)  # decode steps of a call: every row runs each one
    median = sorted(times)[len(times) // 2]
    return {"tokens_per_s": tokens / median, "tokens": tokens, "steps": steps, "step_ms": median / steps * 1e3,
            **process_state(), "comps": comps}


def process_state() -> dict:
    """This process's OS threads and child processes (Linux /proc; empty elsewhere)."""
    try:
        me = os.getpid()
        children = 0
        for pid in os.listdir("/proc"):
            if pid.isdigit():
                try:
                    stat = Path(f"/proc/{pid}/stat").read_text()
                except OSError:
                    continue
                children += int(stat.rsplit(")", 1)[1].split()[1]) == me
        return {"threads": len(os.listdir("/proc/self/task")), "child_processes": children}
    except OSError:
        return {}


def logprob_diff(model, prompts, comps, device) -> dict:
    """Mean and max |behaviour logprob - `model`'s logprob| of the sampled tokens (one cache-free forward each)."""
    diffs = []
    with torch.no_grad():
        for prompt, group in zip(prompts, comps):
            for c in group[:2]:  # two responses per prompt are plenty for the mean
                ids = torch.tensor([list(prompt) + [int(t) for t in c.tokens]], device=device)
                lp = torch.log_softmax(model(input_ids=ids).logits[0].float(), dim=-1)[len(prompt) - 1:-1]
                got = lp.gather(-1, ids[0, len(prompt):, None]).squeeze(-1).double().cpu()
                diffs.append((got - torch.from_numpy(c.logprobs).double()).abs())
    d = torch.cat(diffs)
    return {"logprob_diff_mean": float(d.mean()), "logprob_diff_max": float(d.max())}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--out", required=True, help="JSON lines, one per row")
    p.add_argument("--parts", nargs="+", default=["linear", "engine"], choices=["linear", "engine"])
    p.add_argument("--models", nargs="+", default=["llama", "gptoss"], choices=sorted(ARCHES))
    p.add_argument("--calls", type=int, default=None, help="timed calls per linear (median; default 50 on a GPU)")
    p.add_argument("--prompts", type=int, default=None, help="prompts per generate call (default 16 on a GPU)")
    p.add_argument("--n", type=int, default=None, help="responses per prompt (default 8 on a GPU)")
    p.add_argument("--new-tokens", type=int, default=None, help="tokens per response (default 128 on a GPU)")
    p.add_argument("--repeat", type=int, default=3, help="timed generate calls per engine (median)")
    p.add_argument("--compile", action="store_true", help="also torch.compile Fp8Linear (linear part) and the "
                   "engine's static decode step (rollout.compile; slower start)")
    args = p.parse_args(argv)
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    args.calls = args.calls or (50 if cuda else 3)
    args.prompts = args.prompts or (16 if cuda else 2)
    args.n = args.n or (8 if cuda else 2)
    args.new_tokens = args.new_tokens or (128 if cuda else 4)
    if not cuda:
        args.repeat = min(args.repeat, 1)
    with open(args.out, "w") as out:
        emit(out, {"part": "setup", "torch": torch.__version__, "device": str(device),
                   "gpu": torch.cuda.get_device_name(device) if cuda else None,
                   "capability": list(torch.cuda.get_device_capability(device)) if cuda else None,
                   "scaled_mm": hasattr(torch.nn.functional, "scaled_mm"), "args": vars(args)})
        if "linear" in args.parts:
            linears(args, device, out)
        if "engine" in args.parts:
            engines(args, device, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
