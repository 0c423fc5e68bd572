"""Typed run configuration: YAML file, then dotted command-line overrides, then validation.

Every section is a `msgspec.Struct` with defaults and a comment per field; unknown fields are
errors. `load_config(path, overrides)` is the only entry: it reads the YAML, applies overrides such
as `algo.max_staleness=0` (values parsed as YAML scalars), converts to `Config` and runs the
cross-field checks. Every failure raises `ConfigError` naming the field and the fix. This module
imports only msgspec and yaml so that entry points can parse their config before heavy imports.
"""

from __future__ import annotations

import os
import re
import typing
from typing import Any, Literal

import msgspec
import yaml


class _Loader(yaml.SafeLoader):
    """SafeLoader that reads 1e-6 as a float (YAML 1.2), not as the string PyYAML 1.1 makes of it."""


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"""^(?:[-+]?(?:[0-9][0-9_]*)\.[0-9_]*(?:[eE][-+]?[0-9]+)?
                |[-+]?(?:[0-9][0-9_]*)(?:[eE][-+]?[0-9]+)
                |\.[0-9_]+(?:[eE][-+]?[0-9]+)?
                |[-+]?\.(?:inf|Inf|INF)
                |\.(?:nan|NaN|NAN))$""", re.X),
    list("-+0123456789."),
)


def _yaml(text):
    return yaml.load(text, Loader=_Loader)


class ConfigError(ValueError):
    """A config problem; the message names the field and how to fix it."""


