"""GPU placement of `offpolicy run` (run.learner_gpus / run.rollout_gpus) and the pipeline bench's split
options: the config checks, the CUDA_VISIBLE_DEVICES and rank environment every spawned daemon gets,
and the bench recording where the daemons ran. All on the CPU: the GPU lists only set environment."""

from __future__ import annotations

import argparse
import json
import math
import subprocess
from pathlib import Path

import pytest

from offpolicy.bench import pipeline, pipeline_table
from offpolicy.config import ConfigError, load_config
from offpolicy.launch import run as launcher_mod
from offpolicy.services.cli import main

LLAMA = ["model.arch.model_type=llama"]


def cfg(*overrides: str):
    return load_config(None, [*LLAMA, *overrides])


def test_gpu_lists_parse_and_bad_ones_name_the_field():
    c = cfg("run.learner_gpus=[0]", 'run.rollout_gpus=[1, "2,3"]')
    assert c.run.learner_gpus == [0] and c.run.rollout_gpus == [1, "2,3"]
    assert cfg().run.learner_gpus == [] and cfg().run.rollout_gpus == []
    bad = {("run.learner_gpus=[0, 1]",): "learner.backend=torch uses one",
           ("run.learner_gpus=[0, 0]", "learner.backend=megatron"): "lists a GPU twice",
           ("run.learner_gpus=[-1]",): "negative",
           ('run.rollout_gpus=["1;2"]',): "run.rollout_gpus",
           ("run.learner_gpus=[0]", "learner.device=cuda:1"): "learner.device",
           ("run.rollout_gpus=[1]", "rollout.device=cuda:1"): "rollout.device",
           ("run.learner_gpus=[0, 1, 2]", "learner.backend=megatron", "learner.megatron.tp=2"): "tp x pp x cp = 2"}
    for overrides, message in bad.items():
        with pytest.raises(ConfigError, match=message.replace(".", r"\.").replace("(", r"\(")):
            cfg(*overrides)
    cfg("run.learner_gpus=[0, 1]", "learner.backend=megatron", "learner.megatron.tp=2")  # fine
    cfg("run.learner_gpus=[0]", "learner.device=cpu", "run.rollout_gpus=[1]", "rollout.device=cuda:0")  # fine


def test_placement_sets_cuda_visible_devices_per_daemon():
    daemons = launcher_mod.placement(cfg("run.rollouts=3", "run.learner_gpus=[0]", 'run.rollout_gpus=[1, "2,3"]'),
                                     environ={})
    assert [(n, m.rsplit(".", 1)[1]) for n, m, _, _ in daemons] == [
        ("learner", "learner"), ("rollout-0", "rollout"), ("rollout-1", "rollout"), ("rollout-2", "rollout")]
    env = {n: e for n, _, _, e in daemons}
    assert env == {"learner": {"CUDA_VISIBLE_DEVICES": "0"}, "rollout-0": {"CUDA_VISIBLE_DEVICES": "1"},
                   "rollout-1": {"CUDA_VISIBLE_DEVICES": "2,3"}, "rollout-2": {"CUDA_VISIBLE_DEVICES": "1"}}
    assert [x for n, _, x, _ in daemons if n == "rollout-2"] == [["--index", "2"]]
    # nothing given: every daemon inherits the launcher's GPUs, as before
    assert all(e == {} for _, _, _, e in launcher_mod.placement(cfg(), environ={}))


def test_placement_counts_within_the_launchers_own_visible_devices():
    c = cfg("run.rollouts=2", "run.learner_gpus=[0]", "run.rollout_gpus=[1, 3]")
    env = {n: e for n, _, _, e in launcher_mod.placement(c, environ={"CUDA_VISIBLE_DEVICES": "4,5,6,7"})}
    assert env["learner"]["CUDA_VISIBLE_DEVICES"] == "4" and env["rollout-1"]["CUDA_VISIBLE_DEVICES"] == "7"
    with pytest.raises(ValueError, match="GPU 3 but the launcher sees only 2"):
        launcher_mod.placement(c, environ={"CUDA_VISIBLE_DEVICES": "4,5"})


