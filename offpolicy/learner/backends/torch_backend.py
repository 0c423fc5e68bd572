"""The embedded learner backend: an HF `transformers` causal LM trained with AdamW.

Each step packs the batch's responses (prompt + response, right-padded) into micro-batches of
`learner.micro_batch_groups` groups, recomputes the token logprobs at the rollout temperature and
applies the learner's `policy_loss` (offpolicy/learner/loss.py: clipped ratio, optional dual clip, TIS /
icepop corrections, KL to a frozen reference, entropy bonus). Every term is aggregated with the whole batch's denominators, so gradient
accumulation equals one big batch. Then it clips the global grad norm and steps AdamW.

One optimizer step per batch means the learner's logprobs "before the update" (`algo.logp_old =
recompute`, the proximal policy of decoupled PPO) are exactly this forward pass, detached: no extra
forward is needed. The reference model exists only when `algo.kl_loss_coef > 0`.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors.torch import load_model, save_model

from offpolicy.config import Config
from offpolicy.hub.batch import Group
from offpolicy.learner import algorithms
from offpolicy.learner.loss import policy_loss, step_report
from offpolicy.models.build import build_model, hf_config, hf_state, resolve_device


class TorchBackend:
    def __init__(self, cfg: Config):
        self.cfg = cfg
        self.device = resolve_device(cfg.learner.device)
        self.model = build_model(cfg.model, self.device)
        self.ref = None
        if cfg.algo.kl_loss_coef > 0:
            self.ref = copy.deepcopy(self.model).eval().requires_grad_(False)
        lc = cfg.learner
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=lc.lr, betas=tuple(lc.betas),
                                     weight_decay=lc.weight_decay)
        self.startup: dict[str, float] = {}  # one process, one phase: the loop times the whole build

    def publish(self, version: int, fmts: list[str], w, run: str) -> None:
        """No shards of its own: the publisher writes `weights()` (one process holds the whole model)."""
        return None

    def serve(self) -> None:
        """No worker ranks: nothing to follow."""

    def close(self) -> None:
        """Nothing to release."""

    def weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        return hf_state(self.model)

    def save_checkpoint(self, path: Path) -> None:
        """Model (safetensors, HF names) and AdamW state (tensors and numbers only) into `path`."""
        save_model(self.model, str(path / "model.safetensors"))
        torch.save(self.opt.state_dict(), path / "optimizer.pt")

    def load_checkpoint(self, path: Path) -> None:
        missing, unexpected = load_model(self.model, str(path / "model.safetensors"), strict=True)
        self.opt.load_state_dict(torch.load(path / "optimizer.pt", weights_only=True, map_location=self.device))

    def hf_config(self) -> dict:
        return hf_config(self.model)

    def train_step(self, groups: list[Group], advantages: torch.Tensor) -> dict[str, float]:
        algo, temp = self.cfg.algo, self.cfg.rollout.temperature
        self.model.train()
        self.opt.zero_grad(set_to_none=True)
        totals = dict(num_tokens=sum(g.num_tokens for g in groups), num_seqs=sum(g.n for g in groups),
                      norm_len=self.cfg.rollout.max_new_tokens)
        sums: dict[str, float] = {}
        maxes: dict[str, float] = {}
        mb = self.cfg.learner.micro_batch_groups
        for i in range(0, len(groups), mb):
            ids, attn, resp, old, mask, index = self._pack(groups[i:i + mb])
            adv = advantages[i:i + mb].reshape(-1).to(self.device, old.dtype)
            logits = self._response_logits(self.model, ids, attn, index)
            logp = algorithms.token_logprobs(logits, resp, temp)
            with torch.set_grad_enabled(algo.entropy_coef > 0):
                entropy = algorithms.token_entropy(logits, temp)
            ref_logp = None
            if self.ref is not None:
                with torch.no_grad():
                    ref_logp = algorithms.token_logprobs(self._response_logits(self.ref, ids, attn, index), resp, temp)
            loss, st = policy_loss(logp, old, adv, mask, algo, **totals, ref_logp=ref_logp,
                                   entropy=entropy if algo.entropy_coef > 0 else None)
            loss.backward()
            st["loss"] = loss.detach()
            st["entropy_sum"] = (entropy.detach() * mask).sum()
            for k, v in st.items():
                if k.endswith("_max"):
                    maxes[k] = max(maxes.get(k, 0.0), float(v))
                else:
                    sums[k] = sums.get(k, 0.0) + float(v)
        clip = self.cfg.learner.grad_clip
        params = [p for p in self.model.parameters() if p.grad is not None]
        grad_norm = torch.nn.utils.clip_grad_norm_(params, clip if clip > 0 else float("inf"))
        self.opt.step()
        self.model.eval()
        return step_report(sums, maxes, float(grad_norm))

    @staticmethod
    def _response_logits(model, ids, attn, index) -> torch.Tensor:
        logits = model(input_ids=ids, attention_mask=attn).logits
        return logits.gather(1, index.unsqueeze(-1).expand(-1, -1, logits.shape[-1]))

    def _pack(self, groups: list[Group]):
        """Right-padded prompt+response ids, and per response: tokens, old logprobs, mask, logit index."""
        rows = [(g.prompt, r, lp) for g in groups for r, lp in zip(g.responses, g.logprobs)]
        width = max(len(p) + len(r) for p, r, _ in rows)
        rmax = max(max(len(r) for _, r, _ in rows), 1)
        b = len(rows)
        dtype = next(self.model.parameters()).dtype
        dtype = torch.promote_types(dtype, torch.float32)
        ids = torch.zeros((b, width), dtype=torch.long)
        attn = torch.zeros((b, width), dtype=torch.long)
        resp = torch.zeros((b, rmax), dtype=torch.long)
        old = torch.zeros((b, rmax), dtype=dtype)
        mask = torch.zeros((b, rmax), dtype=dtype)
        index = torch.zeros((b, rmax), dtype=torch.long)
        for i, (p, r, lp) in enumerate(rows):
            n_p, n_r = len(p), len(r)
            ids[i, :n_p] = torch.from_numpy(p.astype("int64"))
            ids[i, n_p:n_p + n_r] = torch.from_numpy(r.astype("int64"))
            attn[i, :n_p + n_r] = 1
            resp[i, :n_r] = ids[i, n_p:n_p + n_r]
            old[i, :n_r] = torch.from_numpy(lp).to(dtype)
            mask[i, :n_r] = 1
            index[i] = (torch.arange(rmax) + n_p - 1).clamp(max=width - 1)
        d = self.device
        return ids.to(d), attn.to(d), resp.to(d), old.to(d), mask.to(d), index.to(d)
