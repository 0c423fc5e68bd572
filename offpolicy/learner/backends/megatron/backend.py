"""The `megatron` learner backend: megatron-core GPTModel with TP/PP/DP, DDP and the distributed optimizer.

Every learner rank builds a `MegatronBackend`. Rank 0 (the hub) calls the LearnerBackend methods;
each call first broadcasts a command over the gloo control group, and ranks 1..k, parked in
`serve()`, run the same method so every collective happens in the same order on every rank. A step:
batching.plan cuts the responses into token-budget micro-batches per DP rank (packed end to end by
default, `learner.megatron.packing`; else right-padded), Megatron's forward-backward schedule
(PP-aware) runs them, the last stage returns final hidden states and the loss of each micro-batch is
`policy_loss` (the same GRPO loss as the torch backend) on vocab-parallel logprobs that logprobs.py
computes from them in vocabulary chunks, then the optimizer steps. Under DP the gradient reduce
overlaps the last micro-batch's backward (`overlap_grad_reduce`). With
`algo.kl_loss_coef > 0` a frozen reference stage (same HF weights, no optimizer) first runs the same
micro-batches forward-only, and its logprobs enter the loss's KL term. Loss
terms use whole-batch denominators, so micro-batch losses add up and DP gradients are summed
(`calculate_per_token_loss`, no 1/dp or 1/num_microbatches scaling). Statistics are reduced to every
rank. `weights()` streams full HF tensors to rank 0 one at a time (tests, tools); `publish(version, ...)`
is the learner's way: every rank that holds distinct pieces writes them into its node's store itself
(shards.py, weights/sharded.py), in a background thread while the next step trains.
"""

from __future__ import annotations

import atexit
import json
import logging
import time
from collections.abc import Iterator
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist

from offpolicy.config import Config, ConfigError
from offpolicy.hub.batch import Group
from offpolicy.learner.backends.megatron import (
    adam,
    arch as arch_mod,
    batching,
    budget,
    checkpointing,
    clip,
    families,
    heap,
    memory,
    microbatches,
    model as model_mod,
    offload,
)
from offpolicy.learner.backends.megatron.kernels import attention, norms, permutation
from offpolicy.learner.backends.megatron.kernels.logprobs import head_logprobs
from offpolicy.learner.backends.megatron.kernels.rows import select as select_rows
from offpolicy.learner.backends.megatron.parallel import Parallel
from offpolicy.learner.backends.megatron.source import HFSource, SeededSource
from offpolicy.learner.loss import policy_loss, step_report
from offpolicy.models.build import DTYPES, matmul_precision
from offpolicy.models import fp8_run

log = logging.getLogger("offpolicy.learner")


