"""Learner throughput of the megatron backend on one GPU: tokens/s and MFU of a GRPO step.

Builds a dense model from an HF config (default: the Qwen2.5-0.5B shape, random weights: no
download), feeds it synthetic groups (prompt + response tokens, random behaviour logprobs) and
times `train_step` after warm-up steps. Model FLOPs per token = 6 x params + attention, with
attention = 12 x layers x heads x head_dim x seq_len (forward + backward, no causal halving).
MFU = tokens/s x FLOPs per token / peak bf16 dense FLOP/s (--peak, default 989e12 for an H100 SXM).

    python benchmarks/megatron_learner.py --groups 32 --n 8 --prompt 128 --response 384
"""

from __future__ import annotations

import argparse
import json
import time

QWEN25_05B = dict(model_type="qwen2", vocab_size=151936, hidden_size=896, intermediate_size=4864,
                  num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                  max_position_embeddings=32768, tie_word_embeddings=True, rope_theta=1000000.0)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--groups", type=int, default=32)
    p.add_argument("--n", type=int, default=8)
    p.add_argument("--prompt", type=int, default=128)
    p.add_argument("--response", type=int, default=384)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--max-tokens", type=int, default=16384, help="learner.megatron.max_tokens_per_gpu")
    p.add_argument("--recompute", default="none")
    p.add_argument("--peak", type=float, default=989e12)
    args = p.parse_args()

    import torch

    from offpolicy.backends.megatron.arch import from_hf
    from offpolicy.backends.megatron.backend import MegatronBackend
    from offpolicy.bench.synthetic import synthetic_batch
    from offpolicy.config import load_config

    arch = "{" + ", ".join(f"{k}: {v}" for k, v in QWEN25_05B.items()) + "}"
    cfg = load_config(None, [f"model.arch={arch}", "model.dtype=bfloat16", "learner.backend=megatron",
                             "learner.lr=1e-6", f"rollout.n_samples={args.n}",
                             f"rollout.max_new_tokens={args.response}",
                             f"learner.megatron.max_tokens_per_gpu={args.max_tokens}",
                             f"learner.megatron.recompute={args.recompute}"])
    backend = MegatronBackend(cfg)
    groups, adv = synthetic_batch(seed=0, groups=args.groups, n=args.n, prompt=args.prompt, response=args.response,
                                  vocab=QWEN25_05B["vocab_size"])
    times = []
    for i in range(args.warmup + args.steps):
        torch.cuda.synchronize()
        t = time.perf_counter()
        stats = backend.train_step(groups, adv)
        torch.cuda.synchronize()
        if i >= args.warmup:
            times.append(time.perf_counter() - t)
    t0 = time.perf_counter()
    n_weights = sum(1 for _ in backend.weights())
    gather_s = time.perf_counter() - t0
    a = from_hf(QWEN25_05B)
    seq = args.prompt + args.response
    tokens = args.groups * args.n * seq
    flops_tok = 6 * a.num_params() + 12 * a.num_layers * a.num_heads * a.head_dim * seq
    step = sum(times) / len(times)
    tps = tokens / step
    print(json.dumps(dict(params=a.num_params(), tokens_per_step=tokens, step_s=round(step, 3),
                          tokens_per_s=round(tps), flops_per_token=flops_tok, mfu=round(tps * flops_tok / args.peak, 4),
                          loss=stats["loss"], grad_norm=stats["grad_norm"], gather_s=round(gather_s, 3),
                          hf_tensors=n_weights, peak_mem_gb=round(torch.cuda.max_memory_allocated() / 2**30, 1),
                          device=torch.cuda.get_device_name())))


if __name__ == "__main__":
    main()
