"""The proof of SGLang loads by fingerprint (offpolicy/rollout/engines/sglang/fingerprint_proof.py): how workers'
reports combine, when SGLang can run it, and the engine in both modes: in process with a stand-in sglang.Engine whose
update_weights_from_tensor calls the registered loader on its model (tests/sglang_layout.py `TensorUpdates`), over
HTTP against the stand-in server (tests/sglang_fake.py, /update_weights_from_tensor on `tp_size` ranks). GPT-OSS has no
get_weights_by_name in SGLang 0.5.14: its loads are proven this way (rollout.sglang.proof auto)."""

from __future__ import annotations

import json
import types

import pytest
import torch

from offpolicy.config import load_config
from offpolicy.rollout.engines import SamplingParams, make_engine
from offpolicy.rollout.engines.errors import ServerUnavailable, WeightUpdateError
from offpolicy.rollout.engines.sglang.fingerprint_proof import (FingerprintProof, kinds_said, split, tensors,
                                                              why_unavailable)
from offpolicy.rollout.engines.sglang.local import engine_kwargs
from offpolicy.rollout.engines.sglang.mxfp4_inplace import LOADER as MXFP4_LOADER
from offpolicy.rollout.engines.sglang.worker import LOADER, SYNCED_LOADER
from offpolicy.weights import WeightVersion
from tests.sglang_fake import FakeSGLang, read_back
from tests.sglang_layout import TensorUpdates, install, noisy_versions
from tests.unit.test_weights_formats import GPT_OSS

FIELDS_0514 = {"tp_size", "dp_size", "enable_dp_attention", "custom_weight_loader"}  # of ServerArgs, that we use


def load(engine, path: str) -> list[dict]:
    with WeightVersion(path) as wv:
        engine.load(wv)
    return engine.last_loads


# --- the proof's parts ------------------------------------------------------------------------------------------


def test_replicas_count_once_shards_add_up_and_attention_dp_groups_count_once():
    """Four TP ranks in two attention-DP groups of two (SGLang's rank layout): a norm on every rank counts once, the
    experts' shards four times, an attention shard repeated in each group twice (once per rank of one group), the
    down bias that only rank 0 holds (zeros elsewhere) once."""
    reports = [{"tensors": {"norm": "5", "experts": str(10 + r), "qkv": str(20 + r % 2), "w2_bias": str(7 if r == 0
                                                                                                           else 0)}}
               for r in range(4)]
    assert tensors(reports, 2) == {"norm": 5, "experts": 46, "qkv": 41, "w2_bias": 7}
    assert tensors(reports, 4)["qkv"] == 82  # without DP attention the same hashes are four shards
    assert tensors(reports[:1], 1) == {"norm": 5, "experts": 10, "qkv": 20, "w2_bias": 7}


def test_an_sglang_that_cannot_run_the_fingerprint_is_never_asked():
    base = {"tp_size": 4, "dp_size": 1, "custom_weight_loader": [LOADER]}
    assert why_unavailable(base, "native") == ("", 4)
    assert why_unavailable({**base, "dp_size": 2, "enable_dp_attention": True}, "native") == ("", 2)  # 0.5.14
    assert why_unavailable({**base, "attn_dp_size": 4}, "native") == ("", 1)  # 0.5.23's name
    assert "--custom-weight-loader " + LOADER in why_unavailable({**base, "custom_weight_loader": []}, "native")[0]
    assert "dp_size > 1" in why_unavailable({**base, "dp_size": 2}, "native")[0]
    assert "pp_size > 1" in why_unavailable({**base, "pp_size": 2}, "native")[0]
    assert "quantizes the model itself" in why_unavailable({**base, "quantization": "fp8"}, "native")[0]
    assert why_unavailable({**base, "quantization": "fp8"}, "fp8")[0] == ""  # the checkpoint's own


