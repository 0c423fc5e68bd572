"""The optimizer on the host (learner.megatron.optimizer_offload) on a GPU: pinned staging, overlapped copies on
their own CUDA streams, the host step, the copy back into the parameter buffer; against the optimizer on the GPU.

The same bf16 model, bf16 gradient buffers and no clipping as the CPU test (tests/unit/test_megatron_offload.py):
the two optimizers then do the same float32 arithmetic up to the kernels' rounding, so the updates after three steps
agree to a few % of their norm and the losses to 1e-3."""

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
              pytest.mark.usefixtures("fresh_parallel_state")]
pytest.importorskip("megatron.core", reason="megatron-core is not installed")

from tests.megatron_workers import overrides, spawn  # noqa: E402

BF16 = ("learner.device=cuda", "model.dtype=bfloat16", "learner.grad_clip=0",
        "learner.megatron.grad_reduce_in_fp32=false")


@pytest.mark.parametrize("family,extra", [("llama", ()), ("gpt_oss", ("learner.megatron.experts=grouped",))])
def test_offload_on_a_gpu_trains_as_the_optimizer_on_it(tmp_path, family, extra):
    gpu = spawn(1, overrides(family, *BF16, *extra), 3, str(tmp_path / "gpu.pt"))
    host = spawn(1, overrides(family, *BF16, *extra, "learner.megatron.optimizer_offload=1.0"), 3,
                 str(tmp_path / "host.pt"))
    assert sum(int((gpu["after"][k] != gpu["before"][k]).sum()) for k in gpu["after"]) > 0
    worst = max(float((gpu["after"][k].float() - host["after"][k].float()).abs().max()) for k in gpu["after"])
    differ = sum(int((gpu["after"][k] != host["after"][k]).sum()) for k in gpu["after"])
    total = sum(v.numel() for v in gpu["after"].values())
    moved = {k: gpu["after"][k].float() - gpu["before"][k].float() for k in gpu["after"]}
    apart = sum(float(((host["after"][k].float() - gpu["after"][k].float()) ** 2).sum()) for k in moved) ** 0.5
    norm = sum(float((m ** 2).sum()) for m in moved.values()) ** 0.5
    losses = [(a["loss"], b["loss"]) for a, b in zip(gpu["stats"], host["stats"], strict=True)]
    seen = (f"losses (gpu, host) {losses}; {differ} of {total} weights differ, by {worst:.3g} at most; the host's "
            f"updates differ from the GPU's by {apart / norm:.3g} of their norm")
    # the host's AdamW (CPU kernel) and the GPU's round the float32 update alike up to an ulp of the fp32 master;
    # bf16 weights show it where it crosses a rounding boundary (on H200: 6% and 14% of the weights, by <= 0.002
    # after 3 steps of lr 1e-2), and the next steps' gradients carry it on. So the updates agree in norm, not bit
    # for bit: a missing, doubled or misplaced update is far outside 5% of it
    assert apart <= 0.05 * norm and worst <= 2 ** -7, seen
    for a, b in losses:
        assert a == pytest.approx(b, rel=1e-3), seen
