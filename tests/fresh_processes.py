"""Fresh processes for the multi-process tests, without paying their imports again each time.

`spawn(fn, args, nprocs, join)` is `torch.multiprocessing.spawn`'s: `nprocs` new processes, each calling
`fn(rank, *args)`, a failure raised in the parent with the child's traceback. Without CUDA they are forked
from a fork server that has only imported torch, megatron-core, transformers (its model classes and generation
utilities too: the children build models) and the wire's libraries (started by the first call, under that moment's
environment; the imports a child made after it cut from ~2.2 s to ~0.1 s). Nothing has run in it, so
each child is as fresh as a spawned one; it takes this process's environment and stdout/stderr at the call,
as a spawned child would (pytest's capture of the calling test). With CUDA they are spawned: the server's
imports may initialise the driver, which a forked child could not use.
"""

from __future__ import annotations

import multiprocessing
import os

import torch

# third-party only: offpolicy and tests are imported by each child after its environment is set; a module
# that does not import is skipped by the fork server
PRELOAD = ["numpy", "torch", "torch.distributed", "transformers", "safetensors.torch", "megatron.core",
           "megatron.core.parallel_state", "megatron.core.tensor_parallel", "megatron.core.transformer",
           "megatron.core.models.gpt", "megatron.core.optimizer", "megatron.core.distributed",
           "megatron.core.dist_checkpointing", "transformers.modeling_utils", "transformers.generation.utils",
           "transformers.models.auto.modeling_auto", "transformers.models.auto.tokenization_auto", "accelerate", "zmq",
           "msgspec"]


def _as_called(rank: int, parent: int, env: dict[str, str], fn, args: tuple) -> None:
    os.environ.clear()
    os.environ.update(env)
    for fd in (1, 2):  # where the caller's stdout and stderr go now
        try:
            target = os.open(f"/proc/{parent}/fd/{fd}", os.O_WRONLY | os.O_APPEND)
        except OSError:
            continue
        os.dup2(target, fd)
        os.close(target)
    fn(rank, *args)


def spawn(fn, args: tuple = (), nprocs: int = 1, join: bool = True):
    """torch.multiprocessing.spawn(fn, args, nprocs, join); without CUDA, forked from the preloaded fork server."""
    if torch.cuda.is_available():
        return torch.multiprocessing.spawn(fn, args=tuple(args), nprocs=nprocs, join=join)
    multiprocessing.get_context("forkserver").set_forkserver_preload(PRELOAD)
    return torch.multiprocessing.start_processes(_as_called, args=(os.getpid(), dict(os.environ), fn, tuple(args)),
                                                 nprocs=nprocs, join=join, start_method="forkserver")