def test_a_proof_that_cannot_run_leaves_loads_unproven_until_one_has_run(tmp_path):
    """Refused, no report, or an error in one: unproven with why, and not asked again; once a proof ran on the
    engine, one that cannot run fails the load."""
    asked = []

    def refuse(name: str) -> tuple[bool, str]:
        asked.append(name)
        return False, "update_weights_from_tensor must run between begin_weight_update() and end_weight_update()"

    proof = FingerprintProof(refuse)
    proof.baseline("/launch")
    assert proof.offset is None and "no fingerprint baseline of the launch checkpoint /launch" in proof.why
    record = proof.prove("/v/1", 1, "here")
    assert not record["verified"] and "begin_weight_update" in record["why"] and len(asked) == 1

    def write(body: dict):
        def send(name: str) -> tuple[bool, str]:
            folder = json.loads(name)["report"]
            with open(f"{folder}/rank0.json", "w") as f:
                json.dump({"rank": 0, "world": 1, "tensors": {"w": "3"}, "files": {"w": "3"}, "files_tensors": 1,
                           **body}, f)
            return True, "Success"
        return send

    proof = FingerprintProof(write({}))
    proof.baseline("/launch")
    assert proof.offset == {"w": 0} and proof.prove("/v/1", 1, "here")["verified"]
    proof.send = write({"error": "RuntimeError: CUDA out of memory"})
    with pytest.raises(WeightUpdateError, match="here: after loading weight version 2 from /v/2 the fingerprint proof, "
                                                "which ran before, could not: .*CUDA out of memory"):
        proof.prove("/v/2", 2, "here")
    proof.send = write({"replicated_kv": True})
    with pytest.raises(WeightUpdateError, match="repeats KV heads"):
        proof.prove("/v/2", 2, "here")
    hub = FingerprintProof(write({"files_tensors": 0}))  # a launch path with no files (a hub id not in the cache)
    hub.baseline("org/model")
    assert hub.offset is None and "org/model holds no safetensors files" in hub.why
    fresh = FingerprintProof(write({}), unavailable="rollout.sglang.proof is read_back")
    fresh.baseline("/launch")
    assert fresh.offset is None and fresh.prove("/v/1", 1, "here")["why"] == "rollout.sglang.proof is read_back"


def test_a_tensor_sglang_changes_itself_is_named(tmp_path):
    """A tensor whose fingerprint moves although the version's files of its group did not (a buffer SGLang writes
    while it serves, which the proof should leave out) is named as such."""
    state = {"tensors": {"model.norm.weight": "3", "logits_processor.buffer": "5"}, "files": {"model.norm": "3"},
             "files_tensors": 1}

    def send(name: str) -> tuple[bool, str]:
        with open(f"{json.loads(name)['report']}/rank0.json", "w") as f:
            json.dump({"rank": 0, "world": 1, **state}, f)
        return True, "Success"

    proof = FingerprintProof(send)
    proof.baseline("/launch")
    assert proof.prove("/v/1", 1, "here")["verified"]
    state["tensors"] = {"model.norm.weight": "3", "logits_processor.buffer": "6"}
    with pytest.raises(WeightUpdateError, match=r"not the version's: logits_processor \(logits_processor\.buffer "
                                                r"changed since version 1, the files did not\); it generates"):
        proof.prove("/v/2", 2, "here")  # a report without the files' kinds: none said


def test_a_failed_proof_compares_the_tensor_kinds_both_sides_have():
    """Per group, the kinds (a name's last part) that SGLang's tensors and the files share are compared, those of one
    side only listed; the daemon's own hash of the files (by group and kind) splits into both."""
    held = {"a|weight": 1, "a|bias": 2, "a|w13_weight": 5, "b|weight": 9}
    files = {"a|weight": 1, "a|bias": 3, "a|gate_up_proj": 5, "b|weight": 8}
    assert kinds_said("a", held, files) == (" (by tensor kind: bias differs; weight matches; only SGLang's: "
                                            "w13_weight; only the files': gate_up_proj)")
    assert kinds_said("b", held, files) == " (by tensor kind: weight differs)" and kinds_said("c", held, files) == ""
    many = {f"a|k{i}": i for i in range(8)}
    assert kinds_said("a", many, {}) == " (by tensor kind: only SGLang's: k0, k1, k2, k3, k4, k5 and 2 more)"
    assert split({"a|weight": 1, "a|bias": 2, "b|weight": 3}) == ({"a": 3, "b": 3}, {"a|weight": 1, "a|bias": 2,
                                                                                      "b|weight": 3})
    assert split({"a": 3}) == ({"a": 3}, None)  # by group alone: no kinds


