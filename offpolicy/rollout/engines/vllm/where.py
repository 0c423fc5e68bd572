"""Where a vLLM worker stages a version (`rollout.vllm.prefetch`, `resolve`) for its in-place reload (`staging.py`).

"hash" stages nothing (vLLM's reload reads the files; only the proof's hash of the files runs ahead); "host" a buffer
of host memory, page-locked with CUDA where the worker has a GPU; "stream" the same host buffer, and at the load each
tensor is copied to the GPU just before the reload takes it (`stream`: vLLM's loaders then slice and permute GPU
tensors; a layer's tensors at a time on the GPU, not the whole version); "device" a buffer on the worker's GPU (a
full copy of the version beside the server's own weights and KV cache: leave room for it in
`rollout.vllm.gpu_memory_utilization`); "direct" stages nothing and hashes nothing ahead: at the load offpolicy's
reader reads the files onto the GPU a window of tensors at a time as the reload takes them, each hashed for the proof
as it passes (`staging.windows`, `staging.HashedAsRead`: the files read once; vLLM's loaders then slice and permute
GPU tensors, with no staged copy held; GPT-OSS's loaders permute each expert tensor with `.contiguous()`, on the host
when vLLM reads the files itself);
"auto" is "device" on a GPU worker when the version and DEVICE_RESERVE fit in AUTO_DEVICE_SHARE of the GPU's memory
free beside the server, else "direct" (a version not staged ahead, without `rollout.double_buffer` or not asked ahead,
is read "direct" too: staging it at the load would read it and then copy it; `worker._offpolicy_staged`), and "hash"
on a CPU (where the staging would be one more copy in the same memory, read by the cores that generate; the engine
sends "direct" where the rollout shares a learner GPU, `engine.prefetch_setting`). Never "host" by itself. vLLM's
in-place load is fastest from the GPU ("device"), then from page-locked host memory ("host"), then "direct", and slowest
where vLLM reads the files itself ("hash") (measured: docs/vllm.md, "Staged loads"). Every worker of a server stages the
whole version (vLLM's loaders cut each worker's share out of it)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from offpolicy.rollout.engines.gpu_room import AUTO_DEVICE_SHARE, DEVICE_RESERVE, fits

if TYPE_CHECKING:
    import torch

SETTINGS = ("auto", "hash", "host", "stream", "device", "direct")


def resolve(setting: str, device: torch.device, nbytes: int, free: int | None) -> tuple[str, str]:
    """Where a version of `nbytes` is staged on a worker of `device` (`free`: bytes of its GPU free beside the server,
    counting a staging buffer the worker holds there already) under `rollout.vllm.prefetch` = `setting`: "hash",
    "host", "device" or "direct", and why."""
    if setting not in SETTINGS:
        raise ValueError(f"rollout.vllm.prefetch is {setting!r}: use one of {', '.join(SETTINGS)}")
    if setting == "stream":
        return "host", "rollout.vllm.prefetch=stream: each tensor copied to the GPU as the reload takes it"
    if setting == "direct":
        return "direct", "rollout.vllm.prefetch=direct: read onto the device a window at a time as the reload takes it"
    if setting != "auto":
        return setting, "rollout.vllm.prefetch"
    if device.type != "cuda":
        return "hash", "auto: the server runs on the CPU, where a staged copy would share memory and cores with it"
    gib = nbytes / 2**30
    if free is None or not fits(nbytes, free, AUTO_DEVICE_SHARE):
        room_said = "unknown" if free is None else f"{free / 2**30:.2f} GiB"
        return "direct", (f"auto: {gib:.2f} GiB and a {DEVICE_RESERVE / 2**30:.0f} GiB reserve would take more than "
                          f"{AUTO_DEVICE_SHARE:.0%} of the GPU's free memory ({room_said}), so nothing is staged: the "
                          "files are read onto the device a window at a time at the load (on an H200 3.5x faster than "
                          "vLLM's own read of GPT-OSS)")
    return "device", f"auto: {gib:.2f} GiB on the GPU, where the reload's copies are device to device"


def stream(tensors, device: torch.device):
    """(name, tensor) of `tensors` (staged in host memory) each copied to `device` as it is taken (asynchronous from
    page-locked memory, on the current stream: the reload's use of it comes after)."""
    for name, t in tensors:
        yield name, t.to(device, non_blocking=True)
