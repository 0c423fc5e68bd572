"""offpolicy.models.build: an MXFP4 GPT-OSS checkpoint loads into the torch backend's transformers model
dequantized to model.dtype, to exactly the values of offpolicy.weights.mxfp4.dequantize."""

import pytest
import torch

from offpolicy.config import ModelConfig
from offpolicy.models.build import build_model, checkpoint_tensors, matmul_precision
from offpolicy.weights import mxfp4
from tests.megatron_workers import random_gpt_oss, write_mxfp4


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_build_model_dequantizes_an_mxfp4_checkpoint(tmp_path, dtype):
    model = random_gpt_oss()
    written = write_mxfp4(model, tmp_path)
    loaded = build_model(ModelConfig(path=str(tmp_path), dtype=dtype), torch.device("cpu"))
    want = dict(mxfp4.dequantized_tensors(written.__getitem__, written, loaded.dtype))
    state = checkpoint_tensors(loaded)
    assert set(state) == set(want) and loaded.dtype == getattr(torch, dtype)
    for name, t in state.items():
        assert torch.equal(t, want[name].to(t.dtype)), name
    assert all(p.dtype == loaded.dtype for p in loaded.parameters())  # trainable, not MXFP4 modules


def test_model_tf32_sets_float32_products_on_a_gpu_only():
    """model.tf32 (default on) puts a GPU process's float32 matmuls on TF32 tensor cores; off, or on the CPU,
    products stay full float32. (Setting the precision needs no GPU; it is process-wide, so it is restored.)"""
    before = torch.get_float32_matmul_precision()
    try:
        assert matmul_precision(ModelConfig(), torch.device("cuda")) == "high"
        assert torch.get_float32_matmul_precision() == "high"
        assert matmul_precision(ModelConfig(tf32=False), torch.device("cuda")) == "highest"
        assert matmul_precision(ModelConfig(), torch.device("cpu")) == "highest"
        assert torch.get_float32_matmul_precision() == "highest"
    finally:
        torch.set_float32_matmul_precision(before)
