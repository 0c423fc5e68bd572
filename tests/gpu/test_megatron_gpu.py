"""The megatron backend on one GPU in bfloat16: verify against transformers, and TP=1 vs the torch backend."""

import subprocess
import sys

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
              pytest.mark.usefixtures("fresh_parallel_state")]
pytest.importorskip("megatron.core", reason="megatron-core is not installed")

from tests.megatron_workers import TINY, batch, free_port, overrides, spawn  # noqa: E402


SMALL = dict(TINY["qwen2"], hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=8,
             num_key_value_heads=2, vocab_size=1000)


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_verify_bf16(tmp_path, family):
    from offpolicy.config import ModelConfig
    from offpolicy.models.build import build_model

    arch = dict(SMALL, model_type=family, **({"head_dim": 32} if family == "qwen3" else {}))
    build_model(ModelConfig(arch=arch, dtype="bfloat16"), torch.device("cpu")).save_pretrained(tmp_path)
    out = subprocess.run([sys.executable, "-m", "offpolicy.services.cli", "verify", "--model", str(tmp_path),
                          "--dtype", "bfloat16"], capture_output=True, text=True, timeout=300,
                         env={**__import__("os").environ, "MASTER_PORT": str(free_port())})
    print(out.stdout)
    assert out.returncode == 0, out.stdout + out.stderr[-3000:]


def test_padded_attention_float32_on_cuda():
    """The float32 CUDA kernel (SDPA over padded rows) against the per-document reference, outputs and grads."""
    from offpolicy.learner.backends.megatron.kernels.attention import kernel, padded_attention, reference_attention

    gen = torch.Generator(device="cuda").manual_seed(0)
    lengths = [1, 70, 128, 5, 127, 64, 90, 33] * 8
    bounds = [0]
    for n in lengths:
        bounds.append(bounds[-1] + n)
    q = torch.randn(bounds[-1], 9, 64, device="cuda", generator=gen)
    k, v = (torch.randn(bounds[-1], 3, 64, device="cuda", generator=gen) for _ in "kv")
    assert kernel(q, None) == "padded" and kernel(q.bfloat16(), None) == "flash"
    grad = torch.randn(q.shape, device="cuda", generator=gen)
    torch.set_float32_matmul_precision("highest")  # full float32 products on both sides (the fixture restores it)
    results = []
    for fn in (padded_attention, reference_attention):
        for window in (-1, 32):
            leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
            out = fn(*leaves, bounds, 0.125, window)
            results.append((out, *torch.autograd.grad(out, leaves, grad)))
    for got, want in zip(results[:2], results[2:]):
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-4)


@pytest.mark.parametrize("family,dtype,extra", [
    ("llama", "bfloat16", ()), ("gpt_oss", "bfloat16", ()), ("llama", "float32", ()),
    ("gpt_oss", "bfloat16", ("learner.megatron.fused_adam=false",)),  # torch AdamW's foreach path (fused: default)
], ids=["llama-bf16", "gpt_oss-bf16", "llama-float32", "gpt_oss-bf16-foreach-adam"])
def test_tp1_step_matches_the_torch_backend(family, dtype, extra):
    from offpolicy.config import load_config
    from offpolicy.learner.backends.megatron.backend import MegatronBackend
    from offpolicy.learner.backends.torch_backend import TorchBackend

    import os

    os.environ["MASTER_PORT"] = str(free_port())
    args = overrides(family, f"model.dtype={dtype}", "learner.device=cuda")
    groups, adv = batch()
    tb = TorchBackend(load_config(None, args))
    ref = [tb.train_step(groups, adv) for _ in range(2)]
    mb = MegatronBackend(load_config(None, args + ["learner.backend=megatron", *extra]))
    got = [mb.train_step(groups, adv) for _ in range(2)]
    for a, b in zip(got, ref):
        print({k: (a[k], b[k]) for k in ("loss", "grad_norm", "entropy")})
        assert a["loss"] == pytest.approx(b["loss"], rel=2e-2, abs=2e-3)
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=5e-2)
        assert a["entropy"] == pytest.approx(b["entropy"], rel=1e-2)


