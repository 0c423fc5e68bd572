"""Process bodies for the megatron-core tests: one learner rank each, on CPU through the test shim.

`spawn(world, overrides, steps, out)` starts `world` fresh processes (torch.multiprocessing, spawn),
each a learner rank with RANK/WORLD_SIZE/LOCAL_RANK set; rank 0 drives `steps` train steps of a
fixed batch and saves the step statistics and the exported HF weights (before and after) to `out`;
the other ranks serve rank 0's commands, as in the learner daemon. `load=DIR` restores a backend
checkpoint before the steps, `save=DIR` writes one after them. `TINY` are small HF configs.
"""

from __future__ import annotations

import os
import socket
from pathlib import Path

import numpy as np
import torch

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
    from offpolicy.models import build_model

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

    from offpolicy.models import checkpoint_tensors, hf_config
    from offpolicy.weights import formats

    tensors, config = formats.encode("mxfp4", checkpoint_tensors(model).items(), hf_config(model))
    out = {k: v.contiguous() for k, v in tensors}
    Path(path).mkdir(parents=True, exist_ok=True)
    save_file(out, str(Path(path) / "model.safetensors"), metadata={"format": "pt"})
    (Path(path) / "config.json").write_text(json.dumps(config))
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def overrides(family: str, *extra: str) -> list[str]:
    arch = "{" + ", ".join(f"{k}: {v}" for k, v in TINY[family].items()) + "}"
    return [f"model.arch={arch}", "learner.device=cpu", "learner.lr=1e-2", "rollout.n_samples=4",
            "learner.micro_batch_groups=1", *extra]


def batch(seed: int = 0, groups: int = 4, vocab: int = 61):
    from offpolicy import algorithms
    from offpolicy.batch import Group

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
    from offpolicy.backends import make_backend
    from offpolicy.config import load_config

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
    torch.multiprocessing.spawn(_rank, args=(world, free_port(), args, steps, out, load, save), nprocs=world,
                                join=True)
    return torch.load(out, weights_only=False)


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
