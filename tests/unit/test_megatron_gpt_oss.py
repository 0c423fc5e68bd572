"""GPT-OSS on the megatron backend: config parsing, YaRN and routing against transformers, the fused-expert
HF <-> Megatron mapping under TP/EP/PP (bit-exact), `offpolicy verify` (float32 logits within 1e-5, with a
negative control per feature: each one, taken out, moves the logits by far more), and GRPO steps equal
across layouts and packed = padded micro-batches (CPU, gloo, float32, through the test shim). The first group needs no megatron-core."""

import dataclasses
import json
import os
import subprocess
import sys

import pytest
import torch

from offpolicy.learner.backends.megatron import arch as A, families, mapping
from offpolicy.learner.backends.megatron.memory import GPT_OSS_120B, GPT_OSS_20B
from offpolicy.models.build import checkpoint_tensors
from tests import fresh_processes
from tests.megatron_workers import TINY, assert_runs_match, assert_stats_close, random_gpt_oss, write_mxfp4

G = TINY["gpt_oss"]


def _hf_model(cfg: dict = G):
    from offpolicy.config import ModelConfig
    from offpolicy.models.build import build_model

    return build_model(ModelConfig(arch=dict(cfg)), torch.device("cpu"))


def test_arch_reads_the_gpt_oss_fields():
    a = families.from_hf(G)
    assert (a.num_experts, a.moe_topk, a.moe_ffn_hidden_size, a.moe_norm_topk) == (4, 2, 32, True)
    assert a.moe_layers == (True,) * 4 and a.window_layers == (True, False, True, False) and a.sliding_window == 8
    assert a.attn_sinks and a.linear_bias and a.qkv_bias and not a.qk_norm
    assert (a.glu_alpha, a.glu_limit, a.glu_offset) == (1.702, 7.0, 1.0)
    assert a.yarn == A.Yarn(factor=4.0, original_max_positions=16, beta_fast=32.0, beta_slow=1.0, truncate=False)
    assert a.rope_theta == 150000.0 and a.head_dim == 16
    # the published gpt-oss-20b config.json (rope_scaling + rope_theta, transformers < 5 names) reads the same way
    old = {k: v for k, v in GPT_OSS_20B.items() if k != "rope_parameters"}
    old.update(rope_theta=150000, rope_scaling={k: v for k, v in GPT_OSS_20B["rope_parameters"].items()
                                                 if k != "rope_theta"}, experts_per_token=4)
    assert families.from_hf(old) == families.from_hf(GPT_OSS_20B)
    feat = A.feature_config(a)
    assert feat["softmax_type"] == "learnable" and feat["window_size"] == (7, 0)
    assert feat["window_attn_skip_freq"] == [1, 0, 1, 0] and feat["add_bias_linear"]


@pytest.mark.parametrize("cfg", [G, GPT_OSS_20B, GPT_OSS_120B], ids=["tiny", "20b", "120b"])
def test_num_params_and_attention_factor_match_transformers(cfg):
    from transformers import AutoConfig, AutoModelForCausalLM

    hf_cfg = AutoConfig.for_model(**cfg)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf_cfg)
    a = families.from_hf(cfg)
    assert a.num_params() == sum(p.numel() for p in model.parameters())
    assert a.yarn.attention_factor() == pytest.approx(model.model.rotary_emb.attention_scaling, rel=1e-15)


def test_unsupported_gpt_oss_configs_name_the_field():
    with pytest.raises(A.ArchError, match="attention_bias"):
        families.from_hf({**G, "attention_bias": False})
    with pytest.raises(A.ArchError, match="layer_types"):
        families.from_hf({**G, "layer_types": ["sliding_attention"] * 3})
    with pytest.raises(A.ArchError, match="sliding_window"):
        families.from_hf({**G, "sliding_window": None})
    with pytest.raises(A.ArchError, match="rope_type 'llama3'"):
        families.from_hf({**G, "rope_parameters": {"rope_type": "llama3", "factor": 8.0}})
    with pytest.raises(A.ArchError, match="attention_factor"):
        families.from_hf({**G, "rope_parameters": {**G["rope_parameters"], "attention_factor": 2.0}})
    with pytest.raises(A.ArchError, match="learner.megatron.etp=1"):
        A.check_layout(families.from_hf(G), tp=1, pp=1, ep=1, etp=2)
    with pytest.raises(A.ArchError, match="num_local_experts 4 is not divisible by megatron.ep 3"):
        A.check_layout(families.from_hf(G), tp=1, pp=1, ep=3)
    assert families.get("gpt_oss").te is False


