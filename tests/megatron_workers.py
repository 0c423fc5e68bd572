"""Process bodies for the megatron-core tests: one learner rank each, on CPU through the test shim.

`spawn(world, overrides, steps, out)` starts `world` fresh processes (tests/fresh_processes.py),
each a learner rank with RANK/WORLD_SIZE/LOCAL_RANK set; rank 0 drives `steps` train steps of a
fixed batch and saves the step statistics and the exported HF weights (before and after) to `out`;
the other ranks serve rank 0's commands, as in the learner daemon. `load=DIR` restores a backend
checkpoint before the steps, `save=DIR` writes one after them. `TINY` are small HF configs.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import torch

from tests import fresh_processes

TINY = {
    "llama": dict(model_type="llama", vocab_size=61, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                  tie_word_embeddings=False),
    "qwen2": dict(model_type="qwen2", vocab_size=61, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                  tie_word_embeddings=True),
    "qwen3": dict(model_type="qwen3", vocab_size=61, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=64,
                  tie_word_embeddings=True),
    # 4 experts, top-2 renormalised; layer 1 of 3 is a dense MLP (mlp_only_layers)
    "qwen3_moe": dict(model_type="qwen3_moe", vocab_size=61, hidden_size=32, intermediate_size=64,
                      moe_intermediate_size=16, num_experts=4, num_experts_per_tok=2, norm_topk_prob=True,
                      num_hidden_layers=3, mlp_only_layers=[1], num_attention_heads=4, num_key_value_heads=2,
                      head_dim=16, max_position_embeddings=64, tie_word_embeddings=False),
    # 4 experts top-2 with biases, sinks, layers sliding (window 8) / full / sliding / full, YaRN factor 4 over
    # 16 original positions (so prompts of 32+ tokens exercise both), clamped SwiGLU
    "gpt_oss": dict(model_type="gpt_oss", vocab_size=61, hidden_size=64, intermediate_size=32, num_hidden_layers=4,
                    num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=4,
                    num_experts_per_tok=2, sliding_window=8, max_position_embeddings=64,
                    rope_parameters=dict(rope_type="yarn", factor=4.0, beta_fast=32.0, beta_slow=1.0, truncate=False,
                                         original_max_position_embeddings=16, rope_theta=150000.0),
                    tie_word_embeddings=False),
}

# A small Qwen3-MoE for GPU layout benchmarks (EP/ETP/TP): ~0.2B parameters, 8 experts top-2.
QWEN3_MOE_SMALL = dict(model_type="qwen3_moe", vocab_size=32000, hidden_size=512, intermediate_size=1536,
                       moe_intermediate_size=512, num_experts=8, num_experts_per_tok=2, norm_topk_prob=True,
                       num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=4, head_dim=64,
                       max_position_embeddings=4096, tie_word_embeddings=False)


def random_gpt_oss(seed: int = 1):
    """TINY["gpt_oss"] with every weight drawn so that each GPT-OSS feature moves the logits: biases and sinks
    ~N(0, 0.5^2), gate_up_proj ~N(0, 1) (a fifth of the gates pass the clamp at 7), lm_head ~N(0, 0.05^2),
    the rest ~N(0, 0.15^2); norms stay 1."""
    from offpolicy.config import ModelConfig
    from offpolicy.models.build import build_model

    model = build_model(ModelConfig(arch=dict(TINY["gpt_oss"])), torch.device("cpu"))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                continue
            scale = (1.0 if "gate_up_proj" in name and "bias" not in name else 0.5 if "bias" in name or "sinks" in name
                     else 0.05 if "lm_head" in name else 0.15)
            p.copy_(torch.randn(p.shape, generator=g) * scale)
    return model


def write_mxfp4(model, path) -> dict:
    """Save `model` (a GPT-OSS) as an MXFP4 checkpoint directory the way this project publishes one
    (weights.formats.encode: expert weights as _blocks/_scales, quantization_config in config.json);
    returns the written tensors."""
    import json
    from pathlib import Path

    from safetensors.torch import save_file

    from offpolicy.models.build import checkpoint_tensors, hf_config
    from offpolicy.weights import formats

    tensors, config = formats.encode("mxfp4", checkpoint_tensors(model).items(), hf_config(model))
    out = {k: v.contiguous() for k, v in tensors}
    Path(path).mkdir(parents=True, exist_ok=True)
    save_file(out, str(Path(path) / "model.safetensors"), metadata={"format": "pt"})
    (Path(path) / "config.json").write_text(json.dumps(config))
    return out


class _OneRank:  # a process group of one, as GroupedExperts asks it for size and rank
    def size(self):
        return 1

    def rank(self):
        return 0


def grouped_experts(gpt_oss: bool, experts: int, hidden: int, ffn: int, device: str = "cpu"):
    """A GroupedExperts of one rank in bf16, GPT-OSS's (biases, clamped sigmoid gate, +1 offset) or Qwen3-MoE's
    (silu, no biases), its parameters drawn large enough (biases too) that every term shows."""
    import functools
    from types import SimpleNamespace

    from megatron.core.transformer import TransformerConfig

    from offpolicy.learner.backends.megatron.arch import sigmoid_gate
    from offpolicy.learner.backends.megatron.kernels.experts import GroupedExperts

    extra = dict(add_bias_linear=True, glu_linear_offset=1.0, activation_func_clamp_value=7.0,
                 activation_func=functools.partial(sigmoid_gate, alpha=1.702)) if gpt_oss else \
        dict(add_bias_linear=False, activation_func=torch.nn.functional.silu)
    cfg = TransformerConfig(num_layers=1, hidden_size=hidden, num_attention_heads=4, ffn_hidden_size=ffn,
                            moe_ffn_hidden_size=ffn, num_moe_experts=experts, gated_linear_unit=True,
                            params_dtype=torch.bfloat16, bf16=True, **extra)
    one = _OneRank()
    with torch.device(device):
        m = GroupedExperts(experts, cfg, pg_collection=SimpleNamespace(ep=one, expt_tp=one, expt_dp=one))
    with torch.no_grad():
        for p in m.parameters():
            p.normal_(0, 0.5 if p.dim() == 2 else 0.1)
    return m


def free_port() -> int:
    from offpolicy.plumbing.ports import free_ports

    return free_ports(1)[0]


def overrides(family: str, *extra: str) -> list[str]:
    arch = "{" + ", ".join(f"{k}: {v}" for k, v in TINY[family].items()) + "}"
    return [f"model.arch={arch}", "learner.device=cpu", "learner.lr=1e-2", "rollout.n_samples=4",
            "learner.micro_batch_groups=1", *extra]


def batch(seed: int = 0, groups: int = 4, vocab: int = 61):
    from offpolicy.hub.batch import Group
    from offpolicy.learner import algorithms

    rng = np.random.default_rng(seed)
    out = []
    for g in range(groups):
        prompt = rng.integers(0, vocab, rng.integers(2, 6)).astype(np.int32)
        rs = [rng.integers(0, vocab, rng.integers(1, 8)).astype(np.int32) for _ in range(4)]
        lps = [(-rng.random(len(r)) * 3).astype(np.float32) for r in rs]
        out.append(Group(g, 0, 0, 0, prompt, rs, lps, rng.random(4), ["stop"] * 4))
    adv = algorithms.compute_advantages(torch.tensor(np.stack([g.rewards for g in out])))
    return out, adv


def _rank(rank: int, world: int, port: int, args: list[str], steps: int, out: str, load: str | None,
          save: str | None) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    torch.set_num_threads(1)
    if "learner.device=cuda" not in args:  # megatron-core on the CPU needs the test shim (not on a GPU)
        from tests.megatron_cpu_shim import install

        install()
    from offpolicy.config import load_config
    from offpolicy.learner.backends import make_backend

    backend = make_backend(load_config(None, args + ["learner.backend=megatron"]))
    if rank != 0:
        backend.serve()
    else:
        groups, adv = batch()
        if load is not None:
            backend.load_checkpoint(Path(load))
        before = {k: v.clone() for k, v in backend.weights()}
        stats = [backend.train_step(groups, adv) for _ in range(steps)]
        after = {k: v.clone() for k, v in backend.weights()}
        if save is not None:
            Path(save).mkdir(parents=True, exist_ok=True)
            backend.save_checkpoint(Path(save))
        torch.save(dict(before=before, after=after, stats=stats, hf_config=backend.hf_config()), out)
        backend.close()
    torch.distributed.destroy_process_group()


def spawn(world: int, args: list[str], steps: int, out: str, load: str | None = None,
          save: str | None = None) -> dict:
    fresh_processes.spawn(_rank, (world, free_port(), args, steps, out, load, save), nprocs=world, join=True)
    return torch.load(out, weights_only=False)


def _startup_rank(rank: int, world: int, port: int, args: list[str], out: str) -> None:
    """Build the backend on one rank and save what this rank read or drew while loading (`backend.loaded`)
    with its layout coordinates to OUT.rank<r>."""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    torch.set_num_threads(1)
    from tests.megatron_cpu_shim import install

    install()
    from offpolicy.config import load_config
    from offpolicy.learner.backends import make_backend

    backend = make_backend(load_config(None, args + ["learner.backend=megatron"]))
    par = backend.par
    torch.save(dict(backend.loaded, startup=backend.startup, pp_rank=par.pp_rank, ep_rank=par.ep_rank,
                    tp_rank=par.tp_rank, etp_rank=par.etp_rank), f"{out}.rank{rank}")
    torch.distributed.barrier(group=par.control)
    if rank == 0:
        backend.close()
    else:
        backend.serve()
    torch.distributed.destroy_process_group()


def spawn_startup(world: int, args: list[str], out: str) -> list[dict]:
    """Every rank's start-up record (`_startup_rank`), in rank order."""
    fresh_processes.spawn(_startup_rank, (world, free_port(), args, out), nprocs=world, join=True)
    return [torch.load(f"{out}.rank{r}", weights_only=False) for r in range(world)]


