"""A learner on two "nodes" that writes versions through the sharded publish's store code, without Megatron.

`PartsWriter(roots, run, formats)` spawns two gloo ranks, rank k on learner node k with its store under
`roots[k]`; each builds a `ShardWriter` (weights/sharded.py) with `node_of=[0, 1]`, so every version is
committed as each node's part, `<format's store>/node<k>/v<N>`, exactly as a Megatron learner on two
nodes commits it. `write(v)` has both ranks write version `v` of their own tensors (`tensors(rank, v)`:
seeded, 2-D, so fp8 quantizes them) and returns once every node committed its part. The tests of the
relay use it to stand two learner nodes on one machine in seconds (`pytest -k sharded_publish`).
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

SHAPE = (256, 256)  # float32: 256 KiB a tensor (one a file: several files in each node's part)
PER_RANK = 3


def tensors(rank: int, version: int, shape: tuple[int, int] = SHAPE) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * version + rank)
    return {f"model.layers.{rank * PER_RANK + i}.mlp.down_proj.weight": torch.randn(shape, generator=g)
            for i in range(PER_RANK)}


def _rank(rank: int, port: int, roots: list[str], run: str, fmts: list[str], ctl: str, checksum: str,
          shape: tuple[int, int]) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    from offpolicy.config import WeightsConfig
    from offpolicy.weights import fastpath
    from offpolicy.weights.sharded import ShardWriter

    shard_bytes = shape[0] * shape[1] * 4 + 44_000  # one tensor a file
    w = fastpath.resolve(WeightsConfig(root=roots[rank], keep=3, shard_bytes=shard_bytes, checksum=checksum,
                                       formats=[f for f in fmts if f != "native"], fp8_block_size=(64, 64)), gpu=False)
    writer = ShardWriter(w, run, rank=rank, world=2, node=rank, node_of=[0, 1], root=roots[rank])
    ctl_dir = Path(ctl)
    while True:
        while not any(ctl_dir.glob("go*")) and not (ctl_dir / "stop").exists():
            time.sleep(0.02)
        if (ctl_dir / "stop").exists():
            break
        v = int(next(ctl_dir.glob("go*")).name[2:])
        dist.barrier()  # both ranks saw the order before rank 0 takes it back
        pieces = [(name, None, t, (rank * PER_RANK + i,))
                  for i, (name, t) in enumerate(tensors(rank, v, shape).items())]
        error = ""
        try:
            writer.begin(v, fmts, pieces, {"model_type": "llama"}).wait()
        except Exception as e:  # rank 0 sees every rank's failure
            error = f"{type(e).__name__}: {e}"
        dist.barrier()
        if rank == 0:
            (ctl_dir / f"go{v}").unlink()
            (ctl_dir / f"done{v}").write_text(error)
        dist.barrier()
    dist.destroy_process_group()


class PartsWriter:
    def __init__(self, roots: list[str], run: str, fmts: list[str], ctl: Path, checksum: str = "none",
                 shape: tuple[int, int] = SHAPE):
        from tests import fresh_processes
        from tests.conftest import free_ports

        self.ctl = ctl
        ctl.mkdir(parents=True, exist_ok=True)
        self.ctx = fresh_processes.spawn(_rank, (free_ports(1)[0], roots, run, fmts, str(ctl), checksum, shape),
                                         nprocs=2, join=False)

    def write(self, version: int, timeout: float = 120) -> None:
        (self.ctl / f"go{version}").touch()
        done = self.ctl / f"done{version}"
        deadline = time.monotonic() + timeout
        while not done.exists():
            assert time.monotonic() < deadline, f"version {version} was not written in {timeout}s"
            assert all(p.is_alive() for p in self.ctx.processes), "a writer rank died"
            time.sleep(0.02)
        error = done.read_text()
        assert not error, error

    def close(self) -> None:
        (self.ctl / "stop").touch()
        deadline = time.monotonic() + 30
        for p in self.ctx.processes:
            p.join(max(0.1, deadline - time.monotonic()))
            if p.is_alive():
                p.kill()
                p.join()


def parts(roots: list[str], run: str, version: int) -> list[Path]:
    """Each learner node's part directory of `version` of store `run` (`<run>/node<k>/v<N>`)."""
    return [Path(r) / run / f"node{k}" / f"v{version}" for k, r in enumerate(roots)]

