"""The MoE layer's memory-bound kernels on one GPU: torch.compile's against moe_triton's, and the bytes' time.

GLU, per model shape (rows = a micro-batch's tokens x top-k, I = the expert FFN width, fc1's biases by row where
the family has them), one forward and one backward of `experts.glu_rows`:
  compiled       torch.compile'd glu_rows with experts.compile_elementwise's options (the path before)
  triton         moe_triton.glu_rows (the default on a GPU), at its tile sizes and at the --tiles variants
Gathered sums (the permutation's sum of each token's k expert outputs, and the permute's backward), per shape
(tokens, k, hidden): compiled permutation.gathered_sum (the path before) against moe_triton.gathered_sum.
RMSNorm (`--norms`, shapes [tokens, 1, heads, width]): torch's F.rms_norm (its fused kernel) against
norms.compile_head_norms' compiled one and norms.rms_norm_triton (the hidden states' norms on a GPU) at its
tiles and the --norm-tiles variants, forward and backward (input and weight gradients), at Qwen3's q and k norms
and the hidden states' widths (Qwen3's 2,048, GPT-OSS's 2,880); its bytes: forward read x, write y; backward read
x and the output's gradient, write x's (the weight's gradient is a [programs, width] float32 partial more).
Each row prints the median time (CUDA events), the bytes it must move (GLU forward: read h [rows, 2I], write
[rows, I]; backward: read h and the output's gradient, write h's gradient; sums: read N k rows, write N; bf16)
and the ratio of the time to those bytes at the copy bandwidth measured in the same run (a device-to-device copy
of 4 GiB): 1.0 is the floor.

    python benchmarks/moe_kernels.py                               # GPT-OSS's and Qwen3-MoE's shapes
    python benchmarks/moe_kernels.py --shapes gptoss:368636:2880 --tiles 8x256,16x128,4x512
    python benchmarks/moe_kernels.py --shapes= --sums= --norm-tiles 4096x8x4,2048x4x8   # the norms alone
"""

from __future__ import annotations

import argparse
import json
import statistics

SHAPES = "gptoss:368636:2880,qwen3:1001944:768"  # GPT-OSS body micro-batch 92,159 tokens x top-4; Qwen3 125,243 x 8
SUMS = "gptoss:92159:4:2880,qwen3:125243:8:2048"
NORMS = "q:125243:32:128,k:125243:4:128,hidden:125243:1:2048,gptoss:92159:1:2880"  # the body micro-batches


