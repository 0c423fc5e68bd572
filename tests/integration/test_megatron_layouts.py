"""Issue 10's tools on the CPU: benchmarks/megatron_layouts.py over two gloo ranks, and the pipeline
bench's learner/rollout split with a two-rank Megatron learner started by the launcher.

The layouts driver runs each layout under `torchrun` with `--cpu` (float32 through the test-only shim);
the step-1 losses of the same seeded weights and batch must agree across layouts. The split run
starts `offpolicy bench pipeline --backend megatron --learner-gpus 0 1 --tp 2`: the launcher starts two
learner ranks (RANK/WORLD_SIZE, CUDA_VISIBLE_DEVICES) and a rollout daemon; the Megatron ranks install
the CPU shim through a `sitecustomize` on PYTHONPATH that only this test puts there.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.conftest import ROOT

pytest.importorskip("megatron.core", reason="megatron-core is not installed (pip install -e '.[megatron]')")

pytestmark = pytest.mark.slow
SCRIPT = ROOT / "benchmarks" / "megatron_layouts.py"
TINY_BATCH = ["--groups", "4", "--samples", "4", "--prompt", "8", "--response", "8", "--steps", "3", "--warmup", "1",
              "--max-tokens", "0"]


def layouts(tmp_path, *args: str) -> tuple[subprocess.CompletedProcess, dict]:
    res = subprocess.run([sys.executable, str(SCRIPT), "--cpu", "--gpus", "2", "--out", str(tmp_path), *TINY_BATCH,
                          *args], capture_output=True, text=True, timeout=420, cwd=tmp_path)
    path = tmp_path / "megatron_layouts.json"
    return res, json.loads(path.read_text()) if path.exists() else {}


def test_dense_layouts_agree_on_the_step_one_loss(tmp_path):
    res, doc = layouts(tmp_path, "--arch", "tiny-qwen3", "--layouts", "1", "tp2", "dp2")
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-4000:]
    rows = {r["name"]: r for r in doc["layouts"]}
    assert [(r["world"], r["tp"], r["dp"]) for r in rows.values()] == [(1, 1, 1), (2, 2, 1), (2, 1, 2)]
    base = rows["1"]["loss"]
    for r in rows.values():
        assert "error" not in r
        assert r["loss"] == pytest.approx(base, rel=1e-4) and r["grad_norm"] == pytest.approx(rows["1"]["grad_norm"],
                                                                                                rel=1e-4)
        assert r["tokens_per_s"] > 0 and r["tokens_per_step"] == 4 * 4 * 16 and len(r["losses"]) == 3
        assert r["params"] > 0 and r["hf_tensors"] > 0
    assert doc["baseline"] == "1" and doc["agree"] and doc["max_rel_loss_diff"] < 1e-4 and doc["rtol"] == 1e-4
    assert rows["tp2"]["scaling"] == pytest.approx(rows["tp2"]["tokens_per_s"] / rows["1"]["tokens_per_s"])
    assert len(rows["1"]["losses"]) == 3 and rows["1"]["losses"][2] != rows["1"]["losses"][0]  # it trains
    md = (tmp_path / "megatron_layouts.md").read_text()
    assert "| tp2 | 2 | 2 | 1 | 1 | 1 |" in md and "agree" in md
    assert (tmp_path / "megatron_layouts_dp2.log").exists()


def test_a_failing_layout_is_reported_and_the_rest_still_run(tmp_path):
    # tiny-llama has 2 KV heads: tp 4 cannot split them (the backend refuses it with the field's name)
    res, doc = layouts(tmp_path, "--arch", "tiny-llama", "--layouts", "1", "tp4", "--gpus", "4")
    assert res.returncode == 2, res.stdout[-3000:]
    rows = {r["name"]: r for r in doc["layouts"]}
    assert "error" not in rows["1"] and "num_key_value_heads" in rows["tp4"]["error"]
    assert "failed: " in (tmp_path / "megatron_layouts.md").read_text()


def test_moe_layouts_agree(tmp_path):
    """Qwen3-MoE (the small config, shrunk): expert parallel, data parallel and tensor parallel with
    sequence parallelism give the 1-rank step-1 loss."""
    small = ["--arch-set", "hidden_size=64", "--arch-set", "num_hidden_layers=2", "--arch-set", "vocab_size=256",
             "--arch-set", "moe_intermediate_size=32", "--arch-set", "intermediate_size=96", "--arch-set",
             "head_dim=16", "--arch-set", "num_experts=4"]
    res, doc = layouts(tmp_path, "--arch", "qwen3-moe-small", *small, "--layouts", "1", "ep2", "dp2", "tp2",
                       "--publish", "1")
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-4000:]
    rows = {r["name"]: r for r in doc["layouts"]}
    assert (rows["ep2"]["ep"], rows["ep2"]["dp"]) == (2, 2) and rows["tp2"]["tp"] == 2
    assert doc["max_rel_loss_diff"] < 1e-4
    for r in rows.values():  # the sharded publish timed in every layout (benchmarks/publish.py)
        assert len(r["fresh_times"]) == len(r["warmup_times"]) == 4 and len(r["publish_times"]) == 1  # keep 3
        assert r["version_bytes"] > 0 and r["publish_s"] > 0 and r["stall_s"] >= 0 and r["host_copy_gbps"] > 0
        assert r["publish_stages"] and r["tokens_per_s"] > 0


def test_expert_data_parallel_layouts_agree_with_ep_alone(tmp_path):
    """Issue 51's layouts at 4 ranks (the 8-GPU part runs ep4dp4, ep8, ep4edp2): GPT-OSS with experts split 2 ways and
    each shard on 2 ranks (edp 2) trains as EP2 alone and EP4 do, over every step, and publishes its version."""
    res, doc = layouts(tmp_path, "--arch", "tiny-gpt_oss", "--gpus", "4", "--layouts", "ep2dp2", "ep2edp2", "ep4",
                       "--publish", "1")
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-4000:]
    rows = {r["name"]: r for r in doc["layouts"]}
    assert [(r["world"], r["ep"], r["dp"], r["edp"]) for r in rows.values()] == [(2, 2, 2, 1), (4, 2, 4, 2),
                                                                                 (4, 4, 4, 1)]
    assert doc["baseline"] == "ep2dp2" and rows["ep4"]["efficiency"] == pytest.approx(rows["ep4"]["scaling"] / 2)
    for r in rows.values():
        assert r["losses"] == pytest.approx(rows["ep2dp2"]["losses"], rel=1e-5)  # the optimizer steps too
        assert r["version_bytes"] > 0 and r["publish_s"] > 0
    assert "| ep2edp2 | 4 | 1 | 1 | 2 | 4 | 2 |" in (tmp_path / "megatron_layouts.md").read_text()


def test_pipeline_split_with_a_two_rank_megatron_learner(tmp_path):
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(
        "import os\nif os.environ.get('OFFPOLICY_TEST_CPU_SHIM') == '1':\n"
        "    from tests.megatron_cpu_shim import install\n    install()\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), str(ROOT)]), "OFFPOLICY_TEST_CPU_SHIM": "1"}
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "offpolicy.services.cli", "bench", "pipeline", "--out", str(out), "--steps", "5",
           "--warmup", "1", "--batch", "2", "--n", "2", "--new-tokens", "128", "--layers", "2", "--hidden", "128",
           "--mlp", "32", "--vocab", "2048", "--device", "cpu", "--dir", str(tmp_path / "runs"), "--staleness", "1",
           "--backend", "megatron", "--tp", "2", "--learner-gpus", "0", "1", "--rollout-gpus", "2"]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=420, env=env, cwd=ROOT)
    logs = tmp_path / "runs" / "s1" / "logs"
    detail = "".join(f"\n--- {f.name}\n" + f.read_text()[-2000:] for f in sorted(logs.glob("*.log"))) \
        if logs.exists() else ""
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:] + detail
    doc = json.loads((out / "pipeline.json").read_text())
    assert (doc["backend"], doc["tp"], doc["learner_gpus"], doc["rollout_gpus"]) == ("megatron", 2, [0, 1], ["2"])
    assert doc["runs"]["1"]["steps_logged"] == 5 and doc["runs"]["1"]["version_bytes"] > 0
    assert sorted(f.name for f in logs.glob("learner*.log")) == ["learner-r1.log", "learner.log"]
    assert "learner[r1]" in (logs / "learner-r1.log").read_text()