def test_megatron_yarn_equals_transformers_rope(monkeypatch):
    """Megatron's YarnRotaryEmbedding with the attributes arch.set_yarn gives = HF's cos/sin (truncate false)."""
    pytest.importorskip("megatron.core")
    monkeypatch.setattr(torch.cuda, "current_device", lambda: "cpu")  # get_emb moves its buffers there
    from megatron.core.models.common.embeddings import YarnRotaryEmbedding

    model = _hf_model()
    y = families.from_hf(G).yarn
    mg = YarnRotaryEmbedding(kv_channels=G["head_dim"], rotary_base=150000.0, use_cpu_initialization=True,
                             scaling_factor=y.factor, original_max_position_embeddings=y.original_max_positions,
                             beta_fast=y.beta_fast, beta_slow=y.beta_slow, mscale=y.mscale,
                             mscale_all_dim=y.mscale_all_dim, correction_range_round_to_int=y.truncate)
    emb, mscale = mg.get_emb(48)
    cos, sin = model.model.rotary_emb(torch.zeros(1), torch.arange(48)[None])
    half = G["head_dim"] // 2
    torch.testing.assert_close(torch.cos(emb[:, 0, 0, :half]) * mscale, cos[0], rtol=0, atol=1e-6)
    torch.testing.assert_close(torch.sin(emb[:, 0, 0, :half]) * mscale, sin[0], rtol=0, atol=1e-6)


