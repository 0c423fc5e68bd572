"""offpolicy's custom weight loader in SGLang's TP workers (offpolicy/rollout/engines/sglang/worker.py), called as
SGLang 0.5.14 calls one (tests/sglang_layout.py `run_loader`: the request pickled as its Engine does, unpickled as its
SafeUnpickler does, `fn(model, named_tensors)` on each rank) on stand-in models laid out as SGLang lays GPT-OSS and
Llama out on each TP rank: fused q/k/v, gate/up interleaved and transposed experts, float32 expert biases, the down
bias on rank 0 only, padded vocabulary and expert columns, rotary tables. The versions are real published ones, each
moved from the last by random noise (a constant step would leave sharded biases with equal shards, which the
fingerprint takes for replicas: fingerprint.combined)."""

from __future__ import annotations

import base64
import io
import json
import pickle
import types

import pytest
import torch

from offpolicy.rollout.engines.errors import WeightUpdateError
from offpolicy.rollout.engines.fingerprint import checkpoint_tensors
from offpolicy.rollout.engines.sglang import worker
from offpolicy.rollout.engines.sglang.fingerprint_proof import FingerprintProof, serialized
from offpolicy.rollout.engines.sglang.worker import LOADER, as_held, group_of, model_dtype, offpolicy_fingerprint
from tests.sglang_layout import SGLangModel, TorchOnly, noisy_versions, run_loader
from tests.unit.test_weights_formats import GPT_OSS

