"""vLLM request and response shapes, engine arguments and load proofs (offpolicy/rollout/engines/vllm/wire.py):
pure functions, no vLLM. The shapes are vLLM 0.32's tokens API (entrypoints/scale_out/token_in_token_out)."""

import json

import numpy as np
import pytest

from offpolicy.config import ConfigError, load_config
from offpolicy.rollout.engines import Completion, SamplingParams, prefill_counts
from offpolicy.rollout.engines.errors import EngineError, VersionMismatch
from offpolicy.rollout.engines import fingerprint as fp
from offpolicy.rollout.engines.vllm.launch import server_command
from offpolicy.rollout.engines.vllm.wire import (
    cli_flags,
    engine_args,
    graph_sizes,
    moe_checkpoint,
    offset_of,
    parse_choice,
    proven,
    request_counts,
    sampling_params,
)

CONFIG = "configs/quickstart-vllm.yaml"


def choice(tokens, logprobs, reason="stop", version="3"):
    return {"index": 0, "finish_reason": reason, "token_ids": tokens,
            "logprobs": {"content": [{"token_id": t, "logprob": lp} for t, lp in zip(tokens, logprobs)]},
            "weight_versions": [{"version": version, "start": 0, "end": len(tokens)}]}


def test_sampling_params_one_request_per_prompt():
    sp = sampling_params(SamplingParams(n=4, temperature=0.7, max_new_tokens=9), [13, 2], seed=11)
    assert sp == {"n": 4, "temperature": 0.7, "top_p": 1.0, "top_k": 0, "max_tokens": 9, "stop_token_ids": [2, 13],
                  "logprobs": 0, "detokenize": False, "skip_special_tokens": False, "seed": 11}
    assert "seed" not in sampling_params(SamplingParams(n=1), [13])


def test_parse_choice_returns_tokens_and_logprobs_of_the_version():
    c = parse_choice(choice([4, 5, 13], [-0.5, -1.0, -0.25]), "3", "r0")
    assert c.tokens.tolist() == [4, 5, 13] and c.finish_reason == "stop"
    np.testing.assert_allclose(c.logprobs, [-0.5, -1.0, -0.25])
    assert parse_choice(choice([4], [-0.1], reason="abort"), "3", "r0") is None
    with pytest.raises(VersionMismatch, match="weight version"):
        parse_choice(choice([4], [-0.1], version="2"), "3", "r0")
    spans = choice([4, 5], [-0.1, -0.2])
    spans["weight_versions"] = [{"version": "3", "start": 0, "end": 1}, {"version": "4", "start": 1, "end": 2}]
    with pytest.raises(VersionMismatch):
        parse_choice(spans, "3", "r0")
    with pytest.raises(EngineError, match="logprobs"):
        parse_choice({**choice([4, 5], [-0.1, -0.2]), "logprobs": None}, "3", "r0")
    with pytest.raises(EngineError, match="non-finite"):
        parse_choice(choice([4], [float("nan")]), "3", "r0")
    with pytest.raises(EngineError, match="finished with"):
        parse_choice(choice([4], [-0.1], reason="tool_calls"), "3", "r0")


def test_parse_choice_reads_vllm_0_26s_chat_shaped_logprobs():
    """vLLM 0.26's tokens API names each token "token_id:N" (no token_id) and stamps no weight versions."""
    legacy = {"index": 0, "finish_reason": "length", "token_ids": [4, 13],
              "logprobs": {"content": [{"token": "token_id:4", "logprob": -0.5, "bytes": None, "top_logprobs": []},
                                       {"token": "token_id:13", "logprob": -0.25, "bytes": None, "top_logprobs": []}]}}
    c = parse_choice(legacy, None, "r0")
    assert c.tokens.tolist() == [4, 13] and c.logprobs.tolist() == [-0.5, -0.25] and c.finish_reason == "length"
    legacy["logprobs"]["content"][1]["token"] = "token_id:12"
    with pytest.raises(EngineError, match="differ from token_ids"):
        parse_choice(legacy, None, "r0")


