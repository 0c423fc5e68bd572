"""Qwen3-MoE on the megatron backend: config parsing, routing semantics, EP/TP weight mapping, a GRPO step
equal to the torch backend's, EP=2 equal to EP=1, and `offpolicy verify` against transformers (CPU, gloo,
float32, through the test shim). The mapping and arch tests need no megatron-core."""

import os
import subprocess
import sys

import pytest
import torch

from offpolicy.learner.backends.megatron import arch as A, families, mapping
from offpolicy.models.build import checkpoint_tensors
from tests.megatron_workers import QWEN3_MOE_SMALL, TINY, assert_runs_match, assert_stats_close

MOE = TINY["qwen3_moe"]


def _hf_model(cfg: dict = MOE):
    from offpolicy.config import ModelConfig
    from offpolicy.models.build import build_model

    return build_model(ModelConfig(arch=dict(cfg)), torch.device("cpu"))


def test_build_model_makes_a_qwen3_moe_from_model_arch():
    m = _hf_model()
    assert type(m).__name__ == "Qwen3MoeForCausalLM"
    assert [type(layer.mlp).__name__ for layer in m.model.layers] == ["Qwen3MoeSparseMoeBlock", "Qwen3MoeMLP",
                                                                       "Qwen3MoeSparseMoeBlock"]


def test_arch_reads_the_moe_fields():
    a = families.from_hf(MOE)
    assert (a.num_experts, a.moe_topk, a.moe_ffn_hidden_size, a.moe_norm_topk) == (4, 2, 16, True)
    assert a.moe_layers == (True, False, True) and a.qk_norm and a.is_moe
    # decoder_sparse_step 2: layers 1 and 3 (0-based) are sparse; transformers 5 writes num_local_experts
    b = families.from_hf({**MOE, "num_hidden_layers": 4, "mlp_only_layers": [], "decoder_sparse_step": 2,
                   "num_experts": None, "num_local_experts": 8, "norm_topk_prob": False})
    assert b.moe_layers == (False, True, False, True) and b.num_experts == 8 and not b.moe_norm_topk
    assert A.moe_config(b, ep=1, etp=1, aux_loss_coef=0.0, dispatcher="alltoall")["moe_router_pre_softmax"]
    assert A.moe_config(a, ep=1, etp=1, aux_loss_coef=0.0, dispatcher="alltoall")["moe_layer_freq"] == [1, 0, 1]
    hf = _hf_model().state_dict()
    assert a.num_params() == sum(v.numel() for v in hf.values())


def test_moe_layouts_are_checked_with_the_field_and_fix():
    a = families.from_hf(MOE)
    with pytest.raises(A.ArchError, match="num_experts 4 is not divisible by megatron.ep 3"):
        A.check_layout(a, tp=1, pp=1, ep=3)
    with pytest.raises(A.ArchError, match="moe_intermediate_size 16 is not divisible by megatron.etp 3"):
        A.check_layout(a, tp=1, pp=1, etp=3)
    with pytest.raises(A.ArchError, match="learner.megatron.ep=1"):
        A.check_layout(families.from_hf(TINY["qwen3"]), tp=1, pp=1, ep=2)
    with pytest.raises(A.ArchError, match="no MoE layer"):
        families.from_hf({**MOE, "mlp_only_layers": [0, 1, 2]})
    A.check_layout(a, tp=2, pp=1, ep=4, etp=2)


def test_world_size_must_hold_the_expert_layout():
    from offpolicy.learner.backends.megatron.parallel import check_world

    check_world(4, tp=2, pp=1, cp=1, ep=4, etp=1)
    with pytest.raises(ValueError, match="learner.megatron.ep x etp"):
        check_world(2, tp=1, pp=1, cp=1, ep=4, etp=1)


def test_allgather_dispatcher_with_ep_is_a_config_error():
    from offpolicy.config import ConfigError, load_config
    from tests.megatron_workers import overrides

    with pytest.raises(ConfigError, match="moe_token_dispatcher"):
        load_config(None, overrides("qwen3_moe", "learner.backend=megatron", "learner.megatron.ep=2",
                                    "learner.megatron.moe_token_dispatcher=allgather"))


