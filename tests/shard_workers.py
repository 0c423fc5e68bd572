"""Process bodies for the sharded-publish tests: Megatron learner ranks on CPU (gloo, the CPU shim).

`spawn_publish(world, overrides, root, formats, versions)` starts `world` spawned ranks of a learner
backend; rank 0 publishes `versions` versions through the sharded path (`MegatronBackend.publish`: every
rank writes its own pieces) with a train step between two, and compares each against today's gathered
path (`backend.weights()` encoded by `formats.encode`), tensor by tensor, bit for bit, and its
config.json; it returns what it found (mismatches, the files' writers). `nodes` gives each rank a node
name (OFFPOLICY_NODE) and `roots` each node's store root, standing in for several machines on one.
`kill_rank` SIGKILLs that rank in the middle of writing its pieces of version `versions - 1`.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

import torch

from tests import fresh_processes
from tests.megatron_workers import batch, free_port

RUN = "run"


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def compare(root: str, version: int, gathered: dict, hf_config: dict, fmts: list[str],
            fp8_block: tuple[int, int] | str = "auto") -> dict:
    """Each format's published version against formats.encode of the gathered tensors (fp8 block `auto`: the one
    the learner resolves weights.fp8_block_size auto to, from the same shapes)."""
    import json

    from offpolicy.weights import formats
    from offpolicy.weights.formats import store_run
    from offpolicy.weights.store import version_dir
    from offpolicy.weights.version import WeightVersion

    out = {}
    for fmt in fmts:
        want, config = formats.encode(fmt, gathered.items(), hf_config, fp8_block)
        want = dict(want)
        path = version_dir(root, store_run(RUN, fmt), version)
        with WeightVersion(path, verify=True) as wv:
            got = {k: v.clone() for k, v in wv.tensors.items()}
            files = sorted(n for n in wv.manifest.files if n.endswith(".safetensors"))
        bad = sorted(k for k in want if k in got and (got[k].dtype != want[k].dtype or got[k].shape != want[k].shape
                                                         or not torch.equal(bits(got[k]), bits(want[k]))))
        out[fmt] = dict(missing=sorted(set(want) - set(got)), extra=sorted(set(got) - set(want)), differ=bad,
                        config=json.loads((path / "config.json").read_text()) == json.loads(json.dumps(config)),
                        files=files)
    return out


def _rank(rank: int, world: int, port: int, args: list[str], roots: list[str], nodes: list[str], fmts: list[str],
          versions: int, out: str, kill_rank: int) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port), OFFPOLICY_NODE=nodes[rank])
    torch.set_num_threads(1)
    from tests.megatron_cpu_shim import install

    install()
    from offpolicy.config import load_config
    from offpolicy.learner.backends import make_backend
    from offpolicy.weights import fastpath

    node = sorted(set(nodes), key=nodes.index).index(nodes[rank])
    root = roots[node]
    low = [f for f in fmts if f != "native"]
    cfg = load_config(None, args + ["learner.backend=megatron", f"weights.root={root}",
                                    f"weights.formats=[{', '.join(low)}]", "weights.checksum=sha256"])
    w = fastpath.resolve(cfg.weights, gpu=False)
    backend = make_backend(cfg)
    if rank == kill_rank:
        from offpolicy.weights import sharded

        fill, last = sharded.ShardWriter._fill, versions - 1

        def dying(self, fmt, version, lay, encoded, *rest):  # this rank dies half-way through its writes
            if version == last:
                os.kill(os.getpid(), signal.SIGKILL)
            return fill(self, fmt, version, lay, encoded, *rest)

        sharded.ShardWriter._fill = dying
    if rank != 0:
        backend.serve()
        torch.distributed.destroy_process_group()
        return
    groups, adv = batch()
    results, writers = [], {}
    for v in range(versions):
        gathered = {k: t.clone() for k, t in backend.weights()}
        try:
            backend.publish(v, fmts, w, RUN).wait()
        except Exception as e:  # a killed peer: the version must not be there
            results.append(dict(error=f"{type(e).__name__}: {e}"))
            _save(dict(results=results, writers=writers), out)
            os._exit(0)  # the dead rank cannot take part in a clean shutdown
        # several nodes: no store holds the version whole; the test puts the parts together
        results.append(compare(root, v, gathered, backend.hf_config(), fmts, cfg.weights.fp8_block_size)
                       if len(set(nodes)) == 1 else {})
        writers = {f: [list(p.writers) for p in lay.files] for f, lay in backend.writer.layouts.items()}
        # each format's tensors written in row pieces (name -> first rows), e.g. by each TP rank
        rows = {f: {n: sorted(r for m, r in lay.where if m == n) for n, r in lay.where if r >= 0}
                for f, lay in backend.writer.layouts.items()}
        results[-1]["gathered"] = gathered
        if v + 1 < versions:
            backend.train_step(groups, adv)
    _save(dict(results=results, writers=writers, rows=rows, hf_config=backend.hf_config()), out)
    backend.close()
    torch.distributed.destroy_process_group()


def _save(obj, out: str) -> None:
    torch.save(obj, out + ".tmp")
    os.rename(out + ".tmp", out)  # whole or absent: the killed-rank test polls for it


def spawn_publish(world: int, args: list[str], roots: list[str], fmts: list[str], out: str, versions: int = 2,
                  nodes: list[str] | None = None, kill_rank: int = -1) -> dict:
    nodes = nodes or ["node0"] * world
    ctx = fresh_processes.spawn(_rank, (world, free_port(), args, roots, nodes, fmts, versions, out, kill_rank),
                                nprocs=world, join=False)
    if kill_rank < 0:
        while not ctx.join():
            pass
    else:  # the killed rank fails the join; wait for rank 0's verdict, then end the others
        import time

        deadline = time.monotonic() + 300
        while not Path(out).exists() and time.monotonic() < deadline:
            time.sleep(0.5)
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
            p.join()
    return torch.load(out, weights_only=False)
