"""The sharded publish (weights/sharded.py, learner/backends/megatron/shards.py): every Megatron rank writes its
own pieces, rank 0 commits. Spawned learner ranks on CPU (gloo, the CPU shim), 2 and 4 of them.

Each run publishes two versions (a train step between them) and compares each, tensor by tensor and bit
for bit, with today's gathered path (`backend.weights()` encoded by `formats.encode`) in every format
(bf16/float32 native, fp8, and mxfp4 for GPT-OSS), config.json included. The default suite runs a
representative handful (TP with each rank writing its rows and the all-gather, EP with GPT-OSS's fused experts written by rows, a rank
killed mid-publish, two nodes); the cross product of families and layouts is `slow`.
`pytest -k sharded_publish` selects every test of the sharded publish.
"""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("megatron.core", reason="megatron-core is not installed (pip install -e '.[megatron]')")

from offpolicy.weights.formats import store_run  # noqa: E402
from offpolicy.weights.store import list_versions, read_manifest, version_dir  # noqa: E402
from tests.megatron_workers import overrides  # noqa: E402
from tests.shard_workers import RUN, spawn_publish  # noqa: E402

SP = "learner.megatron.sequence_parallel=true"
LAYOUTS = {  # family -> {layout id: (world, overrides)}
    # llama tp2: 8-row fp8 blocks, so that every TP-split tensor but the row-parallel ones is written by
    # rows of each rank, fp8 ones too (with 128-row blocks the tiny model's qkv / fc1 rows are gathered)
    "llama": {"tp2": (2, ["learner.megatron.tp=2", "weights.fp8_block_size=[8, 8]"]),
              "tp2-gathered": (2, ["learner.megatron.tp=2"]), "pp2": (2, ["learner.megatron.pp=2"]),
              "tp2pp2": (4, ["learner.megatron.tp=2", "learner.megatron.pp=2"]), "dp2": (2, [])},
    "qwen2": {"tp2": (2, ["learner.megatron.tp=2"]), "pp2": (2, ["learner.megatron.pp=2"])},
    "qwen3": {"tp2": (2, ["learner.megatron.tp=2"]), "pp2dp2": (4, ["learner.megatron.pp=2"])},
    "qwen3_moe": {"ep2": (2, ["learner.megatron.ep=2"]), "etp2": (2, ["learner.megatron.etp=2"]),
                  "tp2ep2": (4, ["learner.megatron.tp=2", "learner.megatron.ep=2", SP]),
                  "ep2etp2": (4, ["learner.megatron.ep=2", "learner.megatron.etp=2"]),
                  "sequential-ep2": (2, ["learner.megatron.ep=2", "learner.megatron.experts=sequential"])},
    "gpt_oss": {"ep2": (2, ["learner.megatron.ep=2"]), "tp2": (2, ["learner.megatron.tp=2", SP]),
                "pp2": (2, ["learner.megatron.pp=2"]), "pp2ep2": (4, ["learner.megatron.pp=2", "learner.megatron.ep=2"]),
                "tp2ep2": (4, ["learner.megatron.tp=2", "learner.megatron.ep=2", SP])},
}
DEFAULT = {("gpt_oss", "ep2"), ("llama", "tp2")}


def _formats(family: str) -> list[str]:
    return ["native", "fp8", "mxfp4"] if family == "gpt_oss" else ["native", "fp8"]


def _equal(result: dict, fmts: list[str]) -> None:
    for v, res in enumerate(result["results"]):
        for fmt in fmts:
            r = res[fmt]
            assert (r["missing"], r["extra"], r["differ"]) == ([], [], []), (v, fmt, r)
            assert r["config"], (v, fmt)


def _cases(default: bool):
    return [pytest.param(f, lay, id=f"{f}-{lay}") for f, layouts in LAYOUTS.items() for lay in layouts
            if ((f, lay) in DEFAULT) == default]


def _run(tmp_path, family: str, layout: str) -> tuple[dict, str]:
    world, extra = LAYOUTS[family][layout]
    root = str(tmp_path / "store")
    return spawn_publish(world, overrides(family, *extra), [root], _formats(family), str(tmp_path / "out.pt")), root


