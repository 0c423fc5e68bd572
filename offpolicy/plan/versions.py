"""A weight version's costs: the sharded publish, the learner's stall and slowdown for it, the rollouts' load.

What the product does (docs/weights.md "Sharded publish", docs/benchmarks.md "Sharded publish (issue 32)"): after
each step every learner rank snapshots its own pieces of the model (the learner's only stall) and writes them
into its node's /dev/shm in a background thread while the next step trains (`weights.overlap_publish`); rank 0
commits and announces the version once every piece is written. The shapes of the formulas (every constant is a
calibration entry, calibration.yaml, each with the run it was measured in):

- bytes a rank writes: the version split evenly over the learner's GPUs on one node (shards.py gives each
  parameter to the replica and group member with the fewest bytes so far); over several nodes only data-parallel
  replica 0 writes (its tp x pp ranks hold the dense part, ep x etp x pp the experts);
- write (`write_s`): `weights.publish.sharded.fixed_s` + the longer of the busiest rank's bytes over one GPU's
  device-to-host copy (`...gpu_gbps`) and the busiest node's bytes over the node's host write rate (`...node_gbps`;
  several ranks of a node share it), plus, for low-bit versions, quantizing the rank's experts on its GPU
  (`...encode_gbps`, bf16 bytes). The path `none` (no `weights.reuse_files`) writes every version into fresh pages
  (`...fresh_gbps` for the node); `sha256` hashes each rank's bytes on its writer thread (`relay.sha256_gbps`; rank
  0's hashing of files several ranks wrote is not modelled);
- stall (`stall_s`): the snapshot, the rank's bytes at `...snapshot_gbps`;
- slowdown: the step that runs while a version is written takes `learner.publish_slowdown` x the seconds it
  overlaps the write longer (the copies share the GPU and the host's memory with it);
- fresh pages: the store recycles keep + 2 sets of shard files and page-locks a file on its second sighting, so
  the first `FRESH_VERSIONS` = 2 x (weights.keep + 2) versions of a run are written (`...fresh_gbps`) and read by
  the torch engine (`weights.load.fresh_gbps`) at the fresh-page rates; the planner plans the steady state after
  them, the calibration runs (short bench runs) are mostly inside them;
- load (`load`): per engine. torch: the whole version on each server's GPU at the registered-maps rate
  (`weights.load.maps`), read in the background into the spare weights (`rollout.double_buffer`, on when the GPU
  holds the copy): the swap waits only for what the read has left. vLLM: in place (`vllm.load.inplace_gbps`,
  `rollout.vllm.load_method` auto; MXFP4 versions too on a server of one GPU, their experts written into the running
  Triton kernels by offpolicy, priced as a bf16 in-place load: not yet measured apart) or a rebuild
  (`vllm.load.rebuild_gbps`, MXFP4 versions: `vllm.load.rebuild_mxfp4_gbps`), the proof included, a stall of the
  server; SGLang: each GPU its share at `sglang.load_gbps` (measured at TP1 on one H200), a stall; with MXFP4 experts
  the same at TP1 (offpolicy's loader, `rollout.sglang.mxfp4_load`), else a new engine per version
  (`sglang.restart_s` more: SGLang cannot load a sharded MXFP4 GPT-OSS version into a running engine, docs/sglang.md).
  Staged (`stage`, the engines' own rule, `rollout/engines/gpu_room.py`): vLLM's in-place load and SGLang's from
  tensors read ahead by offpolicy's reader while the server generates (`weights.stage.device_gbps` onto the GPU,
  `...host_gbps` into page-locked host memory); the swap then takes the staged tensors (`vllm.load.staged_device_gbps`,
  `...staged_host_gbps`, `sglang.load.staged_device_gbps`). `direct` stages nothing: at the load each vLLM worker, or
  SGLang's daemon for its engine, reads the whole version onto the GPU a window at a time (`vllm.load.direct_gbps`,
  `sglang.load.direct_gbps`, a stall). Both engines' `auto` stages on the GPU where the version and the reserve fit in
  half of the memory beside the server ((1 - mem_fraction) of the GPU), else reads `direct`; beside a learner vLLM's
  reads the files, SGLang's `direct`. A `device` that does not fit loads from the files (vLLM) or `direct` (SGLang),
  as the engines do.
"""

from __future__ import annotations

from dataclasses import dataclass

from offpolicy.config import WeightsConfig
from offpolicy.plan.calibration import Calibration
from offpolicy.plan.costs import sglang_load_s
from offpolicy.plan.hardware import Cluster
from offpolicy.plan.memory import LearnerLayout, RolloutServerSpec
from offpolicy.plan.shapes import Shape
from offpolicy.rollout.engines.gpu_room import AUTO_DEVICE_SHARE, fits