def test_megatron_routing_equals_the_gpt_oss_router():
    """Top-k of the biased logits, then a softmax over those k (moe_router_pre_softmax false)."""
    pytest.importorskip("megatron.core")
    from megatron.core.transformer.moe.moe_utils import topk_routing_with_score_function

    router = _hf_model().model.layers[0].mlp.router
    torch.nn.init.normal_(router.weight)
    torch.nn.init.normal_(router.bias)
    logits, weights, idx = router(torch.randn(50, G["hidden_size"]))
    cfg = A.moe_config(families.from_hf(G), ep=1, etp=1, aux_loss_coef=0.0, dispatcher="alltoall")
    probs, rmap = topk_routing_with_score_function(logits, cfg["moe_router_topk"],
                                                   use_pre_softmax=cfg["moe_router_pre_softmax"],
                                                   score_function="softmax")
    dense = torch.zeros_like(probs).scatter(1, idx, weights)
    assert torch.equal(rmap, dense > 0)
    torch.testing.assert_close(probs, dense, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("grouped", [True, False], ids=["grouped", "sequential"])
@pytest.mark.parametrize("tp,ep,pp", [(1, 1, 1), (2, 1, 1), (1, 2, 1), (2, 2, 2), (1, 4, 2)])
def test_round_trip_is_exact(tp, ep, pp, grouped):
    """Fused HF experts -> family reader -> TP/EP shards -> HF pieces -> family export -> fused, bit-exact."""
    model = random_gpt_oss()
    hf = checkpoint_tensors(model)
    assert "model.layers.0.mlp.experts.gate_up_proj" in hf  # GPT-OSS checkpoints keep experts fused
    arch, fam = families.from_hf(G), families.get("gpt_oss")
    get = fam.reader(arch, _StateSource(hf))
    pieces = []
    for stage in range(pp):
        for p in families.stage_params(arch, stage, pp, ep=ep, grouped=grouped):
            size = tp if p.ep_rank is None else 1
            shards = [mapping.to_shard(p, [get(n) for n in p.hf], arch, r, size) for r in range(size)]
            pieces += mapping.from_shards(p, shards, arch)
    out = dict(fam.export(arch, iter(pieces)))
    assert set(out) == set(hf)
    for k, v in hf.items():
        assert torch.equal(out[k], v), k


class _StateSource:  # model.HFSource's get(name, row) over a state dict, without importing safetensors paths
    def __init__(self, state):
        self.state = state

    def get(self, name, row=None):
        return self.state[name] if row is None else self.state[name][row]


def test_expert_pieces_come_from_interleaved_columns():
    """Local expert 0 of EP rank 1 (ep 2) is global expert 2: fc1 = [gate; up] = the even / odd columns of
    gate_up_proj[2], transposed; fc2 = down_proj[2] transposed; the sinks split by heads over TP."""
    model = random_gpt_oss()
    hf = checkpoint_tensors(model)
    arch, fam = families.from_hf(G), families.get("gpt_oss")
    get = fam.reader(arch, _StateSource(hf))
    params = {p.name: p for p in families.stage_params(arch, 0, 1, ep=2, grouped=False) if p.ep_rank in (None, 1)}
    e = "model.layers.1.mlp.experts."
    fc1 = params["decoder.layers.1.mlp.experts.local_experts.0.linear_fc1.weight"]
    w = mapping.to_shard(fc1, [get(n) for n in fc1.hf], arch, 0, 1)
    gu = hf[e + "gate_up_proj"][2]
    assert torch.equal(w, torch.cat([gu[:, 0::2].T, gu[:, 1::2].T]))
    b = params["decoder.layers.1.mlp.experts.local_experts.0.linear_fc1.bias"]
    assert torch.equal(mapping.to_shard(b, [get(n) for n in b.hf], arch, 0, 1),
                       torch.cat([hf[e + "gate_up_proj_bias"][2, 0::2], hf[e + "gate_up_proj_bias"][2, 1::2]]))
    fc2 = params["decoder.layers.1.mlp.experts.local_experts.0.linear_fc2.weight"]
    assert torch.equal(mapping.to_shard(fc2, [get(n) for n in fc2.hf], arch, 0, 1), hf[e + "down_proj"][2].T)
    stacked = {p.name: p for p in families.stage_params(arch, 0, 1, ep=2) if p.ep_rank == 1}  # grouped: row 0
    for name, one in (("linear_fc1.weight", fc1), ("linear_fc1.bias", b), ("linear_fc2.weight", fc2)):
        p = stacked["decoder.layers.1.mlp.experts." + name]
        assert torch.equal(mapping.to_shard(p, [get(n) for n in p.hf], arch, 0, 1)[0],
                           mapping.to_shard(one, [get(n) for n in one.hf], arch, 0, 1))
    sinks = params["decoder.layers.1.self_attention.core_attention.softmax_offset"]
    assert torch.equal(mapping.to_shard(sinks, [get(n) for n in sinks.hf], arch, 1, 2),
                       hf["model.layers.1.self_attn.sinks"][2:])


def test_megatron_build_refuses_the_te_spec_for_gpt_oss():
    from offpolicy.learner.backends.megatron.model import use_te

    assert use_te(families.from_hf(G), "auto") is False
    with pytest.raises(A.ArchError, match="transformer_impl"):
        use_te(families.from_hf(G), "transformer_engine")


def test_swiglu_fusion_only_for_the_plain_silu_gate():
    """The learner asks for megatron-core's fused SwiGLU on a GPU; GPT-OSS's clamped sigmoid gate has no
    fused kernel there (bias_swiglu_impl computes silu), so its config must keep the unfused activation."""
    pytest.importorskip("megatron.core", reason="megatron-core is not installed (pip install -e '.[megatron]')")
    from tests.megatron_workers import TINY as T

    def config(hf):
        return A.transformer_config(families.from_hf(hf), tp=1, pp=1, sequence_parallel=False, dtype=torch.float32,
                                    recompute="none", recompute_layers=1, fused=True)

    gpt_oss = config(G)
    assert gpt_oss.bias_activation_fusion is False and gpt_oss.activation_func.func is A.sigmoid_gate
    assert config(T["llama"]).bias_activation_fusion is True


# -- megatron-core in spawned processes ----------------------------------------------------------------

def _megatron():
    pytest.importorskip("megatron.core", reason="megatron-core is not installed (pip install -e '.[megatron]')")
    from tests import megatron_workers

    return megatron_workers


def _verify(tmp_path, *layout: str, procs: int = 1, mxfp4: bool = False) -> str:
    _megatron()
    from tests.megatron_cpu_shim import shimmed
    from tests.megatron_workers import free_port

    if mxfp4:  # the release format: both sides dequantize the experts
        write_mxfp4(random_gpt_oss(), tmp_path)
    else:
        random_gpt_oss().save_pretrained(tmp_path)
    cmd = [sys.executable, "-c", shimmed("offpolicy.services.cli"), "verify", "--model", str(tmp_path),
           "--device", "cpu", "--max-diff", "1e-5", "--min-top1", "1.0", *layout]
    if procs > 1:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(procs), "--master-port",
               str(free_port()), "--no-python", *cmd]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MASTER_PORT": str(free_port())}  # not 29500: tests run side by side
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stdout + out.stderr[-3000:]
    assert "PASS" in out.stdout and "top-1 agreement      1.0000" in out.stdout and "8/8" in out.stdout
    assert "40 per sequence" in out.stdout and "sliding window 8 on 2/4 layers (seq > window)" in out.stdout
    assert "YaRN x4 over 16 positions, attention factor 1.1386 (seq past them)" in out.stdout
    return out.stdout


