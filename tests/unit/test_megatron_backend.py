"""The megatron backend on CPU (gloo, float32, test shim), each layout in fresh spawned processes.

TP=1 must equal the embedded torch backend (same GRPO loss, same step), packed (the default) and
padded; packed micro-batches under a token budget equal padded ones; TP=2, PP=2 and DP=2 (two
processes) must equal TP=1; exporting the freshly loaded model must give back the HF weights exactly;
a restored checkpoint continues exactly; the KL loss to the frozen reference equals the torch backend's.
"""

import os

import pytest
import torch

pytest.importorskip("megatron.core", reason="megatron-core is not installed (pip install -e '.[megatron]')")

from tests.megatron_cpu_shim import shimmed  # noqa: E402
from tests.megatron_workers import assert_runs_match, assert_stats_close, batch, overrides, spawn  # noqa: E402

STEPS = 2


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    cache = {}

    def run(family: str, world: int, *extra: str) -> dict:
        key = (family, world, extra)
        if key not in cache:
            out = tmp_path_factory.mktemp("mg") / "out.pt"
            cache[key] = spawn(world, overrides(family, *extra), STEPS, str(out))
        return cache[key]

    return run


def _torch_backend(family: str, *extra: str) -> tuple[dict, list[dict], dict]:
    from offpolicy.config import load_config
    from offpolicy.learner.backends.torch_backend import TorchBackend

    tb = TorchBackend(load_config(None, overrides(family, *extra)))
    before = {k: v.clone() for k, v in tb.weights()}
    groups, adv = batch()
    stats = [tb.train_step(groups, adv) for _ in range(STEPS)]
    return before, stats, dict(tb.weights())


@pytest.mark.parametrize("family,extra", [("llama", ()), ("qwen2", ()), ("llama", ("learner.megatron.packing=false",))],
                         ids=["llama-packed", "qwen2-packed", "llama-padded"])
def test_tp1_matches_the_torch_backend(runs, family, extra):
    before, stats, after = _torch_backend(family)
    mg = runs(family, 1, *extra)
    assert set(mg["before"]) == set(before)
    for k in before:  # HF -> Megatron -> HF is exact
        assert torch.equal(mg["before"][k], before[k]), k
    for a, b in zip(mg["stats"], stats):
        assert_stats_close(a, b)
    for k in after:
        assert torch.allclose(mg["after"][k], after[k], atol=1e-4), k
    assert mg["hf_config"]["model_type"] == family


@pytest.mark.parametrize("family,extra", [
    # slow (~18 s each): the default suite runs GPT-OSS's ep2 layout (test_megatron_gpt_oss)
    pytest.param("llama", ("learner.megatron.tp=2",), marks=pytest.mark.slow),
    pytest.param("llama", ("learner.megatron.pp=2",), marks=pytest.mark.slow),  # qwen2-pp2 also splits stages
    # two processes, no model parallelism: DP=2 with the distributed optimizer
    pytest.param("llama", (), marks=pytest.mark.slow),
    pytest.param("qwen2", ("learner.megatron.pp=2",), marks=pytest.mark.slow),  # tied embeddings across stages
    pytest.param("qwen3", ("learner.megatron.tp=2", "learner.megatron.max_tokens_per_gpu=24"), marks=pytest.mark.slow),
    # sequence parallel on the local spec: our norms' grads summed over TP, micro-batches padded to even lengths
    pytest.param("llama", ("learner.megatron.tp=2", "learner.megatron.sequence_parallel=true"),
                 marks=pytest.mark.slow),
], ids=["llama-tp2", "llama-pp2", "llama-dp2", "qwen2-pp2", "qwen3-tp2-budget", "llama-tp2-sp"])
def test_two_process_layouts_match_tp1(runs, family, extra):
    ref, got = runs(family, 1), runs(family, 2, *extra)
    # under a token budget the micro-batches add the gradients in another order, and Adam turns float32 rounding
    # of near-zero gradients into up to 2e-5 of a 2e-2 update (qwen3-tp2-budget, measured: losses agree to 1e-7)
    budget = any(e.startswith("learner.megatron.max_tokens_per_gpu") for e in extra)
    assert_runs_match(ref, got, atol=5e-5 if budget else 1e-5)