def test_engine_args_and_server_flags():
    cfg = load_config(CONFIG, ["rollout.vllm.extra={swap_space: 1}"])
    args = engine_args(cfg, "/m", seed=5, on_cpu=True)
    assert args["model"] == "/m" and args["seed"] == 5 and args["logprobs_mode"] == "processed_logprobs"
    assert args["worker_extension_cls"] == "offpolicy.rollout.engines.vllm.worker.Extension" and args["swap_space"] == 1
    assert engine_args(load_config(CONFIG, ["rollout.vllm.kv_cache_memory_bytes=null"]), "/m", 0, True)[
        "kv_cache_memory_bytes"] == 256 * 1024**2
    flags = cli_flags({"model": "/m", "enforce_eager": True, "enable_prefix_caching": False, "max_model_len": 64,
                       "hf_overrides": {"a": 1}})
    assert flags == ["--model", "/m", "--enforce-eager", "--no-enable-prefix-caching", "--max-model-len", "64",
                     "--hf-overrides", '{"a": 1}']
    cmd = server_command(cfg, "/m", index=1, on_cpu=True)
    assert cmd[1:3] == ["-m", "vllm.entrypoints.openai.api_server"] and "--enable-scale-out" in cmd
    assert cmd[cmd.index("--port") + 1] == str(cfg.rollout.vllm.server_port + 1)
    assert cmd[cmd.index("--seed") + 1] == str(cfg.rollout.seed + 1)


def test_mxfp4_runs_capture_cuda_graphs_up_to_the_step_budget():
    """rollout.vllm.graph_sizes auto: with MXFP4 weights (vLLM's Triton MoE compiles its routing kernels for each new
    size of an eager step) every step up to the budget replays a graph of one of few sizes, compiled at start-up;
    vLLM's own sizes otherwise, on a CPU and eager; compilation_config in extra merges over it."""
    mx = ["weights.formats=[mxfp4]", "rollout.weights_format=mxfp4", "model.arch.model_type=gpt_oss",
          "rollout.vllm.enforce_eager=false"]  # the config's: eager on a CPU
    sizes = engine_args(load_config(CONFIG, mx), "/m", 0, on_cpu=False)["compilation_config"]["cudagraph_capture_sizes"]
    assert sizes[:4] == [1, 2, 4, 8] and 1024 in sizes and sizes[-1] == 16384 and sizes == sorted(set(sizes))
    above = [s for s in sizes if s > 1024]
    assert above == list(range(1536, 16385, 512))  # a step pads by at most 511 tokens
    assert max(b - a for a, b in zip(sizes, sizes[1:]) if b <= 1024) == 16  # vLLM's own below
    capped = load_config(CONFIG, [*mx, "rollout.vllm.extra={max_num_batched_tokens: 5000, compilation_config: "
                                        "{cudagraph_mode: PIECEWISE}}"])
    cc = engine_args(capped, "/m", 0, on_cpu=False)["compilation_config"]
    assert cc["cudagraph_mode"] == "PIECEWISE" and cc["cudagraph_capture_sizes"][-3:] == [4096, 4608, 5000]
    assert "compilation_config" not in engine_args(load_config(CONFIG, mx), "/m", 0, on_cpu=True)  # no graphs there
    for plain in (["rollout.vllm.enforce_eager=false"], [*mx, "rollout.vllm.graph_sizes=vllm"],
                  [*mx, "rollout.vllm.enforce_eager=true"]):
        assert "compilation_config" not in engine_args(load_config(CONFIG, plain), "/m", 0, on_cpu=False)
    budget = load_config(CONFIG, ["rollout.vllm.graph_sizes=budget", "rollout.vllm.enforce_eager=false"])
    assert "compilation_config" in engine_args(budget, "/m", 0, on_cpu=False)
    level = load_config(CONFIG, [*mx, "rollout.vllm.extra={compilation_config: 3}"])
    assert engine_args(level, "/m", 0, on_cpu=False)["compilation_config"] == 3  # theirs stands alone
    flags = cli_flags(engine_args(load_config(CONFIG, mx), "/m", 0, on_cpu=False))
    assert json.loads(flags[flags.index("--compilation-config") + 1])["cudagraph_capture_sizes"] == sizes


