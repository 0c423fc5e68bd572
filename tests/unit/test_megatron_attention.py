"""The packed core attention (offpolicy/backends/megatron/attention.py) against megatron-core's own.

On CPU through the test shim, float32, one spawned process per case (megatron's parallel state is
process-global): padded rows and packed documents give megatron-core's unfused DotProductAttention's
outputs and gradients, with grouped-query attention, a sliding window and learnable sinks (the fields
GPT-OSS sets). The flash kernels themselves are held to the same reference on the GPU
(tests/gpu/test_megatron_gpu.py).
"""

import pytest
import torch

pytest.importorskip("megatron.core", reason="megatron-core is not installed (pip install -e '.[megatron]')")

from tests.megatron_workers import attention_case, free_port  # noqa: E402


@pytest.mark.parametrize("softmax_type,window,groups", [
    ("vanilla", None, 2),
    ("learnable", (3, 0), 2),
    ("learnable", None, 4),
    ("off-by-one", (2, 0), 1),
], ids=["gqa", "window-sinks", "sinks", "mqa-window-off-by-one"])
def test_matches_megatron_dot_product_attention(softmax_type, window, groups):
    torch.multiprocessing.spawn(attention_case, args=(free_port(), softmax_type, window, groups), nprocs=1, join=True)


def test_refuses_what_it_does_not_compute():
    torch.multiprocessing.spawn(attention_refusals, args=(free_port(),), nprocs=1, join=True)


def attention_refusals(_rank: int, port: int) -> None:
    from tests.megatron_workers import attention_refusals as body

    body(port)
