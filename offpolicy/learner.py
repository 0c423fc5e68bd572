"""The learner daemon (rank 0 = hub): one-step-off GRPO.

`train` is the algorithm: publish version 0; then for each step k take a batch the staleness bound
allows (versions >= k - max_staleness), compute group-normalised advantages, run one optimizer step,
publish version k + 1 and announce it. Rollouts generate with the newest version meanwhile, so with
max_staleness = 1 generation of batch k + 1 overlaps training on batch k. `Ledger` keeps the run's
accounting: what was trained, how stale, and whether any prompt was lost or trained twice.
"""

from __future__ import annotations

import asyncio
import logging
import shutil
import time
from collections import Counter

import numpy as np
import torch
import zmq.asyncio

from offpolicy import algorithms, protocol, transport
from offpolicy.backends import make_backend
from offpolicy.batch import Group, batch_stats
from offpolicy.config import Config
from offpolicy.data import load_dataset
from offpolicy.hub import Hub
from offpolicy.metrics import LearnerMetrics, serve
from offpolicy.runlog import RunLog
from offpolicy.tokenizer import load_tokenizer
from offpolicy.weights import WeightStore

log = logging.getLogger("offpolicy.learner")


async def train(cfg: Config, hub: Hub, backend, broadcast, ledger: Ledger, stop: asyncio.Event) -> None:
    await broadcast(0)
    for step in range(cfg.learner.total_steps):
        t0 = time.perf_counter()
        batch = await until(stop, hub.next_batch(step))              # versions >= step - max_staleness
        if batch is None:
            break                                                    # SIGTERM: stop between steps
        waited = time.perf_counter() - t0
        rewards = torch.tensor(np.stack([g.rewards for g in batch]))
        advantages = algorithms.compute_advantages(rewards, cfg.algo.advantage, cfg.algo.adv_eps)
        keep = ~algorithms.zero_variance_groups(rewards) if cfg.algo.filter_zero_variance else None
        stats = await asyncio.to_thread(train_on, backend, batch, advantages, keep)  # GRPO loss, AdamW
        trained = time.perf_counter()
        published = await broadcast(step + 1)                        # rollouts swap to it next batch
        ledger.record(step, batch, stats, advantages, waited=waited, train=trained - t0 - waited,
                      publish=published.publish_seconds, total=time.perf_counter() - t0)


def train_on(backend, batch: list[Group], advantages: torch.Tensor, keep: torch.Tensor | None) -> dict:
    """One optimizer step on the groups `keep` selects (all by default); no step if none is left."""
    if keep is not None:
        batch, advantages = [g for g, k in zip(batch, keep.tolist()) if k], advantages[keep]
    stats = backend.train_step(batch, advantages) if batch else {}
    return {**stats, "groups_filtered": 0 if keep is None else int((~keep).sum())}


async def until(stop: asyncio.Event, coro):
    """Await `coro` unless `stop` is set first (then cancel it and return None)."""
    if stop.is_set():
        coro.close()
        return None
    task, stopper = asyncio.create_task(coro), asyncio.create_task(stop.wait())
    done, _ = await asyncio.wait([task, stopper], return_when=asyncio.FIRST_COMPLETED)
    for t in (task, stopper):
        if t not in done:
            t.cancel()
    return task.result() if task in done else None


class Ledger:
    """Per-step records (metrics.jsonl, Prometheus) and the exactly-once / staleness accounting."""

    def __init__(self, cfg: Config, runlog: RunLog, metrics: LearnerMetrics):
        self.cfg, self.runlog, self.m = cfg, runlog, metrics
        self.t0 = time.time()
        self.rewards: list[float] = []
        self.trained: Counter = Counter()
        self.max_staleness = 0
        self.steps = 0
        self.tokens = 0
        self.publish: list[float] = []
        self.filtered = 0

    def record(self, step: int, batch: list[Group], stats: dict, advantages: torch.Tensor,
               **seconds: float) -> None:
        bs = batch_stats(batch)
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

    def summary(self, hub: Hub) -> dict:
        acct = hub.accounting()
        trained = sum(self.trained.values())
        outstanding = acct["prompts_requeued"] + acct["prompts_in_flight"] + acct["prompts_buffered"]
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
            "tokens_per_s": round(self.tokens / max(wall, 1e-9), 1),
            "publish_seconds_mean": float(np.mean(self.publish)) if self.publish else None,
        }


async def run_learner(cfg: Config) -> int:
    """The `offpolicy-learner` daemon: hub + backend + weight broadcaster until total_steps."""
    metrics = LearnerMetrics()
    serve(metrics.registry, cfg.metrics.port, cfg.metrics.host)
    tokenizer = load_tokenizer(cfg.model.tokenizer)
    dataset = load_dataset(cfg.data)
    backend = make_backend(cfg)
    vocab = max(tokenizer.vocab_size, backend.hf_config().get("vocab_size", 0))
    w = cfg.weights
    shutil.rmtree(f"{w.root}/{cfg.run.name}", ignore_errors=True)  # a fresh run starts a fresh store
    store = WeightStore(w.root, cfg.run.name, keep=w.keep, shard_bytes=w.shard_bytes, checksum=w.checksum)
    runlog = RunLog(cfg)
    ledger = Ledger(cfg, runlog, metrics)
    ctx = zmq.asyncio.Context()
    hub = Hub(cfg, dataset, tokenizer, metrics, vocab_size=vocab)
    await hub.start(ctx)
    stop = asyncio.Event()
    transport.install_stop_signals(stop)

    async def broadcast(version: int) -> protocol.WeightAnnouncement:
        pub = await asyncio.to_thread(store.publish, version, backend.weights(), backend.hf_config())
        metrics.publish_seconds.observe(pub.seconds)
        metrics.publish_bytes.set(pub.total_bytes)
        ann = protocol.WeightAnnouncement(version=version, path=pub.path, total_bytes=pub.total_bytes,
                                          publish_seconds=pub.seconds, step=version)
        await hub.announce(ann)
        return ann

    try:
        log.info("training %d steps of %d groups x %d samples, max_staleness=%d", cfg.learner.total_steps,
                 cfg.learner.batch_groups, cfg.rollout.n_samples, cfg.algo.max_staleness)
        await train(cfg, hub, backend, broadcast, ledger, stop)
        summary = ledger.summary(hub)
        runlog.summary(summary)
        log.info("done: %s", {k: summary[k] for k in ("steps", "initial_reward_mean", "final_reward_mean",
                                                       "prompts_lost", "prompts_duplicated")})
        return 0
    finally:
        await hub.close("training finished" if not stop.is_set() else "learner stopped")
        runlog.close()
        ctx.term()
