"""megatron-core on the CPU with gloo: what the Megatron learner needs where there is no CUDA.

`install_if_cpu(learner.device)` is called by every entry point that builds a Megatron model (the
learner daemon's every rank, `offpolicy verify`) before megatron-core is imported, when the device is
"cpu" (or "auto" on a machine without CUDA); on a GPU it does nothing. So `offpolicy run
configs/gptoss-tiny.yaml` runs on a CPU machine with no PYTHONPATH and no test code.

megatron-core assumes CUDA in a few places: `torch.cuda.current_device()` as a device, tensors made
with `device="cuda"` in its schedules, DDP buffers and optimizer, `.cuda()` calls, `param.type() == "torch.cuda.FloatTensor"` checks, CUDA RNG state in
its RNG tracker, `torch.cuda.synchronize`/streams/events (the MoE alltoall dispatcher synchronizes on a
recorded event), the offloaded optimizer's split of its parameters by `is_cuda`, the MoE router's reference to TE's `te_general_gemm` (undefined without TE), and the
alltoall dispatcher's split sizes (moved to host as numpy only when they are CUDA tensors). `install()` redirects those to the CPU:
a TorchFunctionMode rewrites any CUDA `device=` argument to "cpu", `Tensor.cuda` returns the tensor,
and the CUDA RNG state is a stand-in tensor (dropout is 0 in these tests). It is process-global and idempotent; call it before
building a Megatron model in a test process. Torch function modes are thread-local, so threads started
after `install()` (the learner daemon trains in `asyncio.to_thread`) enter the mode too.
`shimmed(entry)` is the `python -c` program that installs the shim and then runs a console entry
point, for tests that start a daemon or `offpolicy verify` as a subprocess. The model's arithmetic is
unchanged: only placement is. It is process-global: never install it in a process that uses CUDA.
"""

from __future__ import annotations

import contextlib
import threading

import torch
from torch.overrides import TorchFunctionMode

_installed = False


def _cpu(device):
    if isinstance(device, int) or (isinstance(device, str) and device.startswith("cuda")):
        return torch.device("cpu")
    if isinstance(device, torch.device) and device.type == "cuda":
        return torch.device("cpu")
    return device


class _CudaToCpu(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if "device" in kwargs:
            kwargs["device"] = _cpu(kwargs["device"])
        if func in (torch.Tensor.to,) and args and len(args) > 1 and not isinstance(args[1], torch.dtype):
            args = (args[0], _cpu(args[1]), *args[2:])
        return func(*args, **kwargs)


class _NullStream:
    def __init__(self, *a, **k):
        pass

    def wait_stream(self, *a, **k):
        pass

    def synchronize(self):
        pass

    def record_event(self, *a, **k):
        return _NullStream()  # an "event" the MoE alltoall dispatcher can .synchronize()

    def wait(self, *a, **k):  # an event's wait (the offloaded optimizer's copy back)
        pass


def install() -> None:
    """Redirect megatron-core's CUDA assumptions to the CPU for this process."""
    global _installed
    if _installed:
        return
    _installed = True
    torch.cuda.current_device = lambda: "cpu"
    torch.cuda.device_count = lambda: 0
    torch.cuda.synchronize = lambda *a, **k: None
    torch.cuda.current_stream = lambda *a, **k: _NullStream()
    torch.cuda.default_stream = lambda *a, **k: _NullStream()
    torch.cuda.Stream = _NullStream
    torch.cuda.Event = _NullStream
    torch.cuda.stream = lambda *a, **k: contextlib.nullcontext()
    from megatron.core.tensor_parallel import random as mrandom

    fake = {"state": torch.get_rng_state()}  # a stand-in "CUDA" RNG state; the CPU generator is untouched

    def set_state(state, *a, **k):
        fake["state"] = state.clone()

    mrandom._get_cuda_rng_state = lambda *a, **k: fake["state"].clone()
    mrandom._set_cuda_rng_state = set_state
    torch.cuda.get_rng_state = mrandom._get_cuda_rng_state
    torch.cuda.set_rng_state = set_state
    torch.cuda.manual_seed = lambda seed: None
    torch.cuda.manual_seed_all = lambda seed: None
    torch.Tensor.cuda = lambda self, *a, **k: self
    plain_type = torch.Tensor.type

    def cuda_type(self, dtype=None, *args, **kwargs):  # its optimizers test param.type() == "torch.cuda..."
        if dtype is None and not args and not kwargs:
            name = plain_type(self)
            return name if name.startswith("torch.cuda.") else name.replace("torch.", "torch.cuda.", 1)
        return plain_type(self, dtype, *args, **kwargs)

    torch.Tensor.type = cuda_type
    torch.nn.Module.cuda = lambda self, *a, **k: self
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):  # referenced but only defined when TE imports (0.16.1)
        moe_utils.te_general_gemm = None
    from megatron.core.transformer.moe import token_dispatcher

    plain_move = moe_utils.maybe_move_tensor_to_cpu

    def move_to_cpu(tensor, as_numpy=False, record_stream=False):  # the split sizes of all_to_all as numpy
        if torch.is_tensor(tensor) and not tensor.is_cuda and as_numpy:
            return tensor.numpy()
        return plain_move(tensor, as_numpy=as_numpy, record_stream=record_stream)

    moe_utils.maybe_move_tensor_to_cpu = token_dispatcher.maybe_move_tensor_to_cpu = move_to_cpu
    _uneven_collectives()
    _hybrid_optimizer_on_cpu()
    _CudaToCpu().__enter__()  # stays on for the life of the process
    plain_run = threading.Thread.run

    def run_on_cpu(self):
        with _CudaToCpu():
            plain_run(self)

    threading.Thread.run = run_on_cpu


