"""The learner daemon (rank 0 = hub): one-step-off GRPO.

`train` is the algorithm: publish version 0; then for each step k take a batch the staleness bound
allows (versions >= k - max_staleness), compute group-normalised advantages, run one optimizer step,
publish version k + 1 and announce it. Rollouts generate with the newest version meanwhile, so with
max_staleness = 1 generation of batch k + 1 overlaps training on batch k. `run_learner` wires
the daemon: hub, backend, weight store, run log, checkpoints (`--resume` continues the newest one).

Publishing is off the step's critical path (`weights.overlap_publish`): `announce(v)` waits for version
v - 1's writes to end (at most one version in flight), snapshots the weights and returns; the writes
go on in the background and version v is announced once it is complete in every format, never before.
What the learner waited for is its stall (`publish_stall_seconds` in metrics.jsonl); checkpoints and the
end of the run first wait for the version in flight (`settle`).
"""

from __future__ import annotations

import asyncio
import logging
import shutil
import time

import msgspec
import numpy as np
import torch
import zmq.asyncio

from offpolicy.config import Config
from offpolicy.data.encoding import hold_out, load_prompts
from offpolicy.data.tokenizer import load_tokenizer
from offpolicy.hub.batch import Group
from offpolicy.hub.hub import Hub
from offpolicy.learner import algorithms, checkpoint
from offpolicy.learner.backends import make_backend
from offpolicy.learner.ledger import Ledger
from offpolicy.loggers.runlog import RunLog, run_path
from offpolicy.models import fp8_run
from offpolicy.models.build import resolve_device
from offpolicy.plumbing.metrics import LearnerMetrics, serve
from offpolicy.plumbing.trace import Tracer, now
from offpolicy.weights import fastpath, list_versions, room, version_dir
from offpolicy.weights.publisher import Publisher
from offpolicy.wire import protocol, transport

log = logging.getLogger("offpolicy.learner")


async def train(cfg: Config, hub: Hub, backend, announce, ledger: Ledger, stop: asyncio.Event,
                start: int = 0, save=None) -> None:
    for step in range(start, cfg.learner.total_steps):
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
        stall = await announce(step + 1)           # snapshot; announced once written (rollouts swap to it)
        ledger.record(step, batch, stats, advantages, waited=waited, train=trained - t0 - waited,
                      publish=announce.last_seconds, publish_stall=stall, total=time.perf_counter() - t0)
        if save is not None and cfg.checkpoint.every_steps and (step + 1) % cfg.checkpoint.every_steps == 0:
            await save(step + 1)


class Announcer:
    """`await announce(v)`: publish version v with at most one version in flight (module doc); returns
    the seconds the learner stalled for it. `settle()` waits for the version in flight."""

    def __init__(self, store: Publisher, backend, hub: Hub, metrics: LearnerMetrics, tracer: Tracer,
                 overlap: bool = True, announced=None):
        self.store, self.backend, self.hub, self.metrics, self.overlap = store, backend, hub, metrics, overlap
        self.announced = announced  # called with each version once it is announced
        self.tracer = tracer  # run.trace: each version's publish, from its snapshot to its announcement
        self.pending: asyncio.Task | None = None
        self.last_seconds = 0.0  # write time of the newest complete version

    async def __call__(self, version: int) -> float:
        t0 = time.perf_counter()
        await self.settle()
        began = now()  # the snapshot's start (the wait for the version before is the stall)
        publishing = await asyncio.to_thread(self.store.begin, version, self.backend, self.overlap)
        self.pending = asyncio.create_task(self._finish(publishing, began))
        if not self.overlap:
            await self.settle()
        return time.perf_counter() - t0

    async def settle(self) -> None:
        """Wait for the version in flight (raises what stopped it: the learner must not go on without it)."""
        if self.pending is not None:
            pending, self.pending = self.pending, None
            await pending

    async def _finish(self, publishing, began: float) -> None:
        pub = await asyncio.to_thread(publishing.wait)
        self.last_seconds = pub.seconds
        self.metrics.publish_seconds.observe(pub.seconds)
        self.metrics.publish_bytes.set(pub.total_bytes)
        for f in self.store.last:
            self.metrics.format_bytes.labels(f.fmt).set(f.total_bytes)
            self.metrics.format_seconds.labels(f.fmt).set(f.seconds)
        # the span ends where the version became readable (its first format renamed into place): a rollout that
        # finds it in the store before the announcement still reads it after this
        ended = pub.committed or now()
        await self.hub.announce(protocol.WeightAnnouncement(version=publishing.version, path=pub.path,
                                                            total_bytes=pub.total_bytes, publish_seconds=pub.seconds,
                                                            step=publishing.version))
        if self.announced is not None:
            self.announced(publishing.version)
        self.tracer.add("publish", began, ended - began, lane="publish", version=publishing.version,
                        bytes=pub.total_bytes, fresh_files=pub.fresh_files, staged_files=pub.staged_files)
        for name, start, seconds in pub.phases:  # a sharded publish's parts, inside its span (clipped to it)
            start = max(start, began)
            if start < ended:
                self.tracer.add(f"publish: {name}", start, min(seconds, ended - start), lane="publish",
                                version=publishing.version)


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


