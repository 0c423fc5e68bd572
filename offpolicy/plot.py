"""reward.png: the reward curve of a run, drawn from its metrics.jsonl (matplotlib, no display)."""

from __future__ import annotations

from pathlib import Path

from offpolicy.runlog import read_jsonl


def plot_rewards(run_dir: str | Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    run_dir = Path(run_dir)
    rows = read_jsonl(run_dir / "metrics.jsonl")
    if not rows:
        raise ValueError(f"{run_dir}/metrics.jsonl has no steps to plot")
    steps = [r["step"] for r in rows]
    fig, ax = plt.subplots(figsize=(7, 4), dpi=120)
    ax.plot(steps, [r["reward_mean"] for r in rows], lw=1, alpha=0.45, label="batch reward mean")
    k = max(1, len(rows) // 30)
    smooth = [sum(r["reward_mean"] for r in rows[max(0, i - k + 1):i + 1]) / len(rows[max(0, i - k + 1):i + 1])
              for i in range(len(rows))]
    ax.plot(steps, smooth, lw=2, label=f"moving mean ({k} steps)")
    ax.set_xlabel("optimizer step (= weight version - 1)")
    ax.set_ylabel("reward")
    ax.set_ylim(-0.02, 1.02)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    ax.set_title(f"{run_dir.name}: reward per step")
    out = run_dir / "reward.png"
    fig.tight_layout()
    fig.savefig(out)
    plt.close(fig)
    return out
