"""GPT-OSS on the megatron backend, one GPU (the tiny GPT-OSS step against the torch backend is in
test_megatron_gpu.py with the other families): the GPT-OSS-20B-shaped slice (hidden 2880, 64/8 heads, 32 experts top-4, FFN 2880, vocabulary 201088; 2 layers:
one sliding, one full) through benchmarks/megatron_learner.py: `offpolicy verify` figures, tokens/s, MFU on
active parameters, peak memory next to the memory.per_gpu estimate. The JSON line is printed for the record
(docs/megatron.md, "GPT-OSS")."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
              pytest.mark.usefixtures("fresh_parallel_state")]
pytest.importorskip("megatron.core", reason="megatron-core is not installed")

from tests.megatron_workers import free_port  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("layers,max_tokens", [(2, 4096)])
def test_gpt_oss_20b_slice_verify_and_throughput(layers, max_tokens):
    """About 60 GiB at 2 layers (H100 or H200); `--layers 4` needs an H200 (~90 GiB estimated)."""
    cmd = [sys.executable, str(ROOT / "benchmarks" / "megatron_learner.py"), "--arch", "gptoss-slice",
           "--layers", str(layers), "--verify", "--groups", "8", "--n", "8", "--prompt", "256", "--response", "768",
           "--max-tokens", str(max_tokens), "--steps", "3"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=1500, cwd=ROOT,
                         env={**os.environ, "MASTER_PORT": str(free_port())})
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-5000:]
    rows = [json.loads(line) for line in out.stdout.strip().splitlines() if line.startswith("{")]
    r, gathered = rows[0], rows[-1]  # the timed row (with the verify figures), then the gather row
    print(json.dumps(rows, indent=1))
    assert r["verify_ok"] and r["verify_top1"] == 1.0, r  # float32 tolerances (docs/megatron.md)
    assert "sliding window 128 on 1/2 layers (seq > window)" in r["verify_features"]
    assert r["tokens_per_s"] > 0 and 0 < r["mfu"] < 1 and r["loss"] == r["loss"]
    assert gathered["hf_tensors"] == 2 + layers * 17 + 1  # embed, lm_head, 17 per layer (fused experts), final norm
