"""The planner on one node split between the learner and the rollouts (issue 51: GPT-OSS-20B's learner EP4 on GPUs
0-3 of an 8-GPU host, four rollouts on GPUs 4-7), and its expectation for the full model's learner on 8 GPUs."""

from __future__ import annotations

import shlex

import pytest

from offpolicy.learner.backends.megatron import microbatches
from offpolicy.plan import calibration, search, validate
from offpolicy.plan.evaluate import Candidate, check, evaluate
from offpolicy.plan.hardware import DEVICES, Cluster
from offpolicy.plan.memory import LearnerLayout, RolloutServerSpec, micro_tokens
from offpolicy.plan.report import _overrides
from offpolicy.plan.shapes import load_shape
from offpolicy.plan.workload import Lengths, Workload

CAL = calibration.load()
GPTOSS = load_shape("gpt-oss-20b")
NODE = Cluster(1, 8, DEVICES["h200"], host_gib=560, host_cores=128)
# the pipeline's step: 16 groups x 8 responses of 256 tokens after short prompts (benchmarks/gptoss20b_gpu4.sh)
WL = Workload(batch_groups=16, n=8, max_new_tokens=256, prompt_tokens=128, lengths=Lengths.parse("fixed:256"), steps=6)


def four_plus_four(tp: int = 1) -> Candidate:
    lay = LearnerLayout(4, ep=4, max_tokens_per_gpu=8192, grad_fp32=False)
    return Candidate(1, lay, RolloutServerSpec("sglang", tp, tp), learner_gpus=4)


def test_the_learner_takes_its_gpus_of_the_node_and_servers_the_rest_without_a_relay():
    c = four_plus_four()
    assert c.gpus(NODE) == 4 and c.servers(NODE) == 4 and [c.hop(NODE, i) for i in range(4)] == [0, 0, 0, 0]
    assert c.label(NODE).startswith("4 learner + 4 rollout GPUs of node 1: learner TP1 x EP4 x PP1 x DP4, 4 x sglang")
    assert four_plus_four(tp=2).servers(NODE) == 2
    two = Cluster(2, 8, DEVICES["h200"])  # a second node serves behind the relay
    assert four_plus_four().servers(two) == 12 and [four_plus_four().hop(two, i) for i in (3, 4, 11)] == [0, 1, 1]
    assert Candidate(1, LearnerLayout(8), RolloutServerSpec()).gpus(two) == 8  # whole nodes as before


def test_a_split_that_cannot_be_placed_is_a_problem():
    ev = check(GPTOSS, NODE, four_plus_four(), WL, CAL)
    assert ev.fits, ev.problems
    lay = LearnerLayout(4, ep=4)
    bad = [Candidate(2, lay, RolloutServerSpec(), learner_gpus=4),  # a split of one node only
           Candidate(1, LearnerLayout(8, ep=4), RolloutServerSpec(), learner_gpus=8),  # nothing left to serve
           Candidate(1, LearnerLayout(5), RolloutServerSpec("sglang", 2, 2), learner_gpus=5)]  # 3 GPUs, TP2 servers
    for cand in bad:
        assert any("learner_gpus" in p or "beside the learner" in p for p in check(GPTOSS, NODE, cand, WL, CAL).problems)


def test_one_node_is_searched_as_splits_and_the_command_runs_it():
    evals = search.plan(GPTOSS, NODE, WL, CAL)
    fit = [e for e in evals if e.fits]
    assert fit and all(0 < e.candidate.learner_gpus < 8 for e in fit)
    assert {e.candidate.learner_gpus for e in fit} >= {2, 4}
    from offpolicy.plan.report import markdown

    text = markdown(evals, GPTOSS, NODE, WL, CAL)
    line = next(x for x in text.splitlines() if x.strip().startswith("offpolicy run run.yaml "))
    from offpolicy.config import load_config

    cfg = load_config(None, [*shlex.split(line)[3:], "model.path=/m"])
    best = fit[0].candidate
    assert cfg.run.learner_gpus == list(range(best.learner_gpus)) and cfg.run.rollouts == best.servers(NODE)
    assert len(cfg.run.rollout_gpus) == cfg.run.rollouts and cfg.learner.megatron.ep == best.learner.ep
    assert "sbatch" not in text


def test_a_given_split_is_parsed_with_bf16_gradients():
    c = search.parse_layout("learner_gpus=4,tp=1,ep=4,pp=1,max_tokens=8192,grad_fp32=false,rollout_tp=1", GPTOSS,
                            NODE, WL, CAL)
    assert c == four_plus_four()
    searched = search.parse_layout("learner_gpus=4,rollout_tp=1", GPTOSS, NODE, WL, CAL)
    assert searched.learner.gpus == 4 and searched.learner_gpus == 4
    assert search.parse_layout("tp=1,ep=4,pp=1,offload=1", GPTOSS, Cluster(2, 4, DEVICES["h200"]), WL,
                               CAL).learner.grad_fp32 is False  # with the host optimizer, bf16 buffers as before


