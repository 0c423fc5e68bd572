"""Curves of a run (matplotlib, no display): rewards from metrics.jsonl, evaluations from eval.jsonl.

`plot_rewards(run_dir)` writes `run_dir/reward.png` for one run; `plot_runs([dirs], out)` overlays
several runs (e.g. max_staleness 0 against 1) on the same two axes. `plot_eval(run_dir)` writes
`run_dir/eval.png`: pass@k for each k and the mean reward against the weight version.
"""

from __future__ import annotations

from pathlib import Path

from offpolicy.loggers.runlog import read_jsonl


def _smooth(values: list[float], k: int) -> list[float]:
    out = []
    for i in range(len(values)):
        window = values[max(0, i - k + 1):i + 1]
        out.append(sum(window) / len(window))
    return out


def plot_runs(run_dirs: list[str | Path], out: str | Path, labels: list[str] | None = None) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (by_step, by_time) = plt.subplots(1, 2, figsize=(11, 4), dpi=120, sharey=True)
    for i, run_dir in enumerate(map(Path, run_dirs)):
        rows = read_jsonl(run_dir / "metrics.jsonl")
        if not rows:
            raise ValueError(f"{run_dir}/metrics.jsonl has no steps to plot")
        label = labels[i] if labels else run_dir.name
        rewards = [r["reward_mean"] for r in rows]
        k = max(1, len(rows) // 30)
        smooth = _smooth(rewards, k)
        steps, times = [r["step"] for r in rows], [r["time"] for r in rows]
        if len(run_dirs) == 1:
            by_step.plot(steps, rewards, lw=1, alpha=0.4, label="batch reward mean")
            label = f"moving mean ({k} steps)"
        line, = by_step.plot(steps, smooth, lw=2, label=label)
        by_time.plot(times, smooth, lw=2, color=line.get_color(), label=label)
    by_step.set_xlabel("step k (publishes weight version k + 1)")
    by_time.set_xlabel("wall seconds since the learner started")
    by_step.set_ylabel("reward")
    for ax in (by_step, by_time):
        ax.set_ylim(-0.02, 1.02)
        ax.grid(alpha=0.3)
        ax.legend(loc="lower right")
    by_step.set_title("reward per step")
    by_time.set_title("reward per wall second")
    fig.tight_layout()
    fig.savefig(out)
    plt.close(fig)
    return Path(out)


def plot_rewards(run_dir: str | Path) -> Path:
    return plot_runs([run_dir], Path(run_dir) / "reward.png")


def plot_eval(run_dir: str | Path, out: str | Path | None = None) -> Path:
    """pass@k (one line per k) and mean eval reward against the weight version, from eval.jsonl."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in read_jsonl(Path(run_dir) / "eval.jsonl") if "pass_at_k" in r]
    if not rows:
        raise ValueError(f"{run_dir}/eval.jsonl has no evaluated version to plot")
    rows.sort(key=lambda r: r["version"])
    versions = [r["version"] for r in rows]
    fig, (passk, reward) = plt.subplots(1, 2, figsize=(11, 4), dpi=120)
    for k in sorted(rows[-1]["pass_at_k"], key=int):
        passk.plot(versions, [r["pass_at_k"].get(k) for r in rows], marker="o", lw=2, label=f"pass@{k}")
    reward.plot(versions, [r["reward_mean"] for r in rows], marker="o", lw=2, color="tab:purple", label="mean reward")
    passk.set_ylim(-0.02, 1.02)
    passk.set_title("pass@k per weight version")
    reward.set_title("mean eval reward per weight version")
    for ax in (passk, reward):
        ax.set_xlabel("weight version v (the model after v steps)")
        ax.grid(alpha=0.3)
        ax.legend(loc="lower right")
    fig.tight_layout()
    out = Path(out) if out else Path(run_dir) / "eval.png"
    fig.savefig(out)
    plt.close(fig)
    return out