def test_packed_token_budget_equals_padded_micro_batches(runs):
    """Packing under a token budget regroups the rows (first fit, no padding) yet gives the padded
    path's losses, gradients and updates: whole-batch denominators make micro-batch losses add up."""
    budget = ("learner.megatron.max_tokens_per_gpu=24",)
    assert_runs_match(runs("llama", 1, "learner.megatron.packing=false"), runs("llama", 1, *budget))


def test_local_spec_norms_are_ours_and_marked_for_sequence_parallel():
    """Every torch norm of the local spec becomes `norms.Norm`, equal to torch's RMSNorm, its weight marked."""
    from types import SimpleNamespace

    from megatron.core.models.gpt import gpt_layer_specs as specs
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    from offpolicy.learner.backends.megatron.kernels import norms

    spec = norms.with_norms(specs.get_gpt_layer_local_spec(normalization="RMSNorm", qk_layernorm=True))
    sub = spec.submodules
    assert sub.input_layernorm is norms.Norm and sub.pre_mlp_layernorm is norms.Norm
    attn = sub.self_attention.submodules
    assert attn.q_layernorm is norms.Norm and attn.k_layernorm is norms.Norm
    assert WrappedTorchNorm.__name__ not in repr(spec)
    assert norms.block_spec(spec, 3).layer_norm is norms.Norm
    cfg = SimpleNamespace(normalization="RMSNorm", sequence_parallel=True)
    n = norms.Norm(cfg, 8, eps=1e-6)
    torch.nn.init.normal_(n.weight)
    ref = torch.nn.RMSNorm(8, eps=1e-6)
    ref.weight.data.copy_(n.weight.data)
    x = torch.randn(5, 2, 8)
    assert torch.equal(n(x), ref(x)) and n.weight.sequence_parallel
    ln = norms.Norm(SimpleNamespace(normalization="LayerNorm", sequence_parallel=False), 8)
    assert torch.allclose(ln(x), torch.nn.functional.layer_norm(x, (8,))) and not ln.bias.sequence_parallel


# llama is slow: its mapping is test_tp1_matches_the_torch_backend[llama-*]'s, and `offpolicy verify` runs it end to end
# in test_offpolicy_verify_fails_past_the_tolerance; qwen2 (tp 1) and qwen3 (tp 2) pass it here
@pytest.mark.parametrize("family,tp", [pytest.param("llama", 1, marks=pytest.mark.slow), ("qwen2", 1), ("qwen3", 2)])
def test_offpolicy_verify_passes_on_a_tiny_random_model(tmp_path, family, tp):
    import subprocess
    import sys

    from offpolicy.config import ModelConfig
    from offpolicy.models.build import build_model
    from tests.megatron_workers import TINY, free_port

    build_model(ModelConfig(arch=dict(TINY[family])), torch.device("cpu")).save_pretrained(tmp_path)
    code = shimmed("offpolicy.services.cli")
    cmd = [sys.executable, "-c", code, "verify", "--model", str(tmp_path), "--device", "cpu", "--tp", str(tp)]
    if tp > 1:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(tp), "--master-port",
               str(free_port()), "--no-python", *cmd]
    env = {**os.environ, "MASTER_PORT": str(free_port())}  # not 29500: test runs side by side
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stdout + out.stderr[-3000:]
    assert "PASS" in out.stdout and "top-1 agreement      1.0000" in out.stdout


