"""Megatron distributed checkpoints of the megatron backend (CPU, gloo, float32, through the test shim).

A checkpoint written after step 0 under one layout (2 processes: TP=2, PP=2, DP=2 with the distributed
optimizer's Adam state sharded over DP, Qwen3-MoE EP=2) is resumed under another (1 process, or TP=2
from TP=1): the weights come back exactly and step 1 equals step 1 of an uninterrupted single-process
run (its loss, and its update, which needs the Adam moments and step). Missing, incomplete and corrupt
checkpoints fail with a ValueError that says what to do. Same-layout resume and the per_rank format
are in test_megatron_backend.py.
"""

import json
import shutil
from pathlib import Path

import pytest
import torch

pytest.importorskip("megatron.core", reason="megatron-core is not installed (pip install -e '.[megatron]')")

from offpolicy.learner.backends.megatron import checkpointing as mg_checkpoint  # noqa: E402
from offpolicy.learner.backends.megatron.checkpointing import distributed as dist_checkpoint  # noqa: E402
from tests.megatron_workers import assert_stats_close, overrides, spawn  # noqa: E402

TP2 = (2, "learner.megatron.tp=2")
PP2 = (2, "learner.megatron.pp=2")
DP2 = (2,)  # two processes, no model parallelism: the distributed optimizer shards Adam over DP
EP2 = (2, "learner.megatron.ep=2")
TP2SP = (2, "learner.megatron.tp=2", "learner.megatron.sequence_parallel=true")  # MoE with tp > 1 needs SP
ONE = (1,)
SEQ = "learner.megatron.experts=sequential"  # megatron-core's SequentialMLP instead of the stacked GroupedExperts


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    cache = {}

    def run(family: str) -> dict:
        if family not in cache:
            cache[family] = spawn(1, overrides(family), 2, str(tmp_path_factory.mktemp("ref") / "out.pt"))
        return cache[family]

    return run


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """(step-0 run, checkpoint dir) of `family` under `layout`, written once per module."""
    cache = {}

    def save(family: str, layout: tuple) -> tuple[dict, str]:
        if (family, layout) not in cache:
            root = tmp_path_factory.mktemp("ckpt")
            first = spawn(layout[0], overrides(family, *layout[1:]), 1, str(root / "a.pt"), save=str(root / "ckpt"))
            cache[family, layout] = first, str(root / "ckpt")
        return cache[family, layout]

    return save


def resume(tmp_path, ckpt: str, family: str, layout: tuple) -> dict:
    """Load `ckpt` under `layout`, train step 1, and checkpoint again (which must find one step everywhere)."""
    again = tmp_path / "again"
    out = spawn(layout[0], overrides(family, *layout[1:]), 1, str(tmp_path / "b.pt"), load=ckpt, save=str(again))
    assert json.loads((again / dist_checkpoint.META_FILE).read_text())["step"] == 2
    return out


def assert_continues(first: dict, resumed: dict, ref: dict, atol: float = 1e-5) -> None:
    for k in ref["after"]:
        assert torch.equal(resumed["before"][k], first["after"][k]), k  # the weights come back exactly
    assert_stats_close(resumed["stats"][0], ref["stats"][1])
    for k in ref["after"]:  # the update of step 1 needs the restored Adam moments and step
        assert torch.allclose(resumed["after"][k], ref["after"][k], atol=atol), \
            (k, float((resumed["after"][k] - ref["after"][k]).abs().max()))


@pytest.mark.parametrize("family,save_layout,load_layout", [
    # the default suite keeps one resharding: GPT-OSS's stacked experts (ep 1) into SequentialMLP's (ep 2), with
    # the expert biases; the rest run with -m slow (~40-50 s each on 2 cores)
    pytest.param("llama", TP2, ONE, marks=pytest.mark.slow),
    pytest.param("qwen3_moe", EP2, ONE, marks=pytest.mark.slow),  # expert moments of the expert optimizer (ep 2) into the single one (ep 1)
    pytest.param("llama", PP2, ONE, marks=pytest.mark.slow),
    pytest.param("llama", DP2, ONE, marks=pytest.mark.slow),
    pytest.param("llama", ONE, TP2, marks=pytest.mark.slow),
    pytest.param("gpt_oss", EP2, ONE, marks=pytest.mark.slow),  # sinks, expert biases, fused-expert export
    pytest.param("gpt_oss", TP2SP, ONE, marks=pytest.mark.slow),  # sinks split by heads over TP
    pytest.param("qwen3_moe", (*EP2, SEQ), ONE, marks=pytest.mark.slow),  # SequentialMLP's experts and moments (ep 2) into the stacked ones (ep 1)
    ("gpt_oss", ONE, (*EP2, SEQ)),  # stacked experts with biases into SequentialMLP's (ep 2)
    pytest.param("qwen3_moe", (2, "learner.megatron.etp=2", SEQ), ONE, marks=pytest.mark.slow),  # [gate_r; up_r]
    pytest.param("qwen3_moe", ONE, (2, "learner.megatron.etp=2"), marks=pytest.mark.slow),
], ids=["tp2-to-tp1", "moe-ep2-to-ep1", "pp2-to-pp1", "dp2-to-dp1", "tp1-to-tp2", "gpt-oss-ep2-to-ep1",
        "gpt-oss-tp2-to-tp1", "moe-sequential-ep2-to-grouped", "gpt-oss-grouped-to-sequential-ep2",
        "moe-sequential-etp2-to-grouped", "moe-grouped-to-etp2"])