def test_the_kinds_of_a_differing_group_are_said_where_every_report_has_them():
    """Reports with the files by group and kind: the baseline takes an offset per kind too (a constant buffer of a
    kind the files lack stays out of the comparison), and a failed proof says which kind differs; reports of an older
    worker (no `files_kinds`) fail as before, without the kinds."""
    g, state = "model.layers.0.self_attn", {}

    def send(name: str) -> tuple[bool, str]:
        with open(f"{json.loads(name)['report']}/rank0.json", "w") as f:
            json.dump({"rank": 0, "world": 1, "files_tensors": 4, **state}, f)
        return True, "Success"

    def at(v: int, scale: int, kinds: bool = True) -> None:  # version v's files; SGLang holds `scale` as its scale
        state.clear()
        state.update(tensors={f"{g}.qkv_proj.weight": str(10 * v), f"{g}.qkv_proj.weight_scale_inv": str(scale),
                              f"{g}.rotary_emb.inv_freq": "7"}, files={g: str(10 * v + v)})
        if kinds:
            state["files_kinds"] = {f"{g}|weight": str(10 * v), f"{g}|weight_scale_inv": str(v)}

    proof = FingerprintProof(send)
    at(0, 0)
    proof.baseline("/launch")
    assert proof.offset == {g: 7} and proof.kind_offset == {f"{g}|weight": 0, f"{g}|weight_scale_inv": 0,
                                                            f"{g}|inv_freq": 7}
    at(1, 1)
    assert proof.prove("/v/1", 1, "here")["verified"]
    at(2, 4)
    kept = (r"not the version's: model\.layers\.0\.self_attn \(model\.layers\.0\.self_attn\.rotary_emb\.inv_freq "
            r"unchanged since version 1\)")
    with pytest.raises(WeightUpdateError, match=kept + r" \(by tensor kind: weight_scale_inv differs; weight matches; "
                                                       r"only SGLang's: inv_freq\); it generates"):
        proof.prove("/v/2", 2, "here")
    at(2, 4, kinds=False)
    with pytest.raises(WeightUpdateError, match=kept + "; it generates"):
        proof.prove("/v/2", 2, "here")
    at(3, 3)
    assert proof.prove("/v/3", 3, "here")["verified"]


def test_a_version_with_the_values_of_the_one_before_is_unproven(shm_root):
    paths = noisy_versions(shm_root, "same", GPT_OSS, 1)["native"] * 2
    fake = FakeSGLang(model_path=paths[0])
    fake.readback = False
    try:
        e = http_engine(fake.url)
        assert load(e, paths[0])[0]["verified"]  # the first version: nothing to tell it from
        (r,) = load(e, paths[1])
        assert not r["verified"] and "cannot tell this load from none" in r["why"] and r["changed"] == []
    finally:
        fake.stop()


def test_the_engine_registers_its_loader_beside_the_runs_own():
    cfg = load_config(None, ["model.path=/m", "rollout.engine=sglang"])
    ours = [LOADER, SYNCED_LOADER, MXFP4_LOADER]  # the fingerprint, the direct loads' and the in-place MXFP4 loader
    assert engine_kwargs(cfg, 0, fields=FIELDS_0514)["custom_weight_loader"] == ours
    assert "custom_weight_loader" not in engine_kwargs(cfg, 0, fields={"tp_size", "dp_size"})  # an SGLang without
    theirs = load_config(None, ["model.path=/m", "rollout.engine=sglang",
                                f"rollout.sglang.extra.custom_weight_loader=[my.loader, {LOADER}, {SYNCED_LOADER}]"])
    assert engine_kwargs(theirs, 0, fields=FIELDS_0514)["custom_weight_loader"] == [*ours, "my.loader"]


# --- sglang.Engine in process ---------------------------------------------------------------------------------


class _Engine(TensorUpdates):
    """Stand-in for sglang.Engine 0.5.14 holding the checkpoint it last loaded (in bfloat16, SGLang's layout)."""

    keep: tuple[str, ...] = ()  # checkpoint tensors the next updates leave at the version before
    dtype = torch.bfloat16
    starts: list[str] = []

    def __init__(self, **kwargs):
        self.kwargs, self.weights = kwargs, kwargs["model_path"]
        _Engine.starts.append(self.weights)
        args = types.SimpleNamespace(weight_version=kwargs.get("weight_version", "default"))
        self.tokenizer_manager = types.SimpleNamespace(server_args=args, update_weights_from_disk=self._update,
                                                       update_weights_from_tensor=self.tensor_request)
        self.loop = types.SimpleNamespace(run_until_complete=lambda answer: answer)

    def _update(self, req, request):
        self.tokenizer_manager.server_args.weight_version = req.weight_version
        self.stale_from, self.stale, self.weights = self.weights, _Engine.keep, req.model_path
        return True, "Succeeded to update model weights.", 0

    def get_weights_by_name(self, name: str, truncate_size: int = 100):
        return read_back(self.weights, name, truncate_size)  # None: GPT-OSS has none

    def shutdown(self) -> None:
        pass