def test_sglang_servers_are_dealt_out_so_that_each_rollout_daemon_drives_its_own():
    urls = [f"http://127.0.0.1:{30000 + j}" for j in range(5)]
    sgl = ["rollout.engine=sglang", "rollout.sglang.mode=http", f"rollout.sglang.urls=[{', '.join(urls)}]"]
    daemons = launcher_mod.placement(cfg("run.rollouts=2", *sgl), environ={})
    given = {n: next(a for a in x if a.startswith("rollout.sglang.urls=")) for n, _, x, _ in daemons
             if n.startswith("rollout-")}
    assert given == {"rollout-0": f"rollout.sglang.urls=[{urls[0]}, {urls[2]}, {urls[4]}]",
                     "rollout-1": f"rollout.sglang.urls=[{urls[1]}, {urls[3]}]"}
    assert all("rollout.sglang.urls" not in " ".join(x) for _, _, x, _ in
               launcher_mod.placement(cfg("run.rollouts=1", *sgl), environ={}))  # one daemon: the list as it is
    with pytest.raises(ValueError, match="rollout.sglang.urls lists 5 SGLang server.* for run.rollouts=6"):
        launcher_mod.placement(cfg("run.rollouts=6", *sgl), environ={})


def test_megatron_learner_gets_one_rank_per_gpu():
    c = cfg("run.rollouts=1", "learner.backend=megatron", "learner.megatron.tp=2", "run.learner_gpus=[2, 3]",
            "run.rollout_gpus=[0]")
    daemons = launcher_mod.placement(c, environ={})
    assert [n for n, *_ in daemons] == ["learner", "learner-r1", "rollout-0"]
    env = {n: e for n, _, _, e in daemons}
    assert env["learner"] == dict(CUDA_VISIBLE_DEVICES="2,3", RANK="0", WORLD_SIZE="2", LOCAL_RANK="0")
    assert env["learner-r1"] == dict(CUDA_VISIBLE_DEVICES="2,3", RANK="1", WORLD_SIZE="2", LOCAL_RANK="1")
    assert env["rollout-0"] == {"CUDA_VISIBLE_DEVICES": "0"}
    # one learner GPU: a single process, no rank environment
    one = launcher_mod.placement(cfg("learner.backend=megatron", "run.learner_gpus=[1]"), environ={})
    assert one[0] == ("learner", "offpolicy.services.learner", [], {"CUDA_VISIBLE_DEVICES": "1"})


def test_launcher_spawns_daemons_with_their_gpus(tmp_path, monkeypatch):
    spawned = []  # (command, environment) of every Popen

    class FakePopen:
        def __init__(self, cmd, env=None, **kw):
            if "offpolicy.launch.reaper" not in cmd:  # the launcher's orphan reaper (offpolicy/launch/reaper.py)
                spawned.append((cmd, env))
            self.returncode, self.pid, self.stdin = 0, 4711, None

        def poll(self):
            return 0

    monkeypatch.setattr(subprocess, "Popen", FakePopen)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,4")
    overrides = [*LLAMA, f"run.dir={tmp_path}", "run.rollouts=2", "learner.backend=megatron",
                 "run.learner_gpus=[0, 1]", "run.rollout_gpus=[1, 0]"]
    launcher = launcher_mod.Launcher(None, overrides, load_config(None, overrides), resume=True)
    launcher.start()
    assert list(launcher.procs) == ["learner", "learner-r1", "rollout-0", "rollout-1"]
    (c0, e0), (c1, e1), (r0, f0), (r1, f1) = spawned
    assert c0[1:3] == c1[1:3] == ["-m", "offpolicy.services.learner"] and c0[-1] == c1[-1] == "--resume"
    assert (e0["RANK"], e1["RANK"], e0["WORLD_SIZE"], e1["LOCAL_RANK"]) == ("0", "1", "2", "1")
    assert e0["CUDA_VISIBLE_DEVICES"] == e1["CUDA_VISIBLE_DEVICES"] == "3,4"  # indices count within the parent's
    assert r0[-2:] == ["--index", "0"] and f0["CUDA_VISIBLE_DEVICES"] == "4"
    assert r1[-2:] == ["--index", "1"] and f1["CUDA_VISIBLE_DEVICES"] == "3"
    assert f1["PATH"] and "RANK" not in f1  # the rest of the environment, and no rank for a rollout