LLAMA = {"model_type": "llama", "vocab_size": 16, "hidden_size": 64, "intermediate_size": 256,
         "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 4, "tie_word_embeddings": False}


@pytest.fixture
def versions(shm_root):
    """versions(arch, n) -> paths of n published versions of a tiny model, each moved from the last by noise."""
    return lambda arch, n=3: noisy_versions(shm_root, "fpr", arch, n)["native"]


def proof_over(models: list[torch.nn.Module]) -> FingerprintProof:
    """The daemon's proof, sent to `models` (one per TP rank) as SGLang would run the request on them."""

    def send(name: str) -> tuple[bool, str]:
        run_loader([LOADER], [serialized(name)] * len(models), LOADER, models)
        return True, "Success"

    return FingerprintProof(send, attn_tp_size=len(models))


def load(models: list[SGLangModel], path: str, **stale) -> None:
    for m in models:
        m.load(path, **stale)


def test_a_module_group_holds_the_checkpoint_and_sglang_names_alike():
    pairs = [("model.layers.3.self_attn.q_proj.weight", "model.layers.3.self_attn.qkv_proj.weight"),
             ("model.layers.3.mlp.experts.gate_up_proj_bias", "model.layers.3.mlp.experts.w13_weight_bias"),
             ("model.layers.3.mlp.gate_proj.weight", "model.layers.3.mlp.gate_up_proj.weight"),
             ("model.layers.12.mlp.experts.down_proj", "model.layers.12.mlp.experts.quant_method.w2_weight_triton_"
                                                        "tensor.storage"),
             ("lm_head.weight", "lm_head.weight"), ("model.embed_tokens.weight", "model.embed_tokens.weight")]
    for hf, sgl in pairs:
        assert group_of(hf) == group_of(sgl), (hf, sgl)
    norms = ("model.layers.3.input_layernorm.weight", "model.layers.3.post_attention_layernorm.weight")
    assert group_of(norms[0]) != group_of(norms[1])
    assert group_of("model.layers.3.mlp.router.weight") == "model.layers.3.mlp" != group_of("model.layers.30.mlp.x")
    assert group_of("model.norm.weight") == "model.norm" and group_of("w") == "w"


@pytest.mark.parametrize("tp, pad, sinks", [(1, 0, None), (2, 0, None), (2, 8, None), (1, 0, torch.float32)],
                         ids=["tp1", "tp2", "tp2-padded-experts", "float32-sinks"])
def test_each_gpt_oss_version_in_sglangs_bf16_layout_is_proven(versions, tp, pad, sinks):
    """(a) SGLang's bf16 GPT-OSS on `tp` ranks (fused, interleaved, transposed, padded with a constant the loads never
    write, float32 expert biases, sinks in float32 as on the trtllm_mha backend) holds each version it loaded: every
    module group's fingerprint, less the offset its start measured, is the version's files'."""
    paths = versions(GPT_OSS, 3)
    models = [SGLangModel(paths[0], r, tp, torch.bfloat16, pad=pad, sinks_dtype=sinks) for r in range(tp)]
    assert models[0].get_submodule("model.layers.0.mlp.experts").w13_weight_bias.dtype == torch.float32
    proof = proof_over(models)
    proof.baseline(paths[0])
    assert proof.offset is not None and len(proof.offset) == 11  # embed, lm_head, norm, 2 x (2 norms, attention, mlp)
    assert bool(pad) == any(proof.offset.values())  # the padding is constant: in the offset
    for v in (1, 2):
        load(models, paths[v])
        record = proof.prove(paths[v], v, "here")
        assert record["verified"] and record["proof"] == "fingerprint" and len(record["groups"]) == 11, record
        assert record["changed"] == record["groups"] and record["hash_files_seconds"] >= 0


def test_a_tensor_that_keeps_the_previous_versions_values_fails_naming_its_group(versions):
    """(b) A load that missed one tensor (layer 1's experts' down_proj still version 1's) fails, naming the module
    group and the tensor of it that kept its fingerprint; one that missed everything holds version 1's values."""
    paths = versions(GPT_OSS, 4)
    models = [SGLangModel(paths[0], r, 2, torch.bfloat16) for r in range(2)]
    proof = proof_over(models)
    proof.baseline(paths[0])
    load(models, paths[1])
    assert proof.prove(paths[1], 1, "here")["verified"]
    with pytest.raises(WeightUpdateError, match=r"not the version's: lm_head \(it still holds version 1's values\); "
                                                r"model\.embed_tokens \(it still holds version 1's values\); .*and 5 "
                                                r"more groups"):
        proof.prove(paths[2], 2, "here")  # nothing of version 2 was loaded
    load(models, paths[2], stale_from=paths[1], stale=("model.layers.1.mlp.experts.down_proj",))
    kinds = (r"\(by tensor kind: bias, weight match; only SGLang's: w13_weight, w13_weight_bias, w2_weight, "
             r"w2_weight_bias; only the files': down_proj, down_proj_bias, gate_up_proj, gate_up_proj_bias\)")
    with pytest.raises(WeightUpdateError, match=r"^here: after loading weight version 2 from .*v2 the fingerprints of "
                                                r"SGLang's tensors are not the version's: model\.layers\.1\.mlp \("
                                                r"model\.layers\.1\.mlp\.experts\.w2_weight unchanged since version "
                                                rf"1\) {kinds}; it generates no more"):
        proof.prove(paths[2], 2, "here")
    load(models, paths[3])
    assert proof.prove(paths[3], 3, "here")["verified"]


def test_a_failed_proof_says_which_tensor_kinds_of_a_group_differ(shm_root):
    """An fp8 GPT-OSS version whose attention SGLang holds as fused `qkv_proj` weights and scales: a load after which
    the block scales are not the version's (rounded up to powers of two, as a kernel's UE8M0 scales are) fails naming
    the group and, of the kinds SGLang's tensors and the files share, `weight_scale_inv` as differing, the others as
    matching; the same where the daemon hashed the files ahead (`files_hash`); loads before and after are proven."""
    paths = noisy_versions(shm_root, "fp8k", GPT_OSS, 4, formats=("fp8",))["fp8"]
    models = [SGLangModel(paths[0], 0, 1, torch.bfloat16)]
    attn = models[0].get_submodule("model.layers.0.self_attn")
    assert attn.qkv_proj.weight.dtype == torch.float8_e4m3fn and attn.qkv_proj.weight_scale_inv.dtype == torch.float32
    proof = proof_over(models)
    proof.baseline(paths[0])
    load(models, paths[1])
    assert proof.prove(paths[1], 1, "here")["verified"]
    load(models, paths[2])
    with torch.no_grad():
        scale = attn.qkv_proj.weight_scale_inv
        scale.copy_(torch.exp2(torch.ceil(torch.log2(scale))))
    said = (r"not the version's: model\.layers\.0\.self_attn \(by tensor kind: weight_scale_inv differs; bias, sinks, "
            r"weight match\); it generates")
    with pytest.raises(WeightUpdateError, match=said):
        proof.prove(paths[2], 2, "here")
    ahead = proof.files_hash(checkpoint_tensors(paths[2], "cpu"))
    assert ahead is not None and "model.layers.0.self_attn|weight_scale_inv" in ahead
    with pytest.raises(WeightUpdateError, match=said):
        proof.prove(paths[2], 2, "here", ahead=ahead)
    load(models, paths[3])
    assert proof.prove(paths[3], 3, "here", ahead=proof.files_hash(checkpoint_tensors(paths[3], "cpu")))["verified"]


def test_the_loader_writes_no_weight(versions, tmp_path):
    """(c) The model's parameters and buffers are the same tensors holding the same bits after the loader ran, with
    the files hashed and without."""
    paths = versions(GPT_OSS, 2)
    model = SGLangModel(paths[0], 0, 1, torch.bfloat16, pad=4)
    before = {n: (t.data_ptr(), t.detach().clone()) for n, t in [*model.named_parameters(), *model.named_buffers()]}
    for files in (paths[1], None):
        offpolicy_fingerprint(model, [(worker.request(str(tmp_path), files), torch.empty(0))])
        report = json.loads((tmp_path / "rank0.json").read_text())
        assert "error" not in report and ("files" in report) == ("files_kinds" in report) == (files is not None)
        if files is not None:  # the groups' fingerprints are their kinds' summed
            assert {k: str(v) for k, v in worker.by_group({k: int(v) for k, v in report["files_kinds"].items()}).items()
                    } == report["files"] and "model.layers.0.self_attn|sinks" in report["files_kinds"]
    after = dict([*model.named_parameters(), *model.named_buffers()])
    assert sorted(after) == sorted(before)
    for name, (ptr, old) in before.items():
        assert after[name].data_ptr() == ptr and torch.equal(after[name].view(torch.uint8), old.view(torch.uint8)), name


def test_a_llama_version_in_sglangs_layout_is_proven(versions):
    paths = versions(LLAMA, 2)
    models = [SGLangModel(paths[0], r, 2, torch.bfloat16) for r in range(2)]
    assert "qkv_proj" in dict(models[0].named_modules())["model.layers.0.self_attn"]._modules
    proof = proof_over(models)
    proof.baseline(paths[0])
    load(models, paths[1])
    assert proof.prove(paths[1], 1, "here")["verified"]


def test_what_goes_wrong_in_the_worker_is_written_not_raised(versions, tmp_path, caplog):
    """An exception out of a custom loader would end SGLang's scheduler: the loader writes it in its report instead;
    a tensor that is not a request of ours is left alone (nothing loaded, nothing written)."""
    paths = versions(GPT_OSS, 1)
    model = SGLangModel(paths[0])
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "model.safetensors").write_bytes(b"not safetensors")
    offpolicy_fingerprint(model, [(worker.request(str(tmp_path), str(broken)), torch.empty(0))])
    report = json.loads((tmp_path / "rank0.json").read_text())
    assert report["rank"] == 0 and report["world"] == 1 and report["error"] and "traceback" in report
    offpolicy_fingerprint(model, [("model.norm.weight", torch.ones(64))])
    assert "not a request of its own" in caplog.text
    assert sorted(p.name for p in tmp_path.glob("*.json")) == ["rank0.json"]


