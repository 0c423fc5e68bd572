"""source.HFSource: tensors and single rows of a safetensors directory, and MXFP4 GPT-OSS checkpoints
dequantized to the training dtype exactly (against offpolicy.weights.mxfp4 and transformers' own
dequantization); other quantized checkpoints refused. No megatron-core needed."""

import json

import pytest
import torch

from offpolicy.learner.backends.megatron.source import HFSource
from offpolicy.models.build import checkpoint_tensors
from offpolicy.weights import mxfp4
from tests.megatron_workers import random_gpt_oss, write_mxfp4


def test_reads_tensors_and_rows_of_a_bf16_directory(tmp_path):
    model = random_gpt_oss()
    model.save_pretrained(tmp_path)
    src, state = HFSource(str(tmp_path)), checkpoint_tensors(model)
    assert not src.mxfp4
    for name, t in state.items():
        assert torch.equal(src.get(name), t), name
    e = "model.layers.2.mlp.experts.gate_up_proj"
    assert torch.equal(src.get(e, row=3), state[e][3])
    with pytest.raises(KeyError, match="not in the checkpoint"):
        src.get("model.layers.9.mlp.router.weight")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mxfp4_experts_come_back_dequantized_exactly(tmp_path, dtype):
    tmx = pytest.importorskip("transformers.integrations.mxfp4")
    model = random_gpt_oss()
    written = write_mxfp4(model, tmp_path)
    assert "model.layers.0.mlp.experts.gate_up_proj_blocks" in written
    src = HFSource(str(tmp_path), dtype=dtype)
    assert src.mxfp4
    for name, t in checkpoint_tensors(model).items():
        got = src.get(name)
        if not mxfp4.is_expert_weight(name):
            assert torch.equal(got, t), name  # biases, router, attention, embeddings: as saved
            continue
        blocks, scales = written[name + "_blocks"], written[name + "_scales"]
        ours = mxfp4.dequantize(blocks, scales, dtype).transpose(1, 2)
        theirs = tmx.convert_moe_packed_tensors(blocks, scales, dtype=dtype)  # transformers' own
        assert got.dtype == dtype and got.shape == t.shape
        assert torch.equal(got, ours) and torch.equal(got, theirs), name
        assert torch.equal(src.get(name, row=1), got[1])  # one expert, read alone
        assert not torch.equal(got.float(), t.float())  # a lossy format: the test sees the dequantized values


def test_other_quantized_checkpoints_are_refused(tmp_path):
    model = random_gpt_oss()
    model.save_pretrained(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "fp8", "weight_block_size": [128, 128]}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="quant_method 'fp8'.*bf16 checkpoint"):
        HFSource(str(tmp_path))
