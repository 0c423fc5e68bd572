"""The planner's calibration: constants with their sources, read from calibration.yaml.

Each entry has `value`, `unit`, `kind` (measured, derived, public, assumed) and `source` (the
docs/benchmarks.md section, or a public address). `Calibration.get(name)` is how cost models read a
constant; `Calibration.used` remembers which ones a prediction read, so the report can list the
figures behind it and mark the ones that are not this project's measurements.
`from_bench(dir)` re-derives the measured entries from `offpolicy bench` JSONs (weights.json:
publish and load lines; rollout.json: torch-engine step times; transport.json: hub cost per group)
and returns the entries it replaced.
"""

from __future__ import annotations

import json
from pathlib import Path

import msgspec
import yaml

DEFAULT = Path(__file__).with_name("calibration.yaml")
KINDS = ("measured", "derived", "public", "assumed")


class Entry(msgspec.Struct, forbid_unknown_fields=True):
    value: float
    unit: str
    kind: str
    source: str


class Calibration:
    def __init__(self, entries: dict[str, Entry], path: str = ""):
        for name, e in entries.items():
            if e.kind not in KINDS:
                raise ValueError(f"{path}: {name}.kind is {e.kind!r}; use one of {', '.join(KINDS)}")
        self.entries, self.path = dict(entries), path
        self.used: set[str] = set()

    def get(self, name: str) -> float:
        try:
            e = self.entries[name]
        except KeyError:
            raise KeyError(f"calibration {self.path or '(in memory)'} has no entry {name!r}") from None
        self.used.add(name)
        return e.value

    def entry(self, name: str) -> Entry:
        return self.entries[name]

    def replaced(self, **values: float) -> Calibration:
        """A copy with some values replaced (kind 'assumed', source: the command line)."""
        out = dict(self.entries)
        for name, v in values.items():
            old = self.entry(name)
            out[name] = Entry(v, old.unit, "assumed", f"set on the command line (calibration: {old.value:g})")
        return Calibration(out, self.path)

    def dump(self) -> str:
        return yaml.safe_dump({k: msgspec.to_builtins(e) for k, e in self.entries.items()}, sort_keys=False,
                              width=120)


def load(path: str | Path | None = None) -> Calibration:
    p = Path(path) if path else DEFAULT
    raw = yaml.safe_load(p.read_text()) or {}
    try:
        entries = {k: msgspec.convert(v, Entry) for k, v in raw.items()}
    except msgspec.ValidationError as e:
        raise ValueError(f"{p}: {e} (each entry needs value, unit, kind, source)") from None
    return Calibration(entries, str(p))


def _line(points: list[tuple[float, float]]) -> tuple[float, float]:
    """(fixed seconds, GB/s) of the least-squares line seconds = fixed + bytes / rate through (bytes, s)."""
    if len(points) < 2:
        raise ValueError("a rate needs two sizes or more")
    xs, ys = [p[0] / 1e9 for p in points], [p[1] for p in points]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    return max(0.0, my - slope * mx), 1 / slope


def from_bench(directory: str | Path) -> dict[str, Entry]:
    """Entries re-derived from the bench JSONs found in `directory`."""
    d, out = Path(directory), {}
    w = d / "weights.json"
    if w.exists():
        doc = json.loads(w.read_text())
        where = f"{w} ({doc.get('command', '')}; {doc.get('machine', {}).get('gpu', 'no GPU')})"
        rows = doc["rows"]
        modes = {"sha256": "sha256", "none": "none", "fast": "none+reuse+maps"}
        for name, mode in modes.items():
            pts = [(r["bytes"], p["mean_seconds"]) for r in rows for p in r["publish"] if p["mode"] == mode]
            if len(pts) >= 2:
                fixed, rate = _line(pts)
                out[f"weights.publish.{name}.fixed_s"] = Entry(round(fixed, 5), "s", "measured", where)
                out[f"weights.publish.{name}.gbps"] = Entry(round(rate, 3), "GB/s", "measured", where)
        for mode in ("staged", "maps"):
            pts = [(r["bytes"], ld["seconds"]) for r in rows for ld in r.get("loads", []) if ld["mode"] == mode]
            if len(pts) >= 2:
                fixed, rate = _line(pts)
                out[f"weights.load.{mode}.fixed_s"] = Entry(round(fixed, 5), "s", "measured", where)
                out[f"weights.load.{mode}.gbps"] = Entry(round(rate, 3), "GB/s", "measured", where)
    r = d / "rollout.json"
    if r.exists():
        doc = json.loads(r.read_text())
        where = f"{r} ({doc.get('command', '')}; {doc['params_m']}M model, {doc['rows']} rows, {doc['device']})"
        for key, name in (("engine_static", "static"), ("engine_compiled", "static_compile"), ("engine", "dynamic")):
            e = doc["results"].get(key)
            if e and "error" not in e:
                step = round(e["seconds"] / doc["new_tokens"], 6)
                out[f"torch_engine.{name}.step_s"] = Entry(step, "s per decode step", "measured", where)
    t = d / "transport.json"
    if t.exists():
        doc = json.loads(t.read_text())
        recv = [row["hub_receiver_cpu_us_per_group"] for row in doc.get("runs", [])]
        if recv:
            out["hub.group_s"] = Entry(round(min(recv) * 1e-6, 7), "s of hub receive CPU per group", "measured",
                                       f"{t} ({doc.get('command', '')})")
        rates = [row["raw_gb_per_s"] for row in doc.get("runs", []) if row.get("transport") == "tcp"]
        if rates:
            out["relay.stream_gbps"] = Entry(round(rates[0], 3), "GB/s", "measured", f"{t}: raw ZeroMQ over tcp")
    return out
