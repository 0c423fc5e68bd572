"""learner.megatron.fused_adam (offpolicy/learner/backends/megatron/adam.py) on CPU through the test shim: torch
AdamW's fused kernel gives the foreach path's steps up to float32 rounding, and a fused learner saves and
resumes its checkpoint (host `step` tensors from the checkpoint code placed before the step) to the same
step as an uninterrupted run."""

import pytest
import torch

pytest.importorskip("megatron.core", reason="megatron-core is not installed (pip install -e '.[megatron]')")

from tests.megatron_workers import assert_stats_close, overrides, spawn  # noqa: E402

FUSED, FOREACH = "learner.megatron.fused_adam=true", "learner.megatron.fused_adam=false"


def _close(a: dict, b: dict) -> None:
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("world,layout", [
    (1, ()),
    pytest.param(2, ("learner.megatron.ep=2",), marks=pytest.mark.slow),  # chained optimizers, Adam over DP
], ids=["one-rank", "qwen3-moe-ep2"])
def test_fused_adam_steps_and_resumes_like_foreach(tmp_path, world, layout):
    family = "qwen3_moe" if layout else "llama"
    ref = spawn(world, overrides(family, *layout, FOREACH), 2, str(tmp_path / "ref.pt"))
    first = spawn(world, overrides(family, *layout, FUSED), 1, str(tmp_path / "a.pt"), save=str(tmp_path / "ckpt"))
    assert_stats_close(first["stats"][0], ref["stats"][0])
    ckpt = tmp_path / "ckpt"  # the default checkpoint format: Megatron's distributed checkpoint, no per-rank files
    assert not list(ckpt.glob("rank*.pt")) and (ckpt / "offpolicy_megatron.json").exists() and (ckpt / "metadata.json").exists()
    second = spawn(world, overrides(family, *layout, FUSED), 1, str(tmp_path / "b.pt"), load=str(ckpt))
    for k in first["after"]:
        assert torch.equal(second["before"][k], first["after"][k]), k  # the weights come back exactly
    assert_stats_close(second["stats"][0], ref["stats"][1])  # the resumed step needs Adam's moments and step
    _close(second["after"], ref["after"])
    assert not torch.equal(second["after"][next(iter(ref["after"]))], ref["before"][next(iter(ref["before"]))])


class _Wrapped:  # what get_megatron_optimizer returns for one optimizer: the torch one under .optimizer
    def __init__(self, inner):
        self.optimizer = inner


def test_fuse_switches_every_group_and_places_host_steps():
    from offpolicy.learner.backends.megatron import adam

    params = [torch.nn.Parameter(torch.randn(4, 3)), torch.nn.Parameter(torch.randn(5))]
    inner = torch.optim.AdamW([{"params": params[:1]}, {"params": params[1:], "lr": 0.5}], lr=0.1)
    inner.state[params[0]]["step"] = torch.tensor(3.0, dtype=torch.float64)  # as a checkpoint load leaves it
    inner.state[params[1]]["step"] = 3
    opt = _Wrapped(inner)
    adam.fuse(opt)
    assert [g["fused"] for g in inner.param_groups] == [True, True] and inner.defaults["fused"]
    assert all(s["step"].dtype == torch.float32 and s["step"].device == p.device and float(s["step"]) == 3.0
               for p, s in inner.state.items())
    inner.param_groups[1]["fused"] = False  # a group left unfused: its steps are not touched
    inner.state[params[1]]["step"] = 4
    adam.place_steps(opt)
    assert inner.state[params[1]]["step"] == 4