def test_kl_reference_and_checkpoint_round_trip_bf16(tmp_path):
    """KL on: the megatron step equals the torch backend's in bf16; a saved checkpoint loaded back into the
    same backend makes the next step repeat exactly (weights and optimizer state restored)."""
    from offpolicy.config import load_config
    from offpolicy.learner.backends.megatron.backend import MegatronBackend
    from offpolicy.learner.backends.torch_backend import TorchBackend

    import os

    os.environ["MASTER_PORT"] = str(free_port())
    args = overrides("llama", "model.dtype=bfloat16", "learner.device=cuda", "algo.kl_loss_coef=0.5",
                     "algo.kl_loss_type=k2")
    groups, adv = batch()
    tb = TorchBackend(load_config(None, args))
    ref = [tb.train_step(groups, adv) for _ in range(2)]
    mb = MegatronBackend(load_config(None, args + ["learner.backend=megatron"]))
    got = [mb.train_step(groups, adv)]
    mb.save_checkpoint(tmp_path)
    got.append(mb.train_step(groups, adv))
    after = {k: v.clone() for k, v in mb.weights()}
    mb.load_checkpoint(tmp_path)
    again = mb.train_step(groups, adv)
    for a, b in zip(got, ref):
        print({k: (a[k], b[k]) for k in ("loss", "kl_loss", "grad_norm")})
        assert a["loss"] == pytest.approx(b["loss"], rel=2e-2, abs=2e-3)
        assert a["kl_loss"] == pytest.approx(b["kl_loss"], rel=5e-2, abs=1e-3)
    assert got[1]["kl_loss"] > 1e-3
    print("repeat after load", again["loss"], got[1]["loss"])
    assert again["loss"] == pytest.approx(got[1]["loss"], rel=1e-6) and again["kl_loss"] == got[1]["kl_loss"]
    for k, v in mb.weights():
        assert torch.allclose(v.float(), after[k].float(), atol=1e-2), k


MOE_SMALL = dict(TINY["qwen3_moe"], hidden_size=256, intermediate_size=512, moe_intermediate_size=128,
                 num_experts=8, num_experts_per_tok=2, num_hidden_layers=4, mlp_only_layers=[], num_attention_heads=8,
                 num_key_value_heads=2, head_dim=32, vocab_size=1000)


@pytest.mark.parametrize("dispatcher", ["alltoall", "allgather"])
def test_verify_qwen3_moe_bf16(tmp_path, dispatcher):
    """Qwen3-MoE (8 experts, top-2) through the SequentialMLP path; both dispatchers (docs/megatron.md, MoE)."""
    from offpolicy.config import ModelConfig
    from offpolicy.models.build import build_model

    build_model(ModelConfig(arch=dict(MOE_SMALL), dtype="bfloat16"), torch.device("cpu")).save_pretrained(tmp_path)
    code = ("import sys; from offpolicy.learner.backends.megatron import arch; plain = arch.moe_config; "
            f"arch.moe_config = lambda *a, **k: plain(*a, **{{**k, 'dispatcher': {dispatcher!r}}}); "
            "from offpolicy.services.cli import main; sys.exit(main(sys.argv[1:]))")
    out = subprocess.run([sys.executable, "-c", code, "verify", "--model", str(tmp_path), "--dtype", "bfloat16"],
                         capture_output=True, text=True, timeout=300,
                         env={**__import__("os").environ, "MASTER_PORT": str(free_port())})
    print(out.stdout)
    assert out.returncode == 0, out.stdout + out.stderr[-3000:]


@pytest.mark.parametrize("dispatcher", ["alltoall", "allgather"])
def test_qwen3_moe_tp1_step_matches_the_torch_backend_bf16(dispatcher):
    """The training path (forward + backward through the experts): where 0.19.2 once raised an in-place view error."""
    from offpolicy.config import load_config
    from offpolicy.learner.backends.megatron.backend import MegatronBackend
    from offpolicy.learner.backends.torch_backend import TorchBackend

    import os

    os.environ["MASTER_PORT"] = str(free_port())
    arch = "{" + ", ".join(f"{k}: {v}" for k, v in MOE_SMALL.items()) + "}"
    args = overrides("qwen3_moe", f"model.arch={arch}", "model.dtype=bfloat16", "learner.device=cuda")
    groups, adv = batch(vocab=MOE_SMALL["vocab_size"])
    tb = TorchBackend(load_config(None, args))
    ref = [tb.train_step(groups, adv) for _ in range(2)]
    mb = MegatronBackend(load_config(None, args + ["learner.backend=megatron",
                                                   f"learner.megatron.moe_token_dispatcher={dispatcher}"]))
    got = [mb.train_step(groups, adv) for _ in range(2)]
    for a, b in zip(got, ref):
        print(dispatcher, {k: (a[k], b[k]) for k in ("loss", "grad_norm", "entropy")})
        assert a["loss"] == pytest.approx(b["loss"], rel=2e-2, abs=2e-3)
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-1)


