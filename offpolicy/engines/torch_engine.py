"""The embedded rollout engine: an HF `transformers` causal LM with batched KV-cache sampling.

Prompts are left-padded into one batch (each repeated `n` times), prefilled once, then decoded one
token per step with the model's KV cache. Sampling applies temperature, then top-k and top-p; the
behaviour logprob of a sampled token is taken from the temperature-scaled distribution before top-k/
top-p filtering, which is the distribution the learner scores. A response ends at EOS or a stop
token (kept in the response) or at `max_new_tokens` ("length").

Tokens are drawn by inverse CDF from uniform noise fixed before decoding: from the engine's own
generator, or, when `seeds` are given (one per prompt), from a generator per response seeded by its
prompt's seed, so a prompt's responses do not depend on which daemon or batch generated them.

The KV cache is HF's dynamic one by default; with `rollout.static_cache` it is a static cache whose
decode step is a captured CUDA graph on a GPU (`static_decode.StaticDecoder`; `rollout.compile`
compiles the step first), and "all stopped?" is asked every `_SYNC_EVERY` steps instead of every
step (each question is a host sync). Weight swaps read the version's shards with parallel `preadv`
(`weights.transfer.load_version`), straight into the parameters in place.
"""

from __future__ import annotations

import time

import numpy as np
import torch

from offpolicy.config import Config
from offpolicy.engines import Completion, SamplingParams
from offpolicy.engines.static_decode import StaticDecoder
from offpolicy.models import build_model, resolve_device
from offpolicy.tokenizer import load_tokenizer
from offpolicy.weights import WeightVersion
from offpolicy.weights.transfer import load_version


_SYNC_EVERY = 16  # static cache: decode steps between checks that every response has stopped


class TorchEngine:
    def __init__(self, cfg: Config, seed: int = 0):
        self.device = resolve_device(cfg.rollout.device)
        self.model = build_model(cfg.model, self.device)
        self.tokenizer = load_tokenizer(cfg.model.tokenizer)
        self.version = -1
        self._gen = torch.Generator(device=self.device)
        self._gen.manual_seed(seed)
        self.static_cache, self.compile = cfg.rollout.static_cache, cfg.rollout.compile
        self._decoders: dict[tuple[int, int], StaticDecoder] = {}  # by (rows, cache length); two at most

    def load(self, weights: WeightVersion) -> float:
        t0 = time.perf_counter()
        tensors = weights.tensors
        self._check_fits(weights.version, tensors)  # refuse before touching a single parameter
        load_version(self.model.state_dict(), weights.path)  # parallel preads, through pinned memory on a GPU
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
        logits, advance = (self._static(ids, attn, pos, params) if self.static_cache else self._dynamic(ids, attn, pos))
        every = _SYNC_EVERY if self.static_cache else 1  # host syncs cost GPU idle time; extra steps are padding
        for t in range(params.max_new_tokens):
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
            if (t + 1) % every == 0 and bool(done.all()):
                break
            if t + 1 < params.max_new_tokens:
                logits = advance(tok, t)
        tokens = torch.stack(out_tokens, 1).cpu().numpy().astype(np.int32)
        logps = torch.stack(out_logps, 1).cpu().numpy().astype(np.float32)
        lengths, stopped = lengths.cpu().numpy(), stopped.cpu().numpy()
        comps = [Completion(tokens=tokens[i, : lengths[i]].copy(), logprobs=logps[i, : lengths[i]].copy(),
                            finish_reason="stop" if stopped[i] else "length") for i in range(len(rows))]
        return [comps[j * params.n:(j + 1) * params.n] for j in range(len(prompts))]

    def _dynamic(self, ids: torch.Tensor, attn: torch.Tensor, pos: torch.Tensor):
        """First logits and the decode step of the HF dynamic KV cache (the attention mask grows)."""
        o = self.model(input_ids=ids, attention_mask=attn, position_ids=pos, use_cache=True)
        state = {"past": o.past_key_values, "attn": attn, "pos": pos[:, -1:]}

        def advance(tok: torch.Tensor, t: int) -> torch.Tensor:
            state["attn"] = torch.cat([state["attn"], torch.ones_like(state["attn"][:, :1])], dim=-1)
            state["pos"] = state["pos"] + 1
            o = self.model(input_ids=tok[:, None], attention_mask=state["attn"], position_ids=state["pos"],
                           past_key_values=state["past"], use_cache=True)
            state["past"] = o.past_key_values
            return o.logits[:, -1, :]

        return o.logits[:, -1, :], advance

    def _static(self, ids: torch.Tensor, attn: torch.Tensor, pos: torch.Tensor, params: SamplingParams):
        """First logits and the decode step of a static KV cache (a CUDA graph on a GPU), made once per
        (rows, cache length) and reused while the model's weights change in place."""
        rows, width = ids.shape
        step = 256 if self.compile else 64  # fewer distinct lengths: each one compiles anew
        length = -(-(width + params.max_new_tokens) // step) * step
        key = (rows, length)
        if key not in self._decoders:
            if len(self._decoders) >= 2:
                del self._decoders[next(iter(self._decoders))]
            self._decoders[key] = StaticDecoder(self.model, rows, length, graph=self.device.type == "cuda",
                                                compile=self.compile)
        dec = self._decoders[key]
        return dec.prefill(ids, attn, pos), dec.step

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
