"""Smoke tests of `offpolicy bench`: each benchmark runs at tiny sizes on the CPU through the CLI and
writes JSON with its fields and sane positive numbers, plus a markdown table. No timing targets."""

from __future__ import annotations

import json
import math

import pytest

from offpolicy.services.cli import main


def bench(tmp_path, name: str, *args: str) -> dict:
    assert main(["bench", name, "--out", str(tmp_path), *args]) == 0
    doc = json.loads((tmp_path / f"{name}.json").read_text())
    table = (tmp_path / f"{name}.md").read_text()
    assert doc["bench"] == name and doc["command"].startswith(f"offpolicy bench {name}")
    assert doc["machine"]["cores"] >= 1 and "cpu" in doc["machine"]
    assert "| --- |" in table and doc["command"] in table
    return doc


def positive(*xs: float) -> bool:
    return all(isinstance(x, (int, float)) and math.isfinite(x) and x > 0 for x in xs)


def test_transport_bench_reports_hub_and_raw_throughput_and_codec_costs(tmp_path):
    doc = bench(tmp_path, "transport", "--groups", "64", "--batch", "16", "--n", "4", "--tokens", "32",
                "--repeat", "1", "--transports", "ipc", "tcp")
    assert [r["transport"] for r in doc["runs"]] == ["ipc", "tcp"]
    for r in doc["runs"]:
        assert positive(r["raw_tokens_per_s"], r["hub_tokens_per_s"], r["ratio"], r["hub_groups_per_s"],
                        r["hub_receiver_cpu_us_per_group"], r["raw_sender_cpu_us_per_group"])
        assert r["ratio"] == pytest.approx(r["hub_tokens_per_s"] / r["raw_tokens_per_s"])
        cpu = [r[f"{p}_{s}_cpu_us_per_group"] for p in ("raw", "hub") for s in ("sender", "receiver")]
        assert r["cpu_ratio"] == pytest.approx((cpu[0] + cpu[1]) / (cpu[2] + cpu[3]))
    assert positive(*doc["costs"].values()) and set(doc["costs"]) == {
        "encode_s_per_mtok", "decode_s_per_mtok", "check_group_s_per_mtok"}


def test_transport_bench_refuses_groups_that_are_not_whole_batches(tmp_path):
    with pytest.raises(SystemExit, match="multiple of --batch"):
        main(["bench", "transport", "--out", str(tmp_path), "--groups", "10", "--batch", "4"])


def test_weights_bench_reports_publish_and_load_against_copies(tmp_path):
    doc = bench(tmp_path, "weights", "--sizes", "0.04", "--repeat", "1", "--device", "cpu",
                "--root", str(tmp_path / "store"))
    (row,) = doc["rows"]
    assert row["bytes"] > 0 and row["tensors"] >= 1
    assert positive(row["copy_out_gb_per_s"], row["copy_in_gb_per_s"], row["load_gb_per_s"], row["load_ratio"],
                    row["stall_seconds"], *row["fresh_shm_write_gb_per_s"].values())
    assert [p["mode"] for p in row["publish"]] == ["none", "sha256", "none+reuse", "none+reuse+maps",
                                                   "sha256+reuse+maps"]
    for p in row["publish"]:
        assert positive(p["gb_per_s"], p["ratio"], p["first_seconds"], *p["seconds"], p["mean_seconds"])
        assert p["path"] == "staged"  # no GPU: nothing is page-locked, '+maps' runs the staged path
        assert p["stages"]["publish.write"] > 0 and p["counts"]["files.staged"] > 0
        assert len(p["warm_seconds"]) == (6 if p["register_maps"] else 3 if p["reuse_files"] else 1)
    assert [x["mode"] for x in row["loads"]] == ["staged", "maps"]
    for x in row["loads"]:
        assert positive(x["gb_per_s"], x["ratio"], x["seconds"]) and x["path"] == "staged"
        assert x["stages"]["load.read"] > 0
    assert row["load_ratio"] == row["loads"][0]["ratio"]
    assert not (tmp_path / "store").exists() or not any((tmp_path / "store").iterdir())  # cleaned up


