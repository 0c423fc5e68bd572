"""The Megatron learner's compiled elementwise kernels: each module keeps its functions in a dict, which its
`compile_*` function (backend start-up, learner.megatron.compile, GPU only) fills with torch.compile'd ones and
marks "compiled"; before each call the token dims are marked dynamic, so that one graph serves every
micro-batch (`tokens_dynamic`)."""

from __future__ import annotations

import torch


def tokens_dynamic(kernels: dict, *dims: tuple[torch.Tensor | None, int]) -> None:
    """Mark each (tensor, its token dim) dynamic before a call of `kernels`' functions; a no-op while they are
    eager, and for None."""
    if "compiled" in kernels:
        for t, dim in dims:
            if t is not None:
                torch._dynamo.maybe_mark_dynamic(t, dim)