FRESH_VERSIONS = 2 * (WeightsConfig().keep + 2)  # versions of a run written into fresh pages (docs above)
LOAD_METHODS = ("auto", "inplace", "rebuild")
STAGES = {"vllm": ("auto", "hash", "host", "device", "direct"), "sglang": ("auto", "disk", "device", "direct"),
          "torch": ("auto",)}


def version_bytes(shape: Shape, expert_bits: float = 16.0) -> float:
    """One version in the format the rollouts serve: bf16, experts at `expert_bits` (4.25: MXFP4 with scales)."""
    return shape.weight_bytes(expert_bits) if expert_bits < 16 else float(shape.version_bytes())


@dataclass(frozen=True)
class Writers:
    """Who writes a version: ranks writing, the busiest rank's bytes (and bf16 expert bytes it quantizes), the
    busiest node's bytes."""
    ranks: int
    rank_bytes: float
    rank_expert_bf16: float
    node_bytes: float


def writers(shape: Shape, lay: LearnerLayout, cluster: Cluster, expert_bits: float = 16.0) -> Writers:
    """The sharded publish's split of a version over the learner's ranks (shards.py, module doc)."""
    total = version_bytes(shape, expert_bits)
    experts = shape.expert_params * min(expert_bits, 16.0) / 8
    dense = total - experts
    low = 2 * shape.expert_params if expert_bits < 16 else 0.0
    if lay.gpus <= cluster.gpus_per_node:
        ranks = lay.gpus
        return Writers(ranks, total / ranks, low / ranks, total)
    dense_ranks, expert_ranks = lay.tp * lay.pp, lay.ep * lay.etp * lay.pp  # replica 0 only
    ranks = max(dense_ranks, expert_ranks)
    rank = dense / dense_ranks + experts / expert_ranks
    return Writers(ranks, rank, low / expert_ranks, rank * min(ranks, cluster.gpus_per_node))


def publish(shape: Shape, lay: LearnerLayout | None, cluster: Cluster, cal: Calibration, path: str = "fast",
            expert_bits: float = 16.0) -> dict[str, float]:
    """Seconds of one version's publish: `write` (in the background), `fresh` (the same into fresh pages),
    `stall` (the learner's snapshot). `lay` None: the torch learner, one process writing the whole version
    through the weight store (the weights benchmark's line of `path`)."""
    total = version_bytes(shape, expert_bits)
    fresh_rate = cal.get("weights.publish.sharded.fresh_gbps") * 1e9
    snap = cal.get("weights.publish.sharded.snapshot_gbps") * 1e9
    if lay is None:
        write = cal.get(f"weights.publish.{path}.fixed_s") + total / (cal.get(f"weights.publish.{path}.gbps") * 1e9)
        return {"write": write, "fresh": max(write, total / fresh_rate), "stall": total / snap, "rank_bytes": total}
    w = writers(shape, lay, cluster, expert_bits)
    fixed = cal.get("weights.publish.sharded.fixed_s")
    gpu = cal.get("weights.publish.sharded.gpu_gbps") * 1e9
    encode = w.rank_expert_bf16 / (cal.get("weights.publish.sharded.encode_gbps") * 1e9)
    if path == "sha256":
        gpu = min(gpu, cal.get("relay.sha256_gbps") * 1e9)
    steady = fixed + max(w.rank_bytes / gpu, w.node_bytes / (cal.get("weights.publish.sharded.node_gbps") * 1e9))
    fresh = fixed + max(w.rank_bytes / gpu, w.node_bytes / fresh_rate)
    write = fresh if path == "none" else steady
    return {"write": write + encode, "fresh": fresh + encode, "stall": w.rank_bytes / snap, "rank_bytes": w.rank_bytes}


def slowed_train_s(train_s: float, overlap_s: float, slowdown: float) -> float:
    """A step of `train_s` seconds alone that starts while a write has `overlap_s` seconds left: it runs at
    1 - slowdown of its speed while the write lasts (`learner.publish_slowdown`), so it takes slowdown x the
    seconds they overlap longer (all of the step's seconds when the write outlasts it)."""
    if overlap_s <= 0 or slowdown <= 0:
        return train_s
    speed = max(1e-9, 1.0 - slowdown)
    return train_s + slowdown * min(overlap_s, train_s / speed)


def load_method(srv: RolloutServerSpec) -> str:
    """How a server loads a version: `prefetch` (torch, double buffer), `inplace` or `rebuild` (vLLM; MXFP4 experts
    in place too, each worker's part written into the Triton kernels by offpolicy, `rollout/engines/vllm/kernels.py`),
    `stall` (SGLang into the running engine; MXFP4 experts by offpolicy's loader on one GPU,
    `rollout.sglang.mxfp4_load`) or `restart` (SGLang with MXFP4 experts sharded over GPUs: a new engine per
    version)."""
    if srv.engine == "torch":
        return "prefetch"
    if srv.engine == "vllm":
        return srv.load if srv.load != "auto" else "inplace"
    whole = srv.tp == 1 and srv.ep == 1  # one GPU holds the experts whole: offpolicy writes MXFP4 ones in place
    return "stall" if srv.expert_bits >= 16 or whole else "restart"