# tp1 is slow: test_offpolicy_verify_passes_on_an_mxfp4_checkpoint[tp1] runs the same verify of the same model with the
# same checks (the experts dequantized from MXFP4 on both sides; every other tensor read as stored, as here)
@pytest.mark.parametrize("layout,procs", [
    pytest.param((), 1, marks=pytest.mark.slow),
    pytest.param(("--tp", "2"), 2, marks=pytest.mark.slow),
    pytest.param(("--ep", "2"), 2, marks=pytest.mark.slow),
    pytest.param(("--tp", "2", "--ep", "2"), 4, marks=pytest.mark.slow),
], ids=["tp1", "tp2", "ep2", "tp2-ep2"])
def test_offpolicy_verify_passes_on_a_tiny_gpt_oss(tmp_path, layout, procs):
    print(_verify(tmp_path, *layout, procs=procs))


@pytest.mark.parametrize("layout,procs", [((), 1), pytest.param(("--ep", "2"), 2, marks=pytest.mark.slow)],
                         ids=["tp1", "ep2"])
def test_offpolicy_verify_passes_on_an_mxfp4_checkpoint(tmp_path, layout, procs):
    print(_verify(tmp_path, *layout, procs=procs, mxfp4=True))


@pytest.mark.parametrize("world,extra", [(1, ()), pytest.param(2, ("learner.megatron.ep=2",), marks=pytest.mark.slow),
                                         # issue 51's EP4 x DP2 in small: each expert shard loaded by 2 ranks
                                         pytest.param(4, ("learner.megatron.ep=2",), marks=pytest.mark.slow)],
                         ids=["tp1", "ep2", "ep2-edp2"])
def test_an_mxfp4_model_path_loads_dequantized_exactly(tmp_path, world, extra):
    """model.path = an MXFP4 directory: the Megatron learner's exported weights (before any step) are exactly
    the dequantized checkpoint, and exactly what the torch backend loads from it."""
    from offpolicy.config import load_config
    from offpolicy.learner.backends.torch_backend import TorchBackend
    from offpolicy.weights import mxfp4

    w = _megatron()
    written = write_mxfp4(random_gpt_oss(), tmp_path / "mx")
    args = [f"model.path={tmp_path / 'mx'}", "learner.device=cpu", "rollout.n_samples=4", *extra]
    got = w.spawn(world, args, 0, str(tmp_path / "out.pt"))["before"]
    want = dict(mxfp4.dequantized_tensors(written.__getitem__, written, torch.float32))
    torch_backend = dict(TorchBackend(load_config(None, args[:3])).weights())
    assert set(got) == set(want) == set(torch_backend)
    for k in want:
        assert torch.equal(got[k], want[k]) and torch.equal(torch_backend[k], want[k]), k


