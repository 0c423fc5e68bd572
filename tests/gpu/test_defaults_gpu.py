"""The `auto` defaults on a real GPU (skipped without one): the torch engine decodes with the compiled
static-cache CUDA graph and gives the dynamic cache's samples; a model the static cache cannot run falls
back to the dynamic cache; the learner's store resolves to recycled, unhashed, page-locked files and a
version published that way loads back exactly. tests/unit/test_torch_engine.py and
tests/unit/test_weights_fastpath.py check the resolution rules without a GPU."""

from pathlib import Path

import numpy as np
import pytest
import torch

from offpolicy.config import load_config
from offpolicy.models.build import hf_config, hf_state
from offpolicy.rollout.engines import SamplingParams
from offpolicy.rollout.engines.torch_engine import TorchEngine
from offpolicy.weights import WeightStore, WeightVersion, fastpath

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

QUICKSTART = str(Path(__file__).resolve().parents[2] / "configs" / "quickstart.yaml")
PROMPTS = [[11, 1, 2, 3, 12], [11, 7, 12], [11, 9, 8, 7, 6, 12]]


def config(*overrides: str):
    return load_config(QUICKSTART, ["rollout.device=cuda", "learner.device=cuda", *overrides])


def test_the_default_engine_on_a_gpu_is_the_compiled_static_graph_and_samples_like_the_dynamic_cache():
    fast, slow = TorchEngine(config(), seed=0), TorchEngine(config("rollout.static_cache=false"), seed=0)
    assert (fast.static_cache, fast.compile) == (True, True) and (slow.static_cache, slow.compile) == (False, False)
    params = SamplingParams(n=2, temperature=0.7, max_new_tokens=8)
    for ga, gb in zip(slow.generate(PROMPTS, params, [1, 2, 3]), fast.generate(PROMPTS, params, [1, 2, 3])):
        for a, b in zip(ga, gb):
            assert a.tokens.tolist() == b.tokens.tolist()
            assert np.allclose(a.logprobs, b.logprobs, atol=1e-4)


def test_a_sliding_window_model_falls_back_to_the_dynamic_cache_on_a_gpu():
    arch = ("model.arch={model_type: qwen2, vocab_size: 32, hidden_size: 16, intermediate_size: 32, "
            "num_hidden_layers: 2, num_attention_heads: 2, num_key_value_heads: 1, use_sliding_window: true, "
            "sliding_window: 8, max_window_layers: 0}")
    eng = TorchEngine(config(arch), seed=0)
    assert (eng.static_cache, eng.compile) == (False, False)


def test_the_learner_store_on_a_gpu_is_recycled_unhashed_and_loads_back_exactly(tmp_path):
    w = fastpath.resolve(config().weights, gpu=True)
    assert (w.reuse_files, w.checksum, w.register_maps) == (True, "none", True)
    eng = TorchEngine(config(), seed=0)
    store = WeightStore(str(tmp_path), "r", keep=2, checksum=w.checksum, reuse_files=w.reuse_files,
                        register_maps=w.register_maps)
    state = {k: v.detach().clone() for k, v in hf_state(eng.model)}
    for v in range(6):  # files recycled from the third collected version on, registered on their second sighting
        for t in state.values():
            t.add_(1)
        pub = store.publish(v, iter(state.items()), hf_config(eng.model))
    with WeightVersion(pub.path) as wv:
        assert not any(e.sha256 for e in wv.manifest.files.values())
        eng.load(wv)
    own = dict(eng.model.state_dict())
    for name, t in state.items():
        if name in own:
            assert torch.equal(own[name], t), name