@pytest.mark.parametrize("family, layout", _cases(default=True))
def test_sharded_publish_equals_the_gathered_version(tmp_path, family, layout):
    result, root = _run(tmp_path, family, layout)
    _equal(result, _formats(family))
    writers = {r for f in result["writers"]["native"] for r in f}
    assert writers == {0, 1}  # both ranks wrote: nothing went through rank 0
    # a standard HF checkpoint: transformers loads the native version as it is
    from transformers import AutoModelForCausalLM

    path = version_dir(root, RUN, 1)
    model = AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32)
    gathered = result["results"][1]["gathered"]
    state = model.state_dict()
    for name, t in gathered.items():
        assert torch.equal(state[name], t), name
    assert list_versions(root, RUN) == [0, 1]
    if (family, layout) == ("llama", "tp2"):  # each TP rank wrote its own rows of the row-split tensors, in
        rows = result["rows"]  # both formats (fp8 with its 8-row blocks); row-parallel ones were gathered
        for fmt in ("native", "fp8"):
            layer = "model.layers.0."
            got = rows[fmt]
            assert got[layer + "self_attn.q_proj.weight"] == [0, 16] and got[layer + "mlp.up_proj.weight"] == [0, 32]
            assert got[layer + "self_attn.k_proj.weight"] == [0, 8] and got["model.embed_tokens.weight"] == [0, 31]
            assert layer + "self_attn.o_proj.weight" not in got and layer + "mlp.down_proj.weight" not in got
        assert rows["fp8"][layer + "self_attn.q_proj.weight_scale_inv"] == [0, 2]


@pytest.mark.slow
@pytest.mark.parametrize("family, layout", _cases(default=False))
def test_sharded_publish_equals_the_gathered_version_in_every_layout(tmp_path, family, layout):
    result, _ = _run(tmp_path, family, layout)
    _equal(result, _formats(family))


def test_sharded_publish_with_a_rank_killed_mid_write_leaves_no_version(tmp_path):
    root = str(tmp_path / "store")
    result = spawn_publish(2, overrides("llama", "learner.megatron.pp=2"), [root], ["native", "fp8"],
                           str(tmp_path / "out.pt"), versions=2, kill_rank=1)
    assert "error" in result["results"][1], result["results"][1]
    _equal(dict(results=result["results"][:1]), ["native", "fp8"])
    for fmt in ("native", "fp8"):  # version 0 stays; version 1 is nowhere, not even half
        run = store_run(RUN, fmt)
        assert list_versions(root, run) == [0]
        assert not [e for e in os.listdir(os.path.join(root, run)) if e.startswith("v1")]


def test_sharded_publish_from_two_nodes_commits_each_nodes_part(tmp_path):
    """Two store roots stand in for two machines: ranks 0 and 1 are node a, 2 and 3 node b (TP 2 x PP 2, so
    each node holds a pipeline stage). Each node's store gets the files its ranks wrote, as
    `<run>/node<k>/v<N>` with the whole manifest; no store holds a version of its own (no reader could
    see a part as a version); the parts put together are the gathered version."""
    roots = [str(tmp_path / "a"), str(tmp_path / "b")]
    fmts = ["native", "fp8"]
    result = spawn_publish(4, overrides("llama", "learner.megatron.tp=2", "learner.megatron.pp=2"), roots, fmts,
                           str(tmp_path / "out.pt"), versions=1, nodes=["a", "a", "b", "b"])
    from offpolicy.weights.parts import assemble
    from tests.shard_workers import compare

    for fmt in fmts:
        run = store_run(RUN, fmt)
        assert list_versions(roots[0], run) == list_versions(roots[1], run) == []
        parts = [version_dir(r, f"{run}/node{k}", 0) for k, r in enumerate(roots)]
        manifest = read_manifest(parts[0])
        assert manifest.nodes == 2 and read_manifest(parts[1]) == manifest
        for k, part in enumerate(parts):
            held = {n for n in os.listdir(part) if n.endswith(".safetensors")}
            assert held == {n for n, e in manifest.files.items() if n.endswith(".safetensors") and e.node == k}
            assert held
        assemble(parts, version_dir(tmp_path / "whole", run, 0))
    got = compare(str(tmp_path / "whole"), 0, result["results"][0]["gathered"], result["hf_config"], fmts)
    _equal(dict(results=[got]), fmts)