def report(tensors: dict, files: int, empty=()) -> dict:
    return {"tensors": {k: str(v) for k, v in tensors.items()}, "files": str(files), "empty": list(empty)}


def test_moe_checkpoints_capture_cuda_graphs_up_to_the_step_budget_in_any_format(tmp_path):
    """auto: a MoE checkpoint (config.json names experts: vLLM's bf16 fused_moe_kernel also compiles per step size)
    gets budget sizes in bf16; a dense one, or a directory without config.json, keeps vLLM's own."""
    gpu = ["rollout.vllm.enforce_eager=false"]
    cfg = load_config(CONFIG, gpu)
    for name, hf in (("gpt_oss", {"model_type": "gpt_oss", "num_local_experts": 32}),
                     ("qwen3_moe", {"model_type": "qwen3_moe", "num_experts": 128}),
                     ("vl", {"model_type": "x", "text_config": {"n_routed_experts": 64}})):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(json.dumps(hf))
        assert graph_sizes(cfg, str(tmp_path / name)) == "budget"
        assert "compilation_config" in engine_args(cfg, str(tmp_path / name), 0, on_cpu=False)
    (tmp_path / "dense").mkdir()
    (tmp_path / "dense" / "config.json").write_text(json.dumps({"model_type": "llama", "num_experts": 0}))
    for dense in (tmp_path / "dense", tmp_path / "nothing"):
        assert graph_sizes(cfg, str(dense)) == "vllm" and not moe_checkpoint(str(dense))
        assert "compilation_config" not in engine_args(cfg, str(dense), 0, on_cpu=False)
    moe = str(tmp_path / "gpt_oss")
    assert "compilation_config" not in engine_args(cfg, moe, 0, on_cpu=True)  # no graphs on a CPU
    assert graph_sizes(load_config(CONFIG, [*gpu, "rollout.vllm.graph_sizes=vllm"]), moe) == "vllm"


def test_a_load_is_proven_by_files_plus_the_engines_offset():
    const, w0, w1 = 111, 1000, 2000  # a rotary table, the weights of two versions
    offset = offset_of([report({"rotary": const, "w": w0}, files=w0)])
    assert offset == const
    assert proven([report({"rotary": const, "w": w1}, files=w1)], offset)[0]
    assert not proven([report({"rotary": const, "w": w0}, files=w1)], offset)[0]  # stale weights
    ranks = [report({"rotary": const, "w": 700}, files=w1), report({"rotary": const, "w": w1 - 700}, files=w1)]
    assert proven(ranks, offset)[0]  # TP shards summed, the replicated table once
    with pytest.raises(EngineError, match="OFFPOLICY_VLLM_CHECKABLE_WEIGHTS"):
        offset_of([report({"w": w0}, files=w0, empty=["layers.0.qkv_proj.weight"])])
    assert fp.sub(offset, const) == 0


@pytest.mark.parametrize("override, field", [
    (["rollout.top_k=4"], "rollout.top_k"), (["rollout.top_p=0.9"], "rollout.top_p"),
    (["rollout.vllm.tensor_parallel_size=0"], "rollout.vllm.tensor_parallel_size"),
    (["rollout.vllm.extra={dtype: float16}"], "rollout.vllm.extra"),
    (["rollout.vllm.urls=[http://127.0.0.1:8100/v1]"], "rollout.vllm.urls"),
    (["rollout.vllm.mode=engine", "rollout.vllm.urls=[http://127.0.0.1:8100]"], "rollout.vllm.urls"),
    (["rollout.vllm.max_model_len=4"], "rollout.vllm.max_model_len"),
    (["rollout.vllm.stage_threads=-1"], "rollout.vllm.stage_threads"),
    (["eval.every_versions=10"], "eval.engine"),
])
def test_config_refuses_what_vllm_cannot_do(override, field):
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        load_config(CONFIG, override)


