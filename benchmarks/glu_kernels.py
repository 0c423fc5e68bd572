"""The grouped experts' GLU on one GPU: torch.compile's kernels against glu_triton's, each way, and the bytes' time.

Per model shape (rows = a micro-batch's tokens x top-k, I = the expert FFN width, fc1's biases by row where the
family has them), one forward and one backward of `experts.glu_rows`:
  compiled       torch.compile'd glu_rows with experts.compile_elementwise's options (the path before)
  triton         glu_triton.glu_rows (the default on a GPU), at its tile sizes and at the --tiles variants
Each row prints the median time (CUDA events), the bytes each way must move (forward: read h [rows, 2I], write
[rows, I]; backward: read h and the output's gradient, write h's gradient, all bf16) and the ratio of the time to
those bytes at the copy bandwidth measured in the same run (a device-to-device copy of 4 GiB): 1.0 is the floor.

    python benchmarks/glu_kernels.py                               # GPT-OSS's and Qwen3-MoE's shapes
    python benchmarks/glu_kernels.py --shapes gptoss:368636:2880 --tiles 8x256,16x128,4x512
"""

from __future__ import annotations

import argparse
import json
import statistics

SHAPES = "gptoss:368636:2880,qwen3:737272:768"  # GPT-OSS body micro-batch 92,159 tokens x top-4; Qwen3 x top-8


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", default=SHAPES, help="name:rows:I[,...] (gptoss*: clamp, alpha, offset, biases)")
    p.add_argument("--experts", type=int, default=32, help="local experts (the biases' rows)")
    p.add_argument("--tiles", default="8x256,16x128,4x512,16x256", help="Triton tiles to try, BTxBI[,...]")
    p.add_argument("--repeat", type=int, default=20)
    p.add_argument("--out", help="append JSON lines here")
    args = p.parse_args()

    import torch

    from offpolicy.backends.megatron import experts, glu_triton

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
    for spec in args.shapes.split(","):
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
            glu_triton.BT_FWD = glu_triton.BT_BWD = bt
            glu_triton.BI_FWD = glu_triton.BI_BWD = bi
            rows_out.append((f"triton {tile}", *both(lambda: glu_triton.glu_rows(h, bias, idx, probs, alpha, limit,
                                                                                offset))))
        for label, fwd, bwd in rows_out:
            rec = dict(shape=name, rows=rows, width=width, kernel=label, fwd_ms=round(fwd, 3), bwd_ms=round(bwd, 3),
                       fwd_x_bytes=round(fwd / 1e3 * bandwidth / fwd_bytes, 2),
                       bwd_x_bytes=round(bwd / 1e3 * bandwidth / bwd_bytes, 2))
            print(f"{name:8s} {rows:7d} x {width:5d}  {label:16s} forward {fwd:7.3f} ms ({rec['fwd_x_bytes']:.2f}x bytes)"
                  f"  backward {bwd:7.3f} ms ({rec['bwd_x_bytes']:.2f}x bytes)")
            if args.out:
                with open(args.out, "a") as f:
                    f.write(json.dumps(rec) + "\n")
        del h, grad


if __name__ == "__main__":
    main()
