"""The embedded learner backend: an HF `transformers` causal LM trained with AdamW.

Each step packs the batch's responses (prompt + response, right-padded) into micro-batches of
`learner.micro_batch_groups` groups, recomputes the token logprobs at the rollout temperature,
applies the clipped-ratio loss against the behaviour logprobs (token-mean over the whole batch, so
gradient accumulation equals one big batch), clips the global grad norm and steps AdamW.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from offpolicy import algorithms
from offpolicy.batch import Group
from offpolicy.config import Config
from offpolicy.models import build_model, hf_config, hf_state, resolve_device


class TorchBackend:
    def __init__(self, cfg: Config):
        self.cfg = cfg
        self.device = resolve_device(cfg.learner.device)
        self.model = build_model(cfg.model, self.device)
        lc = cfg.learner
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=lc.lr, betas=tuple(lc.betas),
                                     weight_decay=lc.weight_decay)

    def weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        return hf_state(self.model)

    def hf_config(self) -> dict:
        return hf_config(self.model)

    def train_step(self, groups: list[Group], advantages: torch.Tensor) -> dict[str, float]:
        a, temp = self.cfg.algo, self.cfg.rollout.temperature
        self.model.train()
        self.opt.zero_grad(set_to_none=True)
        total_tokens = sum(g.num_tokens for g in groups)
        sums: dict[str, float] = {}
        maxes = {"ratio_max": 0.0, "logprob_diff_max": 0.0}
        mb = self.cfg.learner.micro_batch_groups
        for i in range(0, len(groups), mb):
            ids, attn, resp, old, mask, index = self._pack(groups[i:i + mb])
            adv = advantages[i:i + mb].reshape(-1).to(self.device, torch.float32)
            logits = self.model(input_ids=ids, attention_mask=attn).logits
            logits = logits.gather(1, index.unsqueeze(-1).expand(-1, -1, logits.shape[-1]))
            logp = algorithms.token_logprobs(logits, resp, temp)
            loss, st = algorithms.clipped_policy_loss(logp, old, adv, mask, a.clip_ratio_low,
                                                      a.clip_ratio_high, num_tokens=total_tokens)
            loss.backward()
            with torch.no_grad():
                diff = (logp - old).abs() * mask
                st["logprob_diff_sum"] = diff.sum()
                st["entropy_sum"] = (algorithms.token_entropy(logits, temp) * mask).sum()
                st["loss"] = loss
            for k, v in st.items():
                if k.endswith("_max"):
                    continue
                sums[k] = sums.get(k, 0.0) + float(v)
            maxes["ratio_max"] = max(maxes["ratio_max"], float(st["ratio_max"]))
            maxes["logprob_diff_max"] = max(maxes["logprob_diff_max"], float(diff.max()))
        clip = self.cfg.learner.grad_clip
        params = [p for p in self.model.parameters() if p.grad is not None]
        grad_norm = torch.nn.utils.clip_grad_norm_(params, clip if clip > 0 else float("inf"))
        self.opt.step()
        self.model.eval()
        n = max(sums["tokens"], 1.0)
        return {
            "loss": sums["loss"],
            "grad_norm": float(grad_norm),
            "clip_frac_low": sums["clip_low_tokens"] / n,
            "clip_frac_high": sums["clip_high_tokens"] / n,
            "clip_frac": (sums["clip_low_tokens"] + sums["clip_high_tokens"]) / n,
            "ratio_mean": sums["ratio_sum"] / n,
            "ratio_max": maxes["ratio_max"],
            "approx_kl": sums["kl_sum"] / n,
            "entropy": sums["entropy_sum"] / n,
            "logprob_diff_mean": sums["logprob_diff_sum"] / n,
            "logprob_diff_max": maxes["logprob_diff_max"],
        }

    def _pack(self, groups: list[Group]):
        """Right-padded prompt+response ids, and per response: tokens, old logprobs, mask, logit index."""
        rows = [(g.prompt, r, lp) for g in groups for r, lp in zip(g.responses, g.logprobs)]
        width = max(len(p) + len(r) for p, r, _ in rows)
        rmax = max(max(len(r) for _, r, _ in rows), 1)
        b = len(rows)
        ids = torch.zeros((b, width), dtype=torch.long)
        attn = torch.zeros((b, width), dtype=torch.long)
        resp = torch.zeros((b, rmax), dtype=torch.long)
        old = torch.zeros((b, rmax), dtype=torch.float32)
        mask = torch.zeros((b, rmax), dtype=torch.float32)
        index = torch.zeros((b, rmax), dtype=torch.long)
        for i, (p, r, lp) in enumerate(rows):
            n_p, n_r = len(p), len(r)
            ids[i, :n_p] = torch.from_numpy(p.astype("int64"))
            ids[i, n_p:n_p + n_r] = torch.from_numpy(r.astype("int64"))
            attn[i, :n_p + n_r] = 1
            resp[i, :n_r] = ids[i, n_p:n_p + n_r]
            old[i, :n_r] = torch.from_numpy(lp)
            mask[i, :n_r] = 1
            index[i] = (torch.arange(rmax) + n_p - 1).clamp(max=width - 1)
        d = self.device
        return ids.to(d), attn.to(d), resp.to(d), old.to(d), mask.to(d), index.to(d)