def staged(shape: Shape, srv: RolloutServerSpec, gpu_bytes: float | None = None, colocated: bool = False) -> str:
    """Where a server stages each version ahead of its load: "device", "host", "direct" (nothing staged: the files read
    onto the GPU a window at a time at the load, by vLLM's workers or SGLang's daemon) or "" (it reads the files).
    `gpu_bytes`: the server's GPU memory (None: unknown, nothing staged on it, as vLLM's auto does); `colocated`: the
    server shares its GPUs with the learner (either engine's auto stages nothing there and reads direct)."""
    if srv.stage not in STAGES[srv.engine]:
        raise ValueError(f"stage {srv.stage!r} for {srv.engine}: use one of {', '.join(STAGES[srv.engine])} (vLLM: "
                         "rollout.vllm.prefetch, stream not priced: unmeasured on a GPU; SGLang: "
                         "rollout.sglang.prefetch; auto: the engine's default)")
    if load_method(srv) not in ("inplace", "stall"):
        return ""  # rebuilt (vLLM, MXFP4) and restarted (SGLang, MXFP4) versions are not staged; torch reads its own
    if srv.stage in ("hash", "disk"):
        return ""
    if srv.stage in ("host", "direct"):
        return srv.stage
    if srv.stage == "auto" and colocated:
        return "direct"  # either engine's auto beside a learner stages nothing: the load reads the files onto the GPU
    beside = None if gpu_bytes is None else (1 - srv.mem_fraction) * gpu_bytes
    share = AUTO_DEVICE_SHARE if srv.stage == "auto" else 1.0
    if beside is not None and fits(version_bytes(shape, srv.expert_bits), beside, share):
        return "device"
    # vLLM's auto and SGLang's auto or device read direct where the GPU holds no staged copy; vLLM's device the files
    return "direct" if srv.stage == "auto" or srv.engine == "sglang" else ""


def load(shape: Shape, srv: RolloutServerSpec, cal: Calibration, gpu_bytes: float | None = None,
         colocated: bool = False) -> dict[str, float | bool | str]:
    """A rollout server's load of a version: `seconds` (steady state), `fresh` (the first FRESH_VERSIONS),
    `background` (True: read ahead while generating: the swap waits for what is left of the read), `swap` (what the
    swap itself takes after a read ahead: the staged tensors into the server), `staged` (`staged`)."""
    size = version_bytes(shape, srv.expert_bits)
    how = load_method(srv)
    if how == "prefetch":
        steady = cal.get("weights.load.maps.fixed_s") + size / (cal.get("weights.load.maps.gbps") * 1e9)
        return {"seconds": steady, "fresh": max(steady, size / (cal.get("weights.load.fresh_gbps") * 1e9)),
                "background": True, "swap": 0.0, "staged": ""}
    where = staged(shape, srv, gpu_bytes, colocated)
    if where == "direct":  # vLLM: each worker reads the whole version onto its GPU (its loaders cut its share);
        # SGLang: the daemon reads it onto the engine's first GPU, whence every rank takes its share: no / tp either way
        s = size / (cal.get(f"{srv.engine}.load.direct_gbps") * 1e9)
        return {"seconds": s, "fresh": s, "background": False, "swap": 0.0, "staged": where}
    if where:
        read = size / (cal.get(f"weights.stage.{where}_gbps") * 1e9)  # each worker stages the whole version
        key = f"vllm.load.staged_{where}_gbps" if srv.engine == "vllm" else "sglang.load.staged_device_gbps"
        swap = size / srv.tp / (cal.get(key) * 1e9)
        return {"seconds": read, "fresh": read, "background": True, "swap": swap, "staged": where}
    if how in ("inplace", "rebuild"):
        key = "vllm.load.inplace_gbps" if how == "inplace" else (
            "vllm.load.rebuild_gbps" if srv.expert_bits >= 16 else "vllm.load.rebuild_mxfp4_gbps")
        s = size / srv.tp / (cal.get(key) * 1e9)  # TP > 1: each worker its share (assumed, measured at TP1)
        return {"seconds": s, "fresh": s, "background": False, "swap": 0.0, "staged": ""}
    s = sglang_load_s(size, srv.tp, cal) + (cal.get("sglang.restart_s") if how == "restart" else 0.0)
    return {"seconds": s, "fresh": s, "background": False, "swap": 0.0, "staged": ""}
