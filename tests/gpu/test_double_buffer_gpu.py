"""The torch engine's double buffer on a real GPU (skipped without one): `auto` turns it on, versions read on
the buffer's own stream while the compiled static-cache CUDA graphs generate, swapped in by pointer, give
exactly the samples of an engine that loaded each version in place (the graphs captured once per set of
weights, never reading the spare). tests/unit/test_double_buffer.py checks the logic on the CPU."""

from pathlib import Path

import numpy as np
import pytest
import torch

from offpolicy.config import load_config
from offpolicy.models.build import build_model, hf_config, hf_state
from offpolicy.rollout.engines import SamplingParams
from offpolicy.rollout.engines.torch_engine import TorchEngine
from offpolicy.weights import WeightStore, WeightVersion

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

QUICKSTART = str(Path(__file__).resolve().parents[2] / "configs" / "quickstart.yaml")
PROMPTS = [[11, 1, 2, 3, 12], [11, 7, 12], [11, 9, 8, 7, 6, 12]]
PARAMS = SamplingParams(n=4, temperature=0.8, max_new_tokens=24)
SEEDS = [1, 2, 3]


def config(*overrides: str):
    return load_config(QUICKSTART, ["rollout.device=cuda", "learner.device=cuda", *overrides])


def test_versions_read_beside_the_generating_graphs_sample_like_in_place_loads(tmp_path):
    store = WeightStore(str(tmp_path), "db", keep=10)
    for v in (1, 2, 3, 4):
        model = build_model(config(f"model.seed={10 + v}").model, torch.device("cuda"))
        store.publish(v, hf_state(model), hf_config(model))
    fast, plain = TorchEngine(config(), seed=0), TorchEngine(config("rollout.double_buffer=false"), seed=0)
    assert fast.prefetcher is not None and plain.prefetcher is None  # auto: on, with room for the copy
    assert (fast.static_cache, fast.compile) == (True, True)
    previous = None
    for v in (1, 2, 3, 4):
        with WeightVersion(Path(tmp_path) / "db" / f"v{v}") as wv:
            plain.load(wv)
            expected = plain.generate(PROMPTS, PARAMS, SEEDS)
            fast.prefetcher.prefetch(wv)  # read while the graphs of the previous version generate
            during = [fast.generate(PROMPTS, PARAMS, SEEDS) for _ in range(3)]
            if previous is not None:
                for got in during:  # the previous version's samples, whatever the read was doing meanwhile
                    assert [c.tokens.tolist() for g in got for c in g] == [c.tokens.tolist() for g in previous
                                                                           for c in g]
            fast.load(wv)
        got = fast.generate(PROMPTS, PARAMS, SEEDS)
        for ga, gb in zip(expected, got):
            for a, b in zip(ga, gb):
                assert a.tokens.tolist() == b.tokens.tolist()
                assert np.allclose(a.logprobs, b.logprobs, atol=1e-4)
        previous = got
    records = fast.prefetcher.drain()
    assert [(r.version, r.outcome) for r in records] == [(v, "swapped") for v in (1, 2, 3, 4)]
    assert len({k[-1] for d in fast._decoders.values() for k in d._steps}) == 2  # a graph per set of weights
    fast.close()