def test_the_request_travels_as_sglang_unpickles_it():
    """Over HTTP the request is what SGLang's Engine would send: [(name, empty tensor)] pickled with torch's
    reductions; SGLang's SafeUnpickler takes it (every class it names is torch's), as the narrowed stand-in does."""
    name = worker.request("/dev/shm/x", "/v/1")
    ((got, tensor),) = TorchOnly(io.BytesIO(base64.b64decode(serialized(name)))).load()
    assert got == name and tensor.numel() == 0 and worker.parse(got) == {"kind": worker.KIND, "report": "/dev/shm/x",
                                                                         "files": "/v/1"}
    with pytest.raises(RuntimeError, match="Blocked"):
        TorchOnly(io.BytesIO(pickle.dumps(types.SimpleNamespace()))).load()
    assert worker.parse("model.norm.weight") is None and worker.parse(json.dumps({"kind": "other"})) is None


def test_the_files_are_hashed_as_the_model_holds_them():
    """The model's dtype is its 16- and 32-bit floats' majority; a file tensor takes the dtype of the model's tensor
    of its name (float32 sinks), else that dtype, expert biases float32 where the model widens them, fp8 scales and
    integer tensors as stored."""
    bf, f32 = torch.bfloat16, torch.float32
    assert model_dtype([torch.zeros(100, dtype=bf), torch.zeros(10, dtype=f32), torch.zeros(999).byte()]) == bf
    x = torch.randn(8)
    held = {"model.layers.0.self_attn.sinks": f32}
    assert as_held("model.layers.0.self_attn.sinks", x, bf, False, held).dtype == f32
    assert as_held("model.layers.0.self_attn.o_proj.weight", x, bf, False, held).dtype == bf
    assert as_held("model.layers.0.mlp.experts.down_proj_bias", x, bf, True, held).dtype == f32
    assert as_held("model.layers.0.mlp.experts.down_proj_bias", x, bf, False, held).dtype == bf
    assert as_held("model.layers.0.mlp.experts.down_proj_scale_inv", x, bf, False, held).dtype == f32
    blocks = torch.zeros(4, dtype=torch.uint8)
    assert as_held("model.layers.0.mlp.experts.gate_up_proj_blocks", blocks, bf, False, held) is blocks
    fp8 = {"model.layers.0.self_attn.o_proj.weight": torch.float8_e4m3fn}  # not 16 or 32 bits: the model's dtype
    assert as_held("model.layers.0.self_attn.o_proj.weight", x, bf, False, fp8).dtype == bf