def _sp_rank(rank: int, world: int, port: int, args: list[str], out: str) -> None:
    """One learner rank of a 2-GPU TP=2 + sequence-parallel run (rank 0 drives 2 steps and saves the stats)."""
    import os

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    from offpolicy.config import load_config
    from offpolicy.learner.backends.megatron.backend import MegatronBackend

    mb = MegatronBackend(load_config(None, args))
    if rank != 0:
        mb.serve()
    else:
        groups, adv = batch(vocab=MOE_SMALL["vocab_size"])
        torch.save([mb.train_step(groups, adv) for _ in range(2)], out)
        mb.close()
    torch.distributed.destroy_process_group()


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_qwen3_moe_tp2_sequence_parallel_step_bf16(tmp_path):
    """Qwen3-MoE TP=2 + SP (local spec, norms.Norm) on 2 GPUs vs the torch backend on one, bf16, 2 steps."""
    from offpolicy.config import load_config
    from offpolicy.learner.backends.torch_backend import TorchBackend

    arch = "{" + ", ".join(f"{k}: {v}" for k, v in MOE_SMALL.items()) + "}"
    args = overrides("qwen3_moe", f"model.arch={arch}", "model.dtype=bfloat16", "learner.device=cuda")
    groups, adv = batch(vocab=MOE_SMALL["vocab_size"])
    tb = TorchBackend(load_config(None, args))
    ref = [tb.train_step(groups, adv) for _ in range(2)]
    del tb
    torch.cuda.empty_cache()
    out = str(tmp_path / "stats.pt")
    mg_args = args + ["learner.backend=megatron", "learner.megatron.tp=2", "learner.megatron.sequence_parallel=true"]
    torch.multiprocessing.spawn(_sp_rank, args=(2, free_port(), mg_args, out), nprocs=2, join=True)
    got = torch.load(out, weights_only=False)
    for a, b in zip(got, ref):
        print("tp2+sp", {k: (a[k], b[k]) for k in ("loss", "grad_norm", "entropy")})
        assert a["loss"] == pytest.approx(b["loss"], rel=2e-2, abs=2e-3)
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-1)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_dist_checkpoint_of_tp2_resumes_at_tp1_bf16(tmp_path):
    """A distributed checkpoint written by a TP=2 learner on 2 GPUs (NCCL, bf16) resumes on 1 GPU at TP=1:
    the weights come back exactly and its step 1 matches an uninterrupted TP=1 run's (bf16 tolerance)."""
    args = overrides(family, "model.dtype=bfloat16", "learner.device=cuda")
    ckpt = str(tmp_path / "ckpt")
    first = spawn(2, args + ["learner.megatron.tp=2"], 1, str(tmp_path / "a.pt"), save=ckpt)
    resumed = spawn(1, args, 1, str(tmp_path / "b.pt"), load=ckpt)
    ref = spawn(1, args, 2, str(tmp_path / "ref.pt"))
    for k in first["after"]:
        assert torch.equal(resumed["before"][k], first["after"][k]), k
    print("tp2 -> tp1 step 1 loss", resumed["stats"][0]["loss"], "uninterrupted tp1", ref["stats"][1]["loss"])
    assert resumed["stats"][0]["loss"] == pytest.approx(ref["stats"][1]["loss"], rel=2e-2, abs=2e-3)
    assert resumed["stats"][0]["grad_norm"] == pytest.approx(ref["stats"][1]["grad_norm"], rel=1e-1)


def test_grad_accum_kernel_equals_torchs_add_on_cuda():
    """grad_accum.accumulate (DDP's float32 main-grad accumulation) on a GPU: torch's float32 sums bit for bit,
    sizes no multiple of its block."""
    from offpolicy.learner.backends.megatron import grad_accum

    for n, dtype in ((5_000_001, torch.bfloat16), (4096, torch.float16), (77, torch.float32)):
        dst = torch.randn(n, device="cuda") * 3
        src = torch.randn(n, device="cuda").to(dtype)
        assert grad_accum.runs(dst, src)
        want = dst.clone().add_(src)
        grad_accum.accumulate(dst, src)
        assert torch.equal(dst, want), (n, dtype)
