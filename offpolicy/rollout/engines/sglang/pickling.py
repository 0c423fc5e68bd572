"""How offpolicy pickles tensors for SGLang's `update_weights_from_tensor` (its `serialized_named_tensors`).

SGLang 0.5.14 pickles them with the multiprocessing pickler and torch's reductions (`MultiprocessingSerializer`,
`utils/common.py:2339-2361`), after `monkey_patch_torch_reductions` (`utils/patch_torch.py:41-74`) replaced torch's
`reduce_tensor` in the whole process with one that names a CUDA tensor's device by UUID: it rewrites the 7th of the
reduction's arguments, which a CPU tensor's reduction does not have, so once the patch is in (SGLang's scheduler, or
offpolicy's staged loads: `staged._request`) every CPU tensor pickled in that process raises IndexError. The fingerprint
proof's request is a CPU tensor (an empty one whose name is the request: `fingerprint_proof.serialized`). `pickled`
takes a CUDA tensor by the reduction in force (patched or not) and a CPU tensor by torch's own, whatever patch is in.
"""

from __future__ import annotations

import io
from typing import Any


def pickled(obj: Any) -> bytes:
    """`obj` pickled as SGLang's MultiprocessingSerializer does (what its SafeUnpickler reads back), CPU tensors by
    torch's own reduction even where SGLang's device-UUID patch is in."""
    from multiprocessing.reduction import ForkingPickler

    import torch
    from torch.multiprocessing import reductions  # registers torch's reductions with ForkingPickler

    buf = io.BytesIO()
    pickler = ForkingPickler(buf)
    original = getattr(reductions, "_reduce_tensor_original", None)  # set by SGLang's patch
    if original is not None:
        in_force = reductions.reduce_tensor

        def reduce(t: torch.Tensor):
            return (in_force if t.is_cuda else original)(t)

        for cls in (torch.Tensor, torch.nn.Parameter):
            pickler.dispatch_table[cls] = reduce
    pickler.dump(obj)
    return buf.getvalue()
