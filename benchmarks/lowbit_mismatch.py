"""Rollout/learner logprob mismatch of low-bit rollout weights (issue 15): native vs fp8 vs mxfp4.

One model (`--arch gptoss-slice`: GPT-OSS-20B's shapes with `--layers` layers, random weights from
`--seed`, no download; `tiny-gpt_oss`: the CPU tests' model; or `--model DIR`, an HF checkpoint) in
`--dtype` (bf16, the learner's dtype) is published through the real path for each format of
`--formats` (`formats.encode` on the device, `WeightStore.publish`, a `WeightVersion` opened as a rollout
does), loaded by the torch engine (`TorchEngine.load`: a low-bit version is dequantized on the device,
what `rollout.weights_format` does), and the engine samples `--n` responses of `--new-tokens` tokens to
each of `--prompts` random prompts of `--prompt-len` tokens at temperature 1, recording its behaviour
logprobs. The learner (the model as trained, a copy made before any load) then scores every sampled token
in `--dtype`, and, as a yardstick for the dtype's own noise, the same weights in float32.

Per format and scorer, with d = logp_learner - logp_rollout over the sampled tokens: mean |d|, its p50,
p99 and max; the k3 estimate of KL(rollout || learner) (mean of exp(d) - d - 1); and what the corrections
would do at the default bounds (`algo.tis_threshold` 2, `algo.icepop_low/high` 0.5 / 2): the fraction of
tokens TIS truncates (exp(d) >= 2), the fraction icepop masks (exp(d) outside [0.5, 2]), and the
sequence-level ratio exp(sum d) (median, fraction truncated at 2). The `native` row is the mismatch a
bf16 rollout has anyway (batched decode with a KV cache vs the learner's full forward); the low-bit
rows add the quantization's cost on top.

    python benchmarks/lowbit_mismatch.py --arch gptoss-slice --layers 2 --out runs/mismatch.json   (one GPU)
    python benchmarks/lowbit_mismatch.py --arch tiny-gpt_oss --device cpu --dtype float32           (CPU check)

Random weights say what the quantization does to the arithmetic of this shape, not what it does to a
trained model's (peaked) distributions; pass `--model DIR` for a trained checkpoint.
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def arch(name: str, layers: int) -> dict:
    from offpolicy.learner.backends.megatron.memory import gpt_oss_slice

    if name == "gptoss-slice":
        return gpt_oss_slice(layers)
    if name.startswith("tiny-"):
        if str(ROOT) not in sys.path:
            sys.path.insert(0, str(ROOT))
        import tests.megatron_workers as mw

        return dict(mw.TINY[name[len("tiny-"):]])
    raise SystemExit(f"--arch {name!r}: use gptoss-slice or tiny-<family> (or --model DIR)")


def mismatch(d, lengths, tis: float = 2.0, low: float = 0.5, high: float = 2.0) -> dict:
    """Figures of the per-token differences `d` (1-D, float64) of sequences of `lengths` tokens."""
    import torch

    a = d.abs()
    r = torch.exp(d)
    seq = torch.stack([s.sum() for s in torch.split(d, lengths)])
    return {"tokens": int(d.numel()), "mean_abs": float(a.mean()), "p50_abs": float(a.quantile(0.5)),
            "p99_abs": float(a.quantile(0.99)), "max_abs": float(a.max()), "kl_k3": float((r - d - 1).mean()),
            "tis_truncated_frac": float((r >= tis).double().mean()),
            "icepop_masked_frac": float(((r < low) | (r > high)).double().mean()),
            "seq_ratio_median": float(torch.exp(seq).median()),
            "seq_tis_truncated_frac": float((torch.exp(seq) >= tis).double().mean())}


def score(model, prompts: list[list[int]], responses: list[list[int]], device, rows: int = 4):
    """Per-token logprobs (float64, concatenated) of each response after its prompt under `model`."""
    import torch

    from offpolicy.learner.algorithms import token_logprobs

    out = []
    with torch.no_grad():
        for i in range(0, len(responses), rows):
            for p, r in zip(prompts[i:i + rows], responses[i:i + rows]):  # one row at a time: no padding
                ids = torch.tensor([p + r], device=device)
                logits = model(input_ids=ids).logits[:, len(p) - 1:-1].float()
                out.append(token_logprobs(logits, ids[:, len(p):])[0].double().cpu())
    return torch.cat(out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--arch", default="gptoss-slice")
    p.add_argument("--layers", type=int, default=2, help="layers of gptoss-slice")
    p.add_argument("--model", help="an HF checkpoint directory instead of --arch")
    p.add_argument("--formats", nargs="+", default=["native", "fp8", "mxfp4"])
    p.add_argument("--fp8-block", type=int, nargs=2, default=[128, 128])
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--device", default="cuda")
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--n", type=int, default=4)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--new-tokens", type=int, default=256)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-fp32", action="store_true", help="skip the float32 yardstick scorer")
    p.add_argument("--out", help="write the JSON here")
    args = p.parse_args(argv)

    import torch

    from offpolicy.config import load_config
    from offpolicy.models.build import checkpoint_tensors
    from offpolicy.rollout.engines import SamplingParams
    from offpolicy.rollout.engines.torch_engine import TorchEngine
    from offpolicy.weights import WeightStore, WeightVersion
    from offpolicy.weights.formats import encode

    model = [f"model.path={args.model}"] if args.model else [f"model.arch={json.dumps(arch(args.arch, args.layers))}"]
    cfg = load_config(None, [*model, f"model.dtype={args.dtype}", f"model.seed={args.seed}",
                             f"rollout.device={args.device}", "rollout.static_cache=false", "rollout.compile=false"])
    t0 = time.perf_counter()
    engine = TorchEngine(cfg, seed=args.seed)
    learner = copy.deepcopy(engine.model)  # the weights as trained; the engine's get overwritten by each load
    hf_config = learner.config.to_dict()
    vocab = hf_config["vocab_size"]
    named = list(checkpoint_tensors(learner).items())
    g = torch.Generator().manual_seed(args.seed)
    prompts = torch.randint(0, vocab, (args.prompts, args.prompt_len), generator=g).tolist()
    params = SamplingParams(n=args.n, temperature=1.0, max_new_tokens=args.new_tokens)
    scorers = {args.dtype: learner}
    if not args.no_fp32 and args.dtype != "float32":
        scorers["float32"] = copy.deepcopy(learner).float()
    print(f"model ready in {time.perf_counter() - t0:.1f} s: {sum(t.numel() for _, t in named) / 1e9:.2f}B params, "
          f"{args.prompts} prompts x {args.n} x {args.new_tokens} tokens", flush=True)
    rows = []
    with tempfile.TemporaryDirectory() as root:
        for f in args.formats:
            t0 = time.perf_counter()
            tensors, config = encode(f, named, hf_config, args.fp8_block)
            store = WeightStore(root, f"mismatch-{f}", keep=1, fmt=f)
            path = store.publish(0, tensors, config).path
            del tensors
            with WeightVersion(path) as wv:
                load_s = engine.load(wv)
                nbytes = sum(t.numel() * t.element_size() for t in wv.tensors.values())
            comps = [c for group in engine.generate(prompts, params, seeds=list(range(len(prompts)))) for c in group]
            reps = [c.tokens.tolist() for c in comps]
            rollout = torch.cat([torch.from_numpy(c.logprobs).double() for c in comps])
            row = {"format": f, "bytes": nbytes, "load_seconds": load_s, "seconds": 0.0,
                   "rollout_logprob_mean": float(rollout.mean())}
            for name, m in scorers.items():
                d = score(m, [q for q in prompts for _ in range(args.n)], reps, engine.device) - rollout
                row[name] = mismatch(d, [len(r) for r in reps])
            row["seconds"] = time.perf_counter() - t0
            rows.append(row)
            x = row[args.dtype]
            print(f"{f}: mean |d| {x['mean_abs']:.4g}, p99 {x['p99_abs']:.4g}, max {x['max_abs']:.4g}, "
                  f"KL {x['kl_k3']:.3g}, icepop masks {x['icepop_masked_frac']:.4f} ({row['seconds']:.1f} s)", flush=True)
    result = {"arch": args.model or args.arch, "layers": args.layers, "dtype": args.dtype, "fp8_block": args.fp8_block,
              "prompts": args.prompts, "n": args.n, "prompt_len": args.prompt_len, "new_tokens": args.new_tokens,
              "device": torch.cuda.get_device_name() if engine.device.type == "cuda" else "cpu", "rows": rows}
    print("\n| format | scorer | tokens | mean abs d | p99 | max | KL (k3) | TIS truncates | icepop masks | "
          "seq ratio median | seq truncated |\n" + "| --- " * 11 + "|")
    for r in rows:
        for name in scorers:
            x = r[name]
            print(f"| {r['format']} | {name} | {x['tokens']:,} | {x['mean_abs']:.4g} | {x['p99_abs']:.4g} | "
                  f"{x['max_abs']:.4g} | {x['kl_k3']:.3g} | {x['tis_truncated_frac']:.4f} | "
                  f"{x['icepop_masked_frac']:.4f} | {x['seq_ratio_median']:.3g} | {x['seq_tis_truncated_frac']:.3f} |")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
