"""Attention kernels for the Megatron learner's core attention, forward + backward, on one GPU.

The same documents (lengths drawn uniformly from --lengths, filling --tokens) through:
  flash-varlen        packed, flash-attention's varlen kernels (attention.CoreAttention's path)
  flash-varlen+sinks  the same with per-head sinks (GPT-OSS), output scaled by sigmoid(lse - sink)
  sdpa-padded         right-padded rows (longest first, rows x length <= --tokens), SDPA is_causal
  flex-packed         FlexAttention (torch.compile) with a document-causal block mask, packed
With --float32 (a float32 learner, where flash has no kernel) instead:
  reference           attention.reference_attention, one small matmul chain per document (CPU's path)
  padded              attention.padded_attention, SDPA over right-padded rows of similar length (CUDA float32)
Times are medians of CUDA-event timings; TFLOP/s counts the causal attention FLOPs of the real tokens
(4 x L^2 / 2 x heads x head_dim forward, 2.5x that backward). `--check` also prints each packed kernel's error
against a float32 reference of the same bf16 inputs (output and the three gradients: max |x - ref| / max |ref|).
`--rows` picks rows by name (default all).

    python benchmarks/attention_kernels.py --tokens 16384 --heads 32 --kv-heads 8 --head-dim 64
    python benchmarks/attention_kernels.py --tokens 125243 --heads 32 --kv-heads 4 --head-dim 128 --check \
        --rows flash-varlen                                                 # Qwen3-30B-A3B's heads
    python benchmarks/attention_kernels.py --float32 --tokens 58368 --lengths 60:128 --heads 9 --kv-heads 3  # SmolLM2
"""

from __future__ import annotations

