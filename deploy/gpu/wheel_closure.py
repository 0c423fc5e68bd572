"""The wheels a package set needs beyond what a target machine already has: a name-level closure.

    python deploy/gpu/wheel_closure.py --have HAVE.txt --req REQ.txt --skip a,b --dest DIR

HAVE.txt is the target's `pip list --format=freeze`; REQ.txt holds requirement lines (extras and version specifiers
as pip reads them). Each requirement not in HAVE (by normalized name) nor in --skip is downloaded with --no-deps for
CPython 3.12 on manylinux x86_64, and its own Requires-Dist (markers evaluated for that target, the extras asked for)
join the queue. A name-level closure, not a resolver: a package the target has is taken as it is, whatever version a
dependent asks for (the target's torch, transformers and numpy are the ones the GPU wheels were built against).
Prints every package fetched and every one that could not be.
"""

from __future__ import annotations

import argparse
import glob
import re
import subprocess
import sys
import zipfile

from packaging.markers import default_environment
from packaging.requirements import Requirement

PLATFORMS = ("manylinux_2_34_x86_64 manylinux_2_31_x86_64 manylinux_2_28_x86_64 manylinux_2_27_x86_64 "
             "manylinux_2_26_x86_64 manylinux_2_24_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 "
             "manylinux_2_5_x86_64 manylinux1_x86_64 linux_x86_64 any").split()
TARGET = dict(python_version="3.12", python_full_version="3.12.3", platform_machine="x86_64", sys_platform="linux",
              platform_system="Linux", implementation_name="cpython", platform_python_implementation="CPython")


def norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def download(spec: str, dest: str) -> str | None:
    """The wheel file pip fetched (or found already in dest) for `spec`, or None."""
    before = set(glob.glob(f"{dest}/*.whl"))
    cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:", "--python-version", "3.12",
           "--implementation", "cp", "--abi", "cp312", "--abi", "abi3", "--abi", "none", "-d", dest, spec]
    for p in PLATFORMS:
        cmd += ["--platform", p]
    subprocess.run(cmd, capture_output=True, text=True)
    new = set(glob.glob(f"{dest}/*.whl")) - before
    if new:
        return new.pop()
    name = norm(Requirement(spec).name)
    have = [w for w in before if norm(w.rsplit("/", 1)[-1].split("-")[0]) == name]
    return have[0] if have else None


def requires(wheel: str, extras: set[str]) -> list[Requirement]:
    env = {**default_environment(), **TARGET}
    with zipfile.ZipFile(wheel) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        lines = z.read(meta).decode(errors="replace").splitlines()
    out = []
    for line in lines:
        if line.startswith("Requires-Dist:"):
            r = Requirement(line.split(":", 1)[1].strip())
            if r.marker is None or any(r.marker.evaluate({**env, "extra": e}) for e in extras or {""}):
                out.append(r)
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--have", required=True, help="the target's `pip list --format=freeze`")
    p.add_argument("--req", required=True, help="requirement lines to close over")
    p.add_argument("--skip", default="", help="comma-separated names left out (and not followed)")
    p.add_argument("--dest", required=True)
    a = p.parse_args()
    have = {norm(re.split(r"==| @ ", line)[0]) for line in open(a.have) if line.strip() and not line.startswith("#")}
    skip = {norm(x) for x in a.skip.split(",") if x}
    todo = [Requirement(line.split("#")[0].strip()) for line in open(a.req) if line.split("#")[0].strip()]
    done: set[str] = set()
    failed = []
    while todo:
        r = todo.pop()
        name = norm(r.name)
        if name in done or name in have or name in skip:
            continue
        done.add(name)
        spec = r.name + (f"[{','.join(sorted(r.extras))}]" if r.extras else "") + str(r.specifier)
        wheel = download(spec, a.dest)
        if wheel is None:
            failed.append(spec)
            continue
        print(f"  {wheel.rsplit('/', 1)[-1]}", flush=True)
        todo += requires(wheel, set(r.extras))
    print(f"{len(done) - len(failed)} wheels in {a.dest}" + (f"; not found: {', '.join(failed)}" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