def _without(feature: str, tmp: str) -> float:
    """Process body: `offpolicy verify`'s max logits diff with one GPT-OSS feature taken out of Megatron."""
    from tests.megatron_cpu_shim import install

    install()
    from offpolicy.learner.backends.megatron.families import gpt_oss
    from offpolicy.learner.backends.megatron.verify import verify

    plain_arch, plain_reader = gpt_oss.GptOss.from_hf, gpt_oss.GptOss.reader
    changes = {"sliding window": dict(sliding_window=0, window_layers=()), "window + 1": dict(sliding_window=9),
               "yarn": dict(yarn=None), "gate clamp": dict(glu_limit=None), "up + 1": dict(glu_offset=0.0),
               "gate alpha": dict(glu_alpha=1.0)}

    def arch(self, cfg):
        a = plain_arch(self, cfg)
        if feature == "attention factor":  # mscale = mscale_all_dim: YaRN's frequencies, attention factor 1
            return dataclasses.replace(a, yarn=dataclasses.replace(a.yarn, mscale=1.0, mscale_all_dim=1.0))
        return dataclasses.replace(a, **changes.get(feature, {}))

    def reader(self, arch, source):
        get = plain_reader(self, arch, source)
        return (lambda n: torch.zeros_like(get(n)) if n.endswith("sinks") else get(n)) if feature == "sinks" else get

    gpt_oss.GptOss.from_hf, gpt_oss.GptOss.reader = arch, reader
    try:
        return verify(tmp, device="cpu").max_diff
    finally:
        gpt_oss.GptOss.from_hf, gpt_oss.GptOss.reader = plain_arch, plain_reader


def _without_all(rank: int, port: int, tmp: str, features: list[str], out: str) -> None:
    from megatron.core import parallel_state

    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    diffs = {}
    for f in features:
        diffs[f] = _without(f, tmp)
        parallel_state.destroy_model_parallel()
    torch.save(diffs, out)


def test_every_feature_moves_the_logits(tmp_path):
    """Negative controls of the verify test: taking any one feature out of Megatron (or shifting the window by
    one) costs a max logits diff above 0.1 (0.29 to 2.0), so the 1e-5 pass above cannot come from an unused feature."""
    w = _megatron()
    random_gpt_oss().save_pretrained(tmp_path)
    features = ["none", "sliding window", "window + 1", "yarn", "attention factor", "sinks", "gate clamp",
                "up + 1", "gate alpha"]
    fresh_processes.spawn(_without_all, (w.free_port(), str(tmp_path), features, str(tmp_path / "d.pt")))
    diffs = torch.load(tmp_path / "d.pt")
    print(diffs)
    assert diffs.pop("none") <= 1e-5
    assert all(d > 0.1 for d in diffs.values()), diffs


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    from tests.megatron_workers import run_cache

    return run_cache(tmp_path_factory, "gpt_oss")


def test_tp1_matches_the_torch_backend_and_exports_the_hf_layout(runs, tmp_path):
    from offpolicy.config import load_config
    from offpolicy.learner.backends.torch_backend import TorchBackend

    w = _megatron()
    tb = TorchBackend(load_config(None, w.overrides("gpt_oss")))
    before = {k: v.clone() for k, v in tb.weights()}
    groups, adv = w.batch()
    stats = [tb.train_step(groups, adv) for _ in range(2)]
    after = dict(tb.weights())
    mg = runs(1)
    assert set(mg["before"]) == set(before)  # the fused checkpoint names
    for k in before:
        assert torch.equal(mg["before"][k], before[k]), k
    for a, b in zip(mg["stats"], stats):
        assert_stats_close(a, b)
    for k in after:
        assert torch.allclose(mg["after"][k], after[k], atol=1e-4), k
    # the exported version loads into transformers' GptOssForCausalLM as the torch engine loads one: in place
    model = _hf_model(mg["hf_config"])
    own = checkpoint_tensors(model)
    assert {k: tuple(v.shape) for k, v in own.items()} == {k: tuple(v.shape) for k, v in mg["after"].items()}
    with torch.no_grad():
        for k, t in own.items():
            t.copy_(mg["after"][k])
    assert torch.equal(model.model.layers[3].mlp.experts.down_proj_bias,
                       mg["after"]["model.layers.3.mlp.experts.down_proj_bias"])
    # and from a directory, as a published version is read by from_pretrained (SGLang reads the same layout)
    from safetensors.torch import save_file

    from offpolicy.models.build import from_pretrained

    save_file({k: v.contiguous() for k, v in mg["after"].items()}, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps(mg["hf_config"]))
    loaded = checkpoint_tensors(from_pretrained(str(tmp_path), torch.float32))
    assert all(torch.equal(loaded[k], mg["after"][k]) for k in mg["after"])


