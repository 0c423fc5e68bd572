"""What goes to vLLM and what comes back: engine arguments, sampling parameters, outputs, proofs.

Pure functions over vLLM 0.32's shapes (docs/vllm.md lists each with its source file), shared by the
in-process engine and the HTTP servers; where vLLM 0.26 answers otherwise, both shapes are read
(`versions.py` lists the differences). Invariants:
- one request per prompt with `n` samples; with a prompt seed, vLLM seeds sample i with seed + i
  (`v1/engine/parallel_sampling.py`), so a prompt's samples do not depend on the batch or daemon;
- tokens and behaviour logprobs both come from vLLM's output, the stop token included; logprobs are
  vLLM's `processed_logprobs` (the temperature-scaled distribution the learner scores; the config
  refuses top-k / top-p, which vLLM applies before it reports them);
- a sample is returned only if it finished with "stop" or "length" under the weight version the
  engine holds; "abort" is reported to the caller (who retries), anything else raises;
- a load is proven when the engine's tensors fingerprint as the version's files plus the engine's
  offset (`proven`).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import numpy as np

from offpolicy.config import Config
from offpolicy.rollout.engines import Completion, SamplingParams, prompt_counts
from offpolicy.rollout.engines.errors import EngineError, VersionMismatch
from offpolicy.rollout.engines import fingerprint as fp

EXTENSION = "offpolicy.rollout.engines.vllm.worker.Extension"
log = logging.getLogger("offpolicy.vllm")

CPU_KV_CACHE_BYTES = 256 * 1024**2  # vLLM refuses to start on a CPU without a KV-cache size
ENV = {"VLLM_SERVER_DEV_MODE": "1",  # /collective_rpc, /pause, /resume, /update_weight_version
       "OFFPOLICY_VLLM_CHECKABLE_WEIGHTS": "1"}  # CPU: every weight stays a parameter (plugin.py)


def engine_args(cfg: Config, model: str, seed: int, on_cpu: bool) -> dict[str, Any]:
    """vLLM engine arguments (EngineArgs names) of this run, starting from the HF directory `model`."""
    v = cfg.rollout.vllm
    args: dict[str, Any] = {
        "model": model, "dtype": cfg.model.dtype, "skip_tokenizer_init": True, "logprobs_mode": "processed_logprobs",
        "worker_extension_cls": EXTENSION, "seed": seed if v.seed is None else v.seed,
        "tensor_parallel_size": v.tensor_parallel_size, "data_parallel_size": v.data_parallel_size,
        "enforce_eager": v.enforce_eager,
    }
    if v.enable_expert_parallel:
        args["enable_expert_parallel"] = True
    for name in ("quantization", "max_model_len", "gpu_memory_utilization", "kv_cache_memory_bytes",
                 "enable_prefix_caching"):
        if getattr(v, name) is not None:
            args[name] = getattr(v, name)
    if on_cpu and v.kv_cache_memory_bytes is None:
        args["kv_cache_memory_bytes"] = CPU_KV_CACHE_BYTES
    out = {**args, **v.extra}
    given = v.extra.get("compilation_config", {})  # a dict merges over ours; anything else (a level) stands alone
    if not on_cpu and not v.enforce_eager and graph_sizes(cfg, model) == "budget" and isinstance(given, dict):
        budget = v.extra.get("max_num_batched_tokens")
        mine = {"cudagraph_capture_sizes": budget_capture_sizes(budget if isinstance(budget, int) else None)}
        out["compilation_config"] = {**mine, **given}
    return out


GRAPH_STEP = 512  # tokens between the CUDA-graph sizes above vLLM's own (rollout.vllm.graph_sizes: budget)
BUDGET_CAP = 16384  # vLLM 0.26's largest default step budget (vllm.LLM's on a large GPU; servers' 8192): vLLM drops
# the capture sizes above a run's budget (config/vllm.py `_set_cudagraph_sizes`)


def graph_sizes(cfg: Config, model: str | None = None) -> str:
    """rollout.vllm.graph_sizes resolved: auto is "budget" for MXFP4 weights (versions in MXFP4, or
    rollout.vllm.quantization mxfp4) and for any MoE checkpoint `model` (its config.json names experts), else "vllm".
    vLLM's MoE kernels are Triton kernels compiled per step size: MXFP4's routing (triton_kernels' `_topk_forward`,
    `_sum_bitmatrix_rows`: a constexpr stride of the step's tokens rounded up to 32), bf16's `fused_moe_kernel`;
    every new size of an eager step compiles again, mid-run. With budget, MXFP4 and bf16 both generated faster than
    on vLLM's own sizes, with no MoE compile after the warm-up (measured: docs/vllm.md, "MXFP4 generation and
    Triton's JIT")."""
    v = cfg.rollout.vllm
    if v.graph_sizes != "auto":
        return v.graph_sizes
    mxfp4 = "mxfp4" in (cfg.rollout.weights_format, v.quantization)
    return "budget" if mxfp4 or (model is not None and moe_checkpoint(model)) else "vllm"


MOE_FIELDS = ("num_local_experts", "num_experts", "n_routed_experts")  # gpt_oss / mixtral, qwen*_moe, deepseek


def moe_checkpoint(model: str) -> bool:
    """Whether the HF directory `model` holds a mixture-of-experts model (config.json, or its text_config, names a
    positive expert count); False where there is no config.json to read."""
    path = Path(model) / "config.json"
    if not path.is_file():
        return False
    hf = json.loads(path.read_text())
    return any(isinstance(c.get(k), int) and c[k] > 0 for c in (hf, hf.get("text_config") or {}) for k in MOE_FIELDS)


def budget_capture_sizes(budget: int | None = None) -> list[int]:
    """CUDA-graph sizes for `graph_sizes` budget: vLLM 0.26's own for GPT-OSS (1, 2, 4, then every 8 tokens to 256 and
    every 16 to 1024: `config/vllm.py`, `models/config.py`'s override to 1024), then every GRAPH_STEP tokens up to the
    step budget (`budget`, else BUDGET_CAP, which vLLM cuts to its own) and the budget itself: a step of n tokens is
    padded to the next size (at most GRAPH_STEP - 1 tokens more) and replays that size's graph."""
    top = budget or BUDGET_CAP
    sizes = {1, 2, 4, *range(8, 256, 8), *range(256, 1025, 16), *range(1024 + GRAPH_STEP, top + 1, GRAPH_STEP), top}
    return sorted(s for s in sizes if s <= top)


def cli_flags(args: dict[str, Any]) -> list[str]:
    """`vllm serve` flags of engine arguments: --name-with-dashes VALUE, booleans as --flag / --no-flag."""
    flags: list[str] = []
    for name, value in args.items():
        if name == "model":
            continue
        flag = "--" + name.replace("_", "-")
        if value is True:
            flags.append(flag)
        elif value is False:
            flags.append("--no-" + name.replace("_", "-"))
        elif isinstance(value, (dict, list)):
            flags += [flag, json.dumps(value)]
        else:
            flags += [flag, str(value)]
    return ["--model", str(args["model"]), *flags]


def sampling_params(params: SamplingParams, stop_token_ids: list[int], seed: int | None = None) -> dict[str, Any]:
    """vLLM SamplingParams of one prompt's `n` samples (our top_k 0 is vLLM's 0: off)."""
    sp: dict[str, Any] = {
        "n": params.n, "temperature": params.temperature, "top_p": params.top_p, "top_k": max(params.top_k, 0),
        "max_tokens": params.max_new_tokens, "stop_token_ids": sorted(stop_token_ids), "logprobs": 0,
        "detokenize": False, "skip_special_tokens": False,
    }
    if seed is not None:
        sp["seed"] = seed
    return sp


def request_counts(out: dict[str, Any], n: int = 1) -> dict[str, int]:
    """A request's prefill as its response's `usage` says it (`prompt_counts`; the cached tokens only from a server
    started with --enable-prompt-tokens-details, which `launch.server_command` gives); nothing for a request of `n` > 1
    samples: vLLM runs them as n child requests scheduled together, the first computes the prompt and its siblings find
    those blocks cached in the same step, and `usage` gives the cached tokens of one child, the last to finish (0.26
    `v1/engine/parallel_sampling.py`, `output_processor.py`): nearly all cached on a version's first ask
    (docs/benchmarks.md)."""
    if n > 1:
        return {}
    usage = out.get("usage") or {}
    return prompt_counts(usage.get("prompt_tokens"), (usage.get("prompt_tokens_details") or {}).get("cached_tokens"))


def parse_choice(choice: dict[str, Any], expected_version: str | None, where: str) -> Completion | None:
    """The Completion of one vLLM choice (the tokens API's JSON shape), or None when vLLM aborted it.

    `expected_version` is the weight-version label every output token must carry (None: not checked)."""
    kind = choice.get("finish_reason")
    if kind == "abort":
        return None
    if kind not in ("stop", "length"):
        raise EngineError(f"vLLM output {where} finished with {kind!r}, not stop, length or abort")
    if expected_version is not None:
        spans = choice.get("weight_versions") or []
        seen = sorted({str(s.get("version")) for s in spans})
        if seen != [expected_version]:
            raise VersionMismatch(f"vLLM output {where} was generated with weight version(s) {seen}, the engine loaded "
                                  f"{expected_version}: is another client updating this server's weights?")
    tokens = choice.get("token_ids")
    content = (choice.get("logprobs") or {}).get("content")
    if not isinstance(tokens, list) or not tokens or not isinstance(content, list) or len(content) != len(tokens):
        raise EngineError(f"vLLM output {where} has {len(tokens or [])} token ids and {len(content or [])} logprobs: "
                          "were logprobs asked for?")
    if [_token_id(c) for c in content] != list(tokens):
        raise EngineError(f"vLLM output {where}: the logprobs' token ids differ from token_ids {list(tokens)[:8]}...")
    logprobs = np.array([c.get("logprob") for c in content], dtype=np.float32)
    if not np.isfinite(logprobs).all():
        raise EngineError(f"vLLM output {where} has non-finite logprobs")
    return Completion(tokens=np.array(tokens, dtype=np.int32), logprobs=logprobs, finish_reason=kind)


def _token_id(entry: dict[str, Any]) -> int | None:
    """The token id of one logprobs entry: vLLM 0.32's `token_id`, or 0.26's chat-shaped `"token": "token_id:N"`."""
    if "token_id" in entry:
        return entry["token_id"]
    token = entry.get("token")
    if isinstance(token, str) and token.startswith("token_id:") and token[9:].isdigit():
        return int(token[9:])
    return None


def _engine_and_files(reports: list[dict], what: str) -> tuple[int, int]:
    """The combined fingerprint of the workers' tensors and the one fingerprint they all read of the files."""
    files = {int(r["files"]) for r in reports}
    if len(files) != 1:
        raise EngineError(f"vLLM workers read different fingerprints of {what}: {sorted(files)}")
    return fp.combine([{k: int(v) for k, v in r["tensors"].items()} for r in reports]), next(iter(files))


def proven(reports: list[dict], offset: int) -> tuple[bool, int, int]:
    """Whether a load's per-worker reports prove the version: (ok, engine - offset, files)."""
    engine, files = _engine_and_files(reports, "one version's files")
    engine = fp.sub(engine, offset)
    return engine == files, engine, files


def offset_of(reports: list[dict]) -> int:
    """The engine's offset from its baseline reports (fresh load of its launch checkpoint)."""
    hidden = sorted({name for r in reports for name in r.get("empty", [])})
    if hidden:
        raise EngineError(f"vLLM holds weights the engine cannot read back ({hidden[:4]} are empty parameters: on a "
                          "CPU vLLM moved them into packed kernels): start vLLM with OFFPOLICY_VLLM_CHECKABLE_WEIGHTS=1 "
                          "in its environment (offpolicy/rollout/engines/vllm/plugin.py), or set rollout.vllm.verify=false")
    engine, files = _engine_and_files(reports, "the launch checkpoint")
    return fp.sub(engine, files)


def load_methods(load_method: str, rebuilding: bool) -> list[str]:
    """The load methods to try, in order: rollout.vllm.load_method, or rebuild once an engine is known to need it."""
    if rebuilding or load_method == "rebuild":
        return ["rebuild"]
    return ["inplace", "rebuild"] if load_method == "auto" else ["inplace"]


def tensor_changes(reports: list[dict], previous: list[dict]) -> tuple[list[str], list[str]]:
    """The first worker's model tensors whose fingerprint changed from `previous` (its reports of the last proven load,
    or of its baseline) to `reports`, and those that kept it: after a load that failed its proof, the tensors that
    kept their values where the version changed them (or changed where it did not) are the ones the load missed."""
    now, before = reports[0].get("tensors", {}), previous[0].get("tensors", {})
    common = [k for k in now if k in before]
    return sorted(k for k in common if int(now[k]) != int(before[k])), sorted(k for k in common if int(now[k]) == int(before[k]))


def files_said(record: dict) -> str:
    """How a load record's proof had the version's files hashed, for the log: as the load read them (`direct`), else
    the workers' seconds for it at the load (0 where a staging or the work ahead hashed them)."""
    if record.get("hash_read"):
        return f"{record['hash_read']:.3f} s as the load read them"
    return f"{record.get('hash_files', 0.0):.3f} s"


def waited_said(record: dict) -> str:
    """How long a load waited for the version's staging or hash ahead (`prefetch.waited`) and, over HTTP, what the
    swap's calls took (the load's RPC, and the pause, label and resume around it), for the log."""
    waited = (record.get("prefetch") or {}).get("waited", 0.0)
    out = f"; waited {waited:.3f} s for the work ahead" if waited else ""
    if "rpc" in record and "calls" in record:
        out += f"; the load's RPC {record['rpc']:.3f} s, the swap's other calls {record['calls']:.3f} s"
        each = record.get("call_seconds") or {}
        if each:
            out += " (" + ", ".join(f"{name} {s:.3f}" for name, s in each.items()) + ")"
    return out


def load_until_proven(load, methods: list[str], offset, verify: bool, where: str, version: int,
                      held: dict | None = None) -> dict | None:
    """`load(method)` (the workers' reports) for each method in turn until one is proven by fingerprint (or
    verify is off); the record of that load, or None when none held. `offset()` is read after each load
    (a rebuild baseline defines it). `held["reports"]`: the reports of the last proven load (or the baseline's),
    which a failed proof is compared with to name the tensors the load missed; a proven load replaces them."""
    for asked in methods:
        reports = load(asked)
        method = reports[0].get("method", asked) if reports else asked  # a worker may rebuild instead (worker.py)
        moved = sum(r.get("adopted", {}).get("moved", 0) for r in reports)
        if moved:  # a rebuild that could not copy every tensor into the running one (adopt.py)
            modules = sorted({m for r in reports for m in r.get("adopted", {}).get("moved_in", [])})
            log.warning("%s: the rebuild of version %d replaced %d tensors by reference (in %s): CUDA graphs "
                        "captured at start-up still read the old ones; run the servers with "
                        "rollout.vllm.enforce_eager=true", where, version, moved, ", ".join(modules[:5]))
        # the workers' own seconds (the slowest's): vLLM's load (in place: its reload, then what it misses), then the
        # fingerprints of the model and the files
        parts = {k: max((float(r.get(f"{k}_seconds", 0.0)) for r in reports), default=0.0)
                 for k in ("load", "reload", "misses", "hash", "hash_model", "hash_files", "hash_read")}
        if reports and all("prefetch_seconds" in r for r in reports):  # the files hashed ahead (offpolicy_prefetch)
            parts["prefetch"] = {"seconds": max(float(r["prefetch_seconds"]) for r in reports),
                                 "began": min(float(r["prefetch_began"]) for r in reports),
                                 "waited": max(float(r.get("prefetch_waited", 0.0)) for r in reports)}
            if all("prefetch_cpu_seconds" in r for r in reports):  # its threads' CPU time (background.Done)
                parts["prefetch"]["cpu_seconds"] = max(float(r["prefetch_cpu_seconds"]) for r in reports)
        if reports and all("staged" in r for r in reports):  # the reload took staged tensors (staging.py)
            staged = [r["staged"] for r in reports]
            parts["staged"] = {"where": staged[0]["where"], "pinned": all(s["pinned"] for s in staged),
                               "stream": all(bool(r.get("stream")) for r in reports),
                               "ahead": all(s["ahead"] for s in staged), "bytes": sum(int(s["bytes"]) for s in staged),
                               "read_seconds": max(float(s["read_seconds"]) for s in staged),
                               "mapped": sum(int(s.get("mapped", 0)) for s in staged)}
            if any(s.get("prepared_bytes") or s.get("unprepared") for s in staged):  # made ready for the kernels
                parts["staged"].update(prepared=sum(int(s.get("prepared", 0)) for s in staged),
                                       prepared_bytes=sum(int(s.get("prepared_bytes", 0)) for s in staged),
                                       prepare_seconds=max(float(s.get("prepare_seconds", 0.0)) for s in staged),
                                       unprepared=next((s["unprepared"] for s in staged if s.get("unprepared")), None))
        if reports and all(r.get("direct") for r in reports):  # the files read onto the device at the load
            parts["direct"] = True
        if reports and all(r.get("kernels") for r in reports) and method == "inplace":  # MXFP4 experts by offpolicy
            parts["kernels"] = True  # (kernels.py), not by vLLM's reload
        wheres = sorted({str(r["where"]) for r in reports if r.get("where")})  # where each worker read the version
        if wheres:  # from (rollout.vllm.prefetch resolved: worker._offpolicy_where), and why where they agree
            parts["where"] = "/".join(wheres)
            if len(wheres) == 1 and reports[0].get("where_why"):
                parts["where_why"] = reports[0]["where_why"]
        errors = sorted({r["staging_error"] for r in reports if "staging_error" in r})
        if errors:
            parts["staging_error"] = "; ".join(errors)
        if not verify:
            return {"method": method, "verified": False, "moved": moved, **parts}
        ok, engine, files = proven(reports, offset())
        if ok:
            if method == "rebuild" and asked == "inplace":  # the worker chose it (worker.py, its `reason`)
                why = reports[0].get("reason", "the worker rebuilt")
                log.info("%s: %s: version %d and the next loads by rebuild", where, why, version)
            elif method == "rebuild" and methods[0] == "inplace":
                log.warning("%s: the in-place load of version %d did not hold the version's weights (fingerprint "
                            "check); it loads by rebuild from now on", where, version)
            if held is not None:
                held["reports"] = reports
            return {"method": method, "verified": True, "moved": moved, **parts}
        log.warning("%s: %s load of version %d failed the fingerprint check (engine %d, files %d)%s", where, method,
                    version, engine, files, _missed(reports, held))
    return None


def _missed(reports: list[dict], held: dict | None) -> str:
    """What a failed load's tensors did against the last proven load: the smaller of the changed and kept groups."""
    if not held or not held.get("reports") or not reports:
        return ""
    changed, kept = tensor_changes(reports, held["reports"])
    few, which = (kept, "unchanged") if len(kept) <= len(changed) else (changed, "changed")
    return (f"; against the last proven load {len(changed)} tensors changed and {len(kept)} did not; {which}: "
            f"{', '.join(few[:8])}{' ...' if len(few) > 8 else ''}")
