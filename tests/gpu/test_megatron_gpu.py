"""The megatron backend on one GPU in bfloat16: verify against transformers, and TP=1 vs the torch backend."""

import subprocess
import sys

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
pytest.importorskip("megatron.core", reason="megatron-core is not installed")

from tests.megatron_workers import TINY, batch, free_port, overrides  # noqa: E402


@pytest.fixture(autouse=True)
def fresh_parallel_state():
    """Each test builds its own MegatronBackend in this process: reset Megatron's parallel state after it."""
    yield
    from megatron.core import parallel_state

    parallel_state.destroy_model_parallel()

SMALL = dict(TINY["qwen2"], hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=8,
             num_key_value_heads=2, vocab_size=1000)


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_verify_bf16(tmp_path, family):
    from offpolicy.config import ModelConfig
    from offpolicy.models import build_model

    arch = dict(SMALL, model_type=family, **({"head_dim": 32} if family == "qwen3" else {}))
    build_model(ModelConfig(arch=arch, dtype="bfloat16"), torch.device("cpu")).save_pretrained(tmp_path)
    out = subprocess.run([sys.executable, "-m", "offpolicy.services.cli", "verify", "--model", str(tmp_path),
                          "--dtype", "bfloat16"], capture_output=True, text=True, timeout=300,
                         env={**__import__("os").environ, "MASTER_PORT": str(free_port())})
    print(out.stdout)
    assert out.returncode == 0, out.stdout + out.stderr[-3000:]


def test_tp1_step_matches_the_torch_backend_bf16():
    from offpolicy.backends.megatron.backend import MegatronBackend
    from offpolicy.backends.torch_backend import TorchBackend
    from offpolicy.config import load_config

    import os

    os.environ["MASTER_PORT"] = str(free_port())
    args = overrides("llama", "model.dtype=bfloat16", "learner.device=cuda")
    groups, adv = batch()
    tb = TorchBackend(load_config(None, args))
    ref = [tb.train_step(groups, adv) for _ in range(2)]
    mb = MegatronBackend(load_config(None, args + ["learner.backend=megatron"]))
    got = [mb.train_step(groups, adv) for _ in range(2)]
    for a, b in zip(got, ref):
        print({k: (a[k], b[k]) for k in ("loss", "grad_norm", "entropy")})
        assert a["loss"] == pytest.approx(b["loss"], rel=2e-2, abs=2e-3)
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=5e-2)
        assert a["entropy"] == pytest.approx(b["entropy"], rel=1e-2)


def test_kl_reference_and_checkpoint_round_trip_bf16(tmp_path):
    """KL on: the megatron step equals the torch backend's in bf16; a saved checkpoint loaded back into the
    same backend makes the next step repeat exactly (weights and optimizer state restored)."""
    from offpolicy.backends.megatron.backend import MegatronBackend
    from offpolicy.backends.torch_backend import TorchBackend
    from offpolicy.config import load_config

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