def test_a_worker_that_rebuilds_instead_of_reloading_in_place_is_recorded_as_a_rebuild(caplog):
    """A worker whose model keeps kernel-wrapped weights (vLLM 0.26's Triton MXFP4 experts) rebuilds when asked for
    an in-place load, and says so in its report: the load's record and the log carry the method that ran and the
    worker's reason."""
    caplog.set_level("INFO")
    from offpolicy.rollout.engines.vllm.wire import load_until_proven

    asked = []

    def load(method):
        asked.append(method)
        return [{"tensors": {"w": "7"}, "files": "7", "method": "rebuild", "load_seconds": 2.5, "hash_seconds": 0.5,
                 "reason": "the server keeps weights in kernel wrappers"}]

    record = load_until_proven(load, ["inplace", "rebuild"], lambda: 0, True, "http://x", 3)
    assert record == {"method": "rebuild", "verified": True, "moved": 0, "load": 2.5, "reload": 0.0, "misses": 0.0,
                      "hash": 0.5, "hash_model": 0.0, "hash_files": 0.0, "hash_read": 0.0}
    assert asked == ["inplace"]
    assert "kernel wrappers" in caplog.text and "did not hold" not in caplog.text  # no in-place load ran


def test_a_load_whose_files_every_worker_hashed_ahead_says_so():
    """rollout.double_buffer over HTTP: each worker's report says how long its background hash of the files ran,
    when it began and its thread's CPU time; the load's record keeps the slowest and the earliest, and only when every
    worker had one."""
    from offpolicy.rollout.engines.vllm.wire import load_until_proven

    ahead = [{"tensors": {"w": "7"}, "files": "7", "prefetch_seconds": s, "prefetch_began": b, "prefetch_waited": w}
             for s, b, w in ((1.5, 20.0, 0.0), (2.5, 10.0, 0.25))]
    record = load_until_proven(lambda method: ahead, ["inplace"], lambda: 0, True, "http://x", 3)
    assert record["prefetch"] == {"seconds": 2.5, "began": 10.0, "waited": 0.25}
    timed = [{**r, "prefetch_cpu_seconds": c} for r, c in zip(ahead, (0.4, 0.1))]
    record = load_until_proven(lambda method: timed, ["inplace"], lambda: 0, True, "http://x", 3)
    assert record["prefetch"] == {"seconds": 2.5, "began": 10.0, "waited": 0.25, "cpu_seconds": 0.4}
    mixed = [ahead[0], {"tensors": {"w": "7"}, "files": "7"}]
    assert "prefetch" not in load_until_proven(lambda method: mixed, ["inplace"], lambda: 0, True, "http://x", 3)


def test_a_load_by_offpolicy_s_mxfp4_kernels_says_so():
    """vLLM's MXFP4 experts written in place by offpolicy (vllm/kernels.py): the record says `kernels` where every
    worker's load did, not where one rebuilt instead."""
    from offpolicy.rollout.engines.vllm.wire import load_until_proven

    done = [{"tensors": {"w": "7"}, "files": "7", "method": "inplace", "kernels": True} for _ in range(2)]
    assert load_until_proven(lambda method: done, ["inplace"], lambda: 0, True, "http://x", 3)["kernels"] is True
    rebuilt = [{**r, "method": "rebuild"} for r in done]
    assert "kernels" not in load_until_proven(lambda method: rebuilt, ["inplace"], lambda: 0, True, "http://x", 3)