@pytest.mark.parametrize("norm", [True, False])
def test_megatron_routing_equals_hf_router(norm):
    """Top-k of the logits then softmax (renormalised) for norm_topk_prob, softmax then top-k otherwise."""
    pytest.importorskip("megatron.core")
    from megatron.core.transformer.moe.moe_utils import topk_routing_with_score_function
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

    m = _hf_model({**MOE, "norm_topk_prob": norm})
    router = next(layer.mlp.gate for layer in m.model.layers if hasattr(layer.mlp, "gate"))
    assert isinstance(router, Qwen3MoeTopKRouter)
    torch.nn.init.normal_(router.weight)
    x = torch.randn(50, MOE["hidden_size"])
    logits, weights, idx = router(x)
    cfg = A.moe_config(families.from_hf({**MOE, "norm_topk_prob": norm}), ep=1, etp=1, aux_loss_coef=0.0,
                       dispatcher="alltoall")
    probs, rmap = topk_routing_with_score_function(logits, cfg["moe_router_topk"],
                                                   use_pre_softmax=cfg["moe_router_pre_softmax"],
                                                   score_function="softmax")
    dense = torch.zeros_like(probs).scatter(1, idx, weights)
    assert torch.equal(rmap, dense > 0)
    torch.testing.assert_close(probs, dense, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("grouped", [True, False], ids=["grouped", "sequential"])
@pytest.mark.parametrize("tp,ep,etp", [(1, 1, 1), (1, 2, 1), (2, 1, 1), (2, 2, 1), (1, 2, 2), (1, 4, 1)])
def test_round_trip_is_exact(tp, ep, etp, grouped):
    """HF (transformers-5 fused experts) -> per-expert checkpoint names -> TP/EP/ETP shards (stacked per EP
    rank, or one set per expert) -> HF, bit-exact."""
    model = _hf_model()
    hf = model.state_dict()
    flat = dict(checkpoint_tensors(model))
    assert "model.layers.0.mlp.experts.3.gate_proj.weight" in flat and "model.layers.1.mlp.gate_proj.weight" in flat
    arch = families.from_hf(MOE)
    out = {}
    params = families.stage_params(arch, 0, 1, ep=ep, grouped=grouped)
    assert {p.ep_rank for p in params} == {None, *range(ep)}
    for p in params:
        size = tp if p.ep_rank is None else etp
        shards = [mapping.to_shard(p, [flat[n] for n in p.hf], arch, r, size) for r in range(size)]
        if p.ep_rank is not None and grouped:
            assert p.name.split(".mlp.experts.")[1] in ("linear_fc1.weight", "linear_fc2.weight")
            assert p.stack == arch.num_experts // ep and all(s.shape[0] == p.stack for s in shards)
        elif p.ep_rank is not None:
            assert p.name.startswith("decoder.layers.") and ".mlp.experts.local_experts." in p.name
            assert int(p.name.split("local_experts.")[1].split(".")[0]) < arch.num_experts // ep
        out.update(mapping.from_shards(p, shards, arch))
    assert set(out) == set(flat)
    for k, v in flat.items():
        assert torch.equal(out[k], v), k
    fresh = _hf_model()  # zeroed, then loaded back through the checkpoint-named views (fused experts)
    with torch.no_grad():
        for p in fresh.parameters():
            p.zero_()
        for k, t in checkpoint_tensors(fresh).items():
            t.copy_(out[k])
    fused = fresh.state_dict()
    assert set(fused) == set(hf) and all(torch.equal(fused[k], hf[k]) for k in hf)


def test_expert_e_of_ep_rank_r_is_global_expert():
    arch = families.from_hf(MOE)  # 4 experts, ep 2: rank 1 holds experts 2, 3 as local 0, 1
    p = next(p for p in families.stage_params(arch, 0, 1, ep=2, grouped=False)
             if p.ep_rank == 1 and p.name.endswith("local_experts.0.linear_fc1.weight"))
    assert p.hf == ("model.layers.0.mlp.experts.2.gate_proj.weight", "model.layers.0.mlp.experts.2.up_proj.weight")
    assert p.name == "decoder.layers.0.mlp.experts.local_experts.0.linear_fc1.weight"
    p = next(p for p in families.stage_params(arch, 0, 1, ep=2)  # grouped: rows 0, 1 of the stack
             if p.ep_rank == 1 and p.name == "decoder.layers.0.mlp.experts.linear_fc1.weight")
    assert p.stack == 2 and p.hf == tuple(f"model.layers.0.mlp.experts.{e}.{k}_proj.weight"
                                          for e in (2, 3) for k in ("gate", "up"))
    router = [p for p in families.stage_params(arch, 0, 1, ep=2) if p.name.endswith("router.weight")]
    assert [p.hf for p in router] == [("model.layers.0.mlp.gate.weight",), ("model.layers.2.mlp.gate.weight",)]


def test_small_benchmark_config_parses():
    a = families.from_hf(QWEN3_MOE_SMALL)
    assert a.num_experts == 8 and all(a.moe_layers)
    A.check_layout(a, tp=2, pp=2, ep=8, etp=1)


# -- megatron-core in spawned processes ----------------------------------------------------------------

def _megatron():
    pytest.importorskip("megatron.core", reason="megatron-core is not installed (pip install -e '.[megatron]')")
    from tests import megatron_workers

    return megatron_workers


@pytest.fixture(scope="module")
def moe_runs(tmp_path_factory):
    from tests.megatron_workers import run_cache

    return run_cache(tmp_path_factory, "qwen3_moe")


def test_tp1_ep1_matches_the_torch_backend(moe_runs):
    from offpolicy.config import load_config
    from offpolicy.learner.backends.torch_backend import TorchBackend

    w = _megatron()
    tb = TorchBackend(load_config(None, w.overrides("qwen3_moe")))
    before = {k: v.clone() for k, v in tb.weights()}
    groups, adv = w.batch()
    stats = [tb.train_step(groups, adv) for _ in range(2)]
    after = dict(tb.weights())
    mg = moe_runs(1)
    assert set(mg["before"]) == set(before)  # exported in the checkpoint's per-expert names
    for k in before:
        assert torch.equal(mg["before"][k], before[k]), k
    for a, b in zip(mg["stats"], stats):
        assert_stats_close(a, b)
    for k in after:
        assert torch.allclose(mg["after"][k], after[k], atol=1e-4), k
    assert mg["hf_config"]["model_type"] == "qwen3_moe"


@pytest.mark.slow
@pytest.mark.parametrize("extra", [("learner.megatron.ep=2",), ("learner.megatron.ep=2", "learner.megatron.etp=1",
                                                                  "learner.megatron.use_distributed_optimizer=false")],
                         ids=["ep2", "ep2-no-distopt"])
def test_ep2_matches_ep1(moe_runs, extra):
    ref, got = moe_runs(1), moe_runs(2, *extra)
    assert_runs_match(ref, got)


def test_tp_above_1_without_sequence_parallel_names_the_fix():
    from offpolicy.config import ConfigError, load_config
    from offpolicy.learner.backends.megatron.backend import check_layout
    from tests.megatron_workers import overrides

    def cfg(*extra):
        return load_config(None, overrides("qwen3_moe", "learner.backend=megatron", "learner.megatron.tp=2", *extra))

    with pytest.raises(ConfigError, match=r"learner.megatron.sequence_parallel=true"):
        check_layout(cfg(), families.from_hf(MOE))
    check_layout(cfg("learner.megatron.sequence_parallel=true"), families.from_hf(MOE))
    check_layout(cfg(), families.from_hf(TINY["qwen3"]))  # dense models train with tp > 1 without SP


@pytest.mark.slow
def test_tp2_sequence_parallel_matches_tp1(moe_runs):
    """TP=2 + SP (local spec, our norms; experts replicated over the TP ranks, etp 1) equals TP=1."""
    ref, got = moe_runs(1), moe_runs(2, "learner.megatron.tp=2", "learner.megatron.sequence_parallel=true")
    assert_runs_match(ref, got, atol=1e-4)


@pytest.mark.slow
def test_aux_loss_changes_only_the_update(moe_runs):
    """moe_aux_loss_coef > 0 leaves the reported policy loss of step 0 alone and moves the routers."""
    ref, aux = moe_runs(1), moe_runs(1, "learner.megatron.moe_aux_loss_coef=0.1")
    assert aux["stats"][0]["loss"] == pytest.approx(ref["stats"][0]["loss"], rel=1e-6)
    assert aux["stats"][0]["grad_norm"] != pytest.approx(ref["stats"][0]["grad_norm"], rel=1e-6)
    router = "model.layers.0.mlp.gate.weight"
    assert not torch.allclose(aux["after"][router], ref["after"][router], atol=1e-7)
    dense = "model.layers.1.mlp.gate_proj.weight"  # the dense layer's update is (nearly) the same
    assert torch.isfinite(aux["after"][dense]).all()


def _verify(tmp_path, *layout: str, procs: int = 1):
    _megatron()
    from tests.megatron_cpu_shim import shimmed
    from tests.megatron_workers import free_port

    _hf_model().save_pretrained(tmp_path)
    cmd = [sys.executable, "-c", shimmed("offpolicy.services.cli"), "verify", "--model", str(tmp_path),
           "--device", "cpu", *layout]
    if procs > 1:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(procs), "--master-port",
               str(free_port()), "--no-python", *cmd]
    env = {**os.environ, "MASTER_PORT": str(free_port())}  # not 29500: test runs side by side
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stdout + out.stderr[-3000:]
    assert "PASS" in out.stdout and "top-1 agreement      1.0000" in out.stdout and "8/8" in out.stdout
    return out.stdout


