"""benchmarks/fp8_engine.py (issue 53) runs end to end on the CPU with tiny shapes: its rows say which fp8 path each
engine took and why, and the scaled path's linears were fp8."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "fp8_engine.py"


def test_fp8_engine_benchmark_smoke_on_cpu(tmp_path):
    spec = importlib.util.spec_from_file_location("fp8_engine_bench", SCRIPT)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    out = tmp_path / "rows.jsonl"
    assert bench.main(["--device", "cpu", "--out", str(out), "--models", "llama"]) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    linear = [r for r in rows if r["part"] == "linear"]
    assert linear and all(r["err_vs_reference"] == 0.0 and 0 < r["err_vs_bf16"] < 0.1 for r in linear)
    engine = {r["versions"]: r for r in rows if r["part"] == "engine"}
    assert list(engine) == ["bf16", "fp8-dequantize", "fp8-scaled", "fp8-auto"]
    assert engine["fp8-scaled"]["fp8_plan"] == "scaled" and engine["fp8-scaled"]["fp8_linears"] == 14
    assert engine["fp8-auto"]["fp8_plan"] == "dequantize" and "cpu" in engine["fp8-auto"]["fp8_reason"]
    for r in engine.values():
        assert r["tokens_per_s"] > 0 and r.get("logprob_diff_mean", 0.0) < 0.1
