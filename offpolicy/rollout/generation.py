"""A rollout's work on one lease: generate, score, and send one `SampleGroup` per prompt.

`LeaseGenerator.run(dealer, lease, tokens)` cuts the lease's token frame into its prompts, runs
`engine.generate` in a worker thread (`rollout.n_samples` responses per prompt; per-prompt seeds with
`rollout.seed_per_prompt`), scores every response with the reward router (by each prompt's
data_source), and sends each prompt's group over the daemon's DEALER: token ids and logprobs as raw
array frames, tagged with the weight version that generated them (per token, as runs, where the engine switched
versions in flight: `rollout.inflight_updates`; the group's `weight_version` is then its oldest token's). Generation time, aborted samples,
groups, samples, tokens, the mean reward and the prompt tokens prefilled (computed, or held by the server's prefix
cache, where the engine reports them) go to the rollout's metrics; the generate call (with those prefill counts) and the
scoring and sending after it go to the run's timeline (`run.trace`) as spans `generate` and `score and send`.
"""

from __future__ import annotations

import asyncio
import time

import msgspec
import numpy as np

from offpolicy.config import Config
from offpolicy.data.rewards import RewardRouter
from offpolicy.plumbing.metrics import RolloutMetrics
from offpolicy.plumbing.trace import Tracer, now
from offpolicy.rollout.engines import SamplingParams, prefill_counts, prompt_seed
from offpolicy.wire import protocol, transport
from offpolicy.wire.versions import group_runs


class LeaseGenerator:
    def __init__(self, cfg: Config, engine, tokenizer, metrics: RolloutMetrics, tracer: Tracer):
        self.cfg, self.engine, self.tokenizer, self.m, self.tracer = cfg, engine, tokenizer, metrics, tracer
        self.reward = RewardRouter(cfg.rollout.reward, cfg.data.reward_by_source)  # by each prompt's data_source
        r = cfg.rollout
        self.params = SamplingParams(n=r.n_samples, temperature=r.temperature, top_p=r.top_p, top_k=r.top_k,
                                     max_new_tokens=r.max_new_tokens, stop_token_ids=tuple(r.stop_token_ids))
        self._aborted_seen = 0  # engine.aborted already exported

    async def run(self, dealer, lease: protocol.Lease, tokens: np.ndarray) -> None:
        """Generate and score the lease's prompts with the engine's current version; send their groups."""
        cuts = np.cumsum([p.n_tokens for p in lease.prompts])[:-1]
        prompts = [t.tolist() for t in np.split(tokens, cuts)]
        version = self.engine.version
        t0, began = time.perf_counter(), now()
        seeds = ([prompt_seed(self.cfg.rollout.seed, p.epoch, p.prompt_id) for p in lease.prompts]
                 if self.cfg.rollout.seed_per_prompt else None)
        groups = await asyncio.to_thread(self.engine.generate, prompts, self.params, seeds)
        seconds = time.perf_counter() - t0
        self.m.gen_seconds.observe(seconds)
        prefill = prefill_counts(groups)  # what the call computed in prefill: much of its time (None: not said)
        if prefill is not None:
            self.m.prompt_tokens.labels("computed").inc(prefill[0])
            self.m.prompt_tokens.labels("cached").inc(prefill[1])
        self.tracer.add("generate", began, seconds, groups=len(prompts), version=version,
                        **({} if prefill is None else {"prefill_computed": prefill[0], "prefill_cached": prefill[1]}))
        aborted = self.engine.aborted  # samples the servers aborted and the engine generated again
        self.m.aborted.inc(aborted - self._aborted_seen)
        self._aborted_seen = aborted
        rewards_all, began = [], now()
        for p, ptoks, comps in zip(lease.prompts, prompts, groups):
            rewards = [float(self.reward(p.text, p.answer, self.tokenizer.decode(c.tokens), p.data_source)) for c in comps]
            rewards_all += rewards
            oldest, runs = group_runs([c.version_runs or [protocol.VersionRun(0, version)] for c in comps])
            msg = protocol.SampleGroup(lease_id=lease.lease_id, prompt_id=p.prompt_id, epoch=p.epoch,
                                       weight_version=oldest, response_lengths=[len(c.tokens) for c in comps],
                                       rewards=rewards, finish_reasons=[c.finish_reason for c in comps],
                                       gen_seconds=seconds, version_runs=runs or msgspec.UNSET)
            await transport.send(dealer, msg, np.asarray(ptoks, dtype=protocol.TOKEN_DTYPE),
                                 np.concatenate([c.tokens for c in comps]),
                                 np.concatenate([c.logprobs for c in comps]))
            self.m.groups_sent.inc()
            self.m.samples.inc(len(comps))
            self.m.tokens.inc(sum(len(c.tokens) for c in comps))
        self.m.reward.set(float(np.mean(rewards_all)))
        self.tracer.add("score and send", began, now() - began, lease=lease.lease_id, groups=len(prompts))