@pytest.mark.parametrize("layout,procs", [
    ((), 1),
    pytest.param(("--tp", "2"), 2, marks=pytest.mark.slow),
    pytest.param(("--ep", "2"), 2, marks=pytest.mark.slow),
], ids=["tp1", "tp2", "ep2"])
def test_offpolicy_verify_passes_on_a_tiny_qwen3_moe(tmp_path, layout, procs):
    print(_verify(tmp_path, *layout, procs=procs))


@pytest.mark.parametrize("world,extra", [(1, ()), pytest.param(2, ("learner.megatron.ep=2",), marks=pytest.mark.slow)],
                         ids=["ep1", "ep2"])
def test_grouped_experts_equal_sequential_mlp(moe_runs, world, extra):
    """The default experts module (experts.GroupedExperts: stacked weights; on the CPU its per-expert loop) and
    megatron-core's SequentialMLP train alike in float32: the same losses, grad norms (rel 1e-5) and weights."""
    assert_runs_match(moe_runs(world, *extra, "learner.megatron.experts=sequential"), moe_runs(world, *extra))


@pytest.mark.parametrize("world,extra", [
    (1, ()),
    pytest.param(2, ("learner.megatron.ep=2",), marks=pytest.mark.slow),
    pytest.param(2, ("learner.megatron.etp=2",), marks=pytest.mark.slow),
    pytest.param(1, ("learner.megatron.moe_token_dispatcher=allgather",), marks=pytest.mark.slow),
], ids=["ep1", "ep2", "etp2", "allgather"])
def test_gather_permutation_equals_megatrons(moe_runs, world, extra):
    """learner.megatron.moe_permute=gather (permutation.py, the default) and megatron-core's unfused permute /
    unpermute train alike in float32: the same losses, grad norms (rel 1e-5) and weights."""
    assert_runs_match(moe_runs(world, *extra, "learner.megatron.moe_permute=megatron"),
                      moe_runs(world, *extra, "learner.megatron.moe_permute=gather"))


@pytest.mark.parametrize("extra", [
    ("learner.megatron.etp=2",),
    pytest.param(("learner.megatron.tp=2", "learner.megatron.sequence_parallel=true", "learner.megatron.etp=2"),
                 marks=pytest.mark.slow),
], ids=["etp2", "tp2-sp-etp2"])
def test_etp2_matches_tp1(moe_runs, extra):
    """Each expert split over 2 expert-tensor-parallel ranks ([gate_r; up_r] and fc2 by columns, the uneven
    token gathers of the alltoall dispatcher) trains like 1 rank: the same initial weights, step losses and
    grad norms, and updated weights."""
    ref, got = moe_runs(1), moe_runs(2, *extra)
    assert_runs_match(ref, got, atol=1e-4)