def test_kv_heads_repeated_across_ranks_are_reported(tmp_path):
    """With tp_size > num_key_value_heads SGLang repeats KV heads in each rank's qkv_proj (num_kv_head_replicas): the
    report says so, and the daemon leaves such loads unproven (fingerprint_proof)."""
    model = torch.nn.Module()
    model.qkv_proj = torch.nn.Linear(4, 4)
    model.qkv_proj.num_kv_head_replicas = 2
    offpolicy_fingerprint(model, [(worker.request(str(tmp_path), None), torch.empty(0))])
    assert json.loads((tmp_path / "rank0.json").read_text())["replicated_kv"] is True


def test_the_synced_loader_loads_with_the_model_s_own_load_weights_and_then_returns():
    """offpolicy_load_synced (direct loads): the model's load_weights takes every tensor, a generator's too (SGLang
    hands a list), and the loader returns after it (on a GPU it also waits for their copies: not run on one yet)."""
    from offpolicy.rollout.engines.sglang.worker import offpolicy_load_synced

    taken = []
    model = types.SimpleNamespace(load_weights=lambda named: taken.extend(n for n, _ in named))
    offpolicy_load_synced(model, ((f"w{i}", torch.zeros(2)) for i in range(3)))
    assert taken == ["w0", "w1", "w2"]