def test_a_load_from_staged_tensors_says_where_and_how_many_bytes_and_a_failed_staging_is_named():
    """rollout.vllm.prefetch: each worker's report says what its reload took staged (staging.py); the record sums the
    workers' bytes (each stages the whole version), keeps the slowest read, and is staged only when every worker was.
    A worker whose staging failed (vLLM read the files itself) names the error."""
    from offpolicy.rollout.engines.vllm.wire import load_until_proven

    def staged(pinned, ahead, seconds):
        return {"where": "host", "pinned": pinned, "bytes": 1000, "read_seconds": seconds, "hash_seconds": 0.1,
                "ahead": ahead}

    reports = [{"tensors": {"w": "7"}, "files": "7", "staged": staged(True, True, 0.5)},
               {"tensors": {"w": "7"}, "files": "7", "staged": staged(False, True, 0.75)}]
    record = load_until_proven(lambda method: reports, ["inplace"], lambda: 0, True, "http://x", 3)
    assert record["staged"] == {"where": "host", "pinned": False, "stream": False, "ahead": True, "bytes": 2000,
                                "read_seconds": 0.75, "mapped": 0}
    # what each worker read out of registered maps, and made ready for its MXFP4 kernels ahead (one had no room)
    reports[0]["staged"].update(mapped=600, prepared=8, prepared_bytes=300, prepare_seconds=0.02, unprepared=None)
    reports[1]["staged"].update(mapped=400, prepared=0, prepared_bytes=0, prepare_seconds=0.0, unprepared="no room")
    staged = load_until_proven(lambda method: reports, ["inplace"], lambda: 0, True, "http://x", 3)["staged"]
    assert (staged["mapped"], staged["prepared"], staged["prepared_bytes"]) == (1000, 8, 300)
    assert (staged["prepare_seconds"], staged["unprepared"]) == (0.02, "no room")
    assert "staging_error" not in record
    refused = "StagingRefused: rollout.vllm.prefetch"
    failed = [reports[0], {"tensors": {"w": "7"}, "files": "7", "staging_error": refused}]
    record = load_until_proven(lambda method: failed, ["inplace"], lambda: 0, True, "http://x", 3)
    assert "staged" not in record and record["staging_error"] == refused


def test_a_direct_load_is_said_only_when_every_worker_read_the_files_onto_its_device():
    from offpolicy.rollout.engines.staging import staged_said
    from offpolicy.rollout.engines.vllm.wire import load_until_proven

    direct = [{"tensors": {"w": "7"}, "files": "7", "direct": True, "where": "direct", "where_why": "auto: no room"}
              for _ in range(2)]
    record = load_until_proven(lambda method: direct, ["inplace"], lambda: 0, True, "http://x", 3)
    assert record["direct"] is True and "staged" not in record
    assert (record["where"], record["where_why"]) == ("direct", "auto: no room")  # each load says where and why
    assert staged_said(record) == ", reading the files onto the device a window at a time"
    mixed = [direct[0], {"tensors": {"w": "7"}, "files": "7", "where": "hash", "where_why": "on the CPU"}]
    record = load_until_proven(lambda method: mixed, ["inplace"], lambda: 0, True, "http://x", 3)
    assert "direct" not in record and staged_said(record) == ", reading the files"
    assert record["where"] == "direct/hash" and "where_why" not in record  # the workers disagree: no one reason
    files = [{"tensors": {"w": "7"}, "files": "7", "where": "hash", "where_why": "auto: the server runs on the CPU"}]
    record = load_until_proven(lambda method: files, ["inplace"], lambda: 0, True, "http://x", 3)
    assert staged_said(record) == ", reading the files (auto: the server runs on the CPU)"  # the log says why


def test_the_log_says_who_hashed_the_files_and_how_long_a_load_waited_for_the_work_ahead():
    from offpolicy.rollout.engines.vllm.wire import files_said, load_until_proven, waited_said

    as_read = [{"tensors": {"w": "7"}, "files": "7", "direct": True, "hash_read_seconds": s} for s in (0.25, 0.5)]
    record = load_until_proven(lambda method: as_read, ["inplace"], lambda: 0, True, "http://x", 3)
    assert (files_said(record), waited_said(record)) == ("0.500 s as the load read them", "")
    ahead = [{"tensors": {"w": "7"}, "files": "7", "hash_files_seconds": 0.0, "prefetch_seconds": 1.5,
              "prefetch_began": 2.0, "prefetch_waited": 0.75}]
    record = load_until_proven(lambda method: ahead, ["inplace"], lambda: 0, True, "http://x", 3)
    assert (files_said(record), waited_said(record)) == ("0.000 s", "; waited 0.750 s for the work ahead")
    record.update(rpc=1.25, calls=0.125)  # over HTTP (servers.update_on)
    assert waited_said(record) == ("; waited 0.750 s for the work ahead; the load's RPC 1.250 s, the swap's other "
                                   "calls 0.125 s")
    record["call_seconds"] = {"pause": 0.025, "label": 0.1}
    assert waited_said(record).endswith("the swap's other calls 0.125 s (pause 0.025, label 0.100)")


