"""Devices and clusters for the planner: what a GPU can hold and move, and how the nodes are wired.

A `Device` is one accelerator's datasheet figures (memory, HBM bandwidth, dense bf16 peak, NVLink) plus
the host-device copy rate this project measured (pinned copies on the H200 host, docs/benchmarks.md
"Weights"; H100/H800 share its PCIe Gen5 bus, an assumption said in `source`). A `Cluster` is nodes x
GPUs per node of one device with the node's network bandwidth, host memory and CPU cores. (The CPU runs the planner is
validated on are rebuilt in validate.py from their measured parts, not from a device.)
"""

from __future__ import annotations

from dataclasses import dataclass, replace

GIB = 2**30


@dataclass(frozen=True)
class Device:
    name: str
    mem_gib: float  # usable memory per GPU (what torch can allocate is a little less)
    hbm_gbps: float  # memory bandwidth, GB/s
    peak_tflops: float  # dense bf16 tensor-core peak, TFLOP/s
    nvlink_gbps: float  # NVLink bandwidth per GPU, one direction, GB/s
    pcie_gbps: float  # pinned host <-> device copy, GB/s
    source: str


_PCIE = "pinned D2H/H2D 55.2/55.4 GB/s measured on the H200 host (docs/benchmarks.md, Weights)"
DEVICES = {
    "h100": Device("H100 SXM 80GB", 79.6, 3350, 989, 450, 55.2,
                   f"NVIDIA H100 SXM datasheet (80 GB HBM3 = 81,559 MiB, 3.35 TB/s, 989 TFLOP/s bf16 dense, NVLink "
                   f"900 GB/s both ways); {_PCIE}, the same PCIe Gen5 bus assumed"),
    "h800": Device("H800 SXM 80GB", 79.6, 3350, 989, 200, 55.2,
                   f"as the H100 SXM with NVLink cut to 400 GB/s both ways (NVIDIA H800 datasheet); {_PCIE}, the "
                   "same bus assumed"),
    "h200": Device("H200 SXM 141GB", 140.4, 4800, 989, 450, 55.2,
                   f"143,771 MiB seen by torch (docs/benchmarks.md); 4.8 TB/s, 989 TFLOP/s (NVIDIA H200 datasheet); "
                   f"{_PCIE}"),
}


@dataclass(frozen=True)
class Cluster:
    nodes: int
    gpus_per_node: int
    device: Device
    inter_gbps: float = 50.0  # network bandwidth of one node to another, GB/s (50 = 400 Gb/s)
    host_gib: float = 1024.0  # host memory of a node, GiB (the learner's host optimizer and /dev/shm's versions)
    host_cores: int = 64  # CPU cores of a node, which run the host optimizer's Adam (learner.host_adam_gbps_per_core)

    @property
    def gpus(self) -> int:
        return self.nodes * self.gpus_per_node


def device(name: str, mem_gib: float | None = None) -> Device:
    """A preset by name (h100, h800, h200), optionally with another memory size."""
    try:
        d = DEVICES[name.lower()]
    except KeyError:
        raise ValueError(f"--gpu {name!r}: use one of {', '.join(DEVICES)}") from None
    return replace(d, mem_gib=mem_gib) if mem_gib else d