def test_checkpoint_resumes_under_another_layout(tmp_path, saved, uninterrupted, family, save_layout, load_layout):
    first, ckpt = saved(family, save_layout)
    resumed = resume(tmp_path, ckpt, family, load_layout)
    # GPT-OSS's step 0 under EP2 / TP2 already ends 1.2e-5 / 4e-5 from TP1's (arithmetic order; the layout
    # test's tolerance is 1e-4), and step 1 carries that on; so does a step under etp 2, whose ranks sum the
    # expert FFN's partial outputs (3.2e-5 on a Qwen3-MoE attention weight, first run 2026-11-26)
    etp = any("etp=2" in str(x) for x in (*save_layout, *load_layout))
    assert_continues(first, resumed, uninterrupted(family), atol=1e-4 if family == "gpt_oss" or etp else 1e-5)
    meta = json.loads((Path(ckpt) / dist_checkpoint.META_FILE).read_text())
    assert meta["format"] == "megatron-dist" and meta["step"] == 1 and meta["layout"]["world"] == save_layout[0]


@pytest.mark.slow
def test_distributed_optimizer_checkpoint_resumes_without_it(tmp_path, saved, uninterrupted):
    """The fp32 main parameters the distributed optimizer saves are simply not read by the plain optimizer."""
    first, ckpt = saved("llama", TP2)
    resumed = resume(tmp_path, ckpt, "llama", (1, "learner.megatron.use_distributed_optimizer=false"))
    assert_continues(first, resumed, uninterrupted("llama"))


def test_a_corrupt_checkpoint_fails_with_what_to_do(tmp_path, saved):
    _, ckpt = saved("gpt_oss", ONE)  # the checkpoint the default suite's resharding test wrote already
    broken = tmp_path / "broken"
    shutil.copytree(ckpt, broken)
    shards = list(broken.glob("*.distcp"))
    assert shards
    for f in shards:
        f.write_bytes(f.read_bytes()[:100])  # truncated shards
    with pytest.raises(Exception, match="(?s)cannot load the Megatron distributed checkpoint.*incomplete or corrupt"):
        resume(tmp_path, str(broken), "gpt_oss", ONE)


def _load(path) -> None:
    mg_checkpoint.load(str(path), rank=0, layout={}, model=None, params={}, opt=None, control=None)


def test_a_missing_or_incomplete_checkpoint_fails_before_loading(tmp_path):
    with pytest.raises(ValueError, match="holds no megatron backend checkpoint.*resume from another checkpoint"):
        _load(tmp_path)  # empty: e.g. a save that died before writing anything
    (tmp_path / dist_checkpoint.META_FILE).write_text('{"format": "megatron-dist", "ver')  # cut short
    with pytest.raises(ValueError, match="missing or unreadable.*not a complete megatron backend checkpoint"):
        _load(tmp_path)
    (tmp_path / dist_checkpoint.META_FILE).write_text(json.dumps({"format": "megatron-dist", "version": 2}))
    with pytest.raises(ValueError, match="version 2; this offpolicy reads 'megatron-dist' version 1"):
        _load(tmp_path)


def _meta(tmp_path, layout: dict, **extra) -> None:
    meta = {**dict(format="megatron-dist", version=1, layout=layout, step=3, megatron_core="0.16.1"), **extra}
    (tmp_path / dist_checkpoint.META_FILE).write_text(json.dumps(meta))


def test_layouts_and_versions_that_cannot_load_are_refused_with_the_fix(tmp_path):
    layout = dict(use_distributed_optimizer=False, dtype="float32")
    _meta(tmp_path, layout)
    with pytest.raises(ValueError, match="learner.megatron.use_distributed_optimizer=false and model.dtype=float32"):
        mg_checkpoint.load(str(tmp_path), rank=0, layout=dict(layout, use_distributed_optimizer=True), model=None,
                           params={}, opt=None, control=None)
    _meta(tmp_path, layout, megatron_core="99.1.0")
    with pytest.raises(ValueError, match=r"written by megatron-core 99.1.0.*install megatron-core>=99.1.0"):
        _load(tmp_path)
    (tmp_path / dist_checkpoint.META_FILE).write_text(json.dumps(dict(format="megatron-dist", version=1)))
    with pytest.raises(ValueError, match=r"lacks \['layout', 'megatron_core', 'step'\]"):
        _load(tmp_path)


def test_a_per_rank_checkpoint_does_not_reshard(tmp_path):
    (tmp_path / "layout.json").write_text(json.dumps(dict(tp=2, pp=1, world=2)))
    with pytest.raises(ValueError, match="same learner.megatron.tp/pp/ep/etp/experts, optimizer_offload .0 or not. and number of ranks"):
        mg_checkpoint.load(str(tmp_path), rank=0, layout=dict(tp=1, pp=1, world=1, ep=1, etp=1, moe=False),
                           model=None, params={}, opt=None, control=None)
    # a MoE per_rank checkpoint from before learner.megatron.experts holds SequentialMLP's names
    (tmp_path / "layout.json").write_text(json.dumps(dict(tp=1, pp=1, world=1, ep=1, etp=1)))
    moe = dict(tp=1, pp=1, world=1, ep=1, etp=1, moe=True, experts="grouped")
    with pytest.raises(ValueError, match="'experts': 'sequential'.*'experts': 'grouped'"):
        mg_checkpoint.load(str(tmp_path), rank=0, layout=moe, model=None, params={}, opt=None, control=None)


def test_checkpoint_format_is_a_config_knob():
    from offpolicy.config import ConfigError, load_config

    assert load_config(None, overrides("llama")).learner.megatron.checkpoint_format == "dist"
    cfg = load_config(None, overrides("llama", "learner.backend=megatron",
                                      "learner.megatron.checkpoint_format=per_rank"))
    assert cfg.learner.megatron.checkpoint_format == "per_rank"
    with pytest.raises(ConfigError, match="checkpoint_format"):
        load_config(None, overrides("llama", "learner.megatron.checkpoint_format=zarr"))