def test_a_load_that_fails_its_proof_names_the_tensors_it_missed_against_the_last_proven_load(caplog):
    """After a failed proof the log names the model tensors that kept their values where the version changed the
    rest (what vLLM's in-place reload misses: GPT-OSS's sinks and experts on CPU), against the last proven load's
    per-tensor fingerprints; a proven load becomes the next comparison."""
    from offpolicy.rollout.engines.vllm.wire import load_until_proven, tensor_changes

    held = {"reports": [{"tensors": {"a": "1", "b": "2", "sinks": "3"}, "files": "6"}]}
    missed = [{"tensors": {"a": "10", "b": "20", "sinks": "3"}, "files": "60"}]  # 33 != 60: sinks kept 3, not 30
    assert tensor_changes(missed, held["reports"]) == (["a", "b"], ["sinks"])
    assert load_until_proven(lambda method: missed, ["inplace"], lambda: 0, True, "http://x", 1, held) is None
    assert "against the last proven load 2 tensors changed and 1 did not; unchanged: sinks" in caplog.text
    assert held["reports"][0]["files"] == "6"  # a failed load is no comparison for the next one
    rebuilt = [{"tensors": {"a": "10", "b": "20", "sinks": "30"}, "files": "60"}]
    assert load_until_proven(lambda method: rebuilt, ["rebuild"], lambda: 0, True, "http://x", 1, held)["verified"]
    assert held["reports"] is rebuilt


def test_an_in_place_load_that_fails_its_proof_is_loaded_again_by_rebuild(caplog):
    """load_method auto: an in-place load whose proof fails (a tensor vLLM's reload missed, docs/vllm.md) is followed
    by a rebuild of the same version; the record is the rebuild's, and the log says the server rebuilds from now on."""
    from offpolicy.rollout.engines.vllm.wire import load_until_proven

    reports = {"inplace": [{"tensors": {"a": "10", "experts": "3"}, "files": "40", "method": "inplace"}],
               "rebuild": [{"tensors": {"a": "10", "experts": "30"}, "files": "40", "method": "rebuild"}]}
    asked = []
    record = load_until_proven(lambda m: asked.append(m) or reports[m], ["inplace", "rebuild"], lambda: 0, True,
                               "http://x", 2, {"reports": [{"tensors": {"a": "1", "experts": "3"}, "files": "4"}]})
    assert asked == ["inplace", "rebuild"] and record["method"] == "rebuild" and record["verified"]
    assert "unchanged: experts" in caplog.text and "did not hold the version's weights" in caplog.text


def test_a_requests_prefill_is_read_from_its_usage_and_summed_per_call():
    """vLLM's response `usage` (the cached tokens only with --enable-prompt-tokens-details): a request's n samples
    share one prefill, so its counts go on its first completion; a call sums what its completions say."""
    usage = {"prompt_tokens": 40, "completion_tokens": 12, "prompt_tokens_details": {"cached_tokens": 32}}
    assert request_counts({"choices": [], "usage": usage}) == {"prompt_tokens": 40, "cached_tokens": 32}
    assert request_counts({"choices": [], "usage": {"prompt_tokens": 40}}) == {}  # a server without the flag
    assert request_counts({"choices": []}) == {}
    assert request_counts({"choices": [], "usage": usage}, n=8) == {}  # one child's view of n: its siblings' blocks

    def said(**meta):
        return Completion(tokens=np.array([1], dtype=np.int32), logprobs=np.zeros(1, np.float32), finish_reason="stop",
                          meta=meta)
    groups = [[said(prompt_tokens=40, cached_tokens=32), said()], [said(prompt_tokens=10, cached_tokens=0), said()]]
    assert prefill_counts(groups) == (18, 32)  # computed 8 + 10, cached 32 + 0
    assert prefill_counts([[said(), said()]]) is None  # no completion says: the torch engine, an older server
