"""What the benchmarks share: the machine description every result carries, free ports, a median, timing
on a device, stopping a process group, number formatting and writing `<out>/<name>.json` and `<out>/<name>.md`.
Nothing here imports torch at module level, so `offpolicy bench --help` stays instant."""

from __future__ import annotations

import json
import os
import platform
import signal
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path



def machine() -> dict:
    """Where a result was measured: host, CPU, cores, memory, /dev/shm, GPU (if torch sees one)."""
    info = {"host": socket.gethostname(), "python": platform.python_version(), "cpu": _cpu_model(),
            "cores": os.cpu_count(), "mem_gib": round(_meminfo("MemTotal") / 2**20, 1),
            "shm_gib": round(_shm_bytes() / 2**30, 1), "platform": platform.platform()}
    if "torch" in sys.modules:
        import torch

        info["torch"] = torch.__version__
        if torch.cuda.is_available():
            p = torch.cuda.get_device_properties(0)
            info["gpu"] = f"{torch.cuda.device_count()} x {p.name} ({p.total_memory / 2**30:.0f} GiB)"
    return info


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except FileNotFoundError:
        pass
    return platform.processor()


def _meminfo(key: str) -> int:
    """A /proc/meminfo field in KiB (0 where there is none)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1])
    except FileNotFoundError:
        pass
    return 0


def _shm_bytes() -> int:
    try:
        st = os.statvfs("/dev/shm")
    except FileNotFoundError:
        return 0
    return st.f_bavail * st.f_frsize


def free_port() -> int:
    """A port free to listen on, below the kernel's ephemeral range (`plumbing.ports`)."""
    from offpolicy.plumbing.ports import free_ports

    return free_ports(1)[0]


def median(xs: list[float]) -> float:
    return float(statistics.median(xs))


def git_commit() -> str:
    """The repository commit the code came from ('' outside a git checkout)."""
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=5,
                             cwd=Path(__file__).resolve().parent)
    except (FileNotFoundError, subprocess.TimeoutExpired):
        return ""
    return out.stdout.strip() if out.returncode == 0 else ""


def envelope(name: str, command: list[str], result: dict) -> dict:
    """A result with the benchmark's name, the command that made it, the machine and the time."""
    return {"bench": name, "command": " ".join(["offpolicy", "bench", name, *command]), "machine": machine(),
            "commit": git_commit(), "unix_time": round(time.time(), 1), **result}


def write(out_dir: str | os.PathLike, name: str, doc: dict, markdown: str) -> tuple[Path, Path]:
    """Write `<out>/<name>.json` and `<out>/<name>.md` (the table under the command and machine)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    js, md = out / f"{name}.json", out / f"{name}.md"
    js.write_text(json.dumps(doc, indent=2) + "\n")
    m = doc["machine"]
    where = f"{m['cpu']}, {m['cores']} cores, {m['mem_gib']} GiB" + (f", {m['gpu']}" if "gpu" in m else "")
    md.write_text(f"`{doc['command']}` on {where}\n\n{markdown}\n")
    return js, md


def sync(device) -> None:
    """Wait for `device`'s queued work (a no-op on a CPU)."""
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn, device, repeat: int) -> list[float]:
    """Seconds of each of `repeat` calls of `fn`, the device synchronized around each."""
    out = []
    for _ in range(repeat):
        sync(device)
        t0 = time.perf_counter()
        fn()
        sync(device)
        out.append(time.perf_counter() - t0)
    return out


def stop_group(proc: subprocess.Popen, grace_s: float) -> None:
    """SIGTERM the process group `proc` leads (started with start_new_session=True, so its children go too),
    SIGKILL it if it outlives `grace_s`. A group with no process left is already stopped."""
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    except ProcessLookupError:
        proc.wait()


def fmt(x: float, digits: int = 3) -> str:
    """A number for a table: thousands separators for large values, `digits` significant ones otherwise."""
    if x >= 1000:
        return f"{x:,.0f}"
    return f"{x:.{digits}g}"