def test_pipeline_split_defaults_and_options():
    p = argparse.ArgumentParser()
    pipeline.add_arguments(p)
    parse = p.parse_args
    assert pipeline.split(parse([]), gpus=0) == ([], [])
    assert pipeline.split(parse([]), gpus=1) == ([], [])
    assert pipeline.split(parse([]), gpus=2) == ([0], ["1"])
    assert pipeline.split(parse([]), gpus=4) == ([0], ["1", "2", "3"])
    assert pipeline.split(parse(["--learner-gpus", "0", "1", "--rollout-gpus", "2,3"]), gpus=4) == ([0, 1], ["2,3"])
    assert pipeline.split(parse(["--rollout-gpus", "1"]), gpus=2) == ([], ["1"])
    assert pipeline.split(parse(["--learner-gpus", "1"]), gpus=2) == ([1], [])
    a = parse(["--backend", "megatron", "--tp", "2", "--set", "learner.lr=1e-6", "--set", "algo.clip_ratio_c=4"])
    assert (a.backend, a.tp, a.overrides) == ("megatron", 2, ["learner.lr=1e-6", "algo.clip_ratio_c=4"])


def test_pipeline_bench_records_the_split(tmp_path):
    """--learner-gpus/--rollout-gpus reach the daemons (CUDA_VISIBLE_DEVICES; on the CPU they run anyway)
    and the JSON and the table say where they ran; --set overrides reach the run."""
    assert main(["bench", "pipeline", "--out", str(tmp_path), "--steps", "4", "--warmup", "1", "--batch", "2",
                 "--n", "2", "--new-tokens", "128", "--layers", "1", "--hidden", "32", "--mlp", "32", "--vocab",
                 "2048", "--device", "cpu", "--dir", str(tmp_path / "runs"), "--staleness", "1",
                 "--learner-gpus", "0", "--rollout-gpus", "1", "--set", "learner.lr=2e-5", "--trace"]) == 0
    doc = json.loads((tmp_path / "pipeline.json").read_text())
    assert (doc["learner_gpus"], doc["rollout_gpus"], doc["backend"]) == ([0], ["1"], "torch")
    assert doc["overrides"] == ["learner.lr=2e-5"] and set(doc["runs"]) == {"1"}
    assert doc["runs"]["1"]["steps_logged"] == 4 and doc["runs"]["1"]["version_bytes"] > 0
    assert "rollouts on cpu (GPUs given: 1)" in (tmp_path / "pipeline.md").read_text()
    assert "  lr: 2.0e-05" in (tmp_path / "runs" / "s1" / "config.yaml").read_text()  # --set came after the defaults
    assert not (tmp_path / "runs" / "s1" / "checkpoints").exists()  # checkpoint.final=false: no minute-long save at the end
    run = doc["runs"]["1"]  # summary.json's count; the embedded engine counts no server loads
    assert (doc["engine"], run["prompts_lost"], run["prompts_duplicated"], run["loads_proven"]) == ("torch", 0, 0, 0)
    assert "| torch | 1 |" in (tmp_path / "pipeline.md").read_text()
    trace = json.loads((tmp_path / "pipeline-s1.trace.json").read_text())["traceEvents"]  # --trace: the run's timeline
    spans = {(e["pid"], e["name"]) for e in trace if e["ph"] == "X"}
    assert {name for _, name in spans} >= {"train", "publish", "receive", "generate", "load", "score and send"}
    assert {pid for pid, name in spans if name == "generate"} != {pid for pid, name in spans if name == "train"}
    assert (tmp_path / "pipeline-s1.timeline.png").stat().st_size > 10_000


