"""benchmarks/fp8_engine.py (issue 53) runs end to end on the CPU with tiny shapes: its rows say which fp8 path each
engine took and why, and the scaled path's linears were fp8; each row breaks its load down into stages, and a last
row times the bf16 engine again (then, for GPT-OSS, the mxfp4 and bf16 engines with each other's versions), and a
summary row gives each version over the faster and the mean bf16 row."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "fp8_engine.py"


def run(tmp_path, *args: str) -> list[dict]:
    spec = importlib.util.spec_from_file_location("fp8_engine_bench", SCRIPT)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    out = tmp_path / "rows.jsonl"
    assert bench.main(["--device", "cpu", "--out", str(out), *args]) == 0
    return [json.loads(line) for line in out.read_text().splitlines()]


def test_fp8_engine_benchmark_smoke_on_cpu(tmp_path):
    rows = run(tmp_path, "--models", "llama")
    linear = [r for r in rows if r["part"] == "linear"]
    assert linear and all(r["err_vs_reference"] == 0.0 and 0 < r["err_vs_bf16"] < 0.1 for r in linear)
    engine = {r["versions"]: r for r in rows if r["part"] == "engine"}
    assert list(engine) == ["bf16", "fp8-dequantize", "fp8-scaled", "fp8-auto", "bf16-again"]
    assert engine["fp8-scaled"]["fp8_plan"] == "scaled" and engine["fp8-scaled"]["fp8_linears"] == 14
    assert engine["fp8-auto"]["fp8_plan"] == "dequantize" and "cpu" in engine["fp8-auto"]["fp8_reason"]
    for r in engine.values():
        assert r["tokens_per_s"] > 0 and r.get("logprob_diff_mean", 0.0) < 0.1
        assert 0 < r["tokens"] <= r["rows"] * r["new_tokens"] and r["threads"] >= 1
    for label in ("bf16", "fp8-dequantize", "fp8-scaled", "fp8-auto"):
        assert engine[label]["load_s"] > 0 and engine[label]["reload_s"] > 0 and "load.read" in engine[label]["load_stages"]
    assert "lowbit.dequantize" in engine["fp8-dequantize"]["load_stages"]
    assert "lowbit.dequantize" not in engine["fp8-scaled"]["load_stages"]  # its fp8 bytes go in as they are


def test_fp8_engine_benchmark_breaks_the_mxfp4_load_down_on_cpu(tmp_path):
    rows = run(tmp_path, "--models", "gptoss", "--parts", "engine")
    mx = next(r for r in rows if r.get("versions") == "mxfp4")
    assert mx["fp8_plan"] == "dequantize" and mx["tokens_per_s"] > 0 and mx["logprob_diff_mean"] > 0
    assert {"lowbit.plan", "load.read", "lowbit.dequantize"} <= set(mx["load_stages"])
    engine = {r["versions"]: r for r in rows if r["part"] == "engine"}
    assert list(engine)[-3:] == ["bf16-again", "mxfp4-engine-bf16-values", "bf16-engine-mxfp4-values"]
    for r in engine.values():  # milliseconds per decode step: tokens/s also falls when responses stop early
        assert 1 <= r["steps"] <= r["new_tokens"] and r["step_ms"] > 0
    # the swapped controls: the bf16 engine sampling with the mxfp4 values gives the mxfp4 engine's tokens, and back
    assert engine["bf16-engine-mxfp4-values"]["tokens"] == mx["tokens"]
    assert engine["mxfp4-engine-bf16-values"]["tokens"] == engine["bf16"]["tokens"]
    summary = rows[-1]  # each version over the faster / the mean bf16 measurement, and the drift between them
    assert summary["part"] == "summary" and summary["bf16_drift"] == engine["bf16-again"]["vs_bf16"]
    assert set(summary["vs_bf16_best"]) == {"fp8-dequantize", "fp8-scaled", "fp8-auto", "mxfp4"}
    best = max(1.0, summary["bf16_drift"])
    assert abs(summary["vs_bf16_best"]["mxfp4"] * best - mx["vs_bf16"]) < 1e-9