# GPT-OSS-20B's learner alone (benchmarks/megatron_layouts.py's batch: 16 groups x 8 x 512 tokens, micro-batches of
# 8192, bf16 gradient buffers, the optimizer on the GPUs), on H200s: the expectation docs/megatron.md prints
EXPECTED = {  # (GPUs, ep): (step s, peak GiB)
    (4, 4): (1.175, 111.6), (8, 8): (0.601, 73.5), (8, 4): (0.617, 82.4), (4, 2): (1.198, 129.4)}


@pytest.mark.parametrize("gpus,ep", list(EXPECTED))
def test_full_model_learner_on_eight_gpus_expectation(gpus, ep):
    lay = LearnerLayout(gpus, ep=ep, max_tokens_per_gpu=8192, grad_fp32=False)
    pred = validate.predict_layout(GPTOSS, lay, "h200", 16 * 8 * 512, 512, CAL)
    step, gib = EXPECTED[gpus, ep]
    assert pred["problem"] is None and pred["predicted_host_gib"] == 0
    assert pred["predicted_s"] == pytest.approx(step, abs=5e-3) and pred["predicted_gib"] == pytest.approx(gib, abs=0.1)
    # experts split ep ways and their optimizer state over the expert-data-parallel ranks (gpus / ep)
    assert pred["memory_gib"]["optimizer"] == pytest.approx(58.4 * 4 / gpus, abs=0.1)


# the 4 + 4 pipeline (benchmarks/gptoss20b_gpu4.sh pipeline44: 16 groups x 8 x 256 new tokens after 128-token prompts,
# a lease of 4 groups per rollout) as docs/benchmarks.md "8 GPUs (issue 51)" quotes it, steady state: (engine, expert
# bits) -> (T_step at staleness 0, at 1). The planner before this (the gathered publish, 15.5 s on the learner's path)
# gave 18.8-20.7 s and 16.4 s (1.15-1.26x) for every engine.
PIPELINE44 = {("vllm", 16): (12.5, 11.0), ("vllm", 4.25): (13.9, 12.7), ("torch", 16): (5.34, 3.10),
              ("torch", 4.25): (4.50, 3.10)}


@pytest.mark.parametrize("engine,bits", list(PIPELINE44))
def test_the_four_plus_four_pipeline_with_the_sharded_publish(engine, bits):
    wl = Workload(batch_groups=16, n=8, max_new_tokens=256, prompt_tokens=128, lengths=Lengths.parse("fixed:256"),
                  steps=12)
    lay = LearnerLayout(4, ep=4, max_tokens_per_gpu=8192, grad_fp32=False)
    load = "rebuild" if engine == "vllm" and bits < 16 else "auto"  # as quoted: before MXFP4 loaded in place
    srv = RolloutServerSpec(engine, expert_bits=bits, load=load)
    ev = evaluate(GPTOSS, NODE, Candidate(1, lay, srv, learner_gpus=4), wl, CAL)
    s0, s1 = PIPELINE44[engine, bits]
    assert ev.runs[0]["step_s"] == pytest.approx(s0, rel=0.02) and ev.runs[1]["step_s"] == pytest.approx(s1, rel=0.02)
    assert ev.parts["publish_s"] < 0.6 and ev.parts["stall_s"] < 0.06  # the sharded publish, in the background
    assert ev.speedup() <= ev.speedup_bound() + 1e-9 <= 2 + 1e-9


def test_a_given_pp_microbatches_cuts_the_step_as_the_learner_would_and_reaches_the_overrides():
    """`microbatches=N` (learner.megatron.pp_microbatches) with pp 2: the micro-batch budget the planner costs is the
    learner's for that setting (auto: 4 a stage), and the layout's overrides carry it."""
    given = "learner_gpus=4,tp=1,ep=2,pp=2,max_tokens=16384,rollout_tp=1"
    auto = search.parse_layout(given, GPTOSS, NODE, WL, CAL)
    two = search.parse_layout(given + ",microbatches=2", GPTOSS, NODE, WL, CAL)
    assert auto.learner.pp_microbatches == "auto" and two.learner.pp_microbatches == 2
    per_rank, seq = 32768, 384
    assert micro_tokens(auto.learner, per_rank, seq) == microbatches.budget(per_rank, 16384, 8, seq) == 4096
    assert micro_tokens(two.learner, per_rank, seq) == microbatches.budget(per_rank, 16384, 2, seq) == 16384
    searched = search.parse_layout("learner_gpus=4,rollout_tp=1,microbatches=3", GPTOSS, NODE, WL, CAL)
    assert searched.learner.pp_microbatches == 3
    ev = evaluate(GPTOSS, NODE, two, WL, CAL, staleness=(1,))
    assert ev.fits and "learner.megatron.pp_microbatches=2" in _overrides(ev)
    assert not any("pp_microbatches" in o for o in _overrides(evaluate(GPTOSS, NODE, auto, WL, CAL, staleness=(1,))))
    with pytest.raises(ValueError, match="microbatches is auto or a whole number >= 1"):
        search.parse_layout(given + ",microbatches=0", GPTOSS, NODE, WL, CAL)
