"""HF <-> Megatron mapping, HF config parsing and token-budget batching (pure torch; no megatron needed)."""

import numpy as np
import pytest
import torch

from offpolicy.backends.megatron import arch as A
from offpolicy.backends.megatron import batching, mapping
from tests.megatron_workers import TINY


def _hf_state(family: str) -> dict[str, torch.Tensor]:
    from offpolicy.config import ModelConfig
    from offpolicy.models import build_model

    arch = dict(TINY[family])
    return build_model(ModelConfig(arch=arch), torch.device("cpu")).state_dict()


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
@pytest.mark.parametrize("tp,pp", [(1, 1), (2, 1), (2, 2)])
def test_round_trip_is_exact(family, tp, pp):
    hf = _hf_state(family)
    arch = A.from_hf(TINY[family])
    out = {}
    for stage in range(pp):
        for p in mapping.stage_params(arch, stage, pp):
            shards = [mapping.to_shard(p, [hf[n] for n in p.hf], arch, r, tp) for r in range(tp)]
            if p.export:
                out.update(mapping.from_shards(p, shards, arch))
    expected = {k: v for k, v in hf.items() if not (arch.tie_embeddings and k == "lm_head.weight")}
    assert set(out) == set(expected)
    for k, v in expected.items():
        assert torch.equal(out[k], v), k


def test_qkv_rows_are_grouped_per_query_group():
    arch = A.from_hf(TINY["llama"])  # 4 heads, 2 groups, head_dim 8
    d = arch.head_dim
    q = torch.arange(4 * d).float().unsqueeze(1) + 1000
    k = torch.arange(2 * d).float().unsqueeze(1) + 2000
    v = torch.arange(2 * d).float().unsqueeze(1) + 3000
    p = next(x for x in mapping.stage_params(arch, 0, 1) if x.kind == "qkv")
    shard1 = mapping.to_shard(p, [q, k, v], arch, 1, 2)  # TP rank 1 holds query group 1
    expected = torch.cat([q[2 * d:4 * d], k[d:2 * d], v[d:2 * d]])
    assert torch.equal(shard1, expected)


def test_fc1_shard_is_gate_then_up():
    arch = A.from_hf(TINY["llama"])
    gate, up = torch.randn(64, 32), torch.randn(64, 32)
    p = next(x for x in mapping.stage_params(arch, 0, 1) if x.kind == "fc1")
    assert torch.equal(mapping.to_shard(p, [gate, up], arch, 1, 2), torch.cat([gate[32:], up[32:]]))


def test_vocab_is_padded_to_tp():
    arch = A.from_hf(TINY["llama"])  # vocab 61
    assert arch.padded_vocab(2) == 62 and arch.padded_vocab(1) == 61


def test_unsupported_configs_name_the_field():
    with pytest.raises(A.ArchError, match="model_type"):
        A.from_hf({**TINY["llama"], "model_type": "gpt2"})
    with pytest.raises(A.ArchError, match="rope_scaling"):
        A.from_hf({**TINY["llama"], "rope_scaling": {"rope_type": "yarn", "factor": 4.0}})
    with pytest.raises(A.ArchError, match="megatron.tp"):
        A.check_layout(A.from_hf(TINY["llama"]), tp=4, pp=1)  # 2 query groups
    with pytest.raises(A.ArchError, match="megatron.pp"):
        A.check_layout(A.from_hf(TINY["llama"]), tp=1, pp=3)


def test_num_params_matches_hf():
    for family in TINY:
        hf = _hf_state(family)
        arch = A.from_hf(TINY[family])
        n = sum(v.numel() for k, v in hf.items() if not (arch.tie_embeddings and k == "lm_head.weight"))
        assert arch.num_params() == n, family


def _rows(lengths):
    return [batching.Row(np.zeros(2, np.int32), np.zeros(n, np.int32), np.zeros(n, np.float32), 0.5)
            for n in lengths]


@pytest.mark.parametrize("dp", [1, 2, 3])
def test_plan_keeps_every_row_once_within_budget(dp):
    rows = _rows([1, 7, 3, 12, 5, 5, 2, 9, 30])
    plan = batching.plan(rows, dp, max_tokens=40, rows_per_micro=0)
    assert len({len(r) for r in plan}) == 1  # same number of micro-batches on every DP rank
    real = [row for rank in plan for micro in rank for row in micro if len(row.response)]
    assert sorted(map(id, real)) == sorted(map(id, rows))
    for rank in plan:
        for micro in rank:
            assert len(micro) == 1 or len(micro) * max(r.length for r in micro) <= 40


def test_pack_indexes_the_logit_before_each_response_token():
    rows = [batching.Row(np.array([5, 6], np.int32), np.array([7, 8, 9], np.int32),
                         np.array([-1, -2, -3], np.float32), 1.0)]
    t = batching.pack(rows, torch.device("cpu"))
    assert t["ids"].tolist() == [[5, 6, 7, 8, 9]]
    assert t["index"].tolist() == [[1, 2, 3]]  # logits at position i predict token i + 1
    assert t["resp"].tolist() == [[7, 8, 9]] and t["mask"].tolist() == [[1, 1, 1]]
