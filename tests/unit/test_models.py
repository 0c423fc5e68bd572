"""offpolicy.weights.models: an MXFP4 GPT-OSS checkpoint loads into the torch backend's transformers model
dequantized to model.dtype, to exactly the values of offpolicy.weights.mxfp4.dequantize."""

import pytest
import torch

from offpolicy.config import ModelConfig
from offpolicy.weights import mxfp4
from offpolicy.weights.models import build_model, checkpoint_tensors
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
