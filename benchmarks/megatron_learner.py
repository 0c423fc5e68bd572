"""Learner throughput of the megatron backend on one GPU: tokens/s, MFU and where a GRPO step's time goes.

Builds a model from an HF config preset (random weights: no download; `--arch gptoss-slice` is
GPT-OSS-20B's shapes, offpolicy/learner/backends/megatron/memory.py `gpt_oss_slice`: hidden 2880, 64/8 heads of
64, 32 experts top-4 of FFN 2880, vocabulary 201088, `--layers` layers, sliding and full alternating;
`--arch qwen3moe-slice` is Qwen3-30B-A3B's: hidden 2048, 32/4 heads of 128, 128 experts top-8 of FFN 768,
vocabulary 151936), feeds it a synthetic
batch (prompt and response lengths drawn uniformly from the given ranges, as GRPO responses differ in
length) and times `train_step` after warm-up steps. Then one instrumented step, synchronised around
every phase, gives the breakdown: batch (building each micro-batch's tensors on the host and copying them to
the GPU), forward (the GPTModel call), loss (logprobs + GRPO loss; the
output-layer matmul too where the backend applies the head in its loss), backward
(`torch.autograd.backward`), grad reduce (`finalize_model_grads`), optimizer, and the rest (planning,
other host work). Padding waste is the share of processed token slots that are not real tokens.

Model FLOPs (the work the math needs, counted for the real tokens only):
  6 x (params outside the embedding and output layer) per token          (transformer layers, fwd+bwd;
                                                                          MoE: the top-k experts only)
  + 6 x hidden x vocab per response token                               (the logits a loss needs)
  + 6 x layers x heads x head_dim x L^2 per sequence of length L        (causal attention, fwd+bwd)
  (no window discount for sliding-window layers)
`--body` (or `--vocab N`) is the body-only mode: the same layers with a 2,048-token vocabulary, so that the
output head does not lift the figure. MoE rows run the experts module of learner.megatron.experts (grouped,
the default; `--set learner.megatron.experts=sequential` is megatron-core's SequentialMLP, the module before).
MFU = model FLOPs / step time / --peak (989e12: the dense bf16 peak of an H100 SXM; an H200's is the same).
With `--verify` it first saves the model in `--verify-dtype` (float32) and runs `offpolicy verify` on it (sequence 32 past
the sliding window, YaRN active) and reports its figures; each row also holds memory.per_gpu's estimate.

    python benchmarks/megatron_learner.py --arch llama-1b --groups 16 --n 8 --prompt 64:256 --response 64:1536
    python benchmarks/megatron_learner.py --arch gptoss-slice --layers 2 --verify --groups 8 --prompt 256 \
        --response 768 --max-tokens 8192
    python benchmarks/megatron_learner.py --arch gptoss-slice --layers 2 --body --max-tokens auto   # body-only
    python benchmarks/megatron_learner.py --set learner.megatron.packing=false ...   # any config override

The batch comes from this checkout's `offpolicy/bench/synthetic.py` (loaded by path), so the script
also times an older installed `offpolicy` (the before/after figures in docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

ARCHS = {
    "qwen2.5-0.5b": dict(model_type="qwen2", vocab_size=151936, hidden_size=896, intermediate_size=4864,
                         num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                         max_position_embeddings=32768, tie_word_embeddings=True, rope_theta=1000000.0),
    "qwen2.5-1.5b": dict(model_type="qwen2", vocab_size=151936, hidden_size=1536, intermediate_size=8960,
                         num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2,
                         max_position_embeddings=32768, tie_word_embeddings=True, rope_theta=1000000.0),
    "llama-1b": dict(model_type="llama", vocab_size=128256, hidden_size=2048, intermediate_size=8192,
                     num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8, head_dim=64,
                     max_position_embeddings=131072, tie_word_embeddings=True, rope_theta=500000.0,
                     rms_norm_eps=1e-5),
}
# Qwen3-30B-A3B's config.json shapes; `--layers` of its 48 layers (every layer MoE)
QWEN3_30B_A3B = dict(model_type="qwen3_moe", vocab_size=151936, hidden_size=2048, intermediate_size=6144,
                     moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8, norm_topk_prob=True,
                     num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                     max_position_embeddings=40960, tie_word_embeddings=False, rope_theta=1000000.0, rms_norm_eps=1e-6)


def model_config(name: str, layers: int, vocab: int | None = None) -> dict:
    """The HF config of `name` (slices: `layers` layers), with `vocab` tokens if given (body-only)."""
    if name == "gptoss-slice":
        from offpolicy.learner.backends.megatron.memory import gpt_oss_slice

        cfg = gpt_oss_slice(layers)
    elif name == "qwen3moe-slice":
        cfg = {**QWEN3_30B_A3B, "num_hidden_layers": layers}
    else:
        cfg = dict(ARCHS[name])
    return {**cfg, "vocab_size": vocab} if vocab else cfg


def verify_figures(hf: dict, seed: int, dtype: str = "float32") -> dict:
    """`offpolicy verify` (this process, one GPU) on the model saved with random weights, in `dtype`.

    float32 by default: with random weights in bf16 the MoE router's top-k flips on rounding near-ties and
    the logits of a 201k vocabulary nearly tie, so a bf16 diff says little about the mapping (docs/megatron.md)."""
    import torch

    from offpolicy.config import ModelConfig
    from offpolicy.learner.backends.megatron.verify import verify
    from offpolicy.models.build import build_model

    with tempfile.TemporaryDirectory() as d:
        build_model(ModelConfig(arch=hf, dtype=dtype, seed=seed), torch.device("cuda")).save_pretrained(d)
        t = time.perf_counter()
        r = verify(d, dtype=dtype, device="cuda")
        seconds = time.perf_counter() - t
    from megatron.core import parallel_state

    parallel_state.destroy_model_parallel()  # the backend below sets up its own
    return dict(verify_max_diff=r.max_diff, verify_top1=r.top1, verify_greedy=f"{r.gen_agree}/{r.gen_len}",
                verify_seq_len=r.seq_len, verify_features=r.features, verify_ok=r.ok, verify_s=round(seconds, 1))


PHASES = ("batch", "forward", "loss", "backward", "grad_reduce", "optimizer")


def _span(text: str) -> tuple[int, int]:
    lo, _, hi = text.partition(":")
    return int(lo), int(hi or lo)


def _synthetic():
    path = Path(__file__).resolve().parents[1] / "offpolicy" / "bench" / "synthetic.py"
    spec = importlib.util.spec_from_file_location("_synthetic_of_this_checkout", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.synthetic_batch


def model_flops(arch, groups) -> float:
    """Model FLOPs of one step over the real tokens (see the module docstring)."""
    from offpolicy.learner.backends.megatron.arch import active_params

    emb = arch.vocab_size * arch.hidden_size * (1 if arch.tie_embeddings else 2)
    body = active_params(arch) - emb - arch.hidden_size  # minus the final norm
    total = 0.0
    for g in groups:
        for r in g.responses:
            seq = len(g.prompt) + len(r)
            total += 6 * body * seq + 6 * arch.hidden_size * arch.vocab_size * len(r)
            total += 6 * arch.num_layers * arch.num_heads * arch.head_dim * seq * seq
    return total


class Phases:
    """Wall seconds per phase of one step, each phase synchronised (instrumentation, not the timed steps)."""

    def __init__(self, torch):
        self.torch, self.s, self.slots = torch, {k: 0.0 for k in PHASES}, 0

    def wrap(self, name: str, fn):
        def timed(*a, **k):
            self.torch.cuda.synchronize()
            t = time.perf_counter()
            out = fn(*a, **k)
            self.torch.cuda.synchronize()
            self.s[name] += time.perf_counter() - t
            return out
        return timed

    @contextmanager
    def on(self, backend):
        torch, gpt = self.torch, getattr(backend.model, "module", backend.model)
        forward, loss, step, backward = gpt.forward, backend._loss, backend.opt.step, torch.autograd.backward
        micro_batch = backend._micro_batch
        finalize = backend.tconfig.finalize_model_grads_func

        def counted(*a, **k):
            ids = k.get("input_ids", a[0] if a else None)
            self.slots += ids.numel()
            return forward(*a, **k)

        gpt.forward = self.wrap("forward", counted)
        backend._loss = self.wrap("loss", loss)
        backend._micro_batch = self.wrap("batch", micro_batch)
        backend.opt.step = self.wrap("optimizer", step)
        torch.autograd.backward = self.wrap("backward", backward)
        backend.tconfig.finalize_model_grads_func = self.wrap("grad_reduce", finalize)
        try:
            yield
        finally:
            del gpt.forward, backend._loss, backend._micro_batch, backend.opt.step
            torch.autograd.backward = backward
            backend.tconfig.finalize_model_grads_func = finalize


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--arch", choices=[*sorted(ARCHS), "gptoss-slice", "qwen3moe-slice"], default="llama-1b")
    p.add_argument("--layers", type=int, default=2, help="layers of gptoss-slice / qwen3moe-slice")
    p.add_argument("--body", action="store_true", help="body-only: a 2,048-token vocabulary (--vocab 2048)")
    p.add_argument("--vocab", type=int, default=0, help="vocabulary size instead of the model's own")
    p.add_argument("--verify", action="store_true", help="run offpolicy verify on the model first (--verify-dtype)")
    p.add_argument("--verify-dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--groups", type=int, default=16)
    p.add_argument("--n", type=int, default=8)
    p.add_argument("--prompt", default="64:256", help="prompt length, or MIN:MAX drawn per group")
    p.add_argument("--response", default="64:1536", help="response length, or MIN:MAX drawn per response")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--max-tokens", default="16384", help="learner.megatron.max_tokens_per_gpu (a number or auto)")
    p.add_argument("--variants", default="", help="LAYOUT:TOKENS,... timed one after another on the same backend "
                   "(layout padded or packed; tokens a number or auto), e.g. packed:16384,padded:16384,packed:auto")
    p.add_argument("--recompute", default="none")
    p.add_argument("--set", action="append", default=[], help="extra config override KEY=VALUE (repeatable)")
    p.add_argument("--peak", type=float, default=989e12)
    p.add_argument("--profile", default="", help="write a torch profiler table of one more step to this file")
    p.add_argument("--trace", default="", help="with --profile: also that step's chrome trace, gzipped, at this path "
                   "(the label before .json.gz)")
    p.add_argument("--label", default="")
    p.add_argument("--out", default="", help="append the JSON line to this file")
    args = p.parse_args()

    import torch

    from offpolicy.bench.common import free_port
    from offpolicy.config import load_config
    from offpolicy.learner.backends.megatron.backend import MegatronBackend
    from offpolicy.learner.backends.megatron.families import from_hf

    from offpolicy.learner.backends.megatron import memory

    hf = model_config(args.arch, args.layers, args.vocab or (2048 if args.body else None))
    verified = verify_figures(hf, seed=0, dtype=args.verify_dtype) if args.verify else {}
    (p_lo, p_hi), (r_lo, r_hi) = _span(args.prompt), _span(args.response)

    arch_text = "{" + ", ".join(f"{k}: {json.dumps(v)}" for k, v in hf.items()) + "}"
    cfg = load_config(None, [f"model.arch={arch_text}", "model.dtype=bfloat16", "learner.backend=megatron",
                             "learner.lr=1e-6", f"rollout.n_samples={args.n}", f"rollout.max_new_tokens={r_hi}",
                             f"learner.megatron.max_tokens_per_gpu={args.max_tokens}",
                             f"learner.megatron.recompute={args.recompute}",
                             f"learner.megatron.master_port={free_port()}",  # runs on other GPUs of the host at once
                             *args.set])
    backend = MegatronBackend(cfg)
    groups, adv = _synthetic()(seed=0, groups=args.groups, n=args.n, prompt=p_hi, response=r_hi,
                               vocab=hf["vocab_size"], min_prompt=p_lo, min_response=r_lo)
    arch = from_hf(hf)
    tokens = sum(len(g.prompt) * g.n + g.num_tokens for g in groups)
    flops = model_flops(arch, groups)
    for layout, budget in [v.split(":") for v in args.variants.split(",")] if args.variants else [(None, None)]:
        if layout is not None:  # the same backend with another micro-batch layout and budget
            mc = backend.cfg.learner.megatron
            if hasattr(mc, "packing"):
                mc.packing = layout == "packed"
            elif layout == "packed":
                raise SystemExit("this offpolicy has no learner.megatron.packing")
            if hasattr(backend, "max_tokens"):
                backend.max_tokens = None if budget == "auto" else int(budget)
            else:
                mc.max_tokens_per_gpu = int(budget)
        times = []
        for i in range(args.warmup + args.steps):
            if i == args.warmup:
                torch.cuda.reset_peak_memory_stats()
            torch.cuda.synchronize()
            t = time.perf_counter()
            stats = backend.train_step(groups, adv)
            torch.cuda.synchronize()
            if i >= args.warmup:
                times.append(time.perf_counter() - t)
        peak = torch.cuda.max_memory_allocated() / 2**30
        phases = Phases(torch)
        with phases.on(backend):
            t = time.perf_counter()
            backend.train_step(groups, adv)
            torch.cuda.synchronize()
            instrumented = time.perf_counter() - t
        label = args.label + (f"-{layout}-{budget}" if layout else "")
        step = sorted(times)[len(times) // 2]
        breakdown = {k: round(v, 3) for k, v in phases.s.items()}
        breakdown["other"] = round(instrumented - sum(phases.s.values()), 3)
        seq = p_hi + r_hi
        est = memory.per_gpu(arch, memory.Layout(world=1), memory.Micro(
            tokens=min(tokens, backend.max_tokens or 16384), seq_len=seq,
            microbatches=max(1, tokens // (backend.max_tokens or 16384)), recompute=args.recompute,
            attention="flash",  # the CoreAttention on a GPU: flash varlen, padded or packed
            experts=getattr(backend.cfg.learner.megatron, "experts", "sequential")))
        row = dict(label=label, arch=args.arch, vocab=hf["vocab_size"], **verified, params=arch.num_params(), tokens_per_step=tokens,
                   step_s=round(step, 3), steps_s=[round(x, 3) for x in times], tokens_per_s=round(tokens / step),
                   model_tflop_per_step=round(flops / 1e12, 2), mfu=round(flops / step / args.peak, 4),
                   peak_mem_gib=round(peak, 1), estimated_mem_gib=round(est.total_bytes / 2**30, 1), phases_s=breakdown, instrumented_step_s=round(instrumented, 3),
                   padding_waste=round(1 - tokens / phases.slots, 3) if phases.slots else None,
                   loss=stats["loss"], grad_norm=stats["grad_norm"],
                   max_tokens=getattr(backend, "max_tokens", budget or args.max_tokens), recompute=args.recompute,
                   overrides=args.set, device=torch.cuda.get_device_name(), torch=torch.__version__)
        _emit(row, args.out)
        if args.profile:
            from torch.profiler import ProfilerActivity, profile

            verbose = torch._C._profiler._ExperimentalConfig(verbose=True)  # Python frames in the stacks
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], with_stack=True, record_shapes=True,
                         experimental_config=verbose) as prof:
                backend.train_step(groups, adv)
                torch.cuda.synchronize()
            Path(f"{args.profile}.{label}.txt").write_text(prof.key_averages().table(
                sort_by="self_device_time_total", row_limit=60, max_name_column_width=90))
            # where the kernels come from: the same step by the Python stack that launched each op (forward; the
            # backward's ops run on autograd's thread, without one), and by the ops' input shapes
            Path(f"{args.profile}.{label}.stacks.txt").write_text(prof.key_averages(group_by_stack_n=8).table(
                sort_by="self_device_time_total", row_limit=80, max_name_column_width=60, max_src_column_width=120))
            Path(f"{args.profile}.{label}.shapes.txt").write_text(prof.key_averages(group_by_input_shape=True).table(
                sort_by="self_device_time_total", row_limit=80, max_name_column_width=60, max_shapes_column_width=100))
            if args.trace:  # the step's timeline (chrome://tracing, Perfetto): where the GPU waits on the host
                import gzip

                trace = Path(args.trace).with_suffix(f".{label}.json")
                prof.export_chrome_trace(str(trace))
                with open(trace, "rb") as f, gzip.open(f"{trace}.gz", "wb") as g:
                    g.write(f.read())
                trace.unlink()
    t0 = time.perf_counter()
    n_weights = sum(1 for _ in backend.weights())
    _emit(dict(label=args.label, gather_s=round(time.perf_counter() - t0, 3), hf_tensors=n_weights), args.out)


def _emit(row: dict, out: str) -> None:
    line = json.dumps(row)
    print(line, flush=True)
    if out:
        with open(out, "a") as f:
            f.write(line + "\n")

if __name__ == "__main__":
    main()