import argparse
import json


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=16384)
    p.add_argument("--lengths", default="128:1792")
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--repeat", type=int, default=10)
    p.add_argument("--float32", action="store_true", help="the float32 kernels (reference vs padded) instead")
    p.add_argument("--rows", default="flash-varlen,flash-varlen+sinks,sdpa-padded,flex-packed")
    p.add_argument("--check", action="store_true", help="each packed kernel's error against float32")
    args = p.parse_args()

    import numpy as np
    import torch
    import torch.nn.functional as F

    from offpolicy.learner.backends.megatron.kernels.attention import _Flash

    rng = np.random.default_rng(0)
    lo, hi = (int(x) for x in args.lengths.split(":"))
    lengths: list[int] = []
    while sum(lengths) + hi <= args.tokens:
        lengths.append(int(rng.integers(lo, hi + 1)))
    bounds = np.concatenate([[0], np.cumsum(lengths)]).tolist()
    total, h, g, d, dev = bounds[-1], args.heads, args.kv_heads, args.head_dim, torch.device("cuda")
    scale = d ** -0.5

    def tensors(*shape_q):
        q = torch.randn(*shape_q, h, d, device=dev, dtype=torch.bfloat16, requires_grad=True)
        k, v = (torch.randn(*shape_q, g, d, device=dev, dtype=torch.bfloat16, requires_grad=True) for _ in "kv")
        return q, k, v

    def timed(fn, *inputs):
        out = fn(*inputs)
        grad = torch.randn_like(out)
        for _ in range(3):
            torch.autograd.grad(fn(*inputs), inputs, grad)
        times = []
        for _ in range(args.repeat):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            torch.autograd.grad(fn(*inputs), inputs, grad)
            b.record()
            torch.cuda.synchronize()
            times.append(a.elapsed_time(b))
        return sorted(times)[len(times) // 2]

    if args.float32:
        from offpolicy.learner.backends.megatron.kernels.attention import padded_attention, reference_attention

        q = torch.randn(total, h, d, device=dev, requires_grad=True)
        k, v = (torch.randn(total, g, d, device=dev, requires_grad=True) for _ in "kv")
        rows32 = {name: timed(lambda q, k, v, fn=fn: fn(q, k, v, bounds, scale), q, k, v)
                  for name, fn in (("reference", reference_attention), ("padded", padded_attention))}
        for name, ms in rows32.items():
            print(f"{name:20s} {ms:8.3f} ms")
        print(f"padded / reference speed: {rows32['reference'] / rows32['padded']:.1f}x")
        print(json.dumps(dict(tokens=total, docs=len(lengths), dtype="float32", ms=rows32,
                              device=torch.cuda.get_device_name(), torch=torch.__version__)))
        return
    cu = torch.tensor(bounds, dtype=torch.int32, device=dev)
    longest = max(lengths)
    sink = torch.randn(h, device=dev, dtype=torch.bfloat16, requires_grad=True)
    rows: dict[str, float] = {}
    q, k, v = tensors(total)
    want = args.rows.split(",")
    if "flash-varlen" in want:
        def flash(q, k, v):
            return _Flash.apply(q, k, v, None, cu, longest, scale, -1)

        if args.check:
            print("flash-varlen error against float32:", json.dumps(_errors(flash, q, k, v, bounds, scale)))
        rows["flash-varlen"] = timed(flash, q, k, v)
    if "flash-varlen+sinks" in want:
        rows["flash-varlen+sinks"] = timed(lambda q, k, v, s: _Flash.apply(q, k, v, s, cu, longest, scale, -1),
                                           q, k, v, sink)
    order = sorted(lengths, reverse=True)  # padded rows: longest first, rows x longest <= tokens
    micro: list[list[int]] = []
    for n in order:
        if micro and (len(micro[-1]) + 1) * micro[-1][0] <= args.tokens:
            micro[-1].append(n)
        else:
            micro.append([n])

    def sdpa(*qkv_list):
        outs = [F.scaled_dot_product_attention(qq, kk, vv, is_causal=True, scale=scale, enable_gqa=True)
                for qq, kk, vv in zip(qkv_list[0::3], qkv_list[1::3], qkv_list[2::3])]
        return torch.cat([o.flatten() for o in outs])

    if "sdpa-padded" in want:
        padded = [torch.randn(len(m), n, m[0], d, device=dev, dtype=torch.bfloat16, requires_grad=True)
                  for m in micro for n in (h, g, g)]  # [b, heads, s, d] per micro-batch: q, k, v
        rows["sdpa-padded"] = timed(sdpa, *padded)
    try:
        if "flex-packed" not in want:
            raise ImportError("not asked for (--rows)")
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        doc = torch.repeat_interleave(torch.arange(len(lengths), device=dev), torch.tensor(lengths, device=dev))

        def mask(b, hh, qi, ki):
            return (doc[qi] == doc[ki]) & (ki <= qi)

        block = create_block_mask(mask, None, None, total, total, device=dev)
        flex = torch.compile(flex_attention)
        fq, fk, fv = (t.detach().transpose(0, 1)[None].requires_grad_(True) for t in (q, k, v))
        rows["flex-packed"] = timed(lambda a, b, c: flex(a, b, c, block_mask=block, scale=scale, enable_gqa=True),
                                    fq, fk, fv)
    except (ImportError, RuntimeError) as e:  # compile errors are RuntimeErrors: report the row as failed
        print(f"flex-packed failed: {type(e).__name__}: {e}")
    flops = sum(4 * n * n / 2 * h * d for n in lengths) * 3.5
    for name, ms in rows.items():
        print(f"{name:20s} {ms:8.3f} ms  {flops / ms / 1e9:7.1f} TFLOP/s")
    print(json.dumps(dict(tokens=total, docs=len(lengths), padded_slots=sum(len(m) * m[0] for m in micro),
                          heads=h, kv_heads=g, head_dim=d, ms=rows, device=torch.cuda.get_device_name(),
                          torch=torch.__version__, cudnn=torch.backends.cudnn.version())))


def _errors(fn, q, k, v, bounds: list[int], scale: float) -> dict[str, float]:
    """max |x - ref| / max |ref| of fn's output and gradients against float32 attention of the same inputs."""
    import torch

    from offpolicy.learner.backends.megatron.kernels.attention import reference_attention

    out = fn(q, k, v)
    grad = torch.randn_like(out)
    got = [out.detach(), *torch.autograd.grad(out, (q, k, v), grad)]
    wide = [t.detach().float().requires_grad_(True) for t in (q, k, v)]
    ref_out = reference_attention(*wide, bounds, scale)
    ref = [ref_out.detach(), *torch.autograd.grad(ref_out, wide, grad.float())]
    return {name: round(float((a.float() - r).abs().max() / r.abs().max()), 5)
            for name, a, r in zip(("out", "dq", "dk", "dv"), got, ref)}


if __name__ == "__main__":
    main()