STAT_KEYS = ("loss", "pg_loss", "grad_norm", "approx_kl", "entropy", "clip_frac")


def assert_stats_close(a: dict, b: dict, keys=STAT_KEYS) -> None:
    """Two steps' stats equal up to float32 arithmetic order."""
    import pytest

    for k in keys:
        assert a[k] == pytest.approx(b[k], rel=1e-5, abs=1e-6), k


def assert_runs_match(ref: dict, got: dict, atol: float = 1e-5) -> None:
    """A layout's run equals the reference run: the same initial weights, step stats and close final weights."""
    for k in ref["before"]:
        assert torch.equal(got["before"][k], ref["before"][k]), k
    for a, b in zip(got["stats"], ref["stats"]):
        assert_stats_close(a, b)
    for k in ref["after"]:
        assert torch.allclose(got["after"][k], ref["after"][k], atol=atol), k


def attention_case(_rank: int, port: int, softmax_type: str, window, groups: int) -> None:
    """CoreAttention (padded and packed) against megatron-core's unfused DotProductAttention, on CPU in
    float32: outputs and the gradients of q, k, v and the sinks; raises AssertionError on a mismatch."""
    from tests.megatron_cpu_shim import install

    install()
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType

    from offpolicy.learner.backends.megatron.kernels.attention import CoreAttention, packing

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    ps.initialize_model_parallel(1, 1)
    from megatron.core import tensor_parallel

    tensor_parallel.model_parallel_cuda_manual_seed(0)  # megatron's attention forks its RNG tracker
    cfg = TransformerConfig(num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=groups,
                            kv_channels=8, softmax_type=softmax_type, window_size=window, attention_dropout=0.0,
                            params_dtype=torch.float32)
    torch.manual_seed(0)
    ref, ours = (cls(cfg, 1, AttnMaskType.causal, "self") for cls in (DotProductAttention, CoreAttention))
    if softmax_type == "learnable":
        with torch.no_grad():
            ref.softmax_offset.normal_()
            ours.softmax_offset.copy_(ref.softmax_offset)

    def run(module, q, k, v, w, **kw):  # output and the gradients of sum(out * w)
        q, k, v = (t.detach().clone().requires_grad_(True) for t in (q, k, v))
        out = module(q, k, v, None, **kw)
        (out * w).sum().backward()
        sink = module.softmax_offset
        grad_sink = None if sink is None or sink.grad is None else sink.grad.clone()
        if grad_sink is not None:
            sink.grad = None
        return out.detach(), q.grad, k.grad, v.grad, grad_sink

    def close(a, b):
        for x, y in zip(a, b):
            if x is not None or y is not None:
                torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-5)

    s, b = 9, 3
    q, w = torch.randn(s, b, 4, 8), torch.randn(s, b, 32)
    k, v = torch.randn(s, b, groups, 8), torch.randn(s, b, groups, 8)
    close(run(ours, q, k, v, w), run(ref, q, k, v, w))  # padded rows
    bounds = [0, 4, 6, 9]  # packed: row 0's first 4 tokens, row 1's first 2, row 2's first 3, end to end
    pq, pk, pv, pw = (torch.cat([t[:n, i:i + 1] for i, n in enumerate((4, 2, 3))]) for t in (q, k, v, w))
    got = run(ours, pq, pk, pv, pw, packed_seq_params=packing(bounds, torch.device("cpu")))
    grad_sink = 0
    for a, e in zip(bounds, bounds[1:]):  # each document alone through megatron's attention
        want = run(ref, pq[a:e], pk[a:e], pv[a:e], pw[a:e])
        close([x[a:e] for x in got[:4]], want[:4])
        grad_sink = grad_sink + (want[4] if want[4] is not None else 0)
    if softmax_type == "learnable":
        torch.testing.assert_close(got[4], grad_sink, rtol=1e-5, atol=1e-5)
    ps.destroy_model_parallel()
    dist.destroy_process_group()


