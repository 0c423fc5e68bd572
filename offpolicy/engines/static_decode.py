"""A static KV cache and a CUDA-graph decode step for the embedded torch engine (`rollout.static_cache`).

`StaticDecoder(model, rows, length)` owns an HF `StaticCache` of `rows` sequences x `length` positions
and fixed input buffers (token ids, position ids, a 4-D attention mask over the whole cache). The
prefill runs eagerly and fills positions 0..W-1 of the cache; each decode step writes its inputs into
the fixed buffers and runs the model on them. On CUDA that step is captured once as a CUDA graph and
replayed: one launch instead of hundreds of kernel launches per token, which is what bounds a small
model's decoding. With `compile` (`rollout.compile`) the step is first compiled by `torch.compile`
(inductor), which fuses its many small elementwise kernels; the graph then replays those. The graph
reads the model's parameters in place, so a weight swap (`load_version`, an in-place copy) needs no
new capture. Logits are the model's own, so logprobs stay exact.

Masks: a prompt's left padding is masked out; a padding position attends to itself only (a row with
nothing to attend to would give NaN); positions past the current step are masked, so what a previous
batch left in the cache is never read. Full-attention decoders only (Llama, Qwen2/3, ...).
"""

from __future__ import annotations

import torch


class StaticDecoder:
    def __init__(self, model: torch.nn.Module, rows: int, length: int, graph: bool, compile: bool = False):
        from transformers import StaticCache

        self.model, self.rows, self.length = model, rows, length
        self.cache = StaticCache(config=model.config, max_cache_len=length)
        if any(getattr(layer, "is_sliding", False) for layer in self.cache.layers):
            raise ValueError("rollout.static_cache: the model has sliding-window layers; set it to false")
        impl = getattr(model.config, "_attn_implementation", "sdpa")
        if impl not in ("sdpa", "eager"):
            raise ValueError(f"rollout.static_cache needs sdpa or eager attention, the model uses {impl}")
        self.bool_mask = impl == "sdpa"
        dev = next(model.parameters()).device
        self.ids = torch.zeros((rows, 1), dtype=torch.long, device=dev)
        self.pos = torch.zeros((rows, 1), dtype=torch.long, device=dev)
        self.allowed = torch.zeros((rows, 1, 1, length), dtype=torch.bool, device=dev)
        dtype = next(model.parameters()).dtype
        self.mask = self.allowed if self.bool_mask else torch.zeros((rows, 1, 1, length), dtype=dtype, device=dev)
        self.width = 0
        self.graph: torch.cuda.CUDAGraph | None = None
        self.logits: torch.Tensor | None = None
        # inductor fuses the step's elementwise kernels (norms, rotary, activations): fewer, larger kernels
        self._step = torch.compile(self._forward, dynamic=False, fullgraph=True) if compile else self._forward
        if graph:
            self._capture()

    def _forward(self) -> torch.Tensor:
        out = self.model(input_ids=self.ids, attention_mask=self.mask, position_ids=self.pos,
                         past_key_values=self.cache, use_cache=True)
        return out.logits[:, -1, :]

    def _capture(self) -> None:
        """Warm up (allocates the cache) on a side stream, capture one decode step, then reset the cache."""
        self.allowed.fill_(True)
        self._sync_mask()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(3):  # the first call compiles, when compiling
                self._step()
        torch.cuda.current_stream().wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.logits = self._step()
        torch.cuda.synchronize()
        self.cache.reset()

    def _sync_mask(self) -> None:
        if not self.bool_mask:
            self.mask.copy_(torch.where(self.allowed, 0.0, torch.finfo(self.mask.dtype).min))

    @torch.no_grad()
    def prefill(self, ids: torch.Tensor, attn: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """Run the left-padded prompts `ids` [rows, W] into the cache; the last position's logits."""
        rows, w = ids.shape
        if rows != self.rows or w >= self.length:
            raise ValueError(f"prefill of {rows} x {w} into a static cache of {self.rows} x {self.length}")
        self.cache.reset()
        self.width = w
        keys = attn.bool()
        causal = torch.ones((w, w), dtype=torch.bool, device=ids.device).tril()
        allowed = causal[None] & keys[:, None, :] | torch.eye(w, dtype=torch.bool, device=ids.device)[None]
        full = torch.zeros((rows, 1, w, self.length), dtype=torch.bool, device=ids.device)
        full[:, 0, :, :w] = allowed
        mask = full if self.bool_mask else torch.where(full, 0.0, torch.finfo(self.mask.dtype).min).to(self.mask.dtype)
        out = self.model(input_ids=ids, attention_mask=mask, position_ids=pos, past_key_values=self.cache,
                         use_cache=True, logits_to_keep=1)
        self.allowed.zero_()
        self.allowed[:, 0, 0, :w] = keys
        self.pos.copy_(pos[:, -1:])
        return out.logits[:, -1, :]

    @torch.no_grad()
    def step(self, tokens: torch.Tensor, t: int) -> torch.Tensor:
        """Feed the tokens sampled at step `t` (written at cache position W + t); the next logits."""
        if self.width + t >= self.length:
            raise ValueError(f"decode step {t} past the static cache length {self.length}")
        self.ids.copy_(tokens[:, None])
        self.pos.add_(1)
        self.allowed[:, 0, 0, self.width + t] = True
        self._sync_mask()
        if self.graph is None:
            return self._step()
        self.graph.replay()
        return self.logits