def _uneven_collectives() -> None:
    """NCCL gathers and reduce-scatters lists of tensors of unequal sizes (the alltoall dispatcher does, over the
    expert-TP group, when etp > 1 and its ranks hold different token counts); gloo refuses them. Uneven calls
    run as one collective per rank's part here; even ones go to gloo as before."""
    import torch.distributed as dist

    plain_gather, plain_scatter = dist.all_gather, dist.reduce_scatter

    def src(group, i: int) -> int:
        return i if group is None else dist.get_global_rank(group, i)

    def all_gather(tensor_list, tensor, group=None, async_op=False):
        if async_op or len({t.shape for t in tensor_list}) == 1:
            return plain_gather(tensor_list, tensor, group=group, async_op=async_op)
        me = dist.get_rank(group)
        for i, out in enumerate(tensor_list):
            if i == me:
                out.copy_(tensor)
            dist.broadcast(out, src=src(group, i), group=group)
        return None

    def reduce_scatter(output, input_list, op=dist.ReduceOp.SUM, group=None, async_op=False):
        if async_op or len({t.shape for t in input_list}) == 1:
            return plain_scatter(output, input_list, op=op, group=group, async_op=async_op)
        me = dist.get_rank(group)
        for i, part in enumerate(input_list):
            summed = part.contiguous().clone()
            dist.all_reduce(summed, op=op, group=group)
            if i == me:
                output.copy_(summed)
        return None

    dist.all_gather, dist.reduce_scatter = all_gather, reduce_scatter


def _hybrid_optimizer_on_cpu() -> None:
    """megatron-core's offloaded optimizer (learner.megatron.optimizer_offload) splits its parameters by `is_cuda`
    and pins its host copies: on the CPU every parameter is a "device" one while it splits them (so each gets its
    own fp32 host copy, stepped and copied back as on a GPU: the same arithmetic), and pinning is the identity."""
    try:
        from megatron.core.optimizer.cpu_offloading import hybrid_optimizer
    except ImportError:  # a megatron-core without offload
        return
    hdo = hybrid_optimizer.HybridDeviceOptimizer
    plain_split = hdo._get_sub_optimizer_param_groups

    def split(self, offload_fraction):
        mine = {id(p) for g in self.param_groups for p in g["params"]}
        is_cuda, pin = torch.Tensor.is_cuda, torch.Tensor.pin_memory
        torch.Tensor.is_cuda = property(lambda t: id(t) in mine)
        torch.Tensor.pin_memory = lambda t, *a, **k: t
        try:
            return plain_split(self, offload_fraction)
        finally:
            torch.Tensor.is_cuda, torch.Tensor.pin_memory = is_cuda, pin

    hdo._get_sub_optimizer_param_groups = split


def install_if_cpu(device: str) -> bool:
    """Install the CPU redirection when `device` ("cpu", "cuda", "auto") means the CPU here; True if it did."""
    if device == "cpu" or (device == "auto" and not torch.cuda.is_available()):
        install()
        return True
    return False


def shimmed(entry: str) -> str:
    """`python -c` code: install the shim, then `sys.exit(main(argv))` of module `entry` (e.g. offpolicy.services.cli)."""
    return (f"import sys; from offpolicy.learner.backends.megatron.cpu import install; install(); "
            f"from {entry} import main; sys.exit(main(sys.argv[1:]))")