def test_rollout_bench_compares_the_engine_with_transformers_generate(tmp_path):
    doc = bench(tmp_path, "rollout", "--prompts", "2", "--n", "2", "--new-tokens", "6", "--layers", "1",
                "--hidden", "64", "--mlp", "64", "--vocab", "64", "--repeat", "1", "--device", "cpu")
    assert doc["rows"] == 4 and doc["params"] > 0
    assert set(doc["results"]) == {"generate", "engine", "engine_static"}
    for r in doc["results"].values():
        assert positive(r["tokens_per_s"], r["seconds"], r["speedup_vs_generate"], r["tokens"])
    assert doc["results"]["generate"]["tokens"] == 4 * 6


TINY = ["--prompts", "2", "--n", "2", "--new-tokens", "6", "--prompt-len", "4:8", "--layers", "1", "--hidden", "64",
        "--mlp", "64", "--vocab", "64", "--versions", "2", "--repeat", "1", "--device", "cpu"]


def check_engines(doc: dict, names: list[str]) -> None:
    """The --engines result: every engine measured on all its calls and versions, ratios against torch."""
    assert doc["mode"] == "engines" and list(doc["results"]) == names and doc["rows"] == 4
    for r in doc["results"].values():
        assert len(r["calls"]) == 2 and len(r["swaps"]) == 2  # --versions 2 x --repeat 1
        assert positive(r["tokens_per_s"], r["seconds"], r["swap_seconds"], r["warmup_seconds"], *r["swaps"],
                        *r["calls"], r["tokens_per_s_vs_torch"], r["swap_s_vs_torch"])
        assert all(4 <= n <= 4 * 6 for n in r["call_tokens"])  # every sample made 1..max_new_tokens tokens
    assert doc["results"]["torch"]["tokens_per_s_vs_torch"] == 1.0


def test_rollout_bench_compares_engines_on_the_same_prompts_and_versions(tmp_path):
    doc = bench(tmp_path, "rollout", "--engines", "torch", "hf", "--root", str(tmp_path / "store"), *TINY)
    check_engines(doc, ["torch", "hf"])
    assert not (tmp_path / "store").exists()  # the versions are removed afterwards
    assert "| transformers generate |" in (tmp_path / "rollout.md").read_text()


@pytest.mark.slow  # ~30 s of real daemons; test_bench_pipeline checks the split and the figures
def test_pipeline_bench_runs_both_staleness_settings_with_real_daemons(tmp_path):
    # long enough (seconds of generation a run: with 2048 tokens EOS is rare, so responses run to 128)
    # for the rollouts' /metrics to be scraped while they generate
    doc = bench(tmp_path, "pipeline", "--steps", "6", "--warmup", "1", "--batch", "2", "--n", "2",
                "--new-tokens", "128", "--layers", "1", "--hidden", "32", "--mlp", "32", "--vocab", "2048",
                "--device", "cpu", "--dir", str(tmp_path / "runs"))
    assert set(doc["runs"]) == {"0", "1"} and doc["learner_device"] == "cpu"
    for r in doc["runs"].values():
        assert r["steps_logged"] == 6
        assert positive(r["step_s"], r["gen_s"], r["train_s"], r["publish_s"], r["load_s"], r["tokens_per_s"])
    assert positive(doc["overlap_efficiency"], doc["speedup"])


def test_weights_bench_measures_low_bit_formats_on_gpt_oss_shaped_layers(tmp_path):
    doc = bench(tmp_path, "weights", "--sizes", "0.11", "--repeat", "1", "--device", "cpu", "--modes", "none",
                "--formats", "fp8", "mxfp4", "--shape", "gpt_oss", "--experts", "1", "--format-mode", "none",
                "--root", str(tmp_path / "store"))
    (row,) = doc["rows"]
    assert doc["shape"] == "gpt_oss"  # one layer of 1 expert (~0.1 GB)
    native, fp8, mxfp4 = row["formats"]
    assert [native["format"], fp8["format"], mxfp4["format"]] == ["native", "fp8", "mxfp4"]
    assert native["bytes"] == row["bytes"] and native["bytes_ratio"] == 1.0
    assert mxfp4["bytes"] < fp8["bytes"] < native["bytes"]  # experts at ~4.25 bits beat fp8's attention-only savings
    for x in (native, fp8, mxfp4):
        assert positive(x["publish_seconds"], x["copy_seconds"], x["ratio"], x["load_seconds"], x["gb_per_s"])
    assert positive(fp8["quantize_seconds"], mxfp4["quantize_seconds"]) and native["quantize_seconds"] == 0
    with pytest.raises(SystemExit, match="--shape gpt_oss"):
        main(["bench", "weights", "--out", str(tmp_path), "--formats", "mxfp4", "--device", "cpu"])