@pytest.fixture
def sglang_0514(monkeypatch):
    install(monkeypatch, _Engine, FIELDS_0514)
    monkeypatch.setattr(_Engine, "keep", ())
    monkeypatch.setattr(_Engine, "starts", [])


def engine_mode(*overrides: str):
    return make_engine(load_config(None, ["rollout.engine=sglang", "rollout.sglang.mode=engine",
                                          "model.arch=" + json.dumps(GPT_OSS), *overrides]))


def test_in_process_gpt_oss_loads_are_proven_and_a_stale_tensor_takes_the_engine_out(shm_root, sglang_0514):
    paths = noisy_versions(shm_root, "gpt", GPT_OSS, 4)["native"]
    e = engine_mode(f"model.path={paths[0]}")
    loaders = e.backend.engine.kwargs["custom_weight_loader"]
    assert _Engine.starts == [paths[0]] and loaders == [LOADER, SYNCED_LOADER, MXFP4_LOADER]
    for v in (0, 1):
        (r,) = load(e, paths[v])
        assert (r["method"], r["proof"], r["verified"], len(r["groups"])) == ("disk", "fingerprint", True, 11), r
    _Engine.keep = ("model.layers.0.self_attn.sinks",)
    with pytest.raises(WeightUpdateError, match=r"the in-process SGLang engine: .* not the version's: model\.layers\."
                                                r"0\.self_attn \(model\.layers\.0\.self_attn\.sinks unchanged "
                                                r"since version 1\)"):
        load(e, paths[2])
    assert e.version == 1 and e.backend.version is None  # it generates no more until a load succeeds
    with pytest.raises(WeightUpdateError, match="holds weight version None"):
        e.backend.generate([[1]], [{}], 1, 1)
    _Engine.keep = ()
    (r,) = load(e, paths[3])
    assert r["verified"] and e.version == 3


def test_in_process_mxfp4_restarts_are_proven_against_the_first_starts_offset(shm_root, sglang_0514):
    """MXFP4 GPT-OSS: each version starts the engine again; the first start measures the offset (its own load,
    unproven), each restart is proven against it (the packed experts hashed as bytes)."""
    paths = noisy_versions(shm_root, "mx", GPT_OSS, 3, formats=("mxfp4",))["mxfp4"]
    e = engine_mode("weights.formats=[mxfp4]", "rollout.weights_format=mxfp4")
    records = [load(e, p)[0] for p in paths]
    assert [r["method"] for r in records] == ["start", "restart", "restart"] and _Engine.starts == paths
    assert not records[0]["verified"] and "defines the fingerprint's offset" in records[0]["why"]
    assert all(r["verified"] and r["proof"] == "fingerprint" for r in records[1:]), records


def test_the_proof_mode_picks_the_proof(shm_root, sglang_0514):
    """read_back: the old proof alone (GPT-OSS unproven, nothing fingerprinted); fingerprint: even where the model
    reads back (the tiny Llama)."""
    gpt = noisy_versions(shm_root, "gpt", GPT_OSS, 2)["native"]
    e = engine_mode(f"model.path={gpt[0]}", "rollout.sglang.proof=read_back")
    (r,) = load(e, gpt[1])
    assert r["proof"] == "read_back" and not r["verified"] and e.backend.fingerprint.offset is None
    llama = noisy_versions(shm_root, "llama", {"model_type": "llama", "vocab_size": 16, "hidden_size": 64,
                                               "intermediate_size": 256, "num_hidden_layers": 2,
                                               "num_attention_heads": 4, "num_key_value_heads": 4}, 2)["native"]
    for mode, proof in (("auto", "read_back"), ("fingerprint", "fingerprint")):
        e = engine_mode(f"model.path={llama[0]}", "model.arch.model_type=llama", f"rollout.sglang.proof={mode}")
        (r,) = load(e, llama[1])
        assert r["proof"] == proof and r["verified"], r


