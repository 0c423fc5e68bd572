"""Evaluating a weight version (what `offpolicy eval` and the eval daemon share): `eval.n_samples` samples per prompt, scored, reported as pass@k.

`Evaluator(cfg)` builds once what every evaluation shares: the engine of `eval.engine` (the embedded
torch engine on `eval.device`, or SGLang through its adapter with `rollout.sglang`'s settings), the
tokenizer, the prompts of `eval.data` (overlong ones filtered or truncated as `eval.data` says, the
first `eval.max_prompts` in its seeded order, all encoded up front so a bad prompt fails before any
generation) and the reward. `load(weights)` swaps the engine to a `WeightVersion`; `run(out_dir, label)`
evaluates whatever the engine holds into `out_dir`: `results.jsonl` (per prompt, resumable: see
`results`), `report.json` and `report.md`. Each prompt's samples are seeded by (eval.seed, prompt
id), so a resumed or re-batched evaluation draws the same samples on the torch engine.
"""

from __future__ import annotations

import json
import logging
import random
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import msgspec

from offpolicy.config import Config
from offpolicy.data.encoding import load_prompts
from offpolicy.data.rewards import RewardRouter
from offpolicy.eval.results import ResultsFile, markdown, report
from offpolicy.rollout.engines import SamplingParams, make_engine, prompt_seed, response_tokenizer

log = logging.getLogger("offpolicy.eval")


def engine_config(cfg: Config, model_path: str | None = None) -> Config:
    """`cfg` with the rollout section set to the evaluation's engine and sampling (what make_engine reads),
    and model.path set to `model_path` (an HF directory) when given. No double buffer: the evaluator loads a
    version only between evaluations, so a second copy of the weights would hide nothing."""
    e, r = cfg.eval, cfg.rollout
    rollout = msgspec.structs.replace(r, engine=e.engine or r.engine, device=e.device, n_samples=e.n_samples,
                                      temperature=e.temperature, top_p=e.top_p, top_k=e.top_k,
                                      max_new_tokens=e.max_new_tokens or r.max_new_tokens, seed=e.seed,
                                      double_buffer=False)
    model = msgspec.structs.replace(cfg.model, path=model_path) if model_path else cfg.model
    return msgspec.structs.replace(cfg, rollout=rollout, model=model)


def select(dataset, cfg: Config) -> list:
    """The prompts to evaluate: eval.data's order (seeded shuffle if eval.data.shuffle), the first eval.max_prompts."""
    d = cfg.eval.data
    ids = list(range(len(dataset)))
    if d.shuffle:
        random.Random(d.seed).shuffle(ids)
    if cfg.eval.max_prompts:
        ids = ids[:cfg.eval.max_prompts]
    return [dataset[i] for i in ids]


