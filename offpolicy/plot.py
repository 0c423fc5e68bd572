"""Reward curves drawn from metrics.jsonl (matplotlib, no display): per step and per wall second.

`plot_rewards(run_dir)` writes `run_dir/reward.png` for one run; `plot_runs([dirs], out)` overlays
several runs (e.g. max_staleness 0 against 1) on the same two axes.
"""

from __future__ import annotations

from pathlib import Path

from offpolicy.runlog import read_jsonl


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
    by_step.set_xlabel("optimizer step (= weight version - 1)")
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