# --- servers over HTTP ------------------------------------------------------------------------------------------


def http_engine(*urls: str, fmt: str = "native"):
    return make_engine(load_config(None, [
        "model.arch=" + json.dumps(GPT_OSS), "rollout.engine=sglang", "rollout.sglang.mode=http",
        f"rollout.sglang.urls=[{', '.join(urls)}]", "rollout.sglang.startup_timeout_s=5",
        f"rollout.weights_format={fmt}"]))


@pytest.fixture
def gpt_servers(shm_root):
    made: list[FakeSGLang] = []

    def make(launch: str, n: int = 1, tp: int = 2) -> list[FakeSGLang]:
        for _ in range(n):
            f = FakeSGLang(model_path=launch)
            f.readback, f.tp_size, f.dtype = False, tp, torch.bfloat16  # GPT-OSS: no get_weights_by_name
            made.append(f)
        return made[-n:]

    yield make
    for f in made:
        if f.thread.is_alive():
            f.stop()


def test_gpt_oss_servers_prove_each_load_by_fingerprint_on_their_tp_ranks(shm_root, gpt_servers):
    paths = noisy_versions(shm_root, "gpt", GPT_OSS, 4)["native"]
    good, bad = gpt_servers(paths[0], 2)
    e = http_engine(good.url, bad.url)
    for v in (0, 1):
        records = load(e, paths[v])
        assert sorted(r["url"] for r in records) == sorted([good.url, bad.url])
        assert all(r["verified"] and r["proof"] == "fingerprint" and r["method"] == "disk" for r in records), records
    tensor_calls = [body for _, p, body in good.calls if p == "/update_weights_from_tensor"]
    assert len(tensor_calls) == 3  # the baseline, then one per load
    assert all(len(b["serialized_named_tensors"]) == 2 and b["load_format"] == LOADER and b["flush_cache"] is False
               for b in tensor_calls)
    bad.stale = ("model.layers.1.mlp.experts.gate_up_proj",)
    with pytest.raises(WeightUpdateError, match=rf"{bad.url}: .* not the version's: model\.layers\.1\.mlp \(model\."
                                                r"layers\.1\.mlp\.experts\.w13_weight unchanged since version 1\)"):
        load(e, paths[2])
    assert {s.url: s.version for s in e.backend.servers} == {good.url: 2, bad.url: None}  # it takes no work
    bad.stale = ()
    assert all(r["verified"] for r in load(e, paths[3])) and e.version == 3


def test_a_server_launched_without_the_loader_is_never_sent_the_request(shm_root, gpt_servers):
    """An unregistered load_format ends SGLang's scheduler (model_runner.py:2094): such a server is not asked, and its
    loads say how to launch it."""
    paths = noisy_versions(shm_root, "gpt", GPT_OSS, 2)["native"]
    (fake,) = gpt_servers(paths[0])
    fake.custom_weight_loader = []
    e = http_engine(fake.url)
    for v in (0, 1):
        (r,) = load(e, paths[v])
        assert not r["verified"] and "--custom-weight-loader " + LOADER in r["why"] and e.version == v
    assert "/update_weights_from_tensor" not in fake.paths() and fake.healthy
    assert len(e.generate([[11, 1, 12]], SamplingParams(n=1, max_new_tokens=2))) == 1


def test_a_restarted_server_takes_a_new_baseline(shm_root, gpt_servers):
    """A server that went down and came back is a new process (its launch checkpoint again): its baseline is taken
    anew before its next update, and that load is proven."""
    paths = noisy_versions(shm_root, "gpt", GPT_OSS, 3)["native"]
    a, b = gpt_servers(paths[0], 2, tp=1)
    e = http_engine(a.url, b.url)
    load(e, paths[0])
    b.healthy = False
    e.backend.servers[1].healthy = False
    with pytest.raises(ServerUnavailable):
        e.backend.generate([[1]], [{}], 1, 99)
    b.healthy = True
    b.weights_path = b.model_path = paths[0]  # as launched again
    e.backend.servers[1].checked_at = float("-inf")
    records = load(e, paths[1])
    assert len(records) == 2 and all(r["verified"] for r in records)
    assert [p for p in b.paths() if p == "/update_weights_from_tensor"].__len__() == 4  # 2 baselines, 2 proofs