def emit(out: str | None, rec: dict, line: str) -> None:
    """Print a row and append its record to `out` (JSON lines)."""
    print(line)
    if out:
        with open(out, "a") as f:
            f.write(json.dumps(rec) + "\n")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", default=SHAPES, help="name:rows:I[,...] (gptoss*: clamp, alpha, offset, biases)")
    p.add_argument("--experts", type=int, default=32, help="local experts (the biases' rows)")
    p.add_argument("--norms", default=NORMS, help="name:tokens:heads:width[,...] for the RMSNorms")
    p.add_argument("--sums", default=SUMS, help="name:tokens:k:hidden[,...] for the gathered sums")
    p.add_argument("--tiles", default="8x256,4x256,16x128", help="GLU backward tiles to try, BTxBI[,...]")
    p.add_argument("--norm-tiles", default="4096x8x4,2048x4x8,2048x8x4,8192x16x2",
                   help="Triton RMSNorm variants to try, TILExWARPSxBWD_PER_SM[,...] (norms.py's first)")
    p.add_argument("--repeat", type=int, default=20)
    p.add_argument("--out", help="append JSON lines here")
    args = p.parse_args()

    import torch

    from offpolicy.learner.backends.megatron.kernels import experts, moe_triton, norms, permutation

    torch._functorch.config.donated_buffer = False  # the backward runs again on the same graph
    dev = torch.device("cuda")

    def median_ms(fn) -> float:
        for _ in range(3):
            fn()
        times = []
        for _ in range(args.repeat):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b))
        return statistics.median(times)

    big = torch.empty(1 << 31, dtype=torch.bfloat16, device=dev)
    dst = torch.empty_like(big)
    bandwidth = 2 * big.numel() * 2 / (median_ms(lambda: dst.copy_(big)) / 1e3)  # bytes read + written per s
    del big, dst
    print(f"copy bandwidth {bandwidth / 1e12:.2f} TB/s ({torch.cuda.get_device_name()})")
    experts.compile_elementwise()
    for spec in filter(None, args.shapes.split(",")):
        name, rows, width = spec.split(":")
        rows, width = int(rows), int(width)
        gpt_oss = name.startswith("gptoss")
        alpha, limit, offset = (1.702, 7.0, 1.0) if gpt_oss else (None, None, 0.0)
        torch.manual_seed(0)
        h = (torch.randn(rows, 2 * width, device=dev) * 3).to(torch.bfloat16).requires_grad_()
        bias = torch.randn(args.experts, 2 * width, device=dev).to(torch.bfloat16) if gpt_oss else None
        idx = torch.sort(torch.randint(0, args.experts, (rows,), device=dev)).values if gpt_oss else None
        probs = torch.rand(rows, device=dev).requires_grad_()
        grad = torch.randn(rows, width, device=dev, dtype=torch.bfloat16)
        fwd_bytes, bwd_bytes = rows * width * 2 * 3, rows * width * 2 * 5

        def both(fn):
            out = fn()
            fwd = median_ms(lambda: fn())
            bwd = median_ms(lambda: torch.autograd.grad(out, (h, probs), grad, retain_graph=True))
            return fwd, bwd

        def compiled():
            experts._token_dim_dynamic(h, probs, idx)
            return experts._KERNELS["glu_rows"](h, bias, idx, probs, alpha, limit, offset)

        rows_out = [("compiled", *both(compiled))]
        for tile in args.tiles.split(","):
            bt, bi = (int(x) for x in tile.split("x"))
            moe_triton.BT_BWD, moe_triton.BI_BWD = bt, bi
            rows_out.append((f"triton {tile}", *both(lambda: moe_triton.glu_rows(h, bias, idx, probs, alpha, limit,
                                                                                offset))))
        for label, fwd, bwd in rows_out:
            rec = dict(shape=name, rows=rows, width=width, kernel=label, fwd_ms=round(fwd, 3), bwd_ms=round(bwd, 3),
                       fwd_x_bytes=round(fwd / 1e3 * bandwidth / fwd_bytes, 2),
                       bwd_x_bytes=round(bwd / 1e3 * bandwidth / bwd_bytes, 2))
            emit(args.out, rec, f"{name:8s} {rows:7d} x {width:5d}  {label:16s} forward {fwd:7.3f} ms "
                 f"({rec['fwd_x_bytes']:.2f}x bytes)  backward {bwd:7.3f} ms ({rec['bwd_x_bytes']:.2f}x bytes)")
        del h, grad
    permutation.compile_sums()
    for spec in filter(None, args.sums.split(",")):
        name, n, k, width = spec.split(":")
        n, k, width = int(n), int(k), int(width)
        torch.manual_seed(0)
        rows = torch.randn(n * k, width, device=dev, dtype=torch.bfloat16)
        inverse = torch.randperm(n * k, device=dev).view(n, k)
        want = permutation._KERNELS["gathered_sum"](rows, inverse)
        assert torch.allclose(moe_triton.gathered_sum(rows, inverse).float(), want.float(), atol=3e-2, rtol=1e-2)
        nbytes = (n * k + n) * width * 2
        for label, fn in (("compiled", lambda: permutation._KERNELS["gathered_sum"](rows, inverse)),
                          ("triton", lambda: moe_triton.gathered_sum(rows, inverse))):
            ms = median_ms(fn)
            rec = dict(shape=f"sum-{name}", tokens=n, k=k, width=width, kernel=label, ms=round(ms, 3),
                       x_bytes=round(ms / 1e3 * bandwidth / nbytes, 2))
            emit(args.out, rec, f"sums {name:8s} {n:7d} x {k} x {width:5d}  {label:10s} {ms:7.3f} ms "
                 f"({rec['x_bytes']:.2f}x bytes)")
        del rows

    norms.compile_head_norms()
    tiles = norms.TILE, norms.WARPS, norms.BWD_PER_SM
    for spec in filter(None, args.norms.split(",")):
        name, n, heads, width = spec.split(":")
        n, heads, width = int(n), int(heads), int(width)
        torch.manual_seed(0)
        x = torch.randn(n, 1, heads, width, device=dev, dtype=torch.bfloat16, requires_grad=True)
        w = (torch.rand(width, device=dev) + 0.5).to(torch.bfloat16).requires_grad_()
        grad = torch.randn_like(x)
        fwd_bytes, bwd_bytes = x.numel() * 2 * 2, x.numel() * 2 * 3
        want = torch.nn.functional.rms_norm(x, (width,), w, 1e-6)
        assert torch.allclose(norms.rms_norm_triton(x, w, 1e-6).float(), want.float(), atol=2e-2, rtol=1e-2)
        variants = [("torch", lambda: torch.nn.functional.rms_norm(x, (width,), w, 1e-6), None),
                    ("compiled", lambda: norms._KERNELS["rms"](x, w, 1e-6), None)]
        variants += [(f"triton {t}", lambda: norms.rms_norm_triton(x, w, 1e-6), t)
                     for t in args.norm_tiles.split(",")]
        for label, fn, tile in variants:
            if tile:
                norms.TILE, norms.WARPS, norms.BWD_PER_SM = (int(v) for v in tile.split("x"))
            torch._dynamo.maybe_mark_dynamic(x, 0)
            out = fn()
            fwd = median_ms(fn)
            bwd = median_ms(lambda: torch.autograd.grad(out, (x, w), grad, retain_graph=True))
            rec = dict(shape=f"rms-{name}", tokens=n, heads=heads, width=width, kernel=label, fwd_ms=round(fwd, 3),
                       bwd_ms=round(bwd, 3), fwd_x_bytes=round(fwd / 1e3 * bandwidth / fwd_bytes, 2),
                       bwd_x_bytes=round(bwd / 1e3 * bandwidth / bwd_bytes, 2))
            emit(args.out, rec, f"rms {name:7s} {n:7d} x {heads:3d} x {width:5d}  {label:17s} forward {fwd:7.3f} ms "
                 f"({rec['fwd_x_bytes']:.2f}x bytes)  backward {bwd:7.3f} ms ({rec['bwd_x_bytes']:.2f}x bytes)")
        norms.TILE, norms.WARPS, norms.BWD_PER_SM = tiles
        del x, grad


if __name__ == "__main__":
    main()
