"""Cross-field checks of a loaded `Config` that types alone cannot express (`validate`), run by
`load.load_config`; every failure is a `ConfigError` naming the field, the problem and the fix."""

from __future__ import annotations

import re

from offpolicy.config.schema import Config, ConfigError


def _require(ok: bool, field: str, problem: str, fix: str) -> None:
    if not ok:
        raise ConfigError(f"config field {field}: {problem}; {fix}")


def check_world(world: int, *, tp: int, pp: int, cp: int, ep: int, etp: int) -> None:
    """Raise ValueError (naming learner.megatron fields) when `world` ranks cannot hold this layout."""
    if world % (tp * pp * cp):
        raise ValueError(f"world size {world} is not a multiple of learner.megatron.tp x pp x cp = {tp * pp * cp}: "
                         "start tp*pp*cp*dp learner ranks")
    if (world // pp) % (ep * etp):
        raise ValueError(f"world size {world} / learner.megatron.pp {pp} = {world // pp} ranks per stage is not a "
                         f"multiple of learner.megatron.ep x etp = {ep * etp}: start a multiple of pp*ep*etp ranks "
                         "or lower ep/etp")


def _validate_gpus(cfg: Config) -> None:
    """run.learner_gpus / run.rollout_gpus: GPU indices that fit the learner backend and the device fields."""
    lg, rg = cfg.run.learner_gpus, cfg.run.rollout_gpus
    _require(all(g >= 0 for g in lg), "run.learner_gpus", f"{lg} has a negative index", "use GPU indices >= 0")
    for entry in rg:
        _require(re.fullmatch(r"\d+(,\d+)*", str(entry)) is not None, "run.rollout_gpus",
                 f"entry {entry!r} is not a GPU index or a list of them", 'use e.g. [1] or [1, 2] or ["2,3"]')
    renumbered = ("auto", "cpu", "cuda", "cuda:0")
    if lg:
        _require(len(set(lg)) == len(lg), "run.learner_gpus", f"{lg} lists a GPU twice", "list each GPU once")
        _require(cfg.learner.device in renumbered, "learner.device", f"{cfg.learner.device!r} with run.learner_gpus",
                 "the learner sees only its GPUs, renumbered from 0: use learner.device=cuda (or auto)")
        if cfg.learner.backend == "torch":
            _require(len(lg) == 1, "run.learner_gpus", f"{lg} lists {len(lg)} GPUs but learner.backend=torch uses one",
                     "list one GPU, or use learner.backend=megatron (one rank per GPU)")
        else:
            m = cfg.learner.megatron
            try:
                check_world(len(lg), tp=m.tp, pp=m.pp, cp=m.cp, ep=m.ep, etp=m.etp)
            except ValueError as e:
                _require(False, "run.learner_gpus", f"{len(lg)} GPUs, one learner rank each: {e}",
                         "list as many GPUs as the layout needs")
    if rg:
        _require(cfg.rollout.device in renumbered, "rollout.device", f"{cfg.rollout.device!r} with run.rollout_gpus",
                 "each daemon sees only its GPUs, renumbered from 0: use rollout.device=cuda (or auto)")


def _validate_chaos(cfg: Config) -> None:
    c = cfg.run.chaos
    _require(c.every_s >= 0, "run.chaos.every_s", f"is {c.every_s}", "use 0 (off) or the mean seconds between kills")
    _require(c.after_steps >= 0 and c.max_kills >= 0, "run.chaos.after_steps/max_kills", "must be >= 0", "use 0 or more")
    _require(not c.every_s or c.targets, "run.chaos.targets", "is empty", "name at least one of learner, rollout, vllm, eval")
    _require(not c.every_s or cfg.run.supervise.restart, "run.chaos.every_s",
             "kills processes that run.supervise.restart=false would not bring back", "set run.supervise.restart=true")


def _validate_supervise(cfg: Config) -> None:
    """run.supervise: a budget, times and waits that make sense."""
    s = cfg.run.supervise
    _require(s.max_restarts >= 0, "run.supervise.max_restarts", f"is {s.max_restarts}",
             "use 0 (the first unexpected exit stops the run) or more")
    for name in ("restart_window_s", "backoff_s", "stall_timeout_s"):
        _require(getattr(s, name) >= 0, f"run.supervise.{name}", f"is {getattr(s, name)}", "use 0 or more seconds")
    _require(s.max_backoff_s >= s.backoff_s, "run.supervise.max_backoff_s",
             f"{s.max_backoff_s} is below run.supervise.backoff_s={s.backoff_s}", "raise it to backoff_s or more")
    _require(s.kill_grace_s > 0, "run.supervise.kill_grace_s", f"is {s.kill_grace_s}",
             "give a process's group a moment after SIGTERM, e.g. 5")
    _require(0 <= s.spare_nice <= 19, "run.supervise.spare_nice", f"is {s.spare_nice}",
             "use a niceness from 0 (the run's own priority) to 19 (only the CPU the run leaves)")


def validate(cfg: Config) -> None:
    """Cross-field checks that types alone cannot express; raises ConfigError."""
    r, lr, a, t, w = cfg.rollout, cfg.learner, cfg.algo, cfg.transport, cfg.weights
    _require(cfg.run.name.replace("-", "").replace("_", "").isalnum(), "run.name",
             f"{cfg.run.name!r} has characters other than letters, digits, - and _", "rename the run")
    _require(cfg.run.rollouts >= 1, "run.rollouts", "must be >= 1", "start at least one rollout daemon")
    _validate_gpus(cfg)
    _validate_supervise(cfg)
    _validate_chaos(cfg)
    _require(cfg.run.log_level in ("DEBUG", "INFO", "WARNING", "ERROR"), "run.log_level",
             f"{cfg.run.log_level!r} is not a level", "use DEBUG, INFO, WARNING or ERROR")
    _require(cfg.model.path is not None or "model_type" in cfg.model.arch, "model.arch",
             "no model.path and no model.arch.model_type", "set model.path to an HF directory or give model.arch")
    heads, kv = cfg.model.arch.get("num_attention_heads"), cfg.model.arch.get("num_key_value_heads")
    _require(not (isinstance(heads, int) and isinstance(kv, int)) or (kv >= 1 and heads % kv == 0),
             "model.arch.num_key_value_heads", f"is {kv}, which does not divide num_attention_heads={heads} (each "
             "key-value head serves a whole group of query heads; vLLM refuses such a model at start)",
             f"use a divisor of {heads}")
    _validate_data(cfg.data, "data", cfg.model.tokenizer)
    for d, name, reward, field in ((cfg.data, "data", cfg.rollout.reward, "rollout.reward"),
                                   (cfg.eval.data, "eval.data", cfg.eval.reward or cfg.rollout.reward, "eval.reward")):
        # a `module:function` reward may wrap the scorer (offpolicy.data.reasoning_gym_data.score); other names cannot
        _require(d.source != "reasoning_gym" or reward in ("reasoning_gym", "reasoning_gym_final") or ":" in reward,
                 field, f"is {reward!r} but {name}.source is reasoning_gym, whose answers only the task's own scorer reads",
                 f"set {field}=reasoning_gym or reasoning_gym_final (or a package.module:function that calls "
                 "offpolicy.data.reasoning_gym_data.score)")
    _require(r.n_samples >= 2, "rollout.n_samples", f"is {r.n_samples}",
             "GRPO needs at least 2 responses per prompt to normalise within a group")
    _validate_sampling(r, "rollout")
    _require(r.max_new_tokens >= 1, "rollout.max_new_tokens", "must be >= 1", "raise it")
    _require(r.groups_per_lease >= 1, "rollout.groups_per_lease", "must be >= 1", "raise it")
    _require(r.prefetch_leases >= 0, "rollout.prefetch_leases", "must be >= 0", "use 0 to turn prefetch off")
    _require(lr.batch_groups >= 1, "learner.batch_groups", "must be >= 1", "raise it")
    _require(1 <= lr.micro_batch_groups, "learner.micro_batch_groups", "must be >= 1", "raise it")
    _require(lr.total_steps >= 1, "learner.total_steps", "must be >= 1", "raise it")
    _require(lr.lr > 0, "learner.lr", "must be > 0", "use e.g. 1e-6 for a pretrained LLM")
    _require(len(lr.betas) == 2 and all(0 <= b < 1 for b in lr.betas), "learner.betas",
             f"is {lr.betas}", "give two numbers in [0, 1), e.g. [0.9, 0.999]")
    _require(lr.summary_window >= 1, "learner.summary_window", "must be >= 1", "raise it")
    mg = lr.megatron
    for name in ("tp", "pp", "ep", "etp", "cp", "recompute_layers"):
        _require(getattr(mg, name) >= 1, f"learner.megatron.{name}", "must be >= 1", "use 1 to turn it off")
    _require(mg.cp == 1, "learner.megatron.cp", f"is {mg.cp}; context parallelism is not implemented (megatron-core "
             "runs it only in Transformer Engine's attention: its local DotProductAttention asserts cp == 1)",
             "use cp=1 and raise tp or pp instead")
    _require(mg.max_tokens_per_gpu == "auto" or mg.max_tokens_per_gpu >= 0, "learner.megatron.max_tokens_per_gpu",
             "must be auto or >= 0", "use auto to fill the GPU, or 0 to batch by learner.micro_batch_groups")
    _require(mg.pp_microbatches == "auto" or mg.pp_microbatches >= 1, "learner.megatron.pp_microbatches",
             f"is {mg.pp_microbatches}", "use auto (4 per pipeline stage) or a count >= 1")
    _require(0 <= mg.optimizer_offload <= 1, "learner.megatron.optimizer_offload", f"is {mg.optimizer_offload}",
             "use a fraction in [0, 1]: 0 keeps the optimizer on the GPU, 1.0 puts all of it on the host")
    _require(mg.optimizer_offload == 0 or mg.use_distributed_optimizer, "learner.megatron.optimizer_offload",
             "needs the distributed optimizer (megatron-core's offload fails at the first step without it)",
             "set learner.megatron.use_distributed_optimizer=true")
    _require(mg.optimizer_offload == 0 or cfg.model.dtype in ("bfloat16", "float16"), "learner.megatron.optimizer_offload",
             f"is {mg.optimizer_offload} with model.dtype {cfg.model.dtype}: the host optimizer steps float32 master copies "
             "of 16-bit weights (megatron-core's precision-aware optimizer); with float32 weights the distributed "
             "optimizer's shards are views of the parameters, which its hybrid optimizer refuses (\"can't optimize a "
             "non-leaf Tensor\")", "use model.dtype=bfloat16, or optimizer_offload=0")
    _require(mg.logits_chunk_mib >= 1, "learner.megatron.logits_chunk_mib", "must be >= 1",
             "use e.g. 1024 (MiB of float32 logits per chunk)")
    _require(mg.moe_token_dispatcher == "alltoall" or mg.ep * mg.etp == 1, "learner.megatron.moe_token_dispatcher",
             "allgather needs equal micro-batch shapes on every expert-parallel rank, which DP ranks do not have",
             "use alltoall with ep/etp > 1")
    _require(mg.moe_aux_loss_coef >= 0, "learner.megatron.moe_aux_loss_coef", "must be >= 0",
             "use 0 to turn the load-balancing loss off, e.g. 1e-3 to turn it on")
    _require(lr.backend == "megatron" or mg.tp * mg.pp * mg.ep * mg.etp == 1, "learner.megatron",
             f"sets a parallel layout but learner.backend is {lr.backend!r}", "set learner.backend=megatron")
    _require(a.max_staleness >= 0, "algo.max_staleness", "must be >= 0",
             "use 0 for synchronous GRPO or 1 for one-step-off")
    _require(a.clip_ratio_low >= 0 and a.clip_ratio_high >= 0, "algo.clip_ratio_low/high", "must be >= 0",
             "use e.g. 0.2 and 0.28")
    _require(a.clip_ratio_low < 1, "algo.clip_ratio_low", "must be < 1", "the lower clip bound 1 - low must stay > 0")
    _require(a.adv_eps > 0, "algo.adv_eps", "must be > 0", "use e.g. 1e-6")
    _require(a.clip_ratio_c == 0 or a.clip_ratio_c > 1, "algo.clip_ratio_c", f"is {a.clip_ratio_c}",
             "use 0 (off) or a value > 1, e.g. 3.0")
    _require(a.kl_loss_coef >= 0, "algo.kl_loss_coef", "must be >= 0", "use 0 to turn the KL loss off")
    _require(a.tis_threshold > 0, "algo.tis_threshold", "must be > 0", "use e.g. 2.0")
    _require(0 < a.icepop_low < 1 < a.icepop_high, "algo.icepop_low/high", f"are {a.icepop_low}, {a.icepop_high}",
             "use a band around 1, e.g. 0.5 and 2.0")
    _require((a.tis == "none" and not a.icepop) or a.logp_old == "recompute", "algo.logp_old",
             f"is {a.logp_old!r} but algo.tis/icepop correct the ratio between learner and rollout logprobs",
             "set algo.logp_old=recompute (the ratio then uses the learner's logprobs)")
    for name in ("work_port", "announce_port"):
        port = getattr(t, name)
        _require(0 < port < 65536, f"transport.{name}", f"is {port}", "use a TCP port in 1..65535")
    _require(t.work_port != t.announce_port, "transport.announce_port", "equals transport.work_port",
             "give the two sockets different ports")
    _require(t.hwm >= 1, "transport.hwm", "must be >= 1", "raise it")
    _require(t.heartbeat_timeout_s > t.heartbeat_interval_s, "transport.heartbeat_timeout_s",
             "must exceed transport.heartbeat_interval_s", "raise the timeout or lower the interval")
    _require(t.lease_timeout_s > 0, "transport.lease_timeout_s", "must be > 0", "raise it")
    _require(w.keep >= 2, "weights.keep", f"is {w.keep}",
             "keep at least 2 versions so that a rollout can finish on the previous one during a swap")
    _require(w.shard_bytes >= 1024**2, "weights.shard_bytes", "is below 1 MiB", "use e.g. 2147483648 (2 GiB)")
    _validate_formats(cfg)
    if w.native == "checkpoints":
        _require(cfg.rollout.weights_format != "native", "weights.native",
                 "is checkpoints but rollout.weights_format is native (the rollouts read every native version)",
                 "set rollout.weights_format to one of weights.formats, or weights.native=every")
        _require(cfg.eval.every_versions == 0, "weights.native",
                 "is checkpoints but eval.every_versions is set (the eval daemon reads native versions)",
                 "set eval.every_versions=0, or weights.native=every")
        _require(not cfg.relay.formats or "native" not in cfg.relay.formats, "relay.formats",
                 "lists native but weights.native is checkpoints", "leave native out of relay.formats")
    _require(not (w.verify and w.checksum == "none"), "weights.verify", "needs checksums in the manifest",
             "set weights.checksum=auto or sha256 (auto writes them when weights.verify is on)")
    _require(0 <= cfg.metrics.port < 65536, "metrics.port", f"is {cfg.metrics.port}", "use 0 (off) or a TCP port")
    _require(cfg.metrics.log_every >= 1, "metrics.log_every", "must be >= 1", "raise it")
    _require(cfg.checkpoint.every_steps >= 0, "checkpoint.every_steps", "must be >= 0", "use 0 for end-only")
    _require(cfg.checkpoint.keep >= 1, "checkpoint.keep", "must be >= 1", "keep at least the newest checkpoint")
    _require(r.prefill_chunk_tokens >= 0, "rollout.prefill_chunk_tokens", f"is {r.prefill_chunk_tokens}",
             "use 0 (chunks only where the prompt's attention scores would not fit) or a number of positions")
    _require(not (r.compile is True and r.static_cache is False), "rollout.compile", "needs rollout.static_cache",
             "set rollout.static_cache=true or auto as well (only the static decode step is compiled)")
    _require(not (r.double_buffer is True and not (r.engine == "torch" or (r.engine == "vllm" and r.vllm.mode == "http")
                                                   or (r.engine == "sglang" and r.sglang.mode == "engine"))),
             "rollout.double_buffer", f"is true, but only the torch engine, vLLM servers over HTTP and the in-process "
             f"SGLang engine double-buffer (rollout.engine is {r.engine}"
             f"{', mode ' + r.vllm.mode if r.engine == 'vllm' else ''}"
             f"{', mode ' + r.sglang.mode if r.engine == 'sglang' else ''})", "set rollout.double_buffer=auto or false")
    sglang_http = r.engine == "sglang" and r.sglang.mode == "http"
    servers = (r.engine == "vllm" and r.vllm.mode == "http") or sglang_http
    _require(not (r.inflight_updates is True and not (r.engine == "torch" or servers)),
             "rollout.inflight_updates", f"is true, but only the torch engine and vLLM or SGLang servers over HTTP "
             f"switch weight versions during a generation (rollout.engine is {r.engine}"
             f"{', mode ' + r.vllm.mode if r.engine == 'vllm' else ''}"
             f"{', mode ' + r.sglang.mode if r.engine == 'sglang' else ''}: it finishes each request on the version it "
             "began with)", f"set rollout.inflight_updates=auto or false, or rollout.{r.engine}.mode=http")
    _require(not (r.fp8_matmul == "scaled" and (r.engine != "torch" or r.weights_format != "fp8")),
             "rollout.fp8_matmul", f"is scaled, but it chooses how the torch engine multiplies fp8 versions (rollout.engine "
             f"is {r.engine}, rollout.weights_format {r.weights_format})",
             "set rollout.fp8_matmul=auto, or rollout.engine=torch with rollout.weights_format=fp8")
    _require(not (r.inflight_updates is True and r.double_buffer is False  # SGLang's servers read nothing ahead
                  and not sglang_http), "rollout.inflight_updates",
             "is true, but rollout.double_buffer is false (a version is switched to in flight only once it is read "
             "into the spare weights)", "set rollout.double_buffer=true or auto (inflight_updates=true turns auto on)")
    if r.engine == "sglang":
        _validate_sglang(cfg)
    if r.engine == "vllm":
        _validate_vllm(cfg)
    _validate_eval(cfg)


def _validate_sampling(s, name: str) -> None:
    """temperature / top_p / top_k of a section that samples (`rollout` or `eval`)."""
    _require(s.temperature > 0, f"{name}.temperature", "must be > 0", "use 1.0 for plain sampling")
    _require(0 < s.top_p <= 1, f"{name}.top_p", f"is {s.top_p}", "use a value in (0, 1]; 1.0 turns it off")
    _require(s.top_k >= 0, f"{name}.top_k", "must be >= 0", "use 0 to turn it off")


def _validate_data(d, name: str, tokenizer: str) -> None:
    """A data section (`data` or `eval.data`)."""
    _require(d.source in ("synthetic", "reasoning_gym", "parquet", "jsonl")
             or d.source.endswith((".jsonl", ".jsonl.gz", ".parquet")), f"{name}.source",
             f"{d.source!r} is none of synthetic, reasoning_gym, parquet, jsonl nor a .jsonl/.jsonl.gz/.parquet file",
             "point it at a prompt file")
    suffixes = {"parquet": (".parquet",), "jsonl": (".jsonl", ".jsonl.gz")}.get(d.source)
    if suffixes is None:
        _require(not d.files, f"{name}.files", f"is set but {name}.source is {d.source!r}",
                 f"set {name}.source to parquet or jsonl to read the files, or drop {name}.files")
    else:
        _require(bool(d.files), f"{name}.files", f"is empty with source {d.source}", "list the files to read")
        bad = [f for f in d.files if not f.endswith(suffixes)]
        _require(not bad, f"{name}.files", f"{bad} are not {'/'.join(suffixes)} files (source {d.source})",
                 "list files of that kind, or change the source")
    if d.source == "reasoning_gym":
        _require(bool(d.reasoning_gym.task), f"{name}.reasoning_gym.task", "is empty with source reasoning_gym",
                 "name a reasoning-gym task, e.g. letter_counting")
        _require(d.reasoning_gym.size >= 1, f"{name}.reasoning_gym.size", "must be >= 1", "raise it")
    _require(d.synthetic.length >= 1, f"{name}.synthetic.length", "must be >= 1", "use 1 or more digits")
    _require(d.synthetic.num_prompts >= 1, f"{name}.synthetic.num_prompts", "must be >= 1", "raise it")
    _require(d.max_prompt_tokens >= 1, f"{name}.max_prompt_tokens", "must be >= 1", "raise it")
    _require(not d.chat_template or tokenizer != "digits", f"{name}.chat_template",
             "is on but model.tokenizer is the built-in digit tokenizer, which has no chat template",
             "set model.tokenizer to an HF tokenizer directory with a chat template, or turn it off")
    _require(d.chat_template or not (d.chat_template_kwargs or d.system_prompt), f"{name}.chat_template_kwargs",
             "or system_prompt is set but chat_template is off", f"set {name}.chat_template=true")
    _require(not d.prompt_template or "{prompt}" in d.prompt_template, f"{name}.prompt_template",
             f"is {d.prompt_template!r}, without {{prompt}}", "put {prompt} where the prompt's text goes")


def _validate_eval(cfg: Config) -> None:
    """The eval section (docs/eval.md): checked whether or not the eval daemon runs, as `offpolicy eval` uses it too."""
    e = cfg.eval
    _validate_data(e.data, "eval.data", cfg.model.tokenizer)
    _require(e.every_versions >= 0, "eval.every_versions", "must be >= 0", "use 0 for no eval daemon")
    _require(e.max_prompts >= 0, "eval.max_prompts", "must be >= 0", "use 0 for every prompt")
    _require(e.n_samples >= 1, "eval.n_samples", "must be >= 1", "raise it")
    _require(bool(e.k), "eval.k", "is empty", "list at least one k, e.g. [1, 10]")
    bad = [k for k in e.k if not 1 <= k <= e.n_samples]
    _require(not bad, "eval.k", f"{bad} outside 1..eval.n_samples={e.n_samples}",
             "raise eval.n_samples to the largest k or drop those k (pass@k needs k <= n)")
    _validate_sampling(e, "eval")
    _require(e.max_new_tokens >= 0, "eval.max_new_tokens", "must be >= 0", "use 0 for rollout.max_new_tokens")
    _require(e.batch_prompts >= 1, "eval.batch_prompts", "must be >= 1", "raise it")
    _require(e.reward_workers >= 1, "eval.reward_workers", "must be >= 1", "use 1, or about the core count for code rewards")
    _require(e.max_pending_versions >= 1, "eval.max_pending_versions", "must be >= 1", "raise it")
    _require(all(g >= 0 for g in e.gpus), "eval.gpus", f"{e.gpus} has a negative index", "use GPU indices >= 0")
    _require(not e.gpus or e.device in ("auto", "cuda", "cuda:0"), "eval.device", f"{e.device!r} with eval.gpus",
             "the eval daemon sees only its GPUs, renumbered from 0: use eval.device=cuda (or auto)")


def _validate_formats(cfg: Config) -> None:
    """weights.formats / fp8_* and rollout.weights_format (docs/weights.md, formats)."""
    w, fmt = cfg.weights, cfg.rollout.weights_format
    _require(len(set(w.formats)) == len(w.formats), "weights.formats", f"{w.formats} lists a format twice",
             "name each format once")
    b = w.fp8_block_size
    if b != "auto":
        _require(min(b) >= 1, "weights.fp8_block_size", f"is {b}", "give auto or two positive ints [rows, cols], "
                 "e.g. [128, 128]")
        # vLLM's block GEMMs: square, a power of two >= 16 (docs/weights.md, "Block sizes"); the model's shapes are
        # checked where they are known (weights.fp8_blocks, at the learner's and the launcher's start)
        square_pow2 = b[0] == b[1] and b[0] >= 16 and not b[0] & (b[0] - 1)
        _require(cfg.rollout.engine != "vllm" or fmt != "fp8" or square_pow2, "weights.fp8_block_size",
                 f"is {list(b)}, which vLLM cannot serve (square powers of two >= 16 only)",
                 "use auto, or [128, 128] / [64, 64] / [32, 32] / [16, 16] that divides the model's linears")
    _require(fmt == "native" or fmt in w.formats, "rollout.weights_format",
             f"is {fmt!r} but weights.formats {w.formats} does not publish it",
             f"add {fmt} to weights.formats (learner and rollouts read one config) or use native")
    rf = cfg.relay.formats
    _require(all(f == "native" or f in w.formats for f in rf) and len(set(rf)) == len(rf), "relay.formats",
             f"{rf} names a format twice or one that weights.formats {w.formats} does not publish",
             "list each relayed format once, native or one of weights.formats")
    _require(not rf or fmt in rf, "relay.formats", f"{rf} leaves out rollout.weights_format {fmt!r}: the rollouts on "
             "relayed nodes would wait for it forever", f"add {fmt} to relay.formats (or leave it empty: all)")
    q = cfg.rollout.sglang.quantization
    _require(cfg.rollout.engine != "sglang" or fmt == "native" or q in (None, fmt), "rollout.sglang.quantization",
             f"is {q!r} but the engine loads pre-quantized {fmt} versions (SGLang refuses a quantization "
             "that differs from the checkpoint's quant_method)", f"leave it unset (or set it to {fmt})")
    _require(cfg.rollout.engine != "sglang" or fmt != "mxfp4" or cfg.rollout.sglang.mode == "engine",
             "rollout.sglang.mode", "is http with rollout.weights_format mxfp4, but an SGLang server cannot load a "
             "later MXFP4 GPT-OSS version (SGLang 0.5.14 and 0.5.23 repack the MXFP4 experts at launch, so "
             "update_weights_from_disk finds no expert parameters, and the failed update's rollback takes the "
             "server down; docs/sglang.md)", "use rollout.sglang.mode=engine (the daemon starts sglang.Engine "
             "again on each mxfp4 version) or rollout.weights_format=native")


# sglang.Engine arguments that rollout.sglang.extra may not give: named fields, or set from other sections.
_SGLANG_OWNED = {"model_path": "model.path", "dtype": "model.dtype", "weight_version": "the weight store",
                 **{f: f"rollout.sglang.{f}" for f in ("tp_size", "ep_size", "attn_dp_size", "dp_size",
                                                       "quantization", "mem_fraction_static", "random_seed",
                                                       "attention_backend", "skip_tokenizer_init",
                                                       "enable_metrics", "load_format")}}


def _validate_sglang(cfg: Config) -> None:
    """Checks of rollout.sglang (docs/sglang.md); run only when rollout.engine is sglang."""
    s = cfg.rollout.sglang
    for name in ("tp_size", "ep_size", "attn_dp_size", "dp_size"):
        _require(getattr(s, name) >= 1, f"rollout.sglang.{name}", f"is {getattr(s, name)}", "use 1 or more")
    _require(s.tp_size % s.ep_size == 0, "rollout.sglang.ep_size", f"{s.ep_size} does not divide tp_size {s.tp_size}",
             "use an ep_size that divides tp_size, e.g. ep_size = tp_size for full expert parallelism")
    _require(s.tp_size % s.attn_dp_size == 0, "rollout.sglang.attn_dp_size",
             f"{s.attn_dp_size} does not divide tp_size {s.tp_size}", "use a divisor of tp_size")
    _require(s.mem_fraction_static is None or 0 < s.mem_fraction_static < 1, "rollout.sglang.mem_fraction_static",
             f"is {s.mem_fraction_static}", "use a fraction in (0, 1), e.g. 0.8, or leave it unset")
    for name in ("request_timeout_s", "update_timeout_s", "flush_timeout_s", "startup_timeout_s",
                 "health_check_interval_s", "recover_timeout_s"):
        _require(getattr(s, name) > 0, f"rollout.sglang.{name}", "must be > 0", "raise it")
    _require(s.max_retries >= 0, "rollout.sglang.max_retries", "must be >= 0", "use 0 to fail on the first abort")
    _require(s.mxfp4_load != "inplace" or (s.mode == "engine" and s.dp_size == 1 and s.ep_size == 1),
             "rollout.sglang.mxfp4_load", f"is inplace with mode {s.mode}, dp_size {s.dp_size} and ep_size "
             f"{s.ep_size}, but the in-place MXFP4 loader writes the triton_kernels experts of one in-process engine "
             "(SGLang hands tensors to one replica, and with ep_size > 1 it does not run the experts on "
             "triton_kernels)",
             "use rollout.sglang.mxfp4_load=restart, or mode engine with dp_size and ep_size 1 (tp_size may be more)")
    _require(s.mxfp4_load != "inplace" or (cfg.rollout.device != "cpu" and s.prefetch != "disk"),
             "rollout.sglang.mxfp4_load", f"is inplace with rollout.device {cfg.rollout.device} and "
             f"rollout.sglang.prefetch {s.prefetch}, but the in-place MXFP4 loader takes versions as tensors on the "
             "engine's GPU (SGLang's own MXFP4 reload from disk raises in its scheduler)",
             "set rollout.device=cuda (or auto) and rollout.sglang.prefetch auto, device or direct, or use "
             "rollout.sglang.mxfp4_load=restart")
    _require(cfg.model.dtype != "float64", "model.dtype", "float64 is not an SGLang dtype",
             "use bfloat16, float16 or float32 with rollout.engine=sglang")
    _require(0 < s.server_port <= 55536 - cfg.run.rollouts, "rollout.sglang.server_port",
             f"is {s.server_port} for run.rollouts={cfg.run.rollouts} servers, but SGLang 0.5.14 also takes port + "
             "10000 for gRPC (a TCP port)", f"use a free port at most {55536 - cfg.run.rollouts}, e.g. 30000")
    launched = s.mode == "http" and not s.urls  # `offpolicy run` starts the servers (rollout/engines/sglang/launch.py)
    if s.mode == "engine" or launched:
        owned = sorted(k for k in s.extra if k in _SGLANG_OWNED)
        _require(not owned, "rollout.sglang.extra", f"gives {owned}",
                 "set " + ", ".join(f"{k} through {_SGLANG_OWNED[k]}" for k in owned))
    _require(s.mode == "http" or not s.urls, "rollout.sglang.urls", "is set but rollout.sglang.mode is engine",
             "use rollout.sglang.mode=http to talk to those servers, or clear the urls")
    if s.mode == "http":
        bad = [u for u in s.urls if not re.match(r"^https?://[^/\s]+/?$", u)]
        _require(not bad, "rollout.sglang.urls", f"{bad} are not base URLs", "write http://HOST:PORT with no path")
        _require(len({u.rstrip("/") for u in s.urls}) == len(s.urls), "rollout.sglang.urls", "lists a server twice",
                 "name each server once")
    else:
        _require(cfg.model.path is not None or cfg.rollout.weights_format != "native", "model.path",
                 "is unset but rollout.sglang.mode=engine loads a checkpoint",
                 "set model.path to an HF model directory (a low-bit rollout.weights_format starts on its first version)")
        _require(s.prefetch in ("auto", "disk") or s.dp_size == 1, "rollout.sglang.prefetch",
                 f"is {s.prefetch} with rollout.sglang.dp_size {s.dp_size}, but SGLang updates weights from tensors with "
                 "one data-parallel replica only (0.5.14 tokenizer_control_mixin.py:470-472)",
                 "use rollout.sglang.prefetch=disk, or dp_size 1")
    _require(s.prefetch in ("auto", "disk") or s.mode == "engine", "rollout.sglang.prefetch",
             f"is {s.prefetch} in http mode, but only the in-process engine takes tensors on its GPU from the daemon",
             "use rollout.sglang.prefetch=disk, or rollout.sglang.mode=engine")
    if cfg.rollout.seed_per_prompt and s.mode == "engine":
        _require(s.extra.get("enable_deterministic_inference") is True, "rollout.seed_per_prompt",
                 "is on, but SGLang honours a request's sampling_seed only with enable_deterministic_inference",
                 "set rollout.sglang.extra.enable_deterministic_inference=true or turn rollout.seed_per_prompt off")


# vLLM engine arguments set from other sections (offpolicy/rollout/engines/vllm/wire.py), which rollout.vllm.extra may not give
_VLLM_OWNED = {"model": "model.path / the weight store", "dtype": "model.dtype", "skip_tokenizer_init": "offpolicy",
         "logprobs_mode": "offpolicy (processed_logprobs)", "worker_extension_cls": "offpolicy",
         "tensor_parallel_size": "rollout.vllm.tensor_parallel_size", "seed": "rollout.vllm.seed",
         "data_parallel_size": "rollout.vllm.data_parallel_size", "quantization": "rollout.vllm.quantization",
         "enforce_eager": "rollout.vllm.enforce_eager", "max_model_len": "rollout.vllm.max_model_len",
         "gpu_memory_utilization": "rollout.vllm.gpu_memory_utilization",
         "kv_cache_memory_bytes": "rollout.vllm.kv_cache_memory_bytes",
         "enable_prefix_caching": "rollout.vllm.enable_prefix_caching",
         "enable_expert_parallel": "rollout.vllm.enable_expert_parallel"}


def _validate_vllm(cfg: Config) -> None:
    """Checks of rollout.vllm (docs/vllm.md); run only when rollout.engine is vllm."""
    v, r = cfg.rollout.vllm, cfg.rollout
    for name in ("tensor_parallel_size", "data_parallel_size"):
        _require(getattr(v, name) >= 1, f"rollout.vllm.{name}", f"is {getattr(v, name)}", "use 1 or more")
    _require(r.top_k == 0 and r.top_p == 1.0, "rollout.top_k" if r.top_k else "rollout.top_p",
             f"is {r.top_k if r.top_k else r.top_p}, but vLLM reports logprobs after top-k/top-p filtering "
             "(logprobs_mode processed_logprobs) while the learner scores the temperature-scaled distribution before it",
             "use rollout.top_k=0 and rollout.top_p=1.0 with rollout.engine=vllm")
    _require(v.gpu_memory_utilization is None or 0 < v.gpu_memory_utilization <= 1,
             "rollout.vllm.gpu_memory_utilization", f"is {v.gpu_memory_utilization}", "use a fraction in (0, 1]")
    _require(v.prefetch != "device" or v.gpu_memory_utilization is None or v.gpu_memory_utilization < 1,
             "rollout.vllm.prefetch", "is device with rollout.vllm.gpu_memory_utilization 1.0, which leaves no GPU memory "
             "for the staged copy of a version", "lower rollout.vllm.gpu_memory_utilization (the version's bytes below "
             "what the GPU holds), or use rollout.vllm.prefetch=host")
    _require(v.kv_cache_memory_bytes is None or v.kv_cache_memory_bytes >= 1024**2, "rollout.vllm.kv_cache_memory_bytes",
             f"is {v.kv_cache_memory_bytes}", "give at least 1 MiB (e.g. 268435456), or leave it unset")
    _require(v.max_model_len is None or v.max_model_len > r.max_new_tokens, "rollout.vllm.max_model_len",
             f"is {v.max_model_len}, not above rollout.max_new_tokens {r.max_new_tokens}",
             "raise it to the longest prompt + rollout.max_new_tokens, or leave it unset (the model's)")
    for name in ("request_timeout_s", "update_timeout_s", "startup_timeout_s", "health_check_interval_s",
                 "recover_timeout_s"):
        _require(getattr(v, name) > 0, f"rollout.vllm.{name}", "must be > 0", "raise it")
    _require(v.max_retries >= 0, "rollout.vllm.max_retries", "must be >= 0", "use 0 to fail on the first abort")
    _require(v.stage_threads >= 0, "rollout.vllm.stage_threads", f"is {v.stage_threads}",
             "use 0 (the reader's default) or a number of threads")
    _require(0 < v.server_port < 65536 - cfg.run.rollouts, "rollout.vllm.server_port", f"is {v.server_port}",
             "use a free TCP port, e.g. 8100")
    _require(cfg.model.dtype != "float64", "model.dtype", "float64 is not a vLLM dtype",
             "use bfloat16, float16 or float32 with rollout.engine=vllm")
    bad = [u for u in v.urls if not re.match(r"^https?://[^/\s]+/?$", u)]
    _require(not bad, "rollout.vllm.urls", f"{bad} are not base URLs", "write http://HOST:PORT with no path")
    _require(len({u.rstrip("/") for u in v.urls}) == len(v.urls), "rollout.vllm.urls", "lists a server twice",
             "name each server once")
    _require(v.mode == "http" or not v.urls, "rollout.vllm.urls", "is set but rollout.vllm.mode is engine",
             "use rollout.vllm.mode=http to talk to those servers, or clear the urls")
    owned = sorted(k for k in v.extra if k in _VLLM_OWNED)
    _require(not owned, "rollout.vllm.extra", f"gives {owned}", "set " + ", ".join(f"{k} through {_VLLM_OWNED[k]}" for k in owned))
    _require(cfg.eval.every_versions == 0 or (cfg.eval.engine or r.engine) != "vllm" or v.mode == "engine",
             "eval.engine", f"is {cfg.eval.engine or 'vllm (rollout.engine)'!r} with rollout.vllm.mode http, which would "
             "send the eval daemon's work to the rollouts' vLLM servers and swap their weights",
             "set eval.engine=torch, or rollout.vllm.mode=engine (each daemon its own vllm.LLM)")
