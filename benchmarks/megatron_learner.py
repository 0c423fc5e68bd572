"""Learner throughput of the megatron backend on one GPU: tokens/s, MFU and peak memory of a GRPO step.

Builds a model from an HF config with random weights (no download): `--model qwen2.5-0.5b` (the default,
dense) or `gptoss-slice` (GPT-OSS-20B's shapes, offpolicy/backends/megatron/memory.py `gpt_oss_slice`:
hidden 2880, 64/8 heads of 64, 32 experts top-4 of FFN 2880, vocabulary 201088, `--layers` layers,
sliding and full alternating). Feeds it synthetic groups (prompt + response tokens, random behaviour
logprobs) and times `train_step` after warm-up steps. FLOPs per token = 6 x the parameters a token
passes through (for MoE: the top-k experts, `arch.active_params`; the embedding lookup excluded for
MoE, kept for the dense default as before) + attention 12 x layers x heads x head_dim x seq_len
(forward + backward, no causal or window discount). MFU = tokens/s x FLOPs per token / peak bf16 dense
FLOP/s (--peak, default 989e12 for an H100 SXM; an H200 has the same). The JSON also holds the peak
memory next to memory.per_gpu's estimate for this layout (1 GPU, local attention, the same recompute).
With `--verify` it first saves the model in bf16 and runs `offpolicy verify` on it (sequence 32 past
the sliding window, YaRN active) and reports its figures.

    python benchmarks/megatron_learner.py --groups 32 --n 8 --prompt 128 --response 384
    python benchmarks/megatron_learner.py --model gptoss-slice --layers 2 --verify --groups 8 --n 8 \\
        --prompt 256 --response 768 --max-tokens 8192
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time

QWEN25_05B = dict(model_type="qwen2", vocab_size=151936, hidden_size=896, intermediate_size=4864,
                  num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                  max_position_embeddings=32768, tie_word_embeddings=True, rope_theta=1000000.0)


def model_config(name: str, layers: int) -> dict:
    if name == "qwen2.5-0.5b":
        return dict(QWEN25_05B)
    from offpolicy.backends.megatron.memory import gpt_oss_slice

    return gpt_oss_slice(layers)


def verify_figures(hf: dict, seed: int) -> dict:
    """`offpolicy verify` (bf16, this process, one GPU) on the model saved with random weights."""
    import torch

    from offpolicy.backends.megatron.verify import verify
    from offpolicy.config import ModelConfig
    from offpolicy.models import build_model

    with tempfile.TemporaryDirectory() as d:
        build_model(ModelConfig(arch=hf, dtype="bfloat16", seed=seed), torch.device("cuda")).save_pretrained(d)
        t = time.perf_counter()
        r = verify(d, dtype="bfloat16", device="cuda")
        seconds = time.perf_counter() - t
    from megatron.core import parallel_state

    parallel_state.destroy_model_parallel()  # the backend below sets up its own
    return dict(verify_max_diff=r.max_diff, verify_top1=r.top1, verify_greedy=f"{r.gen_agree}/{r.gen_len}",
                verify_seq_len=r.seq_len, verify_features=r.features, verify_ok=r.ok, verify_s=round(seconds, 1))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="qwen2.5-0.5b", choices=["qwen2.5-0.5b", "gptoss-slice"])
    p.add_argument("--layers", type=int, default=2, help="layers of gptoss-slice")
    p.add_argument("--groups", type=int, default=32)
    p.add_argument("--n", type=int, default=8)
    p.add_argument("--prompt", type=int, default=128)
    p.add_argument("--response", type=int, default=384)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--max-tokens", type=int, default=16384, help="learner.megatron.max_tokens_per_gpu")
    p.add_argument("--recompute", default="none")
    p.add_argument("--peak", type=float, default=989e12)
    p.add_argument("--verify", action="store_true", help="run offpolicy verify on the model first (bf16)")
    args = p.parse_args()

    import torch

    from offpolicy.backends.megatron import memory
    from offpolicy.backends.megatron.arch import active_params, from_hf
    from offpolicy.backends.megatron.backend import MegatronBackend
    from offpolicy.bench.synthetic import synthetic_batch
    from offpolicy.config import load_config

    hf = model_config(args.model, args.layers)
    out: dict = dict(model=args.model)
    if args.verify:
        out.update(verify_figures(hf, seed=0))
    torch.cuda.reset_peak_memory_stats()
    arch_text = "{" + ", ".join(f"{k}: {json.dumps(v)}" for k, v in hf.items()) + "}"
    cfg = load_config(None, [f"model.arch={arch_text}", "model.dtype=bfloat16", "learner.backend=megatron",
                             "learner.lr=1e-6", f"rollout.n_samples={args.n}",
                             f"rollout.max_new_tokens={args.response}",
                             f"learner.megatron.max_tokens_per_gpu={args.max_tokens}",
                             f"learner.megatron.recompute={args.recompute}"])
    backend = MegatronBackend(cfg)
    groups, adv = synthetic_batch(seed=0, groups=args.groups, n=args.n, prompt=args.prompt, response=args.response,
                                  vocab=hf["vocab_size"])
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
    a = from_hf(hf)
    seq = args.prompt + args.response
    tokens = args.groups * args.n * seq
    flops_params = active_params(a) - (a.vocab_size * a.hidden_size if a.is_moe else 0)
    flops_tok = 6 * flops_params + 12 * a.num_layers * a.num_heads * a.head_dim * seq
    step = sum(times) / len(times)
    tps = tokens / step
    est = memory.per_gpu(a, memory.Layout(world=1), memory.Micro(tokens=args.max_tokens, seq_len=seq,
                                                                 microbatches=max(1, tokens // args.max_tokens),
                                                                 recompute=args.recompute))
    out.update(params=a.num_params(), active_params=active_params(a), tokens_per_step=tokens, step_s=round(step, 3),
               tokens_per_s=round(tps), flops_per_token=flops_tok, mfu=round(tps * flops_tok / args.peak, 4),
               loss=stats["loss"], grad_norm=stats["grad_norm"], gather_s=round(gather_s, 3), hf_tensors=n_weights,
               peak_mem_gb=round(torch.cuda.max_memory_allocated() / 2**30, 1),
               estimated_mem_gb=round(est.total_bytes / 2**30, 1), device=torch.cuda.get_device_name())
    print(json.dumps(out))


if __name__ == "__main__":
    main()
