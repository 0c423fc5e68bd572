"""The embedded rollout engine: an HF `transformers` causal LM with batched KV-cache sampling.

Prompts are left-padded into one batch (each repeated `n` times), prefilled once, then decoded one
token per step with the model's KV cache. Sampling applies temperature, then top-k and top-p; the
behaviour logprob of a sampled token is taken from the temperature-scaled distribution before top-k/
top-p filtering, which is the distribution the learner scores. A response ends at EOS or a stop
token (kept in the response) or at `max_new_tokens` ("length").

Tokens are drawn by inverse CDF from uniform noise fixed before decoding: from the engine's own
generator, or, when `seeds` are given (one per prompt), from a generator per response seeded by its
prompt's seed, so a prompt's responses do not depend on which daemon or batch generated them.
"""

from __future__ import annotations

import time

import numpy as np
import torch

from offpolicy.config import Config
from offpolicy.engines import Completion, SamplingParams
from offpolicy.models import build_model, resolve_device
from offpolicy.tokenizer import load_tokenizer
from offpolicy.weights import WeightVersion


class TorchEngine:
    def __init__(self, cfg: Config, seed: int = 0):
        self.device = resolve_device(cfg.rollout.device)
        self.model = build_model(cfg.model, self.device)
        self.tokenizer = load_tokenizer(cfg.model.tokenizer)
        self.version = -1
        self._gen = torch.Generator(device=self.device)
        self._gen.manual_seed(seed)

    def load(self, weights: WeightVersion) -> float:
        t0 = time.perf_counter()
        tensors = weights.tensors
        self._check_fits(weights.version, tensors)  # refuse before touching a single parameter
        with torch.no_grad():
            self.model.load_state_dict(tensors, strict=False)
        self.version = weights.version
        return time.perf_counter() - t0

    def _check_fits(self, version: int, tensors: dict[str, torch.Tensor]) -> None:
        own = self.model.state_dict()
        tied = {k for k in own if getattr(self.model.config, "tie_word_embeddings", False) and k.startswith("lm_head")}
        missing = [k for k in own if k not in tensors and k not in tied]
        unexpected = [k for k in tensors if k not in own]
        shapes = [f"{k} {tuple(t.shape)} != {tuple(own[k].shape)}" for k, t in tensors.items()
                  if k in own and t.shape != own[k].shape]
        if missing or unexpected or shapes:
            raise ValueError(f"weight version {version} does not fit the engine's model: missing {missing[:5]}, "
                             f"unexpected {unexpected[:5]}, shapes {shapes[:5]}")

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], params: SamplingParams,
                 seeds: list[int] | None = None) -> list[list[Completion]]:
        pad = self.tokenizer.pad_token_id
        stops = torch.tensor(sorted({self.tokenizer.eos_token_id, *params.stop_token_ids}), device=self.device)
        rows = [p for p in prompts for _ in range(params.n)]
        width = max(len(p) for p in rows)
        ids = torch.full((len(rows), width), pad, dtype=torch.long)
        attn = torch.zeros((len(rows), width), dtype=torch.long)
        for i, p in enumerate(rows):
            ids[i, width - len(p):] = torch.tensor(p)
            attn[i, width - len(p):] = 1
        ids, attn = ids.to(self.device), attn.to(self.device)
        pos = (attn.cumsum(-1) - 1).clamp(min=0)
        done = torch.zeros(len(rows), dtype=torch.bool, device=self.device)
        stopped = torch.zeros_like(done)
        lengths = torch.zeros(len(rows), dtype=torch.long, device=self.device)
        noise = self._noise(len(prompts), params, seeds)
        out_tokens, out_logps = [], []
        past, step_ids, step_pos = None, ids, pos
        for t in range(params.max_new_tokens):
            o = self.model(input_ids=step_ids, attention_mask=attn, position_ids=step_pos,
                           past_key_values=past, use_cache=True)
            past = o.past_key_values
            logits = o.logits[:, -1, :]
            logits = logits.to(torch.promote_types(logits.dtype, torch.float32)) / params.temperature
            logp = torch.log_softmax(logits, dim=-1)
            tok = self._sample(logits, params, noise[:, t])
            tok = torch.where(done, torch.full_like(tok, pad), tok)
            out_tokens.append(tok)
            out_logps.append(logp.gather(-1, tok[:, None]).squeeze(-1))
            lengths += (~done).long()
            hit = torch.isin(tok, stops) & ~done
            stopped |= hit
            done |= hit
            if bool(done.all()):
                break
            step_ids = tok[:, None]
            step_pos = step_pos[:, -1:] + 1
            attn = torch.cat([attn, torch.ones_like(attn[:, :1])], dim=-1)
        tokens = torch.stack(out_tokens, 1).cpu().numpy().astype(np.int32)
        logps = torch.stack(out_logps, 1).cpu().numpy().astype(np.float32)
        lengths, stopped = lengths.cpu().numpy(), stopped.cpu().numpy()
        comps = [Completion(tokens=tokens[i, : lengths[i]].copy(), logprobs=logps[i, : lengths[i]].copy(),
                            finish_reason="stop" if stopped[i] else "length") for i in range(len(rows))]
        return [comps[j * params.n:(j + 1) * params.n] for j in range(len(prompts))]

    def _noise(self, n_prompts: int, params: SamplingParams, seeds: list[int] | None) -> torch.Tensor:
        """Uniform noise `[prompts * n, max_new_tokens]` (float64) that decides every sampled token."""
        shape = (params.max_new_tokens,)
        if seeds is None:
            return torch.rand((n_prompts * params.n, *shape), generator=self._gen, dtype=torch.float64,
                              device=self.device)
        if len(seeds) != n_prompts:
            raise ValueError(f"{len(seeds)} seeds for {n_prompts} prompts")
        g = torch.Generator()
        rows = []
        for seed in seeds:
            for i in range(params.n):
                g.manual_seed((seed * 1_000_003 + i) % (1 << 63))
                rows.append(torch.rand(shape, generator=g, dtype=torch.float64))
        return torch.stack(rows).to(self.device)

    @staticmethod
    def _sample(logits: torch.Tensor, params: SamplingParams, u: torch.Tensor) -> torch.Tensor:
        """Inverse-CDF sample from softmax(logits) after top-k / top-p, with uniform `u` per row."""
        if params.top_k > 0:
            kth = torch.topk(logits, min(params.top_k, logits.shape[-1]), dim=-1).values[:, -1:]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        probs = torch.softmax(logits.double(), dim=-1)
        if params.top_p < 1.0:
            sorted_p, order = probs.sort(dim=-1, descending=True)
            keep = sorted_p.cumsum(-1) - sorted_p < params.top_p  # always keeps the most likely token
            probs = torch.zeros_like(probs).scatter(-1, order, sorted_p * keep)
        cdf = probs.cumsum(-1)
        target = (u * cdf[:, -1]).unsqueeze(-1)  # scaled by the total, so rounding never overshoots
        idx = (cdf <= target).sum(-1).clamp(max=probs.shape[-1] - 1)
        return idx