def test_server_loads_are_counted_by_proof_and_shown_with_the_engine():
    """The rollouts' `offpolicy_weight_loads_total{method, proven}` (one per server and version) summed over
    their labels and rollouts; the table names the engine and its versions' format, and lost / dup."""
    text = """# TYPE offpolicy_weight_loads_total counter
offpolicy_weight_loads_total{method="inplace",proven="true"} 7.0
offpolicy_weight_loads_total{method="rebuild",proven="true"} 2.0
offpolicy_weight_loads_total{method="inplace",proven="false"} 1.0
offpolicy_generate_seconds_sum 3.5
offpolicy_generate_seconds_count 4.0
"""
    got = pipeline._samples(text)
    assert float(got["loads_proven"]) == 9 and float(got["loads_unproven"]) == 1
    late = pipeline._samples("offpolicy_generate_seconds_count 1.0\n")  # a last scrape that counted no load
    audit = pipeline._audit(Path("/nonexistent"), [(5, got), (6, late)])
    assert (audit["loads_proven"], audit["loads_unproven"], audit["loads"]) == (9, 1, 0)
    assert got["offpolicy_generate_seconds_count"] == "4.0"
    r = {"step_s": 1.0, "gen_s": 0.5, "load_s": 0.01, "gen_busy_s": 0.5, "stall_s": 0.01, "train_s": 0.4,
         "publish_s": 0.2, "wait_s": 0.1, "tokens_per_s": 100.0, "steps_logged": 6, "loads_proven": 9,
         "loads_unproven": 1, "prompts_lost": 0, "prompts_duplicated": 0}
    text = pipeline.table({"engine": "vllm", "weights_format": "fp8", "learner_device": "cuda",
                           "rollout_device": "cuda", "static_cache": False, "rows_per_step": 8, "new_tokens": 4,
                           "warmup": 2, "steps": 10, "runs": {"1": r}})
    assert "| engine | max_staleness |" in text and "| vllm fp8 | 1 | 1.000 |" in text
    assert text.splitlines()[4].endswith("| 0 / 0 | 9 of 10 |")
    embedded = {**r, "loads_proven": 0, "loads_unproven": 0, "loads": 28}  # the torch engine: 4 rollouts x 7 versions
    text = pipeline.table({"engine": "torch", "learner_device": "cuda", "rollout_device": "cuda", "static_cache": False,
                           "rows_per_step": 8, "new_tokens": 4, "warmup": 2, "steps": 10, "runs": {"1": embedded}})
    assert text.splitlines()[4].endswith("| 0 / 0 | 28 loads (embedded: not proven) |")


def test_a_run_that_failed_says_why_in_its_row():
    """A rollout that died says so on its first line and why on the traceback's last (two H200s: a row read only
    "['rollout-0'] failed:"); a one-line error stays as it is."""
    died = ("['rollout-0'] failed:\nTraceback (most recent call last):\n  File \"x.py\", line 1, in load\n"
            "offpolicy.rollout.engines.errors.WeightUpdateError: after loading weight version 1 the fingerprints of "
            "SGLang's tensors are not the version's: model.layers.0.self_attn\n")
    assert pipeline_table.error_summary(died) == (
        "['rollout-0'] failed: offpolicy.rollout.engines.errors.WeightUpdateError: after loading weight version 1 the "
        "fingerprints of SGLang's tensors are not the version's: model.layers.0.self_attn")
    assert pipeline_table.error_summary("pipeline run s1 took over 60 s\nmore") == "pipeline run s1 took over 60 s"
    assert pipeline_table.error_summary("  ") == "failed"
    text = pipeline.table({"engine": "sglang", "learner_device": "cuda", "rollout_device": "cuda",
                           "static_cache": False, "rows_per_step": 8, "new_tokens": 4, "warmup": 2, "steps": 10,
                           "runs": {"1": {"error": died}}})
    assert "| sglang | 1 | failed: ['rollout-0'] failed: offpolicy.rollout.engines.errors.WeightUpdateError: " in text


