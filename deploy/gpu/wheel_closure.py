"""The wheels a package set needs beyond what a target machine already has: a name-level closure.

    python deploy/gpu/wheel_closure.py [--have HAVE.txt] [--req REQ.txt] [--skip a,b] --dest DIR [--site SITE] [REQ ...]

HAVE.txt is the target's `pip list --format=freeze`; REQ.txt and the REQ arguments hold requirement lines (extras and
version specifiers as pip reads them). Everything asked for there is downloaded with --no-deps for CPython 3.12 on
manylinux x86_64 (the GPU image's Python; PLATFORMS below is the one list of platform tags), even where the target
has that name: an explicit line carries its own copy (e.g. the transformers a server pins, shadowing the image's on
that server's PYTHONPATH). Its Requires-Dist (markers evaluated for that target, the extras asked for) are followed
breadth-first, so a top-level package's own pins win over a looser requirement deeper down; a dependency that the
target has (by normalized name) or that --skip names is not fetched nor followed. A name-level closure, not a
resolver: a package the target has is taken as it is, whatever version a dependent asks for (the target's torch,
transformers and numpy are the ones the GPU wheels were built against), and the first version fetched of a name
stays; each such mismatch is printed as a note to judge. --site installs the fetched wheels (--no-deps, for the
same target) into one directory. Prints every package fetched and every one that could not be; exits 1 if any.
"""

from __future__ import annotations

import argparse
import collections
import glob
import os
import re
import subprocess
import sys
import zipfile

from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.version import InvalidVersion, Version

PLATFORMS = ("manylinux_2_34_x86_64 manylinux_2_31_x86_64 manylinux_2_28_x86_64 manylinux_2_27_x86_64 "
             "manylinux_2_26_x86_64 manylinux_2_24_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 "
             "manylinux_2_5_x86_64 manylinux1_x86_64 linux_x86_64 any").split()
TARGET = dict(python_version="3.12", python_full_version="3.12.3", platform_machine="x86_64", sys_platform="linux",
              platform_system="Linux", implementation_name="cpython", platform_python_implementation="CPython")
# pip's options that pick wheels for that target (download and install alike)
PIP_TARGET = ["--only-binary=:all:", "--python-version", "3.12", "--implementation", "cp",
              "--abi", "cp312", "--abi", "abi3", "--abi", "none"] + [a for p in PLATFORMS for a in ("--platform", p)]


def norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def wheel_name_version(path: str) -> tuple[str, str]:
    name, version = os.path.basename(path).split("-")[:2]
    return norm(name), version


def download(r: Requirement, dest: str) -> str | None:
    """The wheel pip fetched (or found already in dest) for `r`: the highest version there that `r` admits."""
    spec = r.name + (f"[{','.join(sorted(r.extras))}]" if r.extras else "") + str(r.specifier)
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", *PIP_TARGET, "-d", dest, spec],
                   capture_output=True, text=True)
    found = []
    for w in glob.glob(f"{dest}/*.whl"):
        name, version = wheel_name_version(w)
        try:
            if name == norm(r.name) and r.specifier.contains(Version(version), prereleases=True):
                found.append((Version(version), w))
        except InvalidVersion:
            continue
    return max(found)[1] if found else None


def requires(wheel: str, extras: set[str]) -> list[Requirement]:
    """The wheel's Requires-Dist whose markers hold on the target with any of `extras` (or none)."""
    env = {**default_environment(), **TARGET}
    with zipfile.ZipFile(wheel) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        lines = z.read(meta).decode(errors="replace").splitlines()
    out = []
    for line in lines:
        if line.startswith("Requires-Dist:"):
            r = Requirement(line.split(":", 1)[1].strip())
            if r.marker is None or any(r.marker.evaluate({**env, "extra": e}) for e in extras | {""}):
                out.append(r)
    return out


def admits(r: Requirement, version: str) -> bool:
    try:
        return r.specifier.contains(Version(version), prereleases=True)
    except InvalidVersion:
        return True


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--have", help="the target's `pip list --format=freeze` (without it, every dependency is fetched)")
    p.add_argument("--req", help="a file of requirement lines to close over")
    p.add_argument("--skip", default="", help="comma-separated names left out (and not followed)")
    p.add_argument("--dest", required=True, help="where the wheels go (wheels already there are reused)")
    p.add_argument("--site", help="pip install the fetched wheels (--no-deps) into this directory for the target")
    p.add_argument("reqs", nargs="*", metavar="REQ", help="more requirement lines")
    a = p.parse_args()
    have = {}
    for line in open(a.have) if a.have else []:
        if line.strip() and not line.startswith("#"):
            name, sep, version = (re.split(r"(==| @ )", line.strip(), maxsplit=1) + ["", ""])[:3]
            have[norm(name)] = version if sep == "==" else ""
    skip = {norm(x) for x in a.skip.split(",") if x}
    lines = [line.split("#")[0].strip() for line in open(a.req)] if a.req else []
    todo = collections.deque((Requirement(x), True) for x in lines + a.reqs if x)  # (requirement, asked for)
    os.makedirs(a.dest, exist_ok=True)
    got: dict[str, tuple[str, str, set[str]]] = {}  # name -> (version, wheel, extras followed)
    failed, notes = [], []
    while todo:
        r, asked = todo.popleft()
        name = norm(r.name)
        if name in skip:
            continue
        if name in got:
            version, wheel, extras = got[name]
            if wheel and not admits(r, version):
                notes.append(f"{r.name}: {version} fetched first; a dependent asks {r}")
            if wheel and set(r.extras) - extras:  # follow the extras this requirement adds
                extras |= set(r.extras)
                todo.extend((d, False) for d in requires(wheel, set(r.extras)))
            continue
        if name in have and not asked:
            if have[name] and not admits(r, have[name]):
                notes.append(f"{r.name}: the target's {have[name]} kept; a dependent asks {r}")
            continue
        wheel = download(r, a.dest)
        if wheel is None:
            failed.append(str(r))
            got[name] = ("", "", set(r.extras))
            continue
        got[name] = (wheel_name_version(wheel)[1], wheel, set(r.extras))
        print(f"  {os.path.basename(wheel)}", flush=True)
        todo.extend((d, False) for d in requires(wheel, set(r.extras)))
    wheels = [w for _, w, _ in got.values() if w]
    print(f"{len(wheels)} wheels in {a.dest}" + (f"; not found: {', '.join(failed)}" if failed else ""))
    for n in dict.fromkeys(notes):
        print(f"  note: {n}")
    if failed:
        return 1
    if a.site:
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-compile", "--target", a.site,
                        *PIP_TARGET, *sorted(wheels)], check=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