class MegatronBackend:
    def __init__(self, cfg: Config):
        from megatron.core.distributed import DistributedDataParallelConfig
        from megatron.core.distributed.finalize_model_grads import finalize_model_grads
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

        self.cfg, mc, lc = cfg, cfg.learner.megatron, cfg.learner
        if mc.packing and mc.transformer_impl == "transformer_engine":
            raise ConfigError("config field learner.megatron.packing: packed micro-batches run on the local spec's "
                              "core attention; set learner.megatron.transformer_impl=local (or auto), or packing=false")
        t0 = time.perf_counter()
        self.par = Parallel(cfg)
        self.hf_cfg, source = _hf_source(cfg, self.par.device)
        self.arch = families.from_hf(self.hf_cfg)
        check_layout(cfg, self.arch)
        self.te = model_mod.use_te(self.arch, mc.transformer_impl, packing=mc.packing)
        self.sp = mc.sequence_parallel and mc.tp > 1  # micro-batch lengths are padded to a multiple of tp
        dtype = DTYPES[cfg.model.dtype]
        matmul_precision(cfg.model, self.par.device)  # model.tf32: float32 models' products on tensor cores
        tconfig = arch_mod.transformer_config(self.arch, tp=mc.tp, pp=mc.pp, sequence_parallel=mc.sequence_parallel,
                                              dtype=dtype, recompute=mc.recompute,
                                              recompute_layers=mc.recompute_layers, ep=mc.ep, etp=mc.etp,
                                              moe_aux_loss_coef=mc.moe_aux_loss_coef,
                                              moe_dispatcher=mc.moe_token_dispatcher,
                                              fused=self.par.device.type == "cuda",
                                              swiglu_module=self.par.device.type == "cuda" and not self.te)
        self.grouped = model_mod.grouped_experts(mc.experts, self.te)  # MoE: stacked experts.GroupedExperts
        if self.arch.is_moe:  # the dispatchers' token permutation (learner.megatron.moe_permute)
            permutation.install(mc.moe_permute, tconfig)
        if mc.compile and self.par.device.type == "cuda":
            model_mod.compile_rope()
            norms.compile_head_norms()  # q/k norms (qk_norm families)
            attention.compile_sinks()  # compiles only where a model has sinks (GPT-OSS): at its first call
            if self.arch.is_moe and mc.moe_permute == "gather":
                permutation.compile_sums()
            if self.arch.is_moe and self.grouped:
                from offpolicy.learner.backends.megatron.kernels.experts import compile_elementwise

                compile_elementwise()
        stage = partial(model_mod.build, self.arch, tconfig, pre=self.par.first_stage, post=self.par.last_stage,
                        use_te=self.te, grouped=self.grouped)
        fill = partial(model_mod.load, arch=self.arch, source=source, tp_rank=self.par.tp_rank, tp=mc.tp,
                       pp_rank=self.par.pp_rank, pp=mc.pp, te=self.te, ep_rank=self.par.ep_rank, ep=mc.ep,
                       etp_rank=self.par.etp_rank, etp=mc.etp, grouped=self.grouped)
        t1 = time.perf_counter()
        with torch.device(self.par.device):
            module = stage()
        t2 = time.perf_counter()
        fill(module)
        self.ref = None  # the frozen reference policy of the KL loss: kept only when algo.kl_loss_coef > 0
        if cfg.algo.kl_loss_coef > 0:
            with torch.device(self.par.device):
                self.ref = stage().eval().requires_grad_(False)  # no DDP, no optimizer, no grads
            fill(self.ref)
        self._sync()
        t3 = time.perf_counter()
        self.loaded = dict(reads=dict(source.reads), bytes=source.bytes)  # what this rank read or drew
        source.close()
        del source
        heap.trim()  # the checkpoint's host copies (many MiB-sized reads) back to the system
        ddp = DistributedDataParallelConfig(grad_reduce_in_fp32=mc.grad_reduce_in_fp32,
                                            overlap_grad_reduce=mc.overlap_grad_reduce and self.par.dp > 1,
                                            use_distributed_optimizer=mc.use_distributed_optimizer,
                                            check_for_nan_in_grad=False)
        from offpolicy.learner.backends.megatron.grad_accum import DistributedDataParallel  # megatron's, vectorised adds

        self.model = DistributedDataParallel(config=tconfig, ddp_config=ddp, module=module)
        tconfig.finalize_model_grads_func = lambda models, num_tokens=None, **kw: finalize_model_grads(models, None)
        tconfig.no_sync_func = self.model.no_sync
        self.tconfig, self.aux_tokens = tconfig, 0
        offload.prepare(mc)  # learner.megatron.optimizer_offload: fp32 master and Adam state on the host
        self.opt = get_megatron_optimizer(OptimizerConfig(
            optimizer="adam", lr=lc.lr, min_lr=lc.lr, weight_decay=lc.weight_decay, adam_beta1=lc.betas[0],
            adam_beta2=lc.betas[1], adam_eps=1e-8, clip_grad=lc.grad_clip if lc.grad_clip > 0 else 1e30,
            bf16=dtype == torch.bfloat16, fp16=dtype == torch.float16, params_dtype=dtype,
            use_distributed_optimizer=mc.use_distributed_optimizer,
            **offload.optimizer_fields(mc, cuda=self.par.device.type == "cuda")), [self.model])
        offload.settle(self.opt, mc, cuda=self.par.device.type == "cuda", torch_threads=cfg.run.torch_threads,
                       rank=self.par.rank)
        clip.install()  # megatron's no-Apex grad clipping: one in-place pass, no host sync per parameter
        if mc.fused_adam:
            adam.fuse(self.opt)
        self.sum_keys, self.max_keys = _stat_keys(cfg)
        self.max_tokens = None if mc.max_tokens_per_gpu == "auto" else mc.max_tokens_per_gpu  # auto: at step 1
        self._said_pipeline = False  # the log line of a budget lowered for pipeline parallelism, once
        self._sync()
        t4 = time.perf_counter()
        # start-up report: seconds to set up (groups, config), build the model, load its weights, wrap it
        # (DDP buffers, optimizer); the largest over the ranks, which are ready when the slowest is
        self.startup = self._slowest(dict(setup=t1 - t0, build=t2 - t1, load=t3 - t2, wrap=t4 - t3, ready=t4 - t0))
        if self.par.rank == 0:
            log.info("megatron learner ready in %.1f s on %d rank(s): setup %.1f s, build %.1f s, load weights %.1f s "
                     "(rank 0 %s %.2f GB), DDP and optimizer %.1f s (each the slowest rank's)", self.startup["ready"],
                     self.par.world, self.startup["setup"], self.startup["build"], self.startup["load"],
                     "read" if cfg.model.path else "drew", self.loaded["bytes"] / 1e9, self.startup["wrap"])
        self.writer = None  # weights/sharded.ShardWriter, made at the first publish
        if self.par.rank == 0 and self.par.world > 1:
            atexit.register(self.close)
        self.trained = 0
        if self.par.device.type == "cuda":
            heap.settle()

    def _sync(self) -> None:
        if self.par.device.type == "cuda":
            torch.cuda.synchronize(self.par.device)

    def _slowest(self, seconds: dict[str, float]) -> dict[str, float]:
        """Each figure's maximum over the ranks (over the gloo control group)."""
        if self.par.world == 1:
            return seconds
        box = torch.tensor(list(seconds.values()), dtype=torch.float64)
        dist.all_reduce(box, op=dist.ReduceOp.MAX, group=self.par.control)
        return dict(zip(seconds, box.tolist()))

    def _fill_budget(self, groups: list[Group]) -> int:
        """`max_tokens_per_gpu: auto`: the token budget that fills this GPU (budget.py, from the memory model
        for the attention path and experts module that run; 16384 on the CPU), the smallest over the ranks
        so that every rank plans the same micro-batches. Measured at the first step, when rollouts that
        share the GPU have taken their memory; the local attention path (float32) counts its scores for the
        longest prompt of the first batch plus rollout.max_new_tokens."""
        mc = self.cfg.learner.megatron
        if self.par.device.type != "cuda":
            return 16384
        free, total = torch.cuda.mem_get_info(self.par.device)
        free += torch.cuda.memory_reserved(self.par.device) - torch.cuda.memory_allocated(self.par.device)
        local = sum(p.numel() for p in self.model.parameters())
        # exp_avg, exp_avg_sq in fp32, made at the first step (none on the GPU when the optimizer is on the host)
        adam = 8 * local / (self.par.dp if mc.use_distributed_optimizer else 1) * (1 - mc.optimizer_offload)
        dtype_bytes = DTYPES[self.cfg.model.dtype].itemsize
        seq_len = max(len(g.prompt) for g in groups) + self.cfg.rollout.max_new_tokens
        w = self.cfg.weights
        snapshot = 0.0  # weights.overlap_publish: a version's snapshot lives while the next step trains
        if w.overlap_publish:
            snapshot = memory.publish_snapshot_bytes(local * dtype_bytes, w.formats)
            if self.writer is not None and not self.writer.idle:
                snapshot = max(0.0, snapshot - self.writer.held_bytes)  # already allocated: not in `free`
        tokens = budget.fill(self.arch, free_bytes=free, total_bytes=total, optimizer_bytes=adam,
                             chunk_bytes=mc.logits_chunk_mib << 20, tp=mc.tp, pp=mc.pp,
                             sequence_parallel=self.sp, etp=mc.etp, experts=mc.experts,
                             attention=memory.attention_path(self.par.device.type, dtype_bytes), seq_len=seq_len,
                             snapshot_bytes=snapshot)
        if self.par.world > 1:
            box = torch.tensor([tokens], device=self.par.device)
            dist.all_reduce(box, op=dist.ReduceOp.MIN)
            tokens = int(box.item())
        log.info("learner.megatron.max_tokens_per_gpu auto: %d tokens a micro-batch (%.1f GiB free of %.1f)",
                 tokens, free / 2**30, total / 2**30)
        return tokens

    def _pipeline_budget(self, rows: list[batching.Row]) -> int:
        """The step's token budget of a micro-batch: with pp > 1 lowered so that each data-parallel rank's share
        fills at least `learner.megatron.pp_microbatches` micro-batches (microbatches.py: the 1F1B bubble)."""
        mc = self.cfg.learner.megatron
        fewest = microbatches.minimum(mc.pp_microbatches, mc.pp)
        if fewest <= 1:  # no pipeline stages (or pp_microbatches 1): the budget as it is, without a pass over the rows
            return self.max_tokens
        lowered = int(microbatches.budget(sum(r.length for r in rows) / self.par.dp, self.max_tokens, fewest,
                                          max(r.length for r in rows)))
        if lowered < self.max_tokens and not self._said_pipeline:
            self._said_pipeline = True
            log.info("learner.megatron.pp_microbatches: pp %d cuts each rank's share of a step into >= %d "
                     "micro-batches (1F1B bubble <= %.0f%%): %d tokens a micro-batch at most, the budget %d", mc.pp,
                     fewest, 100 * microbatches.bubble(mc.pp, fewest), lowered, self.max_tokens)
        return lowered

    # -- the protocol (rank 0 calls these; the other ranks follow in `serve`) ----------------------
    def train_step(self, groups: list[Group], advantages: torch.Tensor) -> dict[str, float]:
        self._command("train")
        return self._train(self.par.share((groups, advantages)))

    def weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        self._command("weights")
        return model_mod.gather(self.model, self.arch, self.par, te=self.te, grouped=self.grouped)

    def publish(self, version: int, fmts: list[str], w, run: str):
        """Start writing `version` in each of `fmts` from every rank (weights/sharded.py); returns rank 0's
        `sharded.Pending` (wait() commits it: only then does the version exist)."""
        if w.fp8_block_size == "auto":  # resolved as run_learner resolves it (where fp8 is written)
            w = fp8_run.resolved(self.cfg, w, fmts)
        self._command("publish")
        return self._publish(self.par.share((version, list(fmts), w, run)))

    def hf_config(self) -> dict:
        return dict(self.hf_cfg)

    def save_checkpoint(self, path: Path) -> None:
        self._command("save")
        self._save(self.par.share(str(path)))

    def load_checkpoint(self, path: Path) -> None:
        self._command("load")
        self._load(self.par.share(str(path)))

    def close(self) -> None:
        """Rank 0: release the worker ranks from `serve` (registered at exit); the heap's frozen objects go back
        to the collector (`heap.release`)."""
        heap.release()
        if self.par.world > 1 and dist.is_initialized():
            self._command("stop")

    def serve(self) -> None:
        """Ranks 1..k: run rank 0's commands until it sends stop."""
        mc = self.cfg.learner.megatron
        log.info("megatron learner rank %d of %d ready in %.1f s (tp %d, pp %d, ep %d): following rank 0's commands",
                 self.par.rank, self.par.world, self.startup["ready"], mc.tp, mc.pp, mc.ep)
        while True:
            cmd = self.par.share()
            if cmd == "stop":
                if self.writer is not None:
                    self.writer.join()  # the last version's writes end before the process does
                return
            if cmd == "train":
                self._train(self.par.share())
            elif cmd == "weights":
                for _ in model_mod.gather(self.model, self.arch, self.par, te=self.te, grouped=self.grouped):
                    pass
            elif cmd == "publish":
                self._publish(self.par.share())
            elif cmd == "save":
                self._save(self.par.share())
            elif cmd == "load":
                self._load(self.par.share())
            else:
                raise RuntimeError(f"unknown learner command {cmd!r} from rank 0")

    def _publish(self, payload: tuple):
        from offpolicy.learner.backends.megatron import shards
        from offpolicy.weights.sharded import ShardWriter

        version, fmts, w, run = payload
        if self.writer is None:
            self.writer = ShardWriter(w, run, rank=self.par.rank, world=self.par.world, node=self.par.node,
                                      node_of=self.par.node_of, root=self.cfg.weights.root)  # this node's store
        self.writer.join()  # one snapshot at a time: the previous version's writes end first
        # fp8 among the run's formats: a TP rank's own rows must start on a scale block
        pieces = shards.local_pieces(self.model, self.arch, self.par, te=self.te, grouped=self.grouped,
                                     fp8_rows=w.fp8_block_size[0] if "fp8" in (*fmts, *w.formats) else 0,
                                     fp8_skip=tuple(w.fp8_skip))
        return self.writer.begin(version, fmts, pieces, self.hf_config())

    def _command(self, cmd: str) -> None:
        if self.par.world > 1:
            self.par.share(cmd)

    # -- one optimizer step -------------------------------------------------------------------------
    def _train(self, payload: tuple[list[Group], torch.Tensor]) -> dict[str, float]:
        from megatron.core.pipeline_parallel import get_forward_backward_func

        groups, advantages = payload
        mc, par = self.cfg.learner.megatron, self.par
        rows_per_micro = max(1, self.cfg.learner.micro_batch_groups * self.cfg.rollout.n_samples)
        if self.max_tokens is None:
            self.max_tokens = self._fill_budget(groups)
        rows = batching.rows_of(groups, advantages)
        plan = batching.plan(rows, par.dp, max_tokens=self._pipeline_budget(rows), rows_per_micro=rows_per_micro,
                             packed=mc.packing)
        micros = plan[par.dp_rank]
        self._scale_aux_loss(plan)
        totals = dict(num_tokens=sum(g.num_tokens for g in groups), num_seqs=sum(g.n for g in groups),
                      norm_len=self.cfg.rollout.max_new_tokens)
        self.model.train()
        self.model.zero_grad_buffer()
        self.opt.zero_grad()
        batches = [self._micro_batch(m) for m in micros]
        shape = dict(num_microbatches=len(micros), seq_length=max(mb["ids"].shape[1] for mb in batches),
                     micro_batch_size=max(mb["ids"].shape[0] for mb in batches))
        if self.ref is not None:
            with torch.no_grad():  # reference logprobs first, in a forward-only pass of the same schedule
                refs = get_forward_backward_func()(forward_step_func=self._ref_step, data_iterator=iter(batches),
                                                   model=self.ref, forward_only=True, **shape)
            for mb, ref in zip(batches, refs):  # the last stage gets one per micro-batch, the others none
                mb["ref"] = ref["ref_logp"]
        stats = get_forward_backward_func()(
            forward_step_func=partial(self._forward_step, totals), data_iterator=iter(batches), model=self.model,
            forward_only=False, **shape)
        if mc.fused_adam:
            adam.place_steps(self.opt)  # a checkpoint's save or load may have put host steps there
        ok, grad_norm, _ = self.opt.step()
        if not ok:
            raise RuntimeError("the Megatron optimizer skipped the step (non-finite gradients)")
        sums, maxes = self._reduce(stats)
        self.trained += 1
        if self.trained == 1 and par.device.type == "cuda":  # the first step compiled the kernels: theirs stay too
            heap.settle()
        return step_report(sums, maxes, float(grad_norm))

    def _micro_batch(self, rows: list[batching.Row]) -> dict:
        """One micro-batch's tensors: packed end to end (with its Packing and RoPE positions) or padded."""
        multiple = self.cfg.learner.megatron.tp if self.sp else 1  # SP splits the sequence over the TP ranks
        dev = self.par.device
        if not self.cfg.learner.megatron.packing:
            return batching.pad(rows, dev, multiple=multiple)
        from offpolicy.learner.backends.megatron.kernels.attention import packing

        mb, bounds = batching.concat(rows, dev, multiple=multiple)
        longest = max(b - a for a, b in zip(bounds, bounds[1:]))
        mb.update(packing=packing(bounds, dev), rope=mb["positions"][0], table=batching.padded(longest, 512))
        return mb

    def _scale_aux_loss(self, plan: list[list[list[batching.Row]]]) -> None:
        """Make the MoE load-balancing loss a token-weighted mean over the whole batch.

        Megatron (with calculate_per_token_loss) multiplies each micro-batch's aux loss by its token count T
        and expects the gradients to be divided by the batch's total N later; this backend's loss is
        already a whole-batch mean, so that division is not done. Instead grad_scale_func divides every
        backward seed by N (the aux losses' too) and `_loss` returns the policy loss times N, which leaves
        the policy gradient unchanged and weights micro-batch aux losses by T / N."""
        mc = self.cfg.learner.megatron
        if mc.moe_aux_loss_coef <= 0 or not self.arch.is_moe:
            return
        # tokens every router sees (padding included), over all DP ranks
        multiple = mc.tp if self.sp else 1
        self.aux_tokens = sum(batching.tokens(m, packed=mc.packing, multiple=multiple) for rank in plan for m in rank)
        self.tconfig.grad_scale_func = lambda t, n=float(self.aux_tokens): t / n

    def _run(self, model, mb: dict) -> torch.Tensor:
        """The stage's forward of one micro-batch: final hidden states `[s, b, h]` (last stage) or activations."""
        with model_mod.hidden_states(model, mb.get("rope"), mb.get("table", 0)):
            return model(input_ids=mb["ids"], position_ids=mb["positions"], attention_mask=None,
                         packed_seq_params=mb.get("packing"))

    def _forward_step(self, totals: dict, data_iterator, model):
        mb = next(data_iterator)
        return self._run(model, mb), partial(self._loss, totals, mb, model)

    def _ref_step(self, data_iterator, model):
        mb = next(data_iterator)
        return self._run(model, mb), partial(self._ref_loss, mb, model)

    def _ref_loss(self, mb: dict, model, hidden: torch.Tensor):
        logp, _ = self._logprobs(mb, model, hidden)
        return hidden.new_zeros(()), mb["mask"].sum().to(torch.int), {"ref_logp": logp}

    def _logprobs(self, mb: dict, model, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Vocab-parallel (logp, entropy) `[b, r]` of the micro-batch's response tokens from the final hidden
        states, the output weight applied in vocabulary chunks (logprobs.py)."""
        from megatron.core.tensor_parallel import mappings

        mc, par = self.cfg.learner.megatron, self.par
        if self.sp:  # all-gather the sequence; the backward reduce-scatters the partial grads of the TP ranks
            hidden = mappings.gather_from_sequence_parallel_region(hidden, tensor_parallel_output_grad=True)
        picked = select_rows(hidden.reshape(-1, hidden.shape[-1]), mb["sel"])  # one row per response token
        if par.tp > 1 and not self.sp:  # replicated input: the backward all-reduces the partial grads
            picked = mappings.copy_to_tensor_model_parallel_region(picked)
        logp, entropy = head_logprobs(picked, model_mod.head_weight(model), mb["tok"], self.cfg.rollout.temperature,
                                      vocab_size=self.arch.vocab_size, tp_rank=par.tp_rank, tp_group=par.tp_group,
                                      chunk_bytes=mc.logits_chunk_mib << 20,
                                      compile=mc.compile and picked.is_cuda)
        mask = mb["mask"]

        def grid(v: torch.Tensor) -> torch.Tensor:
            return v.new_zeros(mask.numel()).index_copy(0, mb["slot"], v).view_as(mask)

        return grid(logp), grid(entropy)

    def _loss(self, totals: dict, mb: dict, model, hidden: torch.Tensor):
        algo = self.cfg.algo
        logp, entropy = self._logprobs(mb, model, hidden)
        if algo.entropy_coef <= 0:
            entropy = entropy.detach()
        loss, st = policy_loss(logp, mb["old"], mb["adv"], mb["mask"], algo, **totals, ref_logp=mb.get("ref"),
                               entropy=entropy if algo.entropy_coef > 0 else None)
        st["loss"] = loss.detach()
        st["entropy_sum"] = (entropy.detach() * mb["mask"]).sum()
        if self.aux_tokens:  # undone by tconfig.grad_scale_func (see _scale_aux_loss)
            loss = loss * self.aux_tokens
        return loss, mb["mask"].sum().to(torch.int), {k: v.detach() for k, v in st.items()}

    def _reduce(self, stats: list[dict]) -> tuple[dict[str, float], dict[str, float]]:
        """Micro-batch statistics of every DP rank's last stage, summed (or maxed) onto every rank."""
        par, dev = self.par, self.par.device
        sums = torch.zeros(len(self.sum_keys), dtype=torch.float64, device=dev)
        maxes = torch.zeros(len(self.max_keys), dtype=torch.float64, device=dev)
        if par.last_stage and par.tp_rank == 0:
            for st in stats:
                sums += torch.stack([st[k].double() for k in self.sum_keys]).to(dev)
                maxes = torch.maximum(maxes, torch.stack([st[k].double() for k in self.max_keys]).to(dev))
        if par.world > 1:
            dist.all_reduce(sums)
            dist.all_reduce(maxes, op=dist.ReduceOp.MAX)
        return dict(zip(self.sum_keys, sums.tolist())), dict(zip(self.max_keys, maxes.tolist()))

    # -- checkpoints (offpolicy/learner/backends/megatron/checkpointing/__init__.py) -----------------------------------
    def _layout(self) -> dict:
        mc = self.cfg.learner.megatron
        return dict(tp=mc.tp, pp=mc.pp, dp=self.par.dp, ep=mc.ep, etp=mc.etp, world=self.par.world,
                    moe=self.arch.is_moe, experts=("grouped" if self.grouped else "sequential") if self.arch.is_moe else None,
                    use_distributed_optimizer=mc.use_distributed_optimizer,
                    dtype=self.cfg.model.dtype, offload=offload.enabled(mc))

    def _save(self, path: str) -> None:
        checkpointing.save(path, fmt=self.cfg.learner.megatron.checkpoint_format, rank=self.par.rank,
                           layout=self._layout(), model=self.model, params=model_mod.named(self.model), opt=self.opt,
                           control=self.par.control)

    def _load(self, path: str) -> None:
        checkpointing.load(path, rank=self.par.rank, layout=self._layout(), model=self.model,
                           params=model_mod.named(self.model), opt=self.opt, control=self.par.control)
        if self.cfg.learner.megatron.fused_adam:
            adam.fuse(self.opt)  # the load put the saved param groups back


def check_layout(cfg: Config, arch: arch_mod.Arch) -> None:
    """Refuse (ConfigError naming the field and the fix) a megatron layout `arch` cannot train with."""
    mc = cfg.learner.megatron
    try:
        arch_mod.check_layout(arch, mc.tp, mc.pp, mc.ep, mc.etp)
        model_mod.use_te(arch, mc.transformer_impl)
    except arch_mod.ArchError as e:
        raise ConfigError(f"config field learner.megatron: {e}") from None
    if arch.is_moe and mc.tp > 1 and not mc.sequence_parallel:
        # Megatron's MoELayer refuses to train with tp > 1 without sequence parallel
        raise ConfigError(f"config field learner.megatron.tp: MoE layers train with tp > 1 ({mc.tp}) only with "
                          "sequence parallelism; set learner.megatron.sequence_parallel=true (or use tp=1 and "
                          "spread the experts with learner.megatron.ep)")


def _hf_source(cfg: Config, device: torch.device) -> tuple[dict, HFSource | SeededSource]:
    """The HF config.json content and the initial weights, served on `device`: model.path (each rank reads
    only what it holds), or model.arch drawn from model.seed (each rank draws only what it holds)."""
    dtype = DTYPES[cfg.model.dtype]
    if cfg.model.path is not None:
        hf_cfg = json.loads((Path(cfg.model.path) / "config.json").read_text())
        return hf_cfg, HFSource(path=cfg.model.path, dtype=dtype, device=device)
    from offpolicy.models.build import arch_plan

    hf_cfg, shapes, std = arch_plan(cfg.model)
    return hf_cfg, SeededSource(shapes, seed=cfg.model.seed, std=std, dtype=dtype, device=device)


def _stat_keys(cfg: Config) -> tuple[list[str], list[str]]:
    """Names of the per-micro-batch statistics `_loss` returns, split into sums and maxima."""
    one = torch.ones(1, 1)
    _, st = policy_loss(one, one, one[0], one, cfg.algo, num_tokens=1, num_seqs=1, norm_len=1,
                        entropy=one if cfg.algo.entropy_coef > 0 else None,
                        ref_logp=one if cfg.algo.kl_loss_coef > 0 else None)
    keys = sorted([*st, "loss", "entropy_sum"])
    return [k for k in keys if not k.endswith("_max")], [k for k in keys if k.endswith("_max")]
