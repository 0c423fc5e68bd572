"""A vLLM general plugin (entry point `vllm.general_plugins`): keeps every CPU weight a checkable parameter.

On a CPU, vLLM moves each linear layer's weight into a oneDNN handle (or an AMX-packed copy) held by a
closure and leaves an empty parameter behind, so no one can read back what the layer computes with
(`vllm/model_executor/layers/utils.py`, `dispatch_cpu_unquantized_gemm`). With
OFFPOLICY_VLLM_CHECKABLE_WEIGHTS=1 in a vLLM process's environment this plugin turns that packing off
(`vllm._custom_ops._supports_onednn = False`, and the AMX bf16 packing's
`check_cpu_sgl_kernel` answers no), so linear layers run `torch.nn.functional.linear` on their own parameter, and
the engine's weight fingerprint (offpolicy/rollout/engines/fingerprint.py) sees every weight. vLLM loads
plugins in every process it starts; without the variable this does nothing, and GPUs are untouched.
"""

from __future__ import annotations

import os

ENV = "OFFPOLICY_VLLM_CHECKABLE_WEIGHTS"


def register() -> None:
    if os.environ.get(ENV) != "1":
        return
    from vllm.platforms import current_platform

    if current_platform.is_cpu():
        import vllm._custom_ops as ops
        import vllm.model_executor.layers.utils as layer_utils

        ops._supports_onednn = False
        layer_utils.check_cpu_sgl_kernel = lambda n, k, dtype: False
