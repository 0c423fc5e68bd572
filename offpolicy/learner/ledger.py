"""The learner's ledger: per-step records (metrics.jsonl, Prometheus) and the run's accounting.

What was trained (by epoch and prompt), how stale, the reward history for summary.json, and the
exactly-once check: prompts_lost = handed out - trained - still outstanding, prompts_duplicated =
prompts trained more than once. A resumed learner rebuilds the ledger from the run's own logs.
"""

from __future__ import annotations

import time
from collections import Counter

import numpy as np
import torch

from offpolicy.config import Config
from offpolicy.hub.batch import Group, batch_stats, version_stats
from offpolicy.hub.leases import PromptRef
from offpolicy.loggers.runlog import RunLog
from offpolicy.plumbing.metrics import LearnerMetrics
from offpolicy.plumbing.trace import Tracer, now


class Ledger:
    """Per-step records (metrics.jsonl, Prometheus) and the exactly-once / staleness accounting."""

    def __init__(self, cfg: Config, runlog: RunLog, metrics: LearnerMetrics, tracer: Tracer):
        self.cfg, self.runlog, self.m = cfg, runlog, metrics
        self.tracer = tracer  # run.trace: the step's parts on the timeline
        self.t0 = time.time()
        self.rewards: list[float] = []
        self.trained: Counter = Counter()
        self.max_staleness = 0
        self.steps = 0
        self.tokens = 0
        self.publish: list[float] = []
        self.filtered = 0
        self.switched_tokens = 0  # tokens generated after an in-flight version switch (rollout.inflight_updates)

    def record(self, step: int, batch: list[Group], stats: dict, advantages: torch.Tensor,
               **seconds: float) -> None:
        self._trace(step, seconds)
        bs = batch_stats(batch)
        bs.update(version_stats(batch, step))  # per-token staleness; tokens switched in flight
        self.switched_tokens += round(bs["switched_token_frac"] * bs["tokens"])
        bs.update(adv_mean=float(advantages.mean()), adv_std=float(advantages.std()),
                  adv_abs_max=float(advantages.abs().max()))
        self.filtered += stats.get("groups_filtered", 0)
        staleness = [step - g.weight_version for g in batch]
        self.max_staleness = max(self.max_staleness, *staleness)
        for g in batch:
            self.trained[(g.epoch, g.prompt_id)] += 1
        self.runlog.trained(step, batch)
        self.rewards.append(bs["reward_mean"])
        self.steps, self.tokens = step + 1, self.tokens + bs["tokens"]
        self.publish.append(seconds["publish"])
        m = self.m
        m.step.set(step + 1)
        m.groups_trained.inc(len(batch))
        for s in staleness:
            m.staleness.observe(s)
        m.step_seconds.observe(seconds["total"])
        m.train_seconds.observe(seconds["train"])
        m.wait_seconds.observe(seconds["waited"])
        m.reward.set(bs["reward_mean"])
        m.groups_filtered.inc(stats.get("groups_filtered", 0))
        if "loss" in stats:  # no step when every group was filtered
            m.loss.set(stats["loss"])
            m.clip.set(stats["clip_frac"])
            m.kl.set(stats["approx_kl"])
            m.entropy.set(stats["entropy"])
        if step % self.cfg.metrics.log_every == 0 or step + 1 == self.cfg.learner.total_steps:
            elapsed = time.time() - self.t0
            self.runlog.step({"step": step, "version": step + 1, "time": round(elapsed, 3), **bs, **stats,
                              "staleness_max": max(staleness), "staleness_mean": float(np.mean(staleness)),
                              "tokens_per_s": self.tokens / max(elapsed, 1e-9),
                              **{f"{k}_seconds": round(v, 6) for k, v in seconds.items()}})

    def _trace(self, step: int, seconds: dict[str, float]) -> None:
        """The step's parts as spans ending now: the wait for its batch, the train step, the publish stall."""
        if not self.tracer.on:
            return
        start = now() - seconds.get("total", 0.0)
        for name, key in (("wait batch", "waited"), ("train", "train"), ("publish stall", "publish_stall")):
            self.tracer.add(name, start, seconds.get(key, 0.0), step=step)
            start += seconds.get(key, 0.0)

    def summary(self, hub: Hub) -> dict:
        acct = hub.accounting()
        trained = sum(self.trained.values())
        outstanding = acct["prompts_waiting_requeue"] + acct["prompts_in_flight"] + acct["prompts_buffered"]
        w = self.cfg.learner.summary_window
        wall = time.time() - self.t0
        return {
            "steps": self.steps,
            "wall_seconds": round(wall, 2),
            "initial_reward_mean": float(np.mean(self.rewards[:w])) if self.rewards else None,
            "final_reward_mean": float(np.mean(self.rewards[-w:])) if self.rewards else None,
            "max_staleness_seen": self.max_staleness,
            "max_staleness_allowed": self.cfg.algo.max_staleness,
            "prompts_lost": acct["prompts_handed_out"] - len(self.trained) - outstanding,
            "prompts_duplicated": sum(1 for c in self.trained.values() if c > 1),
            "groups_trained": trained,
            "groups_dropped_stale": hub.dropped_stale,
            "groups_filtered_zero_variance": self.filtered,
            "leases_issued": hub.book.issued,
            "leases_expired": hub.book.expired,
            **acct,
            "tokens_trained": self.tokens,
            "tokens_switched_in_flight": self.switched_tokens,
            "tokens_per_s": round(self.tokens / max(wall, 1e-9), 1),
            "publish_seconds_mean": float(np.mean(self.publish)) if self.publish else None,
        }

    def restore(self, metrics_rows: list[dict], trained_rows: list[dict]) -> None:
        """Continue the accounting of a resumed run from its (truncated) logs."""
        for t in trained_rows:
            self.trained[(t["epoch"], t["prompt_id"])] += 1
            self.max_staleness = max(self.max_staleness, t["step"] - t["version"])
        for r in metrics_rows:
            self.rewards.append(r["reward_mean"])
            self.tokens += r["tokens"]
            self.publish.append(r["publish_seconds"])
            self.filtered += r.get("groups_filtered", 0)
            self.switched_tokens += round(r.get("switched_token_frac", 0.0) * r["tokens"])
        self.steps = max((t["step"] + 1 for t in trained_rows), default=0)
        if metrics_rows:
            self.t0 = time.time() - metrics_rows[-1]["time"]

    def trained_refs(self) -> set[PromptRef]:
        return {PromptRef(e, p) for e, p in self.trained}
