"""Tests for offpolicy.rollout.engines.torch_engine: batched KV-cache sampling with left padding, behaviour
logprobs checked against an independent no-cache forward pass, stopping, greedy decoding, seeding,
and swapping weights from a published version."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from offpolicy.config import load_config
from offpolicy.models.build import build_model, hf_config, hf_state
from offpolicy.rollout.engines import Completion, SamplingParams, make_engine
from offpolicy.rollout.engines.torch_engine import TorchEngine
from offpolicy.weights import WeightStore, WeightVersion

REPO = Path(__file__).resolve().parents[2]
QUICKSTART = str(REPO / "configs" / "quickstart.yaml")
EOS, BOS, EQ = 13, 11, 12
PROMPTS = [[BOS, 1, 2, 3, 4, EQ], [BOS, 7, EQ], [BOS, 9, 8, 7, 6, 5, 4, 3, 2, EQ], [BOS, 5, 5, EQ]]


def config(*overrides: str):
    return load_config(QUICKSTART, ["rollout.device=cpu", "learner.device=cpu", *overrides])


@pytest.fixture(scope="module", params=[False, True], ids=["dynamic_cache", "static_cache"])
def engine(request) -> TorchEngine:
    return TorchEngine(config(f"rollout.static_cache={str(request.param).lower()}"), seed=0)


def recompute_logprobs(model, prompt: list[int], tokens, temperature: float = 1.0) -> torch.Tensor:
    """log_softmax(logits / T) at `tokens`, from one unpadded forward pass without a cache."""
    ids = torch.tensor([list(prompt) + [int(t) for t in tokens]])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0].float()
    logp = torch.log_softmax(logits / temperature, dim=-1)[len(prompt) - 1:-1]
    return logp.gather(-1, torch.as_tensor(np.asarray(tokens), dtype=torch.long)[:, None]).squeeze(-1)


def greedy_reference(model, prompt: list[int], max_new_tokens: int, stops=(EOS,)) -> list[int]:
    """Argmax decoding without a cache, one full forward pass per token."""
    seq = list(prompt)
    out: list[int] = []
    with torch.no_grad():
        for _ in range(max_new_tokens):
            tok = int(model(input_ids=torch.tensor([seq])).logits[0, -1].argmax())
            out.append(tok)
            seq.append(tok)
            if tok in stops:
                break
    return out


def publish_model(tmp_path, model, version: int = 1, tensors=None) -> WeightVersion:
    store = WeightStore(str(tmp_path), "eng", keep=10)
    pub = store.publish(version, tensors if tensors is not None else hf_state(model), hf_config(model))
    return WeightVersion(pub.path)


def test_generate_returns_n_completions_per_prompt_in_prompt_order(engine):
    params = SamplingParams(n=3, max_new_tokens=5)
    out = engine.generate(PROMPTS, params)
    assert len(out) == len(PROMPTS)
    for prompt, comps in zip(PROMPTS, out):
        assert len(comps) == 3
        for c in comps:
            assert isinstance(c, Completion)
            assert c.tokens.dtype == np.int32 and c.logprobs.dtype == np.float32
            assert 1 <= len(c.tokens) == len(c.logprobs) <= 5
            assert c.finish_reason in ("stop", "length")
            assert np.all(c.logprobs <= 0) and np.all(np.isfinite(c.logprobs))
            # each completion's logprobs belong to its own prompt: order is kept
            lp = recompute_logprobs(engine.model, prompt, c.tokens)
            assert torch.allclose(lp, torch.from_numpy(c.logprobs), atol=1e-4)


def test_batched_greedy_equals_single_prompt_greedy_in_order(engine):
    params = SamplingParams(n=2, top_k=1, max_new_tokens=6)
    batched = engine.generate(PROMPTS, params)
    for prompt, comps in zip(PROMPTS, batched):
        alone = engine.generate([prompt], params)[0]
        for a, b in zip(comps, alone):
            assert a.tokens.tolist() == b.tokens.tolist()
            assert np.allclose(a.logprobs, b.logprobs, atol=1e-4)


@pytest.mark.parametrize("temperature", [1.0, 0.7, 1.5])
def test_left_padded_logprobs_match_an_unpadded_forward(engine, temperature):
    params = SamplingParams(n=4, temperature=temperature, max_new_tokens=8)
    out = engine.generate(PROMPTS, params)
    lengths = {len(p) for p in PROMPTS}
    assert len(lengths) > 1  # prompts of different lengths share one left-padded batch
    checked = 0
    for prompt, comps in zip(PROMPTS, out):
        for c in comps:
            lp = recompute_logprobs(engine.model, prompt, c.tokens, temperature)
            assert torch.allclose(lp, torch.from_numpy(c.logprobs), atol=1e-4), (prompt, c.tokens)
            checked += len(c.tokens)
    assert checked > 4 * len(PROMPTS)


def test_logprobs_are_from_the_distribution_before_top_k_and_top_p(engine):
    for params in (SamplingParams(n=3, top_k=3, max_new_tokens=6, temperature=0.8),
                   SamplingParams(n=3, top_p=0.5, max_new_tokens=6, temperature=0.8)):
        for prompt, comps in zip(PROMPTS, engine.generate(PROMPTS, params)):
            for c in comps:
                lp = recompute_logprobs(engine.model, prompt, c.tokens, params.temperature)
                assert torch.allclose(lp, torch.from_numpy(c.logprobs), atol=1e-4)


def test_top_k_restricts_samples_to_the_k_most_likely_tokens(engine):
    params = SamplingParams(n=8, top_k=2, max_new_tokens=6)
    for prompt, comps in zip(PROMPTS, engine.generate(PROMPTS, params)):
        for c in comps:
            seq = list(prompt)
            with torch.no_grad():
                for tok in c.tokens.tolist():
                    logits = engine.model(input_ids=torch.tensor([seq])).logits[0, -1]
                    assert tok in logits.topk(2).indices.tolist()
                    seq.append(tok)


def test_stops_at_eos_with_eos_included(engine):
    params = SamplingParams(n=16, max_new_tokens=10)
    comps = [c for cs in engine.generate(PROMPTS, params) for c in cs]
    stopped = [c for c in comps if c.finish_reason == "stop"]
    cut = [c for c in comps if c.finish_reason == "length"]
    assert stopped and cut  # the random tiny model does both at this length
    for c in stopped:
        assert c.tokens[-1] == EOS
        assert EOS not in c.tokens[:-1].tolist()
        assert len(c.tokens) <= 10
    for c in cut:
        assert len(c.tokens) == 10
        assert EOS not in c.tokens.tolist()


def test_extra_stop_token_ids_stop_too(engine):
    params = SamplingParams(n=16, max_new_tokens=10, stop_token_ids=(3, 7))
    comps = [c for cs in engine.generate(PROMPTS, params) for c in cs]
    stop_tokens = {int(c.tokens[-1]) for c in comps if c.finish_reason == "stop"}
    assert stop_tokens & {3, 7}
    assert stop_tokens <= {3, 7, EOS}
    for c in comps:
        assert not set(c.tokens[:-1].tolist()) & {3, 7, EOS}
        if c.finish_reason == "length":
            assert len(c.tokens) == 10 and int(c.tokens[-1]) not in {3, 7, EOS}


@pytest.mark.parametrize("static", [False, True], ids=["dynamic_cache", "static_cache"])
def test_an_eos_of_the_models_generation_config_stops(tmp_path, static):
    """model.path's generation_config.json lists another EOS id (GPT-OSS lists <|return|>, <|endoftext|> and <|call|>),
    which vLLM and SGLang stop on: the torch engine stops on it too (`model_stop_ids`), with finish reason "stop"."""
    import json

    other = 5  # a digit the random tiny model samples often
    build_model(config().model, torch.device("cpu")).save_pretrained(tmp_path)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [EOS, other]}))
    engine = TorchEngine(config(f"model.path={tmp_path}", f"rollout.static_cache={str(static).lower()}"), seed=0)
    comps = [c for cs in engine.generate(PROMPTS, SamplingParams(n=16, max_new_tokens=10)) for c in cs]
    assert {int(c.tokens[-1]) for c in comps if c.finish_reason == "stop"} == {EOS, other}
    for c in comps:
        assert not {EOS, other} & set(c.tokens[:-1].tolist())
        assert (c.finish_reason == "stop") == (int(c.tokens[-1]) in {EOS, other})


@pytest.mark.parametrize("max_new_tokens", [1, 3])
def test_max_new_tokens_gives_length(engine, max_new_tokens):
    params = SamplingParams(n=8, max_new_tokens=max_new_tokens)
    comps = [c for cs in engine.generate(PROMPTS, params) for c in cs]
    for c in comps:
        assert 1 <= len(c.tokens) <= max_new_tokens
        if c.finish_reason == "length":
            assert len(c.tokens) == max_new_tokens and c.tokens[-1] != EOS
        else:
            assert c.finish_reason == "stop" and c.tokens[-1] == EOS
    assert any(c.finish_reason == "length" for c in comps)


def test_top_k_1_is_greedy(engine):
    out = engine.generate(PROMPTS, SamplingParams(n=4, top_k=1, max_new_tokens=8, temperature=0.9))
    for prompt, comps in zip(PROMPTS, out):
        ref = greedy_reference(engine.model, prompt, 8)
        for c in comps:
            assert c.tokens.tolist() == ref
            assert c.finish_reason == ("stop" if ref[-1] == EOS else "length")
            # the behaviour logprob is the temperature-scaled one, not log(1) of the filtered distribution
            lp = recompute_logprobs(engine.model, prompt, ref, 0.9)
            assert np.allclose(c.logprobs, lp.numpy(), atol=1e-4)
            assert np.all(c.logprobs < 0)


def test_tiny_top_p_is_greedy(engine):
    out = engine.generate(PROMPTS, SamplingParams(n=3, top_p=1e-6, max_new_tokens=6))
    for prompt, comps in zip(PROMPTS, out):
        ref = greedy_reference(engine.model, prompt, 6)
        assert all(c.tokens.tolist() == ref for c in comps)


@pytest.mark.parametrize("params", [SamplingParams(n=4, max_new_tokens=8),
                                    SamplingParams(n=3, temperature=0.7, top_k=5, max_new_tokens=20),
                                    SamplingParams(n=2, top_p=0.8, max_new_tokens=40)], ids=["plain", "top_k", "top_p"])
def test_static_cache_gives_the_dynamic_caches_samples_and_logprobs(params):
    dynamic, static = TorchEngine(config(), seed=0), TorchEngine(config("rollout.static_cache=true"), seed=0)
    seeds = [11, 22, 33, 44]
    for _ in range(2):  # the second call reuses the static cache (and on a GPU its graph)
        for ga, gb in zip(dynamic.generate(PROMPTS, params, seeds), static.generate(PROMPTS, params, seeds)):
            for a, b in zip(ga, gb):
                assert a.tokens.tolist() == b.tokens.tolist() and a.finish_reason == b.finish_reason
                assert np.allclose(a.logprobs, b.logprobs, atol=1e-5)


@pytest.mark.slow  # torch.compile on 2 cores (~17 s)
def test_compiled_static_decode_gives_the_dynamic_caches_samples_and_logprobs():
    params = SamplingParams(n=2, temperature=0.7, max_new_tokens=6)
    dynamic = TorchEngine(config(), seed=0)
    compiled = TorchEngine(config("rollout.static_cache=true", "rollout.compile=true"), seed=0)
    seeds = [5, 6, 7, 8]
    for ga, gb in zip(dynamic.generate(PROMPTS, params, seeds), compiled.generate(PROMPTS, params, seeds)):
        for a, b in zip(ga, gb):
            assert a.tokens.tolist() == b.tokens.tolist()
            assert np.allclose(a.logprobs, b.logprobs, atol=1e-5)


def test_same_seed_gives_same_samples_and_another_seed_differs():
    params = SamplingParams(n=4, max_new_tokens=8)

    def run(seed):
        out = TorchEngine(config(), seed=seed).generate(PROMPTS, params)
        return [[c.tokens.tolist() for c in cs] for cs in out], [[c.logprobs for c in cs] for cs in out]

    (a, la), (b, lb), (c, _) = run(5), run(5), run(6)
    assert a == b
    for x, y in zip(la, lb):
        for p, q in zip(x, y):
            assert np.array_equal(p, q)
    assert a != c


def test_seeds_make_a_prompts_samples_independent_of_its_batch():
    params = SamplingParams(n=3, max_new_tokens=6)
    engine = TorchEngine(config(), seed=0)
    batched = engine.generate(PROMPTS, params, seeds=[101, 102, 103, 104])
    alone = TorchEngine(config(), seed=9).generate([PROMPTS[2]], params, seeds=[103])[0]
    assert [c.tokens.tolist() for c in batched[2]] == [c.tokens.tolist() for c in alone]
    for a, b in zip(batched[2], alone):
        assert np.allclose(a.logprobs, b.logprobs, atol=1e-4)
    other = engine.generate([PROMPTS[2]], params, seeds=[999])[0]
    assert [c.tokens.tolist() for c in other] != [c.tokens.tolist() for c in alone]
    # the n responses of one prompt are not copies of each other
    assert len({tuple(c.tokens.tolist()) for cs in batched for c in cs}) > len(PROMPTS)


def test_seeds_must_match_the_prompts():
    engine = TorchEngine(config(), seed=0)
    with pytest.raises(ValueError):
        engine.generate(PROMPTS, SamplingParams(n=2, max_new_tokens=2), seeds=[1, 2])


def test_samples_follow_the_model_distribution(engine):
    """First-token frequencies over many samples match softmax(logits / T) of the model."""
    prompt = [BOS, 4, 2, EQ]
    n = 4000
    out = engine.generate([prompt], SamplingParams(n=n, temperature=1.3, max_new_tokens=1))[0]
    counts = np.bincount([int(c.tokens[0]) for c in out], minlength=16) / n
    with torch.no_grad():
        probs = torch.softmax(engine.model(input_ids=torch.tensor([prompt])).logits[0, -1] / 1.3, -1).numpy()
    assert np.abs(counts - probs).max() < 0.035  # about 5 standard errors at p = 0.1


def test_make_engine_builds_the_torch_engine():
    eng = make_engine(config(), seed=0)
    assert isinstance(eng, TorchEngine) and eng.version == -1


def test_load_changes_outputs_and_sets_version(tmp_path):
    engine = TorchEngine(config(), seed=0)
    params = SamplingParams(n=2, top_k=1, max_new_tokens=6)
    before = engine.generate(PROMPTS, params)
    other_cfg = config("model.seed=7")
    other = build_model(other_cfg.model, torch.device("cpu"))
    with publish_model(tmp_path, other, version=3) as wv:
        seconds = engine.load(wv)
    assert seconds >= 0 and engine.version == 3
    after = engine.generate(PROMPTS, params)
    first = [float(cs[0].logprobs[0]) for cs in before]
    assert not np.allclose(first, [float(cs[0].logprobs[0]) for cs in after], atol=1e-3)
    # the engine now decodes exactly like a model built with the published weights
    reference = TorchEngine(other_cfg, seed=0).generate(PROMPTS, params)
    for x, y in zip(after, reference):
        for a, b in zip(x, y):
            assert a.tokens.tolist() == b.tokens.tolist()
            assert np.allclose(a.logprobs, b.logprobs, atol=1e-5)
    for name, t in other.state_dict().items():
        assert torch.equal(engine.model.state_dict()[name], t), name


def test_load_copies_weights_out_of_the_shared_version(tmp_path):
    engine = TorchEngine(config(), seed=0)
    other = build_model(config("model.seed=7").model, torch.device("cpu"))
    wv = publish_model(tmp_path, other)
    engine.load(wv)
    wv.tensors["lm_head.weight"].zero_()  # the map is private, but the engine must not alias it either
    assert torch.equal(engine.model.lm_head.weight, other.lm_head.weight)
    wv.close()


def test_load_of_a_tied_model_version_fits_a_tied_engine(tmp_path):
    cfg = config("model.arch.tie_word_embeddings=true", "model.seed=3")
    engine = TorchEngine(config("model.arch.tie_word_embeddings=true"), seed=0)
    source = build_model(cfg.model, torch.device("cpu"))
    with publish_model(tmp_path, source) as wv:
        assert "lm_head.weight" not in wv.tensors
        engine.load(wv)
    assert torch.equal(engine.model.lm_head.weight, source.model.embed_tokens.weight)


def test_load_of_a_version_with_an_unexpected_tensor_raises_value_error(tmp_path):
    engine = TorchEngine(config(), seed=0)
    model = build_model(config().model, torch.device("cpu"))
    tensors = list(hf_state(model)) + [("model.extra.weight", torch.zeros(4))]
    with publish_model(tmp_path, model, tensors=tensors) as wv:
        with pytest.raises(ValueError, match="extra"):
            engine.load(wv)
    assert engine.version == -1


def test_load_of_a_version_missing_a_tensor_raises_value_error(tmp_path):
    engine = TorchEngine(config(), seed=0)
    model = build_model(config().model, torch.device("cpu"))
    tensors = [(k, t) for k, t in hf_state(model) if k != "model.norm.weight"]
    with publish_model(tmp_path, model, tensors=tensors) as wv:
        with pytest.raises(ValueError, match="model.norm.weight"):
            engine.load(wv)
    assert engine.version == -1


def test_load_of_a_version_with_other_shapes_raises_value_error(tmp_path):
    engine = TorchEngine(config(), seed=0)
    wider = build_model(config("model.arch.hidden_size=32").model, torch.device("cpu"))
    with publish_model(tmp_path, wider) as wv:
        with pytest.raises(ValueError):
            engine.load(wv)
    assert engine.version == -1


def test_a_refused_version_leaves_the_engine_weights_unchanged(tmp_path):
    engine = TorchEngine(config(), seed=0)
    before = {k: v.clone() for k, v in engine.model.state_dict().items()}
    other = build_model(config("model.seed=7").model, torch.device("cpu"))
    tensors = list(hf_state(other)) + [("model.extra.weight", torch.zeros(4))]
    with publish_model(tmp_path, other, tensors=tensors) as wv:
        with pytest.raises(ValueError):
            engine.load(wv)
    assert engine.version == -1
    for name, t in engine.model.state_dict().items():
        assert torch.equal(t, before[name]), name


MOE = dict(model_type="qwen3_moe", vocab_size=64, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
           num_experts=4, num_experts_per_tok=2, norm_topk_prob=True, num_hidden_layers=2, num_attention_heads=4,
           num_key_value_heads=2, head_dim=8, max_position_embeddings=128, tie_word_embeddings=False)


def test_moe_versions_carry_checkpoint_names_and_load_into_the_fused_experts(tmp_path):
    """transformers 5 fuses a layer's experts in memory; versions name each expert as the checkpoint does
    (what SGLang and the megatron backend use), and the engine loads them back into the fused tensors."""
    from offpolicy.config import ModelConfig
    from offpolicy.models.build import checkpoint_tensors

    src = build_model(ModelConfig(arch=MOE, seed=1), torch.device("cpu"))
    names = dict(hf_state(src))
    assert "model.layers.0.mlp.experts.3.up_proj.weight" in names
    assert not any(k.endswith("experts.gate_up_proj") or k.endswith("experts.down_proj") for k in names)
    fused = src.state_dict()["model.layers.1.mlp.experts.gate_up_proj"]
    assert torch.equal(names["model.layers.1.mlp.experts.2.gate_proj.weight"], fused[2, :16])
    assert torch.equal(names["model.layers.1.mlp.experts.2.up_proj.weight"], fused[2, 16:])
    version = publish_model(tmp_path, src)
    engine = TorchEngine(config(), seed=0)
    engine.model = build_model(ModelConfig(arch=MOE, seed=2), torch.device("cpu"))
    assert not torch.equal(engine.model.state_dict()["model.layers.1.mlp.experts.down_proj"],
                           src.state_dict()["model.layers.1.mlp.experts.down_proj"])
    engine.load(version)
    for k, t in src.state_dict().items():
        assert torch.equal(engine.model.state_dict()[k], t), k
    assert set(checkpoint_tensors(engine.model)) == set(names)


@pytest.mark.parametrize("static, compile, cuda, problem, expected", [
    ("auto", "auto", True, None, (True, True)),          # the default on a GPU: graph + compile
    ("auto", "auto", True, "sliding", (False, False)),   # a model the static cache cannot run: dynamic cache
    ("auto", "auto", False, None, (False, False)),       # the default on the CPU: dynamic cache
    ("auto", False, True, None, (True, False)),          # compile off, a knob away
    (False, "auto", True, None, (False, False)),         # the cautious path, a knob away
    (True, "auto", False, None, (True, False)),          # static on the CPU when asked (never compiled by auto)
    (True, True, False, None, (True, True)),             # explicit values win
    (True, "auto", True, "sliding", (True, True)),       # explicit true stays (StaticDecoder then names the problem)
])
def test_decode_mode_resolves_auto_to_the_fast_path_on_a_gpu(static, compile, cuda, problem, expected):
    from offpolicy.rollout.engines.torch_engine import decode_mode

    assert decode_mode(static, compile, cuda, problem) == expected


def test_the_default_engine_on_the_cpu_uses_the_dynamic_cache():
    assert (TorchEngine(config(), seed=0).static_cache, TorchEngine(config(), seed=0).compile) == (False, False)
    eng = TorchEngine(config("rollout.static_cache=true"), seed=0)
    assert (eng.static_cache, eng.compile) == (True, False)


def test_unsupported_names_sliding_window_layers_and_the_static_decoder_refuses_them():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from offpolicy.rollout.engines.static_decode import StaticDecoder, unsupported

    kw = dict(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
              num_key_value_heads=1, max_window_layers=0)
    assert unsupported(Qwen2ForCausalLM(Qwen2Config(**kw))) is None
    slid = Qwen2ForCausalLM(Qwen2Config(**kw, use_sliding_window=True, sliding_window=8))
    assert "sliding-window" in unsupported(slid)
    with pytest.raises(ValueError, match="rollout.static_cache: the model has sliding-window layers"):
        StaticDecoder(slid, rows=2, length=16, graph=False)
