"""Learner start-up (issue 31): `model.arch` weights drawn per tensor and expert row from `model.seed`
(models.initial_tensor, source.SeededSource) equal `build_model`'s, and a Megatron rank reads from
`model.path` (or draws) only the tensors and expert rows it holds, each once; the start-up report."""

import pytest
import torch

from offpolicy.config import ModelConfig
from offpolicy.learner.backends.megatron.source import HFSource, SeededSource
from offpolicy.models.build import arch_plan, build_model, hf_state, initial_tensor
from tests.megatron_workers import TINY, overrides, random_gpt_oss, write_mxfp4

CPU = torch.device("cpu")


@pytest.mark.parametrize("family", sorted(TINY))
def test_seeded_source_draws_build_models_weights(family):
    cfg = ModelConfig(arch=dict(TINY[family]), seed=3)
    model = dict(hf_state(build_model(cfg, CPU)))
    hf_cfg, shapes, std = arch_plan(cfg)
    assert hf_cfg["model_type"] == family and set(shapes) == set(model)  # tied copies once, buffers never
    src = SeededSource(shapes, seed=3, std=std, dtype=torch.float32, device=CPU)
    for name, t in model.items():
        assert torch.equal(src.get(name), t), name
        if t.dim() == 3:  # stacked experts: a row is drawn alone, and equals the whole tensor's row
            assert torch.equal(src.get(name, row=1), t[1]), name
            assert src.reads[(name, 1)] == 1 and src.reads[(name, None)] == 1
    other = dict(hf_state(build_model(ModelConfig(arch=dict(TINY[family]), seed=4), CPU)))
    assert not torch.equal(other["model.embed_tokens.weight"], model["model.embed_tokens.weight"])


def test_initial_weights_follow_hf_init_scheme():
    cfg = ModelConfig(arch=dict(TINY["gpt_oss"], initializer_range=0.1))
    model = dict(hf_state(build_model(cfg, CPU)))
    assert torch.equal(model["model.norm.weight"], torch.ones(64))
    assert torch.equal(model["model.layers.0.self_attn.q_proj.bias"], torch.zeros_like(model["model.layers.0.self_attn.q_proj.bias"]))
    assert model["model.layers.0.mlp.router.bias"].std() > 0  # GPT-OSS draws its router bias
    assert model["model.embed_tokens.weight"].std().item() == pytest.approx(0.1, rel=0.1)
    row = initial_tensor("model.layers.0.mlp.experts.down_proj", (4, 32, 64), seed=0, std=0.1, device=CPU, row=2)
    assert torch.equal(row, initial_tensor("model.layers.0.mlp.experts.down_proj", (4, 32, 64), seed=0, std=0.1,
                                           device=CPU)[2])


def test_hf_source_opens_each_file_once_and_keeps_the_last_row(tmp_path):
    random_gpt_oss().save_pretrained(tmp_path)
    src = HFSource(str(tmp_path), dtype=torch.float32)
    e = "model.layers.1.mlp.experts.gate_up_proj"
    a, b = src.get(e, row=2), src.get(e, row=2)  # a GPT-OSS row serves its gate half, then its up half
    assert a is b and src.reads[(e, 2)] == 1 and src.bytes == a.numel() * 4
    src.get("model.norm.weight")
    assert len(src._open) == 1  # one (memory-mapped) reader for the file, however many tensors


def _megatron():
    pytest.importorskip("megatron.core", reason="megatron-core is not installed (pip install -e '.[megatron]')")
    from tests import megatron_workers

    return megatron_workers


def _expert_rows(reads: dict) -> set[tuple[str, int]]:
    return {(n, r) for n, r in reads if r is not None}


@pytest.mark.parametrize("fmt", ["bf16", "mxfp4"])
def test_an_ep2_rank_reads_only_its_experts_once(tmp_path, fmt):
    w = _megatron()
    model = random_gpt_oss()
    if fmt == "mxfp4":
        write_mxfp4(model, tmp_path / "model")
    else:
        model.save_pretrained(tmp_path / "model")
    args = overrides("gpt_oss", f"model.path={tmp_path / 'model'}", "learner.megatron.ep=2")
    ranks = w.spawn_startup(2, args, str(tmp_path / "out"))
    experts, layers = TINY["gpt_oss"]["num_local_experts"], TINY["gpt_oss"]["num_hidden_layers"]
    for rank in ranks:
        assert all(n == 1 for n in rank["reads"].values()), "a tensor or expert row read twice"
        rows = _expert_rows(rank["reads"])
        assert rows and {r for _, r in rows} == set(range(rank["ep_rank"] * 2, rank["ep_rank"] * 2 + 2))
        assert not any(r is None and ".mlp.experts." in n and "bias" not in n for n, r in rank["reads"])
        assert set(rank["startup"]) == {"setup", "build", "load", "wrap", "ready"}
    pieces = 4 if fmt == "bf16" else 6  # gate_up, down (+ biases); mxfp4: _blocks and _scales of each weight
    assert len(_expert_rows(ranks[0]["reads"]) | _expert_rows(ranks[1]["reads"])) == layers * pieces * experts
    dense = {n for n, r in ranks[0]["reads"] if ".mlp.experts." not in n}
    assert dense == {n for n, r in ranks[1]["reads"] if ".mlp.experts." not in n}  # both hold every dense tensor


def test_pipeline_stages_draw_only_their_layers(tmp_path):
    w = _megatron()
    ranks = w.spawn_startup(2, overrides("llama", "learner.megatron.pp=2"), str(tmp_path / "out"))
    names = [{n for n, _ in r["reads"]} for r in ranks]
    assert not names[0] & names[1]
    assert "model.embed_tokens.weight" in names[0] and "lm_head.weight" in names[1]
    assert all(".layers.0." in n for n in names[0] if ".layers." in n)
    assert all(".layers.1." in n for n in names[1] if ".layers." in n)
    assert all(n == 1 for r in ranks for n in r["reads"].values())
