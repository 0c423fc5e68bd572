"""Held-out pass@k against training minutes for one or more runs (issue 34's picture and table).

    python benchmarks/smollm2_curve.py LABEL=RUN_DIR... [--out docs/smollm2_eval.png]

Each RUN_DIR holds a run's eval.jsonl (the eval daemon's pass@k per version) and metrics.jsonl (the learner's
step log: `time` is seconds since the learner started); a version's minute is when the learner published it
(version 0: minute 0). Prints, per run, the first version at least 20 points above version 0 and the last
version's figures, as markdown; writes the picture with --out (matplotlib).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def curve(run: Path) -> list[tuple[int, float, dict]]:
    """(version, training minutes, pass@k) for every evaluated version, in version order."""
    minutes = {m["version"]: m["time"] / 60 for m in jsonl(run / "metrics.jsonl")}
    minutes[0] = 0.0
    rows = [(e["version"], minutes[e["version"]], e["pass_at_k"]) for e in jsonl(run / "eval.jsonl")
            if "pass_at_k" in e and e["version"] in minutes]
    return sorted(rows, key=lambda r: r[0])


def first_gain(rows: list[tuple[int, float, dict]], points: float = 0.20) -> tuple[int, float, dict] | None:
    """The first version whose pass@1 is `points` above version 0's, or None."""
    base = rows[0][2]["1"]
    return next((r for r in rows if r[2]["1"] >= base + points), None)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("runs", nargs="+", help="LABEL=RUN_DIR")
    p.add_argument("--out", help="write the picture here (png)")
    args = p.parse_args(argv)
    runs = {label: curve(Path(d)) for label, d in (r.split("=", 1) for r in args.runs)}
    print("| run | pass@1 v0 | first version +20 points (minute) | last version (minute) | pass@1 last "
          "| pass@8 v0 -> last |")
    print("| --- | --- | --- | --- | --- | --- |")
    for label, rows in runs.items():
        v0, last, gain = rows[0][2], rows[-1], first_gain(rows)
        reached = f"v{gain[0]} ({gain[1]:.1f}): {gain[2]['1']:.3f}" if gain else "not reached"
        print(f"| {label} | {v0['1']:.3f} | {reached} | v{last[0]} ({last[1]:.1f}) | {last[2]['1']:.3f} | "
              f"{v0.get('8', float('nan')):.3f} -> {last[2].get('8', float('nan')):.3f} |")
    if args.out:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        fig, ax = plt.subplots(figsize=(7, 4))
        for label, rows in runs.items():
            minutes = [r[1] for r in rows]
            (line,) = ax.plot(minutes, [r[2]["1"] for r in rows], "-", marker=".", label=f"{label} pass@1")
            ax.plot(minutes, [r[2]["8"] for r in rows], ":", color=line.get_color(), label=f"{label} pass@8")
        base = next(iter(runs.values()))[0][2]["1"]
        ax.axhline(base + 0.20, color="grey", lw=0.8, ls="--", label="version 0 pass@1 + 20 points")
        ax.set_xlabel("training minutes (learner clock)")
        ax.set_ylabel("held-out pass@k (200 problems x 8)")
        ax.set_ylim(0, 1)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8, loc="lower right")
        fig.tight_layout()
        fig.savefig(args.out, dpi=110)
        print(f"written: {args.out}")


if __name__ == "__main__":
    main()
