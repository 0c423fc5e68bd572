"""The embedded rollout engine: an HF `transformers` causal LM with batched KV-cache sampling.

Prompts are left-padded into one batch (each repeated `n` times), prefilled once, then decoded one
token per step with the model's KV cache. The prefill runs the lm_head on each row's last prompt position only
(`logits_to_keep=1`, both caches): nothing reads a prompt token's logprob, and logits of every prompt position
would cost rows x prompt length x vocab (48 GiB at 256 x 500 x GPT-OSS's 201,088, measured). Sampling applies temperature, then top-k and top-p; the
behaviour logprob of a sampled token is taken from the temperature-scaled distribution before top-k/
top-p filtering, which is the distribution the learner scores. A response ends on a stop token, kept in the
response ("stop": the tokenizer's EOS, an EOS id of the model's config.json / generation_config.json, or one of
`params.stop_token_ids`, `model_stop_ids`, the ids vLLM and SGLang stop on too), or at `max_new_tokens` ("length").

Tokens are drawn by inverse CDF from uniform noise fixed before decoding: from the engine's own
generator, or, when `seeds` are given (one per prompt), from a generator per response seeded by its
prompt's seed, so a prompt's responses do not depend on which daemon or batch generated them.

The KV cache is a static one on a GPU (`rollout.static_cache: auto`, `decode_mode`) whose decode step
is a captured CUDA graph (`static_decode.StaticDecoder`; `rollout.compile`, also on by `auto` on a GPU,
compiles the model step first), else HF's dynamic one (on the CPU, or for a model the static cache
cannot run). With the static cache, sampling and bookkeeping run in the same graph, reading and writing
fixed device buffers (`_SampleState`), and "all stopped?" is asked every `_SYNC_EVERY` steps instead of
every step (each question is a host sync). Weight swaps read the version's shards with parallel `preadv`
(`weights.transfer.load_version`), straight into the parameters in place; a low-bit version (fp8,
mxfp4: `rollout.weights_format`) is read the same way, its quantized weights staged on the engine's device and
dequantized there into the parameters in place (`weights.lowbit_load`: the model's tensors keep their storage and
strides, no second copy of the model is made), unless
`rollout.fp8_matmul` keeps an fp8 version's linear weights in fp8 (`fp8_matmul`, `fp8_linear.Fp8Linear`: the
model then holds the version's fp8 weights and block scales, read in byte for byte like a native version's). With
`rollout.double_buffer` (`double_buffer.DoubleBuffer`, `prefetcher`) the same read fills a second set of
weights in a background thread (its own CUDA stream) as soon as the daemon hears of a version, and `load`
only waits for that read to end (if it has not) and swaps the parameters' storage; decode graphs are then
captured once per set. Either way a version is checked against the model (names, shapes) before a byte of
it is read, and `version` changes only when its weights are the ones `generate` reads.

With `rollout.inflight_updates` (`inflight_updates` resolves it) a generation also moves to a newer version
between decode steps, as PipelineRL does: before each forward it asks the double buffer for a version newer
than the one it holds and ready in the spare (`DoubleBuffer.take_ready`, no wait); if there is one it is
swapped in and decoding goes on with the KV cache as it is (the earlier tokens' keys and values stay those
of the older version). The forward that feeds token t-1 under the new version gives the logits of token t,
so token t is the first the new version produced: its behaviour logprob is that version's, and every
`Completion` carries its tokens' versions as runs (`version_runs`, `wire.versions`). A captured CUDA graph
reads the bank it was captured with, so graphed static decoding cannot switch (true is refused there).
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable

import numpy as np
import torch

from offpolicy.config import Config
from offpolicy.data.tokenizer import load_tokenizer
from offpolicy.models.build import build_model, checkpoint_tensors, resolve_device
from offpolicy.rollout.engines import Completion, SamplingParams, fp8_matmul, model_stop_ids, request_stops
from offpolicy.rollout.engines.double_buffer import DoubleBuffer, double_buffered, weight_bytes
from offpolicy.rollout.engines.prefill import chunk_tokens, spans
from offpolicy.rollout.engines.static_decode import StaticDecoder, unsupported
from offpolicy.weights import WeightVersion, lowbit_load
from offpolicy.weights.formats import NATIVE
from offpolicy.weights.maps import shared as shared_maps
from offpolicy.weights.transfer import load_version
from offpolicy.wire.versions import response_runs


log = logging.getLogger("offpolicy.rollout.engines.torch")

_SYNC_EVERY = 16  # static cache: decode steps between checks that every response has stopped


class TorchEngine:
    def __init__(self, cfg: Config, seed: int = 0):
        self.device = resolve_device(cfg.rollout.device)
        self.model = build_model(cfg.model, self.device)
        # rollout.fp8_matmul: fp8 versions kept in fp8 and multiplied by torch's scaled matmul, or dequantized on load
        self.fp8 = fp8_matmul.plan(cfg, self.model, self.device)
        if self.fp8.scaled:
            fp8_matmul.convert(self.model, self.fp8)
        if self.fp8.mode != "off":
            log.info("%s versions: %s (%s)", cfg.rollout.weights_format,
                     f"fp8 weights, {len(self.fp8.modules)} linears in {self.fp8.kernel} scaled matmuls"
                     if self.fp8.scaled else "dequantized to the model's dtype on load", self.fp8.reason)
        self.tokenizer = load_tokenizer(cfg.model.tokenizer)
        self.stop_ids = model_stop_ids(cfg.model, self.tokenizer.eos_token_id)  # and each request's stop_token_ids
        self.version = -1
        self.aborted = 0  # an embedded engine aborts nothing
        self.last_loads: list[dict] = []  # no servers
        self._gen = torch.Generator(device=self.device)
        self._gen.manual_seed(seed)
        problem = unsupported(self.model)
        self.static_cache, self.compile = decode_mode(cfg.rollout.static_cache, cfg.rollout.compile,
                                                      self.device.type == "cuda", problem)
        if self.static_cache:
            how = "a static KV cache" + (", CUDA graphs" if self.device.type == "cuda" else "")
            how += ", compiled" if self.compile else ""
        else:
            how = "HF's dynamic KV cache" + (f" (no static cache: {problem})" if problem else "")
        log.info("decoding with %s", how)
        self.prefill_chunk_setting = cfg.rollout.prefill_chunk_tokens  # the dynamic cache's prefill (prefill.py)
        self._decoders: dict[tuple[int, int], StaticDecoder] = {}  # by (rows, cache length); two at most
        # weights.register_maps: shard files met again are copied to the GPU from page-locked maps (weights/maps.py)
        on_gpu = cfg.weights.register_maps and self.device.type == "cuda"
        self._maps = shared_maps(cfg.weights.keep + 2) if on_gpu else None
        # rollout.double_buffer: versions read into a second set of weights in the background (see the module doc)
        on = double_buffered(cfg.rollout.double_buffer, weight_bytes(self.model), self.device)
        on = on or cfg.rollout.inflight_updates is True  # in-flight switches take versions read into the spare
        self.prefetcher: DoubleBuffer | None = DoubleBuffer(self.model, self._read, self.device) if on else None
        # rollout.inflight_updates: switch to a newer version between decode steps (see the module doc)
        self.inflight = inflight_updates(cfg.rollout.inflight_updates, on, self.static_cache and self.device.type == "cuda")
        self._switches: list[tuple[int, int]] = []  # this generate call's (first token index, version)

    def load(self, weights: WeightVersion) -> float:
        """Swap to `weights`: in place, or with the double buffer by swapping in the spare weights once the
        background read of this version is over (started here if nobody asked for it). Returns the seconds
        the swap took: with the double buffer, only what the read had left plus the pointer swap."""
        t0 = time.perf_counter()
        if self.prefetcher is not None:
            self.prefetcher.prefetch(weights)  # nothing new if it is being read or ready already
            self.prefetcher.swap_in(weights.version, weights.manifest.created_unix)  # VersionRefused if it failed
        else:
            self._read(weights, checkpoint_tensors(self.model))  # in place
        self.version = weights.version
        return time.perf_counter() - t0

    def _read(self, weights: WeightVersion, dest: dict[str, torch.Tensor]) -> None:
        """Read `weights` into `dest` (the model's tensors, or the spare ones, by checkpoint name), after checking
        that it fits. For the double buffer (a background thread) the copies to a GPU are queued on the
        thread's current stream, the buffer's own, which the buffer waits for, not on the whole device."""
        background = self.prefetcher is not None
        if self.fp8.scaled:  # the model holds fp8 weights and scales: the version's bytes go in as they are
            qc = json.loads((weights.path / "config.json").read_text()).get("quantization_config") or {}
            fp8_matmul.check_version(weights.version, weights.manifest.format, qc, self.fp8)
        if weights.manifest.format == NATIVE or self.fp8.scaled:
            meta = {n: (tuple(t.shape), t.dtype) for n, t in weights.tensors.items()}
            self._check_fits(weights.version, meta, dest)  # refuse before touching a single tensor
            load_version(dest, weights.path, maps=self._maps, sync=not background)
        else:  # fp8 / mxfp4: dequantized on the engine's device straight into the destination, in place
            dtype = next(iter(dest.values())).dtype
            self._check_fits(weights.version, lowbit_load.shapes(weights, dtype), dest)
            lowbit_load.read_into(weights, dest, maps=self._maps, sync=not background)

    def _check_fits(self, version: int, meta: dict[str, tuple[tuple[int, ...], torch.dtype]],
                    own: dict[str, torch.Tensor]) -> None:
        """Refuse a version (`meta`: name -> (shape, dtype) of what it writes) that does not fit `own`."""
        tied = {k for k in own if getattr(self.model.config, "tie_word_embeddings", False) and k.startswith("lm_head")}
        missing = [k for k in own if k not in meta and k not in tied]
        unexpected = [k for k in meta if k not in own]
        shapes = [f"{k} {shape} != {tuple(own[k].shape)}" for k, (shape, _) in meta.items()
                  if k in own and shape != tuple(own[k].shape)]
        f8 = torch.float8_e4m3fn  # an fp8 tensor is read into an fp8 one only: a cast would drop its block scales
        shapes += [f"{k} {dtype} into {own[k].dtype}" for k, (_, dtype) in meta.items()
                   if k in own and (dtype == f8) != (own[k].dtype == f8)]
        if missing or unexpected or shapes:
            raise ValueError(f"weight version {version} does not fit the engine's model: missing {missing[:5]}, "
                             f"unexpected {unexpected[:5]}, shapes or dtypes {shapes[:5]}")

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], params: SamplingParams,
                 seeds: list[int] | None = None) -> list[list[Completion]]:
        pad = self.tokenizer.pad_token_id
        stops = torch.tensor(request_stops(self.stop_ids, params, prompts, seeds), device=self.device)
        rows = [p for p in prompts for _ in range(params.n)]
        width = max(len(p) for p in rows)
        ids = torch.full((len(rows), width), pad, dtype=torch.long)
        attn = torch.zeros((len(rows), width), dtype=torch.long)
        for i, p in enumerate(rows):
            ids[i, width - len(p):] = torch.tensor(p)
            attn[i, width - len(p):] = 1
        ids, attn = ids.to(self.device), attn.to(self.device)
        pos = (attn.cumsum(-1) - 1).clamp(min=0)
        noise = self._noise(len(prompts), params, seeds)
        self._switches = [(0, self.version)]
        run = self._decode_static if self.static_cache else self._decode_dynamic
        tokens, logps, lengths, stopped = run(ids, attn, pos, params, noise, stops, pad)
        tokens, logps = tokens.cpu().numpy().astype(np.int32), logps.cpu().numpy().astype(np.float32)
        lengths, stopped = lengths.cpu().numpy(), stopped.cpu().numpy()
        comps = [Completion(tokens=tokens[i, : lengths[i]].copy(), logprobs=logps[i, : lengths[i]].copy(),
                            finish_reason="stop" if stopped[i] else "length",
                            version_runs=response_runs(self._switches, int(lengths[i]))) for i in range(len(rows))]
        return [comps[j * params.n:(j + 1) * params.n] for j in range(len(prompts))]

    def interrupt(self) -> None:
        """Nothing waits here but the generation itself, which ends on its own."""

    def on_lost(self, callback: Callable[[str], None]) -> None:
        """Never lost: the model runs in the daemon's own process."""

    def close(self) -> None:
        """Stop the double buffer's reads, if any; the model goes with the process."""
        if self.prefetcher is not None:
            self.prefetcher.close()

    def _decode_dynamic(self, ids, attn, pos, params, noise, stops, pad):
        """Decode with HF's dynamic KV cache (the attention mask grows), one eager step per token. The prefill
        computes the lm_head at the last position only (`logits_to_keep=1`: prompts are left-padded, so it is every
        row's last prompt token): rows x vocab logits, not rows x prompt length x vocab; it runs in chunks of
        positions where the whole prompt's attention scores would not fit (prefill.py)."""
        o = None
        for start, end in spans(ids.shape[1], self._prefill_chunk(ids.shape)):  # prefill.py: scores that fit
            o = self.model(input_ids=ids[:, start:end], attention_mask=attn[:, :end], position_ids=pos[:, start:end],
                           past_key_values=None if o is None else o.past_key_values, use_cache=True, logits_to_keep=1)
        state = _SampleState(ids.shape[0], params.max_new_tokens, self.device)
        state.reset(noise)
        past, logits = o.past_key_values, o.logits[:, -1, :]
        step = torch.zeros(1, dtype=torch.long, device=self.device)
        for t in range(params.max_new_tokens):
            tok = state.step(logits, step, params, stops, pad)
            step += 1
            if bool(state.done.all()):
                break
            if t + 1 < params.max_new_tokens:
                if self.inflight:
                    self._switch(t + 1)  # the forward feeding token t gives token t + 1's logits
                attn = torch.cat([attn, torch.ones_like(attn[:, :1])], dim=-1)
                pos = pos[:, -1:] + 1
                o = self.model(input_ids=tok[:, None], attention_mask=attn, position_ids=pos,
                               past_key_values=past, use_cache=True)
                past, logits = o.past_key_values, o.logits[:, -1, :]
        return state.result(t + 1)

    def _prefill_chunk(self, shape: tuple[int, int]) -> int:
        """Prompt positions per prefill forward (prefill.py) for `shape` = (rows, width)."""
        config = self.model.config
        return chunk_tokens(shape[0], int(config.num_attention_heads), shape[1], self.prefill_chunk_setting,
                            eager=getattr(config, "_attn_implementation", "sdpa") == "eager")

    def _decode_static(self, ids, attn, pos, params, noise, stops, pad):
        """Decode with a static KV cache; each step (sample, bookkeeping, next forward) is one CUDA graph
        on a GPU. "All stopped?" is asked every `_SYNC_EVERY` steps (a host sync each time)."""
        rows, width = ids.shape
        quantum = 256 if self.compile else 64  # fewer distinct lengths: each one compiles anew
        length = -(-(width + params.max_new_tokens) // quantum) * quantum
        key = (rows, length)
        if key not in self._decoders:
            if len(self._decoders) >= 2:
                del self._decoders[next(iter(self._decoders))]
            self._decoders[key] = StaticDecoder(self.model, rows, length, graph=self.device.type == "cuda",
                                                compile=self.compile)
        dec = self._decoders[key]

        def make() -> tuple[_SampleState, Callable[[], None]]:
            state = _SampleState(rows, params.max_new_tokens, self.device)
            return state, lambda: dec.feed(state.step(dec.logits, dec.t, params, stops, pad))

        bank = self.prefetcher.live if self.prefetcher is not None else 0  # a graph reads the weights it captured
        skey = (params.max_new_tokens, params.temperature, params.top_k, params.top_p, tuple(stops.tolist()), pad,
                bank)
        state = dec.prepare(skey, make)
        dec.prefill(ids, attn, pos)
        state.reset(noise)
        steps = 0
        for steps in range(1, params.max_new_tokens + 1):
            if self.inflight:
                self._switch(steps)  # this step samples token steps - 1, its forward gives token steps' logits
            dec.replay(skey)
            if steps % _SYNC_EVERY == 0 and bool(state.done.all()):
                break
        return state.result(steps)

    def _switch(self, start: int) -> None:
        """Between decode steps: swap in a newer version ready in the spare, if any; tokens from `start` on are its."""
        v = self.prefetcher.take_ready(self.version)
        if v is not None:
            self.version = v
            self._switches.append((start, v))

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


def decode_mode(static_cache: bool | str, compile: bool | str, cuda: bool, problem: str | None) -> tuple[bool, bool]:
    """(static cache, compile) from `rollout.static_cache` / `rollout.compile`: "auto" is the fast path
    where it is safe, a static cache replayed as a CUDA graph and compiled on a GPU (several times faster
    `generate` on a GPU; docs/benchmarks.md) when the model allows one (`problem` is None), else HF's
    dynamic cache (on the CPU the static cache gains little). An explicit true stays
    true (an unsupported model then fails with the reason)."""
    static = (cuda and problem is None) if static_cache == "auto" else bool(static_cache)
    return static, (static and cuda) if compile == "auto" else bool(compile)


def inflight_updates(setting: bool | str, double_buffer: bool, graphs: bool) -> bool:
    """`rollout.inflight_updates` resolved for the torch engine: it needs the double buffer (`double_buffer`, on)
    and decode steps that are not captured CUDA graphs (`graphs`: a graph reads the weights it captured). auto is
    on wherever it can run: switching costs nothing the double buffer had not paid already (no wait, a pointer swap)
    and makes the tokens of generations longer than a learner step fresher (docs/benchmarks.md)."""
    if setting == "auto":
        return double_buffer and not graphs
    if setting and graphs:
        raise ValueError("rollout.inflight_updates is true, but the decode step is a captured CUDA graph, which reads "
                         "the weights it was captured with; set rollout.static_cache=false, or "
                         "rollout.inflight_updates=auto or false")
    return bool(setting) and double_buffer


def sample_tokens(logits: torch.Tensor, params: SamplingParams, u: torch.Tensor) -> torch.Tensor:
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


class _SampleState:
    """Device buffers of one decode run: the noise, the sampled tokens and logprobs, and which rows have
    stopped. `step` reads and writes them in place with no host sync (so it can live in a CUDA graph)."""

    def __init__(self, rows: int, max_new: int, device: torch.device):
        self.noise = torch.zeros((rows, max_new), dtype=torch.float64, device=device)
        self.tokens = torch.zeros((rows, max_new), dtype=torch.long, device=device)
        self.logps = torch.zeros((rows, max_new), dtype=torch.float32, device=device)
        self.done = torch.zeros(rows, dtype=torch.bool, device=device)
        self.stopped = torch.zeros_like(self.done)
        self.lengths = torch.zeros(rows, dtype=torch.long, device=device)

    def reset(self, noise: torch.Tensor) -> None:
        self.noise.copy_(noise)
        for buf in (self.tokens, self.logps, self.done, self.stopped, self.lengths):
            buf.zero_()

    def step(self, logits: torch.Tensor, t: torch.Tensor, params: SamplingParams,
             stops: torch.Tensor, pad: int) -> torch.Tensor:
        """Sample step `t` (a one-element device tensor) from `logits`; the tokens (pad for stopped rows)."""
        logits = logits.to(torch.promote_types(logits.dtype, torch.float32)) / params.temperature
        logp = torch.log_softmax(logits, dim=-1)
        tok = sample_tokens(logits, params, self.noise.index_select(1, t).squeeze(1))
        tok = torch.where(self.done, pad, tok)
        self.tokens.index_copy_(1, t, tok[:, None])
        self.logps.index_copy_(1, t, logp.gather(-1, tok[:, None]).to(torch.float32))
        self.lengths += (~self.done).long()
        hit = (tok[:, None] == stops).any(-1) & ~self.done
        self.stopped |= hit
        self.done |= hit
        return tok

    def result(self, steps: int):
        """Tokens and logprobs of the first `steps` steps, response lengths, and which rows stopped."""
        return self.tokens[:, :steps], self.logps[:, :steps], self.lengths, self.stopped