class Evaluator:
    def __init__(self, cfg: Config, model_path: str | None = None):
        self.cfg = engine_config(cfg, model_path)
        e, r = cfg.eval, self.cfg.rollout
        self.tokenizer = response_tokenizer(cfg.model)
        dataset, self.encoder = load_prompts(e.data, self.tokenizer, "eval.data")
        self.prompts = select(dataset, cfg)
        self.token_ids = {p.id: self.encoder.encode(p, p.id) for p in self.prompts}
        self.encoder.counts.kept = len(self.prompts)
        self.reward_name = e.reward or cfg.rollout.reward
        self.reward = RewardRouter(self.reward_name, e.data.reward_by_source)  # by each prompt's data_source
        self.params = SamplingParams(n=e.n_samples, temperature=r.temperature, top_p=r.top_p, top_k=r.top_k,
                                     max_new_tokens=r.max_new_tokens, stop_token_ids=tuple(r.stop_token_ids))
        self.engine = make_engine(self.cfg, seed=e.seed)
        self._pool: ThreadPoolExecutor | None = None

    def load(self, weights) -> float:
        """Swap the engine to the `WeightVersion` `weights`; returns seconds."""
        return self.engine.load(weights)

    def meta(self, label: str) -> dict:
        """Everything that decides the samples (a resumed results file must match it)."""
        e, r = self.cfg.eval, self.cfg.rollout
        return {"weights": label, "version": self.engine.version, "engine": r.engine, "source": e.data.source,
                "data": msgspec.to_builtins(e.data), "max_prompts": e.max_prompts, "reward": self.reward_name,
                "n": e.n_samples, "temperature": r.temperature, "top_p": r.top_p, "top_k": r.top_k,
                "max_new_tokens": r.max_new_tokens, "seed": e.seed, "model_dtype": self.cfg.model.dtype}

    def run(self, out_dir: str | Path, label: str, on_batch: Callable[[int, int], None] | None = None,
            stop: threading.Event | None = None) -> dict | None:
        """Evaluate the engine's weights into `out_dir`; returns the report, or None if `stop` came first
        (what was done stays in results.jsonl for the next run)."""
        e = self.cfg.eval
        out = Path(out_dir)
        results = ResultsFile(out / "results.jsonl", self.meta(label))
        todo = [p for p in self.prompts if p.id not in results.done()]
        gen_s = reward_s = 0.0
        samples = tokens = 0
        if on_batch:
            on_batch(len(self.prompts) - len(todo), len(self.prompts))
        for i in range(0, len(todo), e.batch_prompts):
            if stop is not None and stop.is_set():
                return None
            chunk = todo[i:i + e.batch_prompts]
            t0 = time.perf_counter()
            groups = self.engine.generate([self.token_ids[p.id] for p in chunk], self.params,
                                          [prompt_seed(e.seed, 0, p.id) for p in chunk])
            t1 = time.perf_counter()
            records = self._score_all(chunk, groups)
            reward_s += time.perf_counter() - t1
            gen_s += t1 - t0
            samples += sum(len(r["lengths"]) for r in records)
            tokens += sum(sum(r["lengths"]) for r in records)
            results.append(records)
            if on_batch:
                on_batch(len(self.prompts) - len(todo) + i + len(chunk), len(self.prompts))
        counts = {**self.encoder.counts.as_dict(), "evaluated": len(results.records)}
        throughput = {"samples": samples, "tokens": tokens, "generate_seconds": round(gen_s, 3),
                      "reward_seconds": round(reward_s, 3), "samples_per_s": samples / gen_s if gen_s else 0.0,
                      "tokens_per_s": tokens / gen_s if gen_s else 0.0}
        records = [results.records[p.id] for p in self.prompts]
        rep = report(records, list(e.k), e.pass_threshold, results.meta, counts, throughput)
        (out / "report.json").write_text(json.dumps(rep, indent=1) + "\n")
        (out / "report.md").write_text(markdown(rep))
        return rep

    def _score_all(self, prompts, groups) -> list[dict]:
        """One record per prompt; the samples are scored on eval.reward_workers threads (1: this thread)."""
        texts = [[self.tokenizer.decode(c.tokens) for c in comps] for comps in groups]
        jobs = [(p.text, p.answer, t, p.data_source) for p, ts in zip(prompts, texts) for t in ts]
        workers = self.cfg.eval.reward_workers
        if workers > 1:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(workers, thread_name_prefix="reward")
            scores = list(self._pool.map(lambda job: float(self.reward(*job)), jobs))
        else:
            scores = [float(self.reward(*job)) for job in jobs]
        out, i = [], 0
        for p, comps, ts in zip(prompts, groups, texts):
            rec = {"id": p.id, "answer": p.answer, "rewards": scores[i:i + len(ts)],
                   "lengths": [len(c.tokens) for c in comps], "finish": [c.finish_reason for c in comps]}
            if self.cfg.eval.save_responses:
                rec["responses"] = ts
            out.append(rec)
            i += len(ts)
        return out
