"""`offpolicy verify`: load an HF checkpoint into Megatron and compare it with `transformers`.

On the same random token ids (seeded) it compares the logits of both models (max abs diff in
float32, top-1 agreement over every position), then runs a short greedy generation on both and
reports how many tokens agree. It prints a table and returns 1 when the max diff exceeds
`max_diff` or the top-1 agreement is below `min_top1` (defaults per dtype: float32 1e-3 / 0.999,
bfloat16 0.5 / 0.95; see docs/megatron.md). Layouts: any tp with pp = 1, and for MoE models any ep /
etp; start a number of processes that tp and ep x etp both divide (torchrun), every rank feeds the same
tokens; with tp > 1 the model runs with sequence parallelism (as MoE training needs); only rank 0
runs the HF model and prints. The TP shards of the logits are gathered
here, on a few positions only, to compare them; training never gathers the vocabulary. The default
sequence length is 32 tokens, or 32 past the sliding window for a model with one, so that sliding
layers drop keys; the table lists the attention features the model exercised (`features`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

TOLERANCE = {"float32": (1e-3, 0.999), "bfloat16": (0.5, 0.95), "float16": (0.5, 0.95)}


@dataclass
class Result:
    max_diff: float
    top1: float
    gen_agree: int
    gen_len: int
    ok: bool
    seq_len: int = 0
    features: str = ""  # sinks, sliding window, YaRN: what the compared tokens exercised


def features(arch, seq_len: int) -> str:
    """A line naming the attention features of `arch` and whether `seq_len` tokens go past them."""
    out = ["attention sinks"] if arch.attn_sinks else []
    if arch.sliding_window:
        out.append(f"sliding window {arch.sliding_window} on {sum(arch.window_layers)}/{arch.num_layers} layers "
                   f"({'seq > window' if seq_len > arch.sliding_window else 'seq within the window'})")
    if arch.yarn is not None:
        y = arch.yarn
        out.append(f"YaRN x{y.factor:g} over {y.original_max_positions} positions, attention factor "
                   f"{y.attention_factor():.4f} ({'seq past them' if seq_len > y.original_max_positions else 'seq within them'})")
    return "; ".join(out)


def verify(model_dir: str, *, tp: int = 1, ep: int = 1, etp: int = 1, dtype: str = "float32", device: str = "auto", seq_len: int | None = None,
           batch: int = 2, new_tokens: int = 8, seed: int = 0, max_diff: float | None = None,
           min_top1: float | None = None, sequence_parallel: bool | None = None,
           experts: str = "grouped") -> Result | None:
    """Compare Megatron with transformers on `model_dir`; the Result on rank 0, None elsewhere.

    `sequence_parallel` (default: on when tp > 1, the layout MoE training needs) shards the sequence
    over the TP ranks; inputs are right-padded to a multiple of tp then (exact under the causal mask)."""
    from offpolicy.learner.backends.megatron.cpu import install_if_cpu

    install_if_cpu(device)  # megatron-core on a machine without CUDA
    from offpolicy.config import load_config
    from offpolicy.learner.backends.megatron import arch as arch_mod, families, model as model_mod
    from offpolicy.learner.backends.megatron.parallel import Parallel
    from offpolicy.learner.backends.megatron.source import HFSource
    from offpolicy.models.build import DTYPES, from_pretrained

    cfg = load_config(None, [f"model.path={model_dir}", f"model.dtype={dtype}", f"learner.device={device}",
                             "learner.backend=megatron", f"learner.megatron.tp={tp}",
                             f"learner.megatron.ep={ep}", f"learner.megatron.etp={etp}",
                             f"learner.megatron.experts={experts}"])
    par = Parallel(cfg)
    hf_cfg = json.loads((Path(model_dir) / "config.json").read_text())
    arch = families.from_hf(hf_cfg)
    seq_len = seq_len or 32 + arch.sliding_window
    te = model_mod.use_te(arch, cfg.learner.megatron.transformer_impl)
    grouped = model_mod.grouped_experts(cfg.learner.megatron.experts, te)
    sp = tp > 1 if sequence_parallel is None else sequence_parallel and tp > 1
    tconfig = arch_mod.transformer_config(arch, tp=tp, pp=1, sequence_parallel=sp, dtype=DTYPES[dtype],
                                          recompute="none", recompute_layers=1, ep=ep, etp=etp)
    with torch.device(par.device):
        mg = model_mod.build(arch, tconfig, pre=True, post=True, use_te=te, grouped=grouped)
    model_mod.load(mg, arch, HFSource(path=model_dir, dtype=DTYPES[dtype], device=par.device), tp_rank=par.tp_rank, tp=tp, pp_rank=0, pp=1, te=te,
                   ep_rank=par.ep_rank, ep=ep, etp_rank=par.etp_rank, etp=etp, grouped=grouped)
    mg.eval()
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, arch.vocab_size, (batch, seq_len), generator=gen).to(par.device)

    def mg_logits(x: torch.Tensor) -> torch.Tensor:
        n = x.shape[1]
        if sp and n % tp:
            x = torch.nn.functional.pad(x, (0, tp - n % tp))
        pos = torch.arange(x.shape[1], device=x.device).expand(x.shape[0], -1)
        with torch.no_grad():
            local = mg(input_ids=x, position_ids=pos, attention_mask=None).float()[:, :n]
        if tp > 1:
            parts = [torch.empty_like(local) for _ in range(tp)]
            dist.all_gather(parts, local.contiguous(), group=par.tp_group)
            local = torch.cat(parts, dim=-1)
        return local[..., : arch.vocab_size]

    mine = mg_logits(ids)
    seq = ids[:1].clone()
    for _ in range(new_tokens):  # every rank steps the same greedy tokens (logits are gathered)
        seq = torch.cat([seq, mg_logits(seq)[:, -1].argmax(-1, keepdim=True)], dim=1)
    if par.rank != 0:
        return None

    hf = from_pretrained(model_dir, DTYPES[dtype], device=par.device).eval()
    with torch.no_grad():
        ref = hf(input_ids=ids).logits.float()
        ref_seq = ids[:1].clone()
        for _ in range(new_tokens):  # the same full-recompute greedy loop (no EOS stop) as for Megatron
            ref_seq = torch.cat([ref_seq, hf(input_ids=ref_seq).logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    diff = float((mine - ref).abs().max())
    top1 = float((mine.argmax(-1) == ref.argmax(-1)).float().mean())
    a, b = seq[0, seq_len:].tolist(), ref_seq[0, seq_len:].tolist()
    agree = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    tol_diff, tol_top1 = TOLERANCE[dtype]
    tol_diff = tol_diff if max_diff is None else max_diff
    tol_top1 = tol_top1 if min_top1 is None else min_top1
    return Result(diff, top1, agree, new_tokens, diff <= tol_diff and top1 >= tol_top1, seq_len,
                  features(arch, seq_len))


def table(model_dir: str, tp: int, dtype: str, r: Result, max_diff: float, min_top1: float, ep: int = 1,
          etp: int = 1) -> str:
    experts = f" ep={ep} etp={etp}" if ep * etp > 1 else ""
    rows = [("model", model_dir), ("layout", f"tp={tp} pp=1{experts}"), ("dtype", dtype),
            ("logits max abs diff", f"{r.max_diff:.3e}  (tolerance {max_diff:g})"),
            ("top-1 agreement", f"{r.top1:.4f}  (at least {min_top1:g})"),
            ("greedy tokens equal", f"{r.gen_agree}/{r.gen_len}"), ("tokens", f"{r.seq_len} per sequence"),
            *([("features", r.features)] if r.features else []), ("result", "PASS" if r.ok else "FAIL")]
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)