@pytest.mark.parametrize("world,extra", [
    pytest.param(2, ("learner.megatron.tp=2", "learner.megatron.sequence_parallel=true"), marks=pytest.mark.slow),
    pytest.param(2, ("learner.megatron.pp=2",), marks=pytest.mark.slow),
    (2, ("learner.megatron.ep=2",)),
    pytest.param(4, ("learner.megatron.tp=2", "learner.megatron.sequence_parallel=true", "learner.megatron.ep=2"),
                 marks=pytest.mark.slow),
    pytest.param(4, ("learner.megatron.pp=2", "learner.megatron.ep=2"), marks=pytest.mark.slow),
    pytest.param(4, ("learner.megatron.ep=4",), marks=pytest.mark.slow),
], ids=["tp2-sp", "pp2", "ep2", "tp2-ep2", "pp2-ep2", "ep4"])
def test_layouts_match_tp1(runs, world, extra):
    """Two GRPO steps: the same losses and grad norms (rel 1e-5) and close weights as one process."""
    ref, got = runs(1), runs(world, *extra)
    assert_runs_match(ref, got, atol=1e-4)
    drift = max(float((got["after"][k] - ref["after"][k]).abs().max()) for k in ref["after"])
    print(f"{extra}: loss {[round(s['loss'], 7) for s in got['stats']]} vs {[round(s['loss'], 7) for s in ref['stats']]}, "
          f"grad norm {[round(s['grad_norm'], 7) for s in got['stats']]} vs "
          f"{[round(s['grad_norm'], 7) for s in ref['stats']]}, weights within {drift:.1e}")


@pytest.mark.parametrize("world,extra", [(1, ()), pytest.param(2, ("learner.megatron.ep=2",), marks=pytest.mark.slow)],
                         ids=["ep1", "ep2"])
def test_grouped_experts_equal_sequential_mlp(runs, world, extra):
    """GroupedExperts (biases, clamped SwiGLU; on the CPU its per-expert loop) and SequentialMLP train alike in
    float32: the same losses, grad norms (rel 1e-5) and weights (1e-5)."""
    assert_runs_match(runs(world, *extra, "learner.megatron.experts=sequential"), runs(world, *extra))


@pytest.mark.parametrize("world,extra", [(1, ()), pytest.param(2, ("learner.megatron.ep=2",), marks=pytest.mark.slow)],
                         ids=["ep1", "ep2"])
def test_gather_permutation_equals_megatrons(runs, world, extra):
    """learner.megatron.moe_permute=gather (permutation.py) and megatron-core's unfused permutation train the
    tiny GPT-OSS (biased experts: probs weight the fc2 bias too) alike in float32."""
    assert_runs_match(runs(world, *extra, "learner.megatron.moe_permute=megatron"),
                      runs(world, *extra, "learner.megatron.moe_permute=gather"))


def test_packed_micro_batches_equal_padded_ones(runs):
    """Two GRPO steps of the tiny GPT-OSS (sinks, window 8, YaRN past 16 positions, biased experts, the
    clamped gate), float32: packed micro-batches (the default: every sequence end to end in one row, RoPE
    restarting per document) give the padded path's losses, grad norms and updated weights. Measured:
    losses bit-equal, grad norms within 1.1e-7 relative, weights (lr 1e-2, two Adam steps of 0.02) within
    1.9e-5: Adam scales the float32 rounding of near-zero expert gradients up, hence atol 1e-4 as for layouts."""
    from offpolicy.config import Config

    assert Config().learner.megatron.packing  # runs(1) is the packed path
    padded, packed = runs(1, "learner.megatron.packing=false"), runs(1)
    assert_runs_match(padded, packed, atol=1e-4)
    for a, b in zip(packed["stats"], padded["stats"]):
        assert abs(a["loss"] - b["loss"]) <= 1e-6 * max(1.0, abs(b["loss"])), (a["loss"], b["loss"])
        assert abs(a["grad_norm"] - b["grad_norm"]) <= 1e-5 * b["grad_norm"], (a["grad_norm"], b["grad_norm"])
