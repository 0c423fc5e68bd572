"""The setup of tests/gpu/test_sglang_gpu.py, on the CPU: its launch checkpoint and configs load here, so that a GPU
run (minutes of lent device time) never fails in its first seconds on a config error (one did: the model was built
from a config whose rollout section wanted a model.path)."""

from __future__ import annotations

import json

from offpolicy.config import load_config
from tests.gpu.test_sglang_gpu import BF16, GPTOSS, initial


def test_the_launch_checkpoint_and_both_modes_configs_load(tmp_path):
    launch, model = initial(tmp_path)
    assert json.loads((launch / "config.json").read_text())["model_type"] == "gpt_oss"
    assert (launch / "model.safetensors").exists() or list(launch.glob("*.safetensors"))
    in_process = load_config(GPTOSS, [*BF16, f"model.path={launch}", "rollout.sglang.extra.disable_cuda_graph=true"])
    assert in_process.rollout.sglang.mode == "engine" and in_process.model.path == str(launch)
    http = load_config(GPTOSS, [*BF16, "rollout.sglang.mode=http", "rollout.sglang.urls=[http://127.0.0.1:1]"])
    assert http.rollout.sglang.urls == ["http://127.0.0.1:1"]
