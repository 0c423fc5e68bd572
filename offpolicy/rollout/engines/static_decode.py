"""A static KV cache and a CUDA-graph decode step for the embedded torch engine (`rollout.static_cache`).

`StaticDecoder(model, rows, length)` owns an HF `StaticCache` of `rows` sequences x `length` positions,
fixed input buffers (token ids, position ids, a 4-D attention mask over the whole cache), a float32
buffer with the current logits and two device counters (the prompt width and the decode step). The
prefill runs eagerly and fills positions 0..W-1 of the cache. `feed(tokens)` writes the sampled
tokens into the input buffers and runs the model once (its logits replace `logits`), with no host
synchronisation, so the caller's whole decode step (sample from `logits`, bookkeeping, `feed`) can be
captured as one CUDA graph with `prepare(key, make)` and replayed with `replay(key)`: one launch
per token instead of hundreds of kernel launches for the model and a few dozen for the sampler, which
is what bounds a small model's decoding. Off CUDA `replay` runs the same body eagerly. With `compile`
(`rollout.compile`) the model step is first compiled by `torch.compile` (inductor), which fuses its
many small elementwise kernels; the graph then replays those. Graphs read the model's parameters in
place, so a weight swap (`load_version`, an in-place copy) needs no new capture; the double buffer's
swap points the parameters at other storage, so the engine keys its steps by the live set of weights too
(one capture per set). Logits are the
model's own, so logprobs stay exact.

Masks: a prompt's left padding is masked out; a padding position attends to itself only (a row with
nothing to attend to would give NaN); positions past the current step are masked, so what a previous
batch left in the cache is never read. Full-attention decoders only (Llama, Qwen2/3, ...).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Any

import torch

_MAX_GRAPHS = 4  # decode steps (and graphs) kept per decoder: one per distinct sampling set-up


def unsupported(model: torch.nn.Module) -> str | None:
    """Why `model` cannot decode with a static cache (sliding-window layers, an attention implementation
    other than sdpa or eager), or None if it can. (An HF StaticCache allocates nothing until used.)"""
    from transformers import StaticCache

    if any(getattr(layer, "is_sliding", False) for layer in StaticCache(config=model.config, max_cache_len=1).layers):
        return "the model has sliding-window layers"
    impl = getattr(model.config, "_attn_implementation", "sdpa")
    if impl not in ("sdpa", "eager"):
        return f"it needs sdpa or eager attention, the model uses {impl}"
    return None


class StaticDecoder:
    def __init__(self, model: torch.nn.Module, rows: int, length: int, graph: bool, compile: bool = False):
        from transformers import StaticCache

        problem = unsupported(model)
        if problem is not None:
            raise ValueError(f"rollout.static_cache: {problem}; set it to false (or auto)")
        self.model, self.rows, self.length = model, rows, length
        self.cache = StaticCache(config=model.config, max_cache_len=length)
        self.bool_mask = getattr(model.config, "_attn_implementation", "sdpa") == "sdpa"
        dev = next(model.parameters()).device
        self.ids = torch.zeros((rows, 1), dtype=torch.long, device=dev)
        self.pos = torch.zeros((rows, 1), dtype=torch.long, device=dev)
        self.allowed = torch.zeros((rows, 1, 1, length), dtype=torch.bool, device=dev)
        dtype = next(model.parameters()).dtype
        self.mask = self.allowed if self.bool_mask else torch.zeros((rows, 1, 1, length), dtype=dtype, device=dev)
        self.logits = torch.zeros((rows, model.config.vocab_size), dtype=torch.promote_types(dtype, torch.float32),
                                  device=dev)  # the logits the next decode step samples from
        self.width = torch.zeros(1, dtype=torch.long, device=dev)  # prompt width of the current batch
        self.t = torch.zeros(1, dtype=torch.long, device=dev)  # decode steps fed since the prefill
        self.graphed = graph
        self._steps: dict[Hashable, tuple[Any, Callable[[], None], torch.cuda.CUDAGraph | None]] = {}
        self._pool = torch.cuda.graph_pool_handle() if graph else None  # graphs replay one at a time: one pool
        # inductor fuses the step's elementwise kernels (norms, rotary, activations): fewer, larger kernels
        self._step = torch.compile(self._forward, dynamic=False, fullgraph=True) if compile else self._forward

    def _forward(self) -> torch.Tensor:
        out = self.model(input_ids=self.ids, attention_mask=self.mask, position_ids=self.pos,
                         past_key_values=self.cache, use_cache=True)
        return out.logits[:, -1, :]

    def _sync_mask(self) -> None:
        if not self.bool_mask:
            self.mask.copy_(torch.where(self.allowed, 0.0, torch.finfo(self.mask.dtype).min))

    def prepare(self, key: Hashable, make: Callable[[], tuple[Any, Callable[[], None]]]) -> Any:
        """The decode step registered for `key`, made first if new: `make()` gives `(state, body)`, where
        `body` is one decode step (reads `logits` and `state`, calls `feed`, no host syncs); on CUDA it is
        captured as a graph. Returns `state`. The decoder keeps state, body and graph together (a graph
        writes into its state's buffers, so they live as long as it). Capturing runs the body on whatever
        the buffers hold, so call this before `prefill`, which resets them."""
        if key in self._steps:
            return self._steps[key][0]
        if len(self._steps) >= _MAX_GRAPHS:
            del self._steps[next(iter(self._steps))]
        state, body = make()
        graph = self._capture(body) if self.graphed else None
        self._steps[key] = (state, body, graph)
        return state

    def _capture(self, body: Callable[[], None]) -> torch.cuda.CUDAGraph:
        self.allowed.fill_(True)
        self.width.zero_()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(3):  # the first call compiles, when compiling
                self.t.zero_()
                body()
        torch.cuda.current_stream().wait_stream(side)
        self.t.zero_()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            body()
        torch.cuda.synchronize()
        return graph

    def replay(self, key: Hashable) -> None:
        """One decode step of `key`: its graph, or its body itself off CUDA."""
        _, body, graph = self._steps[key]
        if graph is None:
            body()
        else:
            graph.replay()

    @torch.no_grad()
    def prefill(self, ids: torch.Tensor, attn: torch.Tensor, pos: torch.Tensor) -> None:
        """Run the left-padded prompts `ids` [rows, W] into the cache; their last logits go to `logits`."""
        rows, w = ids.shape
        if rows != self.rows or w >= self.length:
            raise ValueError(f"prefill of {rows} x {w} into a static cache of {self.rows} x {self.length}")
        self.cache.reset()
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
        self.width.fill_(w)
        self.t.zero_()
        self.logits.copy_(out.logits[:, -1, :])

    def feed(self, tokens: torch.Tensor) -> None:
        """Feed the tokens sampled at the current step (cache position W + t, both on the device) and
        advance; the next logits land in `logits`. No host synchronisation: safe inside a captured graph."""
        self.ids.copy_(tokens[:, None])
        self.pos.add_(1)
        self.allowed.index_fill_(3, self.width + self.t, True)
        self.t.add_(1)
        self._sync_mask()
        self.logits.copy_(self._step())