class _Section(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    pass


class RunConfig(_Section):
    name: str = "offpolicy"  # run name: names the weight-store folder and the run directory
    dir: str = "runs"  # parent of run directories; the learner writes <dir>/<name>/
    rollouts: int = 2  # `offpolicy run` only: how many rollout daemons to start on this machine
    learner_gpus: list[int] = []  # `offpolicy run` only: the learner's GPUs (its CUDA_VISIBLE_DEVICES), e.g. [0] or [0, 1] (megatron: one rank per GPU); [] = inherit
    rollout_gpus: list[int | str] = []  # `offpolicy run` only: GPUs of rollout daemon i = entry i mod len; a string lists several ("2,3": an SGLang TP2 engine); [] = inherit
    log_level: str = "INFO"  # DEBUG, INFO, WARNING or ERROR
    torch_threads: int = 0  # threads per daemon for torch on CPU; 0 = torch's default


class ModelConfig(_Section):
    path: str | None = None  # HF model directory to start from; None = build `arch` from scratch
    arch: dict[str, Any] = {}  # HF config.json fields for a model built from scratch (needs model_type)
    tokenizer: str = "digits"  # "digits" (built-in, for the synthetic tasks) or an HF tokenizer directory
    dtype: Literal["float32", "bfloat16", "float16", "float64"] = "float32"  # parameter dtype of engine and learner
    seed: int = 0  # initialisation seed for a model built from scratch


class SyntheticConfig(_Section):
    task: Literal["copy", "reverse", "sort"] = "reverse"  # what the response must do to the digits
    length: int = 3  # digits per prompt
    num_prompts: int = 100_000  # prompts per epoch
    seed: int = 0  # data seed (the same seed always gives the same prompts)


class DataConfig(_Section):
    source: str = "synthetic"  # "synthetic", or a .jsonl / .parquet file of prompts
    prompt_field: str = "prompt"  # field of a file row holding the prompt text
    answer_field: str = "answer"  # field handed to the reward function as the reference answer
    synthetic: SyntheticConfig = msgspec.field(default_factory=SyntheticConfig)
    shuffle: bool = True  # shuffle the prompt order each epoch (seeded by `seed` and the epoch)
    seed: int = 0  # shuffle seed
    max_prompt_tokens: int = 1024  # longer prompts are refused with an error naming the row


class SGLangConfig(_Section):
    mode: Literal["engine", "http"] = "engine"  # "engine": sglang.Engine inside the daemon; "http": the SGLang servers at `urls`
    urls: list[str] = []  # http mode: base URLs of running SGLang servers on this node, e.g. "http://127.0.0.1:30000"
    tp_size: int = 1  # engine mode: tensor-parallel GPUs of the engine (SGLang tp_size)
    ep_size: int = 1  # engine mode: expert-parallel size of MoE layers, divides tp_size (SGLang ep_size)
    attn_dp_size: int = 1  # engine mode: data-parallel attention groups inside TP, divides tp_size (SGLang attn_dp_size)
    dp_size: int = 1  # engine mode: data-parallel replicas of the model (SGLang dp_size)
    quantization: str | None = None  # engine mode: "fp8", "mxfp4", ...; None = what the checkpoint says (SGLang quantization)
    mem_fraction_static: float | None = None  # engine mode: GPU memory share for weights + KV cache; None = SGLang's choice
    random_seed: int | None = None  # engine mode: SGLang random_seed; None = rollout.seed + the daemon's index
    attention_backend: str | None = None  # engine mode: "fa3", "flashinfer", "triton", ...; None = SGLang's choice
    skip_tokenizer_init: bool = True  # engine mode: SGLang loads no tokenizer (we send and read token ids)
    enable_metrics: bool = False  # engine mode: SGLang collects its sglang:* metrics (only its HTTP server serves them)
    load_format: str | None = None  # load_format of update_weights_from_disk; None = the engine's own
    pause_mode: Literal["retract", "abort", "in_place"] = "retract"  # http: /pause_generation mode around a weight update
    request_timeout_s: float = 600.0  # http: limit of one /generate call; past it the server is marked down
    update_timeout_s: float = 600.0  # http: limit of each pause, update_weights_from_disk and continue call
    flush_timeout_s: float = 60.0  # http, pause_mode in_place: how long /flush_cache waits for running requests
    startup_timeout_s: float = 900.0  # http: how long to wait at start for every server's /health_generate
    health_check_interval_s: float = 10.0  # http: a server marked down is probed again after this many seconds
    max_retries: int = 3  # aborted samples are generated again up to this often, then generate raises
    extra: dict[str, Any] = {}  # engine mode: further sglang.Engine (ServerArgs) fields, passed as given


class RolloutConfig(_Section):
    engine: Literal["torch", "sglang"] = "torch"  # rollout engine; "torch" = embedded HF transformers, "sglang" = see rollout.sglang
    device: str = "auto"  # "auto" (cuda if present, else cpu), "cpu", "cuda", "cuda:1", ...
    n_samples: int = 8  # responses per prompt (the GRPO group size)
    temperature: float = 1.0  # sampling temperature; the learner scores logprobs at the same temperature
    top_p: float = 1.0  # nucleus sampling mass; 1.0 = off
    top_k: int = 0  # keep the k most likely tokens; 0 = off
    max_new_tokens: int = 16  # response length limit; longer responses are cut and marked "length"
    stop_token_ids: list[int] = []  # extra stop tokens; the tokenizer's EOS always stops
    groups_per_lease: int = 8  # prompts asked for per work request (one generation batch)
    prefetch_leases: int = 1  # work requests kept outstanding while generating (hides the round trip)
    reward: str = "digits_partial"  # reward function name in the registry (offpolicy.rewards)
    seed: int = 0  # sampling seed; each daemon adds its index
    seed_per_prompt: bool = False  # seed sampling by (seed, epoch, prompt): samples independent of daemon and batch
    static_cache: bool = False  # torch engine: static KV cache; on a GPU each decode step replays a captured CUDA graph
    compile: bool = False  # torch engine with static_cache: torch.compile the decode step first (fused kernels; minutes to start)
    sglang: SGLangConfig = msgspec.field(default_factory=SGLangConfig)


class MegatronConfig(_Section):
    tp: int = 1  # tensor-parallel size
    pp: int = 1  # pipeline-parallel size (must divide num_hidden_layers)
    ep: int = 1  # expert-parallel size: each EP rank holds num_experts/ep experts (MoE models only; dense models need 1)
    etp: int = 1  # expert tensor-parallel size: splits each expert's MLP (MoE models only; dense models need 1)
    cp: int = 1  # context-parallel size (only 1 is implemented)
    sequence_parallel: bool = False  # shard activations along the sequence inside TP regions (tp > 1; local spec or TE); MoE training with tp > 1 needs it
    recompute: Literal["none", "selective", "full"] = "none"  # activation recomputation
    recompute_layers: int = 1  # layers per recompute chunk with recompute=full (uniform method)
    max_tokens_per_gpu: int = 0  # token budget of one micro-batch (rows x padded length); 0 = learner.micro_batch_groups groups
    use_distributed_optimizer: bool = True  # shard optimizer state over data-parallel ranks (ZeRO-1)
    transformer_impl: Literal["auto", "local", "transformer_engine"] = "auto"  # layer spec; auto = TE if importable, else local
    master_port: int = 29500  # torch.distributed rendezvous port when MASTER_PORT is unset
    moe_aux_loss_coef: float = 0.0  # MoE load-balancing aux loss weight (per MoE layer, token-weighted mean over the batch); 0 = off; HF router_aux_loss_coef is not read
    moe_token_dispatcher: Literal["alltoall", "allgather"] = "alltoall"  # Megatron MoE token dispatcher (docs/megatron.md, MoE)


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
    checksum: Literal["sha256", "none"] = "sha256"  # per-shard checksum in the manifest
    verify: bool = False  # rollouts check every file of a version against the manifest before loading it
    reuse_files: bool = False  # learner: write new versions into the shard files of collected ones (no fresh pages; readers must not keep tensors after close)


class RelayConfig(_Section):
    nodes: list[str] = []  # relay hosts in chain order; [] = the Slurm step's (else job's) node list
    source: str = ""  # host of the learner-side shard server (offpolicy-relay --serve); "" = the learner host
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


class CheckpointConfig(_Section):
    every_steps: int = 0  # learner: checkpoint every N steps (and always at the end and on SIGTERM); 0 = only then
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


def load_config(path: str | os.PathLike | None, overrides: list[str] = ()) -> Config:
    """Read YAML at `path` (None = defaults), apply `a.b=value` overrides, convert and validate."""
    raw: dict[str, Any] = {}
    if path is not None:
        try:
            with open(path) as f:
                raw = _yaml(f) or {}
        except FileNotFoundError:
            raise ConfigError(f"config file {path} not found: pass an existing YAML file") from None
        except yaml.YAMLError as e:
            raise ConfigError(f"config file {path} is not valid YAML: {e}") from None
        if not isinstance(raw, dict):
            raise ConfigError(f"config file {path} must hold a mapping of sections, got {type(raw).__name__}")
    for item in overrides:
        apply_override(raw, item)
    try:
        cfg = msgspec.convert(raw, Config, strict=False)
    except msgspec.ValidationError as e:
        raise ConfigError(_explain(e)) from None
    validate(cfg)
    return cfg


def apply_override(raw: dict[str, Any], item: str) -> None:
    """Apply one `section.field=value` override to a raw config mapping in place."""
    key, sep, text = item.partition("=")
    if not sep or not key:
        raise ConfigError(f"override {item!r} must look like section.field=value, e.g. algo.max_staleness=0")
    parts = key.strip().split(".")
    _check_path(parts)
    node = raw
    for p in parts[:-1]:
        node = node.setdefault(p, {})
        if not isinstance(node, dict):
            raise ConfigError(f"override {item!r}: {p} is not a section")
    try:
        node[parts[-1]] = _yaml(text) if text.strip() else ""
    except yaml.YAMLError as e:
        raise ConfigError(f"override {item!r}: value is not a YAML scalar or list: {e}") from None


def _check_path(parts: list[str]) -> None:
    for i, p in enumerate(parts):
        parent = _field_type(parts[:i]) if i else Config
        fields = getattr(parent, "__struct_fields__", None)
        if fields is None:  # a free-form mapping such as model.arch
            return
        if p not in fields:
            where = ".".join(parts[:i]) or "the top level"
            raise ConfigError(f"unknown field {'.'.join(parts[: i + 1])}: {where} has {', '.join(fields)}")


def _explain(e: msgspec.ValidationError) -> str:
    msg = str(e)
    text, sep, where = msg.rpartition(" - at `$.")
    field = where.rstrip("`").replace("[", ".").replace("]", "") if sep else ""
    text = text if sep else msg
    unknown = _UNKNOWN.match(text)
    if unknown:  # report it as the override path check does: the field and what the section has
        parts = [*filter(None, field.split(".")), unknown.group(1)]
        try:
            _check_path(parts)
        except ConfigError as ce:
            return str(ce)
    choices = typing.get_args(_field_type(field.split("."))) if field else ()
    if "enum value" in text and choices:
        return f"config field {field}: {text}; use one of {', '.join(map(repr, choices))}"
    if not field:
        return f"config: {text}"
    return f"config field {field}: {text}; fix the value in the YAML file or the override"


_UNKNOWN = re.compile(r"Object contains unknown field `([^`]*)`")


def _field_type(parts: list[str]) -> Any:
    struct: Any = Config
    for p in parts:
        fields = getattr(struct, "__struct_fields__", ())
        if p not in fields:
            return None
        struct = msgspec.structs.fields(struct)[fields.index(p)].type
    return struct


def _require(ok: bool, field: str, problem: str, fix: str) -> None:
    if not ok:
        raise ConfigError(f"config field {field}: {problem}; {fix}")


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
            mp = m.tp * m.pp * m.cp
            _require(len(lg) % mp == 0, "run.learner_gpus", f"{len(lg)} GPUs (one learner rank each) are not a "
                     f"multiple of learner.megatron tp x pp x cp = {mp}", "list tp*pp*cp*dp GPUs")
    if rg:
        _require(cfg.rollout.device in renumbered, "rollout.device", f"{cfg.rollout.device!r} with run.rollout_gpus",
                 "each daemon sees only its GPUs, renumbered from 0: use rollout.device=cuda (or auto)")


def validate(cfg: Config) -> None:
    """Cross-field checks that types alone cannot express; raises ConfigError."""
    r, lr, a, t, w = cfg.rollout, cfg.learner, cfg.algo, cfg.transport, cfg.weights
    _require(cfg.run.name.replace("-", "").replace("_", "").isalnum(), "run.name",
             f"{cfg.run.name!r} has characters other than letters, digits, - and _", "rename the run")
    _require(cfg.run.rollouts >= 1, "run.rollouts", "must be >= 1", "start at least one rollout daemon")
    _validate_gpus(cfg)
    _require(cfg.run.log_level in ("DEBUG", "INFO", "WARNING", "ERROR"), "run.log_level",
             f"{cfg.run.log_level!r} is not a level", "use DEBUG, INFO, WARNING or ERROR")
    _require(cfg.model.path is not None or "model_type" in cfg.model.arch, "model.arch",
             "no model.path and no model.arch.model_type", "set model.path to an HF directory or give model.arch")
    _require(cfg.data.source == "synthetic" or cfg.data.source.endswith((".jsonl", ".parquet")), "data.source",
             f"{cfg.data.source!r} is neither 'synthetic' nor a .jsonl/.parquet file", "point it at a prompt file")
    _require(cfg.data.synthetic.length >= 1, "data.synthetic.length", "must be >= 1", "use 1 or more digits")
    _require(cfg.data.synthetic.num_prompts >= 1, "data.synthetic.num_prompts", "must be >= 1", "raise it")
    _require(r.n_samples >= 2, "rollout.n_samples", f"is {r.n_samples}",
             "GRPO needs at least 2 responses per prompt to normalise within a group")
    _require(r.temperature > 0, "rollout.temperature", "must be > 0", "use 1.0 for plain sampling")
    _require(0 < r.top_p <= 1, "rollout.top_p", f"is {r.top_p}", "use a value in (0, 1]; 1.0 turns it off")
    _require(r.top_k >= 0, "rollout.top_k", "must be >= 0", "use 0 to turn it off")
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
    _require(mg.cp == 1, "learner.megatron.cp", f"is {mg.cp}; context parallelism is not implemented",
             "use cp=1 and raise tp or pp instead")
    _require(mg.max_tokens_per_gpu >= 0, "learner.megatron.max_tokens_per_gpu", "must be >= 0",
             "use 0 to batch by learner.micro_batch_groups")
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
    _require(0 <= cfg.metrics.port < 65536, "metrics.port", f"is {cfg.metrics.port}", "use 0 (off) or a TCP port")
    _require(cfg.metrics.log_every >= 1, "metrics.log_every", "must be >= 1", "raise it")
    _require(cfg.checkpoint.every_steps >= 0, "checkpoint.every_steps", "must be >= 0", "use 0 for end-only")
    _require(cfg.checkpoint.keep >= 1, "checkpoint.keep", "must be >= 1", "keep at least the newest checkpoint")
    _require(r.static_cache or not r.compile, "rollout.compile", "needs rollout.static_cache",
             "set rollout.static_cache=true as well (only the static decode step is compiled)")
    if r.engine == "sglang":
        _validate_sglang(cfg)


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
                 "health_check_interval_s"):
        _require(getattr(s, name) > 0, f"rollout.sglang.{name}", "must be > 0", "raise it")
    _require(s.max_retries >= 0, "rollout.sglang.max_retries", "must be >= 0", "use 0 to fail on the first abort")
    _require(cfg.model.dtype != "float64", "model.dtype", "float64 is not an SGLang dtype",
             "use bfloat16, float16 or float32 with rollout.engine=sglang")
    if s.mode == "http":
        _require(bool(s.urls), "rollout.sglang.urls", "is empty in http mode",
                 "list the SGLang servers, e.g. [http://127.0.0.1:30000], or use rollout.sglang.mode=engine")
        bad = [u for u in s.urls if not re.match(r"^https?://[^/\s]+/?$", u)]
        _require(not bad, "rollout.sglang.urls", f"{bad} are not base URLs", "write http://HOST:PORT with no path")
        _require(len({u.rstrip("/") for u in s.urls}) == len(s.urls), "rollout.sglang.urls", "lists a server twice",
                 "name each server once")
    else:
        _require(cfg.model.path is not None, "model.path", "is unset but rollout.sglang.mode=engine loads a checkpoint",
                 "set model.path to an HF model directory")
        owned = sorted(k for k in s.extra if k in _SGLANG_OWNED)
        _require(not owned, "rollout.sglang.extra", f"gives {owned}",
                 "set " + ", ".join(f"{k} through {_SGLANG_OWNED[k]}" for k in owned))
    if cfg.rollout.seed_per_prompt and s.mode == "engine":
        _require(s.extra.get("enable_deterministic_inference") is True, "rollout.seed_per_prompt",
                 "is on, but SGLang honours a request's sampling_seed only with enable_deterministic_inference",
                 "set rollout.sglang.extra.enable_deterministic_inference=true or turn rollout.seed_per_prompt off")


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