def test_a_run_that_learned_nothing_is_said_under_the_table(tmp_path):
    """A random GPT-OSS slice scores 0 on every response (the H200's SGLang run: grad_norm 0 at every step, each
    version the last one's values, so SGLang proved 1 load of 7): the table says so under that run, and only there."""
    steps = [dict(time=float(i), tokens=100, train_seconds=0.3, publish_seconds=0.5, waited_seconds=0.1,
                  grad_norm=0.0 if i < 20 else 0.5) for i in range(30)]
    snaps = [(n, {"offpolicy_generate_seconds_count": n, "offpolicy_generate_seconds_sum": 0.5 * n,
                  "offpolicy_weight_load_seconds_count": n, "offpolicy_weight_load_seconds_sum": 0.1 * n})
             for n in range(1, 31)]
    args = argparse.Namespace(warmup=2, rollouts=1)
    still, moving = (pipeline._reduce(steps[:10], snaps[:10], args, tmp_path),
                     pipeline._reduce(steps[20:], snaps[20:], args, tmp_path))
    assert still["grad_norm"] == 0.0 and moving["grad_norm"] == 0.5
    no_key = pipeline._reduce([{k: v for k, v in s.items() if k != "grad_norm"} for s in steps[:10]], snaps[:10],
                              args, tmp_path)
    assert math.isnan(no_key["grad_norm"])  # a learner that logs none: nothing said
    text = pipeline.table({"learner_device": "cpu", "rollout_device": "cpu", "static_cache": False,
                           "rows_per_step": 8, "new_tokens": 4, "warmup": 2, "steps": 10,
                           "runs": {"0": {**still, "tokens_per_s": 1.0}, "1": {**moving, "tokens_per_s": 1.0},
                                    "2": {**no_key, "tokens_per_s": 1.0}}})
    assert text.count("gradient was 0 at every step") == 1 and "staleness 0: the learner's gradient" in text
    assert "algo.entropy_coef" in text


def test_overlap_with_two_rollouts_counts_generation_per_step_and_rollout(tmp_path):
    """Two rollouts generate side by side, each a whole batch per call in 0.9 s while a step takes 1.0 s:
    a call's time is not a step's share (max(T_gen, T_train) / T_step would be 1.8 here, as 1.13 was
    reported on the GPU); G = all generate seconds / rollouts / steps is, and the learner's stall per
    version comes from metrics.jsonl."""
    steps = [dict(time=float(i), tokens=100, train_seconds=0.3, publish_seconds=0.5, waited_seconds=0.1,
                  publish_stall_seconds=0.02) for i in range(10)]
    # every step both rollouts generate once for 0.9 s: calls and seconds grow by 2 and 1.8 a step
    snaps = [(n, {"offpolicy_generate_seconds_count": 2.0 * n, "offpolicy_generate_seconds_sum": 1.8 * n,
                  "offpolicy_weight_load_seconds_count": 2.0 * n, "offpolicy_weight_load_seconds_sum": 0.2 * n})
             for n in range(1, 11)]
    args = argparse.Namespace(warmup=2, rollouts=2)
    r = pipeline._reduce(steps, snaps, args, tmp_path)
    assert r["gen_s"] == pytest.approx(0.9) and r["gen_busy_s"] == pytest.approx(0.9)
    assert r["step_s"] == pytest.approx(1.0) and r["stall_s"] == pytest.approx(0.02) and r["publish_s"] == 0.5
    args = argparse.Namespace(warmup=2, rollouts=4)  # the same seconds over four rollouts: each busy 0.45 s a step
    assert pipeline._reduce(steps, snaps, args, tmp_path)["gen_busy_s"] == pytest.approx(0.45)
    # the learner then checkpoints for a minute while the rollouts generate two batches ahead (steps never
    # taken): scrapes after the last step leave G as it was (on the GPU they had made it 1.16 x T_step)
    ahead = [(10, {k: v + (3.6 if k == "offpolicy_generate_seconds_sum" else 4.0 if "generate" in k else 0)
                   for k, v in snaps[-1][1].items()}) for _ in range(3)]
    args = argparse.Namespace(warmup=2, rollouts=2)
    assert pipeline._reduce(steps, snaps + ahead, args, tmp_path)["gen_busy_s"] == pytest.approx(0.9)
    one = {**r, "tokens_per_s": 100.0}
    text = pipeline.table({"learner_device": "cpu", "rollout_device": "cpu", "static_cache": False,
                           "rows_per_step": 8, "new_tokens": 4, "warmup": 2, "steps": 10,
                           "runs": {"1": one}, **pipeline.speedups({"1": one})})
    assert "learner stall s (per version)" in text and "max(G, T_train) / T_step = 0.90" in text
    zero = {**r, "step_s": 1.49, "tokens_per_s": 67.0}
    runs = {"0": zero, "1": one}
    two = pipeline.table({"learner_device": "cpu", "rollout_device": "cpu", "static_cache": False, "rows_per_step": 8,
                          "new_tokens": 4, "warmup": 2, "steps": 10, "runs": runs, **pipeline.speedups(runs)})
    assert "speed-up of staleness 1 over 0: 1.49x (at most 1.66x for this workload" in two
    assert "T_step >= 0.745 s" in two and "above its bound" not in two
    # SGLang, two H200s (nineteenth session): G 1.683 s at staleness 0, 0.637 s at 1: 2.09x against a bound of 2
    fast = {**one, "step_s": 2.310, "gen_busy_s": 0.637, "train_s": 0.544, "publish_s": 0.917, "load_s": 1.541}
    slow = {**zero, "step_s": 4.825, "gen_busy_s": 1.683, "train_s": 0.543, "publish_s": 0.807, "load_s": 1.555}
    runs = {"0": slow, "1": fast}
    above = pipeline.table({"learner_device": "cuda", "rollout_device": "cuda", "static_cache": False,
                            "rows_per_step": 8, "new_tokens": 4, "warmup": 2, "steps": 10, "runs": runs,
                            **pipeline.speedups(runs)})
    assert "speed-up of staleness 1 over 0: 2.09x (at most 2.00x" in above
    assert ("the speed-up of staleness 1 is above its bound: parts of the chain ran faster than in the staleness-0 "
            "run (G 1.683 s at staleness 0, 0.637 s at 1)") in above


