"""HF <-> Megatron mapping and HF config parsing (pure torch; no megatron needed)."""

import pytest
import torch

from offpolicy.learner.backends.megatron import arch as A, families, mapping
from tests.megatron_workers import TINY


def _hf_state(family: str, arch: dict | None = None) -> dict[str, torch.Tensor]:
    from offpolicy.config import ModelConfig
    from offpolicy.models.build import build_model

    arch = dict(arch or TINY[family])
    return build_model(ModelConfig(arch=arch), torch.device("cpu")).state_dict()


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
@pytest.mark.parametrize("tp,pp", [(1, 1), (2, 1), (2, 2)])
def test_round_trip_is_exact(family, tp, pp):
    hf = _hf_state(family)
    arch = families.from_hf(TINY[family])
    out = {}
    for stage in range(pp):
        for p in families.stage_params(arch, stage, pp):
            shards = [mapping.to_shard(p, [hf[n] for n in p.hf], arch, r, tp) for r in range(tp)]
            if p.export:
                out.update(mapping.from_shards(p, shards, arch))
    expected = {k: v for k, v in hf.items() if not (arch.tie_embeddings and k == "lm_head.weight")}
    assert set(out) == set(expected)
    for k, v in expected.items():
        assert torch.equal(out[k], v), k


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "gpt_oss"])
@pytest.mark.parametrize("tp", [2, 4])
def test_own_rows_of_every_rank_make_the_gathered_tensors(family, tp):
    """The sharded publish's TP path: each rank's rows (own_rows), put in place, equal from_shards of all the
    shards, for every parameter whose shard is rows of its HF tensors (qkv and its bias, fc1, vocabulary with
    its padding left out, per-head sinks); row_counts says where every rank's rows start."""
    arch_cfg = dict(TINY[family])
    if arch_cfg["num_key_value_heads"] % tp:  # the tiny models have 2 query groups: 8 heads in 4 groups for TP4
        arch_cfg.update(num_attention_heads=8, num_key_value_heads=4)
        if family != "gpt_oss":
            arch_cfg["head_dim"] = arch_cfg["hidden_size"] // 8
    hf = _hf_state(family, arch_cfg)
    arch = families.from_hf(arch_cfg)
    seen = set()
    for p in families.stage_params(arch, 0, 1):
        if p.kind not in mapping.ROW_KINDS or p.stack or not p.export:
            continue
        seen.add(p.kind)
        shards = [mapping.to_shard(p, [hf[n] for n in p.hf], arch, r, tp) for r in range(tp)]
        whole = dict(mapping.from_shards(p, shards, arch))
        built = {n: torch.full_like(t, float("nan")) for n, t in whole.items()}
        for r, shard in enumerate(shards):
            counts = mapping.row_counts(p, shard, arch, tp)
            pieces = mapping.own_rows(p, shard, arch, r, tp)
            for (name, row, t), n in zip(pieces, counts):
                assert row == r * n
                built[name][row:row + t.shape[0]] = t
        for n, t in whole.items():
            assert torch.equal(built[n], t), (p.name, n)
    assert seen == ({"qkv", "vocab", "col"} if family == "gpt_oss" else {"qkv", "vocab", "fc1"})  # MoE: no dense fc1


def test_qkv_rows_are_grouped_per_query_group():
    arch = families.from_hf(TINY["llama"])  # 4 heads, 2 groups, head_dim 8
    d = arch.head_dim
    q = torch.arange(4 * d).float().unsqueeze(1) + 1000
    k = torch.arange(2 * d).float().unsqueeze(1) + 2000
    v = torch.arange(2 * d).float().unsqueeze(1) + 3000
    p = next(x for x in families.stage_params(arch, 0, 1) if x.kind == "qkv")
    shard1 = mapping.to_shard(p, [q, k, v], arch, 1, 2)  # TP rank 1 holds query group 1
    expected = torch.cat([q[2 * d:4 * d], k[d:2 * d], v[d:2 * d]])
    assert torch.equal(shard1, expected)


def test_fc1_shard_is_gate_then_up():
    arch = families.from_hf(TINY["llama"])
    gate, up = torch.randn(64, 32), torch.randn(64, 32)
    p = next(x for x in families.stage_params(arch, 0, 1) if x.kind == "fc1")
    assert torch.equal(mapping.to_shard(p, [gate, up], arch, 1, 2), torch.cat([gate[32:], up[32:]]))


def test_vocab_is_padded_to_tp():
    arch = families.from_hf(TINY["llama"])  # vocab 61
    assert arch.padded_vocab(2) == 62 and arch.padded_vocab(1) == 61


def test_unsupported_configs_name_the_field():
    with pytest.raises(A.ArchError, match="model_type"):
        families.from_hf({**TINY["llama"], "model_type": "gpt2"})
    with pytest.raises(A.ArchError, match="rope_scaling"):
        families.from_hf({**TINY["llama"], "rope_scaling": {"rope_type": "yarn", "factor": 4.0}})
    with pytest.raises(A.ArchError, match="megatron.tp"):
        A.check_layout(families.from_hf(TINY["llama"]), tp=4, pp=1)  # 2 query groups
    with pytest.raises(A.ArchError, match="megatron.pp"):
        A.check_layout(families.from_hf(TINY["llama"]), tp=1, pp=3)


def test_num_params_matches_hf():
    for family in TINY:
        hf = _hf_state(family)
        arch = families.from_hf(TINY[family])
        n = sum(v.numel() for k, v in hf.items() if not (arch.tie_embeddings and k == "lm_head.weight"))
        assert arch.num_params() == n, family