def attention_refusals(port: int) -> None:
    """CoreAttention raises ValueError for a non-causal window, dropout and a padding mask."""
    from tests.megatron_cpu_shim import install

    install()
    import pytest
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.enums import AttnMaskType

    from offpolicy.learner.backends.megatron.kernels.attention import CoreAttention

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    ps.initialize_model_parallel(1, 1)
    base = dict(num_layers=2, hidden_size=32, num_attention_heads=4, kv_channels=8, params_dtype=torch.float32,
                attention_dropout=0.0)
    with pytest.raises(ValueError, match="only causal windows"):
        CoreAttention(TransformerConfig(**base, window_size=(3, 2)), 1, AttnMaskType.causal, "self")
    with pytest.raises(ValueError, match="attention_dropout"):
        CoreAttention(TransformerConfig(**{**base, "attention_dropout": 0.1}), 1, AttnMaskType.causal, "self")
    with pytest.raises(ValueError, match="causal only"):
        CoreAttention(TransformerConfig(**base), 1, AttnMaskType.padding, "self")
    attn = CoreAttention(TransformerConfig(**base), 1, AttnMaskType.causal, "self")
    q = torch.zeros(3, 1, 4, 8)
    with pytest.raises(ValueError, match="attention_mask"):
        attn(q, q, q, torch.zeros(1, 1, 3, 3, dtype=torch.bool))
    ps.destroy_model_parallel()
    dist.destroy_process_group()


def run_cache(tmp_path_factory, family: str, steps: int = 2):
    """A module fixture's body: `run(world, *overrides)` spawns `family` once per (world, overrides) and
    caches the result, so the tests of a module share their multi-process runs."""
    import pytest

    cache: dict = {}

    def run(world: int, *extra: str) -> dict:
        pytest.importorskip("megatron.core", reason="megatron-core is not installed (pip install -e '.[megatron]')")
        key = (world, extra)
        if key not in cache:
            out = tmp_path_factory.mktemp(family) / "out.pt"
            cache[key] = spawn(world, overrides(family, *extra), steps, str(out))
        return cache[key]

    return run