def test_speed_up_at_staleness_k_is_bounded_by_k_plus_one_and_by_the_longer_side():
    """The bound the bench prints: staleness 0's step over max(G, T_train), and never above k + 1 (the chain publish
    -> load -> generate -> train is staleness 0's whole step, and k + 1 steps at staleness k hold it at least once)."""
    run = lambda step, gen, train: {"step_s": step, "gen_busy_s": gen, "train_s": train}  # noqa: E731
    # GPT-OSS slice, 2 + 2, eleventh session: staleness 0 1.839 s; at 1 1.005 s with G 0.247, T_train 0.263
    out = pipeline.speedups({"0": run(1.839, 0.186, 0.179), "1": run(1.005, 0.247, 0.263),
                             "2": run(0.70, 0.25, 0.26)})
    one, two = out["by_staleness"]["1"], out["by_staleness"]["2"]
    assert one["bound"] == 2 and two["bound"] == 3  # 1.839 / 0.263 = 6.99: the chain, not the sides, binds
    assert one["speedup"] == pytest.approx(1.83, abs=0.01) and one["chain_s"] == pytest.approx(0.9195)
    assert two["chain_s"] == pytest.approx(0.613) and two["overlap"] == pytest.approx(0.26 / 0.70)
    assert out["speedup"] == one["speedup"] and out["speedup_bound"] == 2 and out["overlap_efficiency"] == one["overlap"]
    # the 1.2B dense model on 1 + 1 GPUs: the longer side binds before the chain does
    assert pipeline.speedups({"0": run(1.0, 0.5, 0.54), "1": run(0.55, 0.5, 0.54)})["speedup_bound"] == \
        pytest.approx(1.0 / 0.54)
    nan = pipeline.speedups({"0": run(1.0, 0.5, 0.5), "1": run(0.6, math.nan, 0.5)})["by_staleness"]["1"]
    assert "overlap" not in nan and "bound" not in nan and nan["speedup"] == pytest.approx(1 / 0.6)
    assert pipeline.speedups({"1": run(0.6, 0.5, 0.5)}) == {"by_staleness": {"1": {"overlap": 0.5 / 0.6}},
                                                            "overlap_efficiency": 0.5 / 0.6}