def test_a_sharded_publish_reports_its_parts_in_order_inside_its_time(tmp_path):
    """Each rank's publish records its parts (begin's encode, then the writer's create, the waits, the write, the
    seal and the commit) with wall starts and seconds: the learner puts them in the run's timeline under the
    version's publish span (learner/loop.py), where a slow part shows."""
    import time

    from offpolicy.config import WeightsConfig
    from offpolicy.weights.sharded import ShardWriter

    w = WeightsConfig(root=str(tmp_path), keep=2, formats=["fp8"], fp8_block_size=(16, 16), checksum="sha256")
    writer = ShardWriter(w, "run", rank=0, world=1)
    pieces = [(f"model.layers.{i}.mlp.down_proj.weight", None, torch.randn(32, 32), (i,)) for i in range(3)]
    before = time.time()
    pending = writer.begin(0, ["native", "fp8"], pieces, {"model_type": "llama"})
    published = pending.wait()
    after = time.time()
    assert set(published) == {"native", "fp8"}
    names = [name for name, _, _ in pending.phases]
    assert names == ["encode", "create", "wait for writers", "write", "wait for writes", "seal", "commit"]
    starts = [start for _, start, _ in pending.phases]
    assert before <= starts[0] and starts == sorted(starts)
    assert all(seconds >= 0 and start + seconds <= after + 1e-3 for _, start, seconds in pending.phases)


def test_a_sharded_publish_counts_the_files_it_made_new(tmp_path):
    """A version written into files made new (the pool had none of their sizes) is slower for the pages it faults
    in; the learner's timeline marks its publish (`fresh_files`), so that `offpolicy trace` leaves it out of the
    publish-beside-a-step comparison (loggers/timeline.py)."""
    from offpolicy.config import WeightsConfig
    from offpolicy.weights.sharded import ShardWriter

    w = WeightsConfig(root=str(tmp_path), keep=1, reuse_files=True)
    writer = ShardWriter(w, "run", rank=0, world=1)
    fresh = []
    for v in range(4):
        pieces = [(f"model.layers.{i}.mlp.down_proj.weight", None, torch.randn(32, 32) + v, (i,)) for i in range(3)]
        pending = writer.begin(v, ["native"], pieces, {"model_type": "llama"})
        pending.wait()
        fresh.append(pending.fresh_files)
    assert fresh[0] >= 1 and fresh[2:] == [0, 0], fresh  # keep=1: from the third version on the pool holds one


def test_a_sharded_publish_counts_the_files_it_wrote_without_a_registered_map(tmp_path):
    """A file the maps have not met before is written through pinned buffers (on an H200 a 5.6 GB version took 550
    ms so against 105 ms through its map, beside a step or not); the learner's timeline marks such a publish
    (`staged_files`) for `offpolicy trace` to leave out of the publish-beside-a-step comparison. Host maps with a fake
    registration stand in for a GPU's (tests/unit/test_weights_maps.py)."""
    from offpolicy.config import WeightsConfig
    from offpolicy.weights.maps import MapCache
    from offpolicy.weights.sharded import ShardWriter

    w = WeightsConfig(root=str(tmp_path), keep=1, reuse_files=True)
    writer = ShardWriter(w, "run", rank=0, world=1)
    writer.maps = MapCache(w.keep + 2, register=lambda *a: None, unregister=lambda *a: None, host=True)
    counts = []
    for v in range(6):
        pieces = [(f"model.layers.{i}.mlp.down_proj.weight", None, torch.randn(32, 32) + v, (i,)) for i in range(3)]
        pending = writer.begin(v, ["native"], pieces, {"model_type": "llama"})
        pending.wait()
        counts.append((pending.fresh_files, pending.staged_files))
    # keep=1: versions 0 and 1 into new files (met the first time), from 2 on the pool's, met before: registered
    assert counts == [(1, 1), (1, 1), (0, 0), (0, 0), (0, 0), (0, 0)], counts
    writer.maps.clear()