def test_offpolicy_verify_fails_past_the_tolerance(tmp_path):
    import subprocess
    import sys

    from offpolicy.config import ModelConfig
    from offpolicy.models.build import build_model
    from tests.megatron_workers import TINY, free_port

    build_model(ModelConfig(arch=dict(TINY["llama"])), torch.device("cpu")).save_pretrained(tmp_path)
    code = shimmed("offpolicy.services.cli")
    out = subprocess.run([sys.executable, "-c", code, "verify", "--model", str(tmp_path), "--device", "cpu",
                          "--max-diff", "0"], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "MASTER_PORT": str(free_port())})
    assert out.returncode == 1 and "FAIL" in out.stdout, out.stdout + out.stderr[-3000:]


@pytest.mark.parametrize("world,extra,fmt", [
    # tp1 is slow: test_megatron_adam.py::test_fused_adam_steps_and_resumes_like_foreach[one-rank] runs the same two
    # default-config runs (fused Adam, dist format: save after step 0, resume) with the same checks, against foreach
    pytest.param(1, (), "dist", marks=pytest.mark.slow),
    pytest.param(2, ("learner.megatron.tp=2",), "dist", marks=pytest.mark.slow),
    pytest.param(1, (), "per_rank", marks=pytest.mark.slow),  # test_a_per_rank_checkpoint_* cover the format
    pytest.param(2, ("learner.megatron.tp=2",), "per_rank", marks=pytest.mark.slow),
], ids=["tp1", "tp2", "tp1-per-rank", "tp2-per-rank"])
def test_checkpoint_resume_equals_uninterrupted_training(runs, tmp_path, world, extra, fmt):
    """Step 1 of a backend restored from the checkpoint after step 0 equals step 1 of an uninterrupted run.
    The checkpoint is written in `fmt` and loaded with the default knob: the format on disk decides."""
    ckpt = tmp_path / "ckpt"
    first = spawn(world, overrides("llama", *extra, f"learner.megatron.checkpoint_format={fmt}"), 1,
                  str(tmp_path / "a.pt"), save=str(ckpt))
    resumed = spawn(world, overrides("llama", *extra), 1, str(tmp_path / "b.pt"), load=str(ckpt))
    ref = runs("llama", 1)
    ranks = sorted(p.name for p in ckpt.glob("rank*.pt"))
    if fmt == "dist":  # Megatron's distributed checkpoint (test_megatron_dist_checkpoint.py: other layouts)
        assert ranks == [] and (ckpt / "offpolicy_megatron.json").exists() and (ckpt / "metadata.json").exists()
    else:
        assert ranks == [f"rank{r:05d}.pt" for r in range(world)] and (ckpt / "layout.json").exists()
    assert_stats_close(first["stats"][0], ref["stats"][0])
    for k in ref["after"]:
        assert torch.equal(resumed["before"][k], first["after"][k]), k  # the weights come back exactly
    assert_stats_close(resumed["stats"][0], ref["stats"][1])  # and so does the optimizer state: same next step
    for k in ref["after"]:
        assert torch.allclose(resumed["after"][k], ref["after"][k], atol=1e-5), k


KL = ("algo.kl_loss_coef=0.5", "algo.kl_loss_type=k2")


@pytest.mark.slow  # two backends' runs (~27 s); the KL terms' math is checked in test_algorithms_variants
def test_kl_loss_to_the_frozen_reference_matches_the_torch_backend(runs):
    """Step 0 trains away from the reference, so step 1's KL term is non-zero; it, the loss and the update
    equal the torch backend's; PP=2 (the reference runs its own forward-only pipeline pass) equals TP=1."""
    _, stats, after = _torch_backend("llama", *KL)
    mg, pp2 = runs("llama", 1, *KL), runs("llama", 2, "learner.megatron.pp=2", *KL)
    assert stats[0]["kl_loss"] == pytest.approx(0.0, abs=1e-9) and stats[1]["kl_loss"] > 1e-4
    for got in (mg, pp2):
        for a, b in zip(got["stats"], stats):
            assert_stats_close(a, b, keys=("loss", "pg_loss", "kl_loss", "grad_norm", "approx_kl"))
        for k in after:
            assert torch.allclose(got["after"][k], after[k], atol=1e-4), k