def test_a_run_whose_rollouts_no_scrape_saw_generate_keeps_the_learners_figures(tmp_path):
    """A run over before a scrape caught the rollouts after they generated (a tiny model on a loaded CPU: the
    rollouts leave on the learner's goodbye) reports its learner figures and NaN for what only the rollouts'
    histograms give, naming them, instead of failing; so does a run whose rollouts never answered."""
    steps = [dict(time=float(i), tokens=100, train_seconds=0.3, publish_seconds=0.5, waited_seconds=0.1)
             for i in range(6)]
    before = [(n, {"offpolicy_weight_load_seconds_count": 1.0, "offpolicy_weight_load_seconds_sum": 0.1})
              for n in range(3)]  # answered early, then never again: no generate seen
    args = argparse.Namespace(warmup=2, rollouts=1)
    for snaps in (before, []):
        r = pipeline._reduce(steps, snaps, args, tmp_path)
        assert r["step_s"] == 1.0 and r["train_s"] == pytest.approx(0.3) and r["tokens_per_s"] == pytest.approx(100)
        assert math.isnan(r["gen_s"]) and math.isnan(r["gen_busy_s"]) and "generate" in r["unscraped"]
    assert pipeline._reduce(steps, before, args, tmp_path)["load_s"] == pytest.approx(0.1)


def test_a_run_over_its_timeout_reports_the_steps_it_made_or_says_how_many(tmp_path, capsys):
    """A run cut by --timeout is stopped (its daemons too) and reports its figures over the steps it logged,
    marked timed out; with too few steps for a figure, the error names the steps logged and the fix."""
    timeout = 15  # 3 steps needed; on 2 cores a run logs hundreds in 15 s (389 idle, 532 beside 2 busy loops)
    argv = ["bench", "pipeline", "--out", str(tmp_path), "--steps", "100000", "--warmup", "1", "--batch", "2",
            "--n", "2", "--new-tokens", "8", "--layers", "1", "--hidden", "32", "--mlp", "32", "--vocab", "2048",
            "--device", "cpu", "--dir", str(tmp_path / "runs"), "--staleness", "1", "--timeout", str(timeout)]
    code = main(argv)
    run = json.loads((tmp_path / "pipeline.json").read_text())["runs"]["1"]
    if "error" in run:  # a machine too loaded to start the daemons and log 3 steps in time: said, and exit 1
        assert code == 1 and "steps logged" in run["error"] and "--timeout" in run["error"]
        assert f"| torch | 1 | failed: pipeline run s1 took over {timeout} s" in (tmp_path / "pipeline.md").read_text()
        return
    assert code == 0
    assert run["timed_out"] and 3 <= run["steps_logged"] < 100000 and run["tokens_per_s"] > 0
    assert "(timed out:" in (tmp_path / "pipeline.md").read_text()
    assert f"over --timeout {timeout} s" in capsys.readouterr().err


def test_a_failed_run_is_reported_and_the_others_still_count(tmp_path, monkeypatch, capsys):
    """One staleness setting's run failing (here: its rollouts' histograms never scraped) costs only its own
    row: the other run's figures are written, the table says which failed and why, and the bench exits 1."""
    good = {"step_s": 1.0, "gen_s": 0.5, "load_s": 0.01, "gen_busy_s": 0.5, "stall_s": 0.01, "train_s": 0.4,
            "publish_s": 0.2, "wait_s": 0.1, "tokens_per_s": 100.0, "steps_logged": 6, "version_bytes": 1000}

    def one_run(overrides, args, name, servers=None):
        if name == "s1":
            raise RuntimeError("runs/s1: the rollouts observed no generate")
        return dict(good)

    monkeypatch.setattr(pipeline, "_one_run", one_run)
    argv = ["bench", "pipeline", "--out", str(tmp_path), "--device", "cpu", "--dir", str(tmp_path / "runs")]
    assert main(argv) == 1
    doc = json.loads((tmp_path / "pipeline.json").read_text())
    assert doc["runs"]["0"]["step_s"] == 1.0 and "observed no generate" in doc["runs"]["1"]["error"]
    md = (tmp_path / "pipeline.md").read_text()
    assert "| torch | 1 | failed: runs/s1: the rollouts observed no generate |" in md and "speed-up" not in md
    assert "pipeline run s1 failed" in capsys.readouterr().err


def test_warmup_auto_waits_for_the_recycled_files_on_a_gpu():
    from offpolicy.bench.pipeline import warmup_steps

    assert warmup_steps("auto", False, []) == 3  # CPU: fresh files every version
    assert warmup_steps("auto", True, []) == 10  # keep 3: a ring of 5 versions' files, each seen twice
    assert warmup_steps("auto", True, ["weights.keep=1", "weights.keep=2"]) == 8  # the last override wins
    assert warmup_steps("5", True, []) == 5


