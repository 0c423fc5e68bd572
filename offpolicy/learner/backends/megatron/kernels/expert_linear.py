"""The row-parallel linear of local-spec experts with biases (GPT-OSS), trainable at ep = etp = 1.

megatron-core 0.16-0.19's expert MLP adds the router-weighted fc2 bias to fc2's output in place
(`output += output_bias * per_token_scale`, transformer/mlp.py). When the experts are neither
expert- nor expert-tensor-parallel (ep = etp = 1) that output comes from a size-1 reduce
(`_ReduceFromModelParallelRegion` or the sequence-parallel reduce-scatter) that hands its input back
as a view, and autograd refuses the in-place add in training ("Output 0 of
_ReduceFromModelParallelRegion is a view and is being modified inplace"). `ExpertRowParallelLinear`
returns a copy in exactly that case (expert, bias, no explicit expert communication); every other
linear, and every other layout, runs megatron-core's RowParallelLinear unchanged. Imports megatron:
import it only where the model is built.
"""

from __future__ import annotations

from megatron.core.tensor_parallel import RowParallelLinear


class ExpertRowParallelLinear(RowParallelLinear):
    def forward(self, input_):
        output, bias = super().forward(input_)
        if self.is_expert and bias is not None and not self.explicit_expert_comm:
            output = output.clone()  # not a view of a size-1 reduce: the expert MLP adds its bias in place
        return output, bias