async def run_learner(cfg: Config, resume: bool = False) -> int:
    """The `offpolicy-learner` daemon: hub + backend + weight publisher until total_steps."""
    began = time.perf_counter()
    # weights.reuse_files / checksum "auto": the fast write path when the weights are on a GPU
    gpu = resolve_device(cfg.learner.device).type == "cuda"
    cfg = msgspec.structs.replace(cfg, weights=fastpath.resolve(cfg.weights, gpu))
    log.info("weight store: reuse_files=%s, register_maps=%s, checksum=%s", cfg.weights.reuse_files,
             cfg.weights.register_maps, cfg.weights.checksum)
    if "fp8" in cfg.weights.formats:  # weights.fp8_block_size: auto, or a block the rollout engine must serve
        cfg = msgspec.structs.replace(cfg, weights=fp8_run.resolved(cfg))
        log.info("fp8 versions in %s x %s blocks (weights.fp8_block_size)", *cfg.weights.fp8_block_size)
    metrics = LearnerMetrics()
    serve(metrics.registry, cfg.metrics.port, cfg.metrics.host)
    tokenizer = load_tokenizer(cfg.model.tokenizer)
    dataset, _ = load_prompts(cfg.data, tokenizer)  # overlong prompts filtered when data.overlong_prompts=filter
    if cfg.eval.hold_out and cfg.eval.every_versions:  # pass@k on problems never trained on
        dataset, held = hold_out(dataset, load_prompts(cfg.eval.data, tokenizer, "eval.data")[0])
        log.info("eval.hold_out: %d of the training prompts are eval.data prompts and were left out (%d remain)",
                 held, len(dataset))
    t = time.perf_counter()
    backend = make_backend(cfg)
    parts = {k: v for k, v in backend.startup.items() if k != "ready"}  # the backend's own phases
    startup = {"backend": time.perf_counter() - t, **parts}
    vocab = max(tokenizer.vocab_size, backend.hf_config().get("vocab_size", 0))
    tracer = Tracer(cfg, "learner")
    hub = Hub(cfg, dataset, tokenizer, metrics, vocab_size=vocab, tracer=tracer)
    state = checkpoint.load(run_path(cfg), cfg, backend) if resume else None
    start = state.step if state else 0
    runlog = RunLog(cfg, resume_step=start if resume else None)
    ledger = Ledger(cfg, runlog, metrics, tracer)
    w = cfg.weights
    if state is None:
        shutil.rmtree(f"{w.root}/{cfg.run.name}", ignore_errors=True)  # a fresh run starts a fresh store
    # the native version (weights.native=checkpoints: only those a checkpoint exports) and every weights.formats one
    store = Publisher(w, cfg.run.name, native_at=lambda v: w.native == "every" or checkpoint.exports(cfg, v))
    if state is not None:
        ledger.restore(runlog.kept["metrics"], runlog.kept["trained"])
        hub.restore(state.cursor, state.step, ledger.trained_refs())
        dropped = store.drop_after(state.step)
        log.info("resuming at step %d from %s (dropped abandoned versions %s)", start,
                 checkpoint.checkpoint_root(runlog.dir), dropped)
    ctx = zmq.asyncio.Context()
    await hub.start(ctx)
    stop = asyncio.Event()
    transport.install_stop_signals(stop)

    def started(version: int) -> None:  # the start-up report: ready, then the first step's version out
        if version not in (start, start + 1):
            return
        phase = "ready" if version == start else "first_step"
        startup[phase] = time.perf_counter() - began
        for k, v in startup.items():
            metrics.startup.labels(k).set(v)
        log.info("start-up: %s, version %d published, %.1f s after the daemon started (%s)",
                 "ready" if version == start else "first step done", version, startup[phase],
                 ", ".join(f"{k} {v:.1f} s" for k, v in startup.items()))
        if phase == "ready":  # the first version's size is known and the optimizer allocated: room for the rest?
            short = room.shortfall_message(w.root, cfg.run.name, version, list(w.formats), w.keep)
            if short:
                log.warning("%s", short)

    announce = Announcer(store, backend, hub, metrics, tracer, overlap=w.overlap_publish, announced=started)
    saved = {"step": start if state is not None else -1}

    async def save(step: int) -> None:
        if saved["step"] == step:
            return  # SIGTERM right after a periodic checkpoint: it is already on disk
        saved["step"] = step
        await announce.settle()  # version `step` complete in the store: the checkpoint's hf/ export
        snapshot = checkpoint.CheckpointState(step=step, cursor=hub.snapshot(), python_rng=checkpoint.python_rng(),
                                              fingerprint=checkpoint.fingerprint(cfg))
        hf = version_dir(w.root, cfg.run.name, step)  # the HF export: version `step`, published already
        if step not in list_versions(w.root, cfg.run.name):
            why = (" (weights.native=checkpoints writes native versions only at checkpoint.every_steps and the run's "
                   "end)") if w.native == "checkpoints" else ""
            log.warning("weight version %d is not in the store%s: checkpoint %d has no hf/ export", step, why, step)
            hf = None
        path = await asyncio.to_thread(checkpoint.save, runlog.dir, snapshot, backend, cfg.checkpoint.keep, hf)
        log.info("checkpoint after %d steps (version %d; a resume runs step %d next) written to %s", step, step,
                 step, path)

    try:
        log.info("training steps %d..%d (versions %d..%d) of %d groups x %d samples, max_staleness=%d", start,
                 cfg.learner.total_steps - 1, start + 1, cfg.learner.total_steps, cfg.learner.batch_groups,
                 cfg.rollout.n_samples, cfg.algo.max_staleness)
        await announce(start)
        await train(cfg, hub, backend, announce, ledger, stop, start=start, save=save)
        await announce.settle()  # the last version announced before the run's end
        if cfg.checkpoint.final:
            await save(ledger.steps)  # the end of the run, or SIGTERM: resume continues from here
        summary = ledger.summary(hub)
        runlog.summary(summary)
        log.info("done: %s", {k: summary[k] for k in ("steps", "initial_reward_mean", "final_reward_mean",
                                                       "prompts_lost", "prompts_duplicated")})
        return 0
    finally:
        await hub.close("training finished" if not stop.is_set() else "learner stopped")
        runlog.close()
        ctx.term()