def test_a_steps_batch_is_split_over_the_rollouts_leases():
    """At max_staleness 1 only one step's batch can be generated at a time (the next one needs the version this step
    makes): a lease of the whole batch would leave every rollout but one waiting, so each takes batch / rollouts."""
    from offpolicy.bench.pipeline import lease_groups

    assert [lease_groups(64, r) for r in (1, 2, 3, 4)] == [64, 32, 22, 16]
    assert lease_groups(1, 4) == 1


def test_dry_run_checks_and_prints_each_runs_config_and_starts_nothing(tmp_path, capsys):
    """Issue 51's 4 + 4 pipeline on a machine without GPUs: the GPUs the options name, each run's overrides checked
    (a config error stops it), and no daemon started (no run directory)."""
    args = ["bench", "pipeline", "--dry-run", "--backend", "megatron", "--learner-gpus", "0", "1", "2", "3",
            "--rollouts", "4", "--rollout-gpus", "4", "5", "6", "7", "--steps", "6", "--warmup", "2", "--staleness",
            "0", "1", "--dir", str(tmp_path / "runs"), "--out", str(tmp_path / "out"), "--set", "learner.megatron.ep=4",
            "--set", "weights.keep=2"]
    with pytest.raises(SystemExit) as done:
        main(args)
    assert done.value.code == 0
    lines = [x for x in capsys.readouterr().out.splitlines() if x.startswith("pipeline run ")]
    assert [x.split(" (")[0] for x in lines] == ["pipeline run s0", "pipeline run s1"]
    assert all("(8 GPUs; warmup 2 of 6 steps)" in x for x in lines)
    assert "'run.learner_gpus=[0,1,2,3]'" in lines[0] and "run.rollouts=4" in lines[0]
    assert lines[0].endswith("algo.max_staleness=0") and lines[1].endswith("algo.max_staleness=1")
    assert not (tmp_path / "runs").exists() and not (tmp_path / "out").exists()
    with pytest.raises(ConfigError, match="weights.keep"):
        main([*args, "--set", "weights.keep=1"])


def test_what_each_generate_call_prefilled_is_said_under_the_table(tmp_path):
    """An engine that reports its prefix cache (SGLang, vLLM): the prompt tokens a generate call computed and those
    its prefix cache held, over the same window as G; the torch engine says nothing and nothing is printed."""
    steps = [dict(time=float(i), tokens=100, train_seconds=0.3, publish_seconds=0.1, waited_seconds=0.1)
             for i in range(10)]
    computed, cached = 'offpolicy_rollout_prompt_tokens_total{kind="computed"}', \
        'offpolicy_rollout_prompt_tokens_total{kind="cached"}'
    snaps = [(n, {"offpolicy_generate_seconds_count": 1.0 * n, "offpolicy_generate_seconds_sum": 0.5 * n,
                  "offpolicy_weight_load_seconds_count": 1.0 * n, "offpolicy_weight_load_seconds_sum": 0.1 * n,
                  computed: 16_000.0 * n, cached: 112_000.0 * n}) for n in range(1, 11)]
    args = argparse.Namespace(warmup=2, rollouts=1)
    r = pipeline._reduce(steps, snaps, args, tmp_path)
    assert (r["prefill_computed"], r["prefill_cached"]) == (pytest.approx(16_000), pytest.approx(112_000))
    bare = [(n, {k: v for k, v in h.items() if "prompt_tokens" not in k}) for n, h in snaps]
    plain = pipeline._reduce(steps, bare, args, tmp_path)
    assert math.isnan(plain["prefill_computed"])
    text = pipeline.table({"learner_device": "cuda", "rollout_device": "cuda", "static_cache": False,
                           "rows_per_step": 8, "new_tokens": 4, "warmup": 2, "steps": 10,
                           "runs": {"1": {**r, "tokens_per_s": 100.0}, "0": {**plain, "tokens_per_s": 50.0}}})
    assert ("prefill (staleness 1): 16,000 prompt tokens computed a generate call, the prefix cache held 88% of its "
            "prompt tokens") in text and "prefill (staleness 0)" not in text
