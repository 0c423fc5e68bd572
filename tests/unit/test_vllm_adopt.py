"""`adopt`: a rebuilt vLLM model's state goes into the running model's own tensors (what CUDA graphs captured
at start-up read), by reference only where a tensor's shape or dtype changed. Pure torch stand-ins for vLLM's
layers: a linear layer with a kernel object holding a derived copy, an attention layer with a KV cache and an
`impl` that keeps its own reference to the sinks."""

from __future__ import annotations

import torch

from offpolicy.rollout.engines.vllm.adopt import adopt, release
from offpolicy.rollout.engines.fingerprint import model_fingerprints


class Kernel:  # a quant method's object, holding a tensor derived from its layer's weight
    def __init__(self, w: torch.Tensor):
        self.packed = w.t().contiguous()


class Linear(torch.nn.Module):
    def __init__(self, rows: int, seed: int):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.weight = torch.nn.Parameter(torch.randn(rows, 8, generator=g), requires_grad=False)
        self.kernel = Kernel(self.weight)


class Impl:
    def __init__(self, sinks: torch.Tensor):
        self.sinks = sinks


class Attention(torch.nn.Module):
    def __init__(self, seed: int):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.sinks = torch.nn.Parameter(torch.randn(4, generator=g), requires_grad=False)
        self.register_buffer("kv_cache", torch.zeros(3))
        self.impl = Impl(self.sinks.data)


class Model(torch.nn.Module):
    def __init__(self, seed: int, rows: int = 4):
        super().__init__()
        self.proj = Linear(rows, seed)
        self.attn = Attention(seed + 1)


def test_a_rebuild_lands_in_the_running_tensors_memory():
    running, fresh = Model(0), Model(1)
    running.attn.kv_cache.fill_(7.0)  # requests' state: kept
    captured = {n: (t, t.data_ptr()) for n, t in [("w", running.proj.weight), ("packed", running.proj.kernel.packed),
                                                   ("sinks", running.attn.sinks), ("impl", running.attn.impl.sinks)]}
    kernel = running.proj.kernel
    got = adopt(dict(running.named_modules()), fresh, {id(running.attn)})
    assert got == {"copied": 4, "moved": 0, "moved_in": []}
    for name, (t, ptr) in captured.items():  # what a captured graph reads is now the fresh model's
        assert t.data_ptr() == ptr, name
    assert torch.equal(captured["w"][0], fresh.proj.weight) and torch.equal(captured["packed"][0], fresh.proj.kernel.packed)
    assert torch.equal(captured["impl"][0], fresh.attn.sinks) and running.proj.kernel is kernel
    assert torch.equal(running.attn.kv_cache, torch.full((3,), 7.0))
    assert model_fingerprints(running) == model_fingerprints(fresh)  # what the load's proof sees


def test_a_tensor_of_another_shape_is_moved_and_its_module_takes_the_fresh_state():
    running, fresh = Model(0, rows=4), Model(1, rows=6)
    got = adopt(dict(running.named_modules()), fresh, {id(running.attn)})
    assert got["moved"] == 2 and got["moved_in"] == ["proj"] and got["copied"] == 2  # weight and packed moved
    assert running.proj.weight.shape == (6, 8) and running.proj.kernel is fresh.proj.kernel
    assert model_fingerprints(running) == model_fingerprints(fresh)


def test_release_drops_what_was_copied_and_keeps_what_was_taken_by_reference():
    """After a rebuild the fresh modules whose tensors were copied hold nothing (their memory goes at once, cycles or
    not); one whose state a running module took by reference (a tensor of another shape) stays whole, and the running
    model still computes with it."""
    import weakref

    running, fresh = Model(0, rows=4), Model(1, rows=6)
    fresh.attn.sinks.weight_loader = fresh.attn.forward  # a cycle, as vLLM's layers have
    sinks, kept, proj, attn = weakref.ref(fresh.attn.sinks), fresh.proj.weight, fresh.proj, fresh.attn
    modules = dict(running.named_modules())
    adopt(modules, fresh, {id(running.attn)})
    release(fresh, modules)
    assert sinks() is None and vars(attn) == {} and vars(fresh) == {}  # copied into the running sinks: dropped
    assert running.proj.weight is kept and proj.weight is kept  # taken by reference: whole
    assert model_fingerprints(running)  # the running model is intact
    shared = torch.nn.Linear(2, 2)  # a module vLLM caches and gives every model it builds (get_rope's)
    running.rope, fresh2 = shared, Model(2)
    fresh2.rope = shared
    modules = dict(running.named_modules())
    adopt(modules, fresh2, {id(running.attn)})
    release(fresh2, modules)
    assert vars(shared) and running.rope(torch.ones(2)).shape == (2,)  # left whole: the running model holds it


def test_kernel_wrapped_experts_are_copied_into_the_running_storage():
    """A rebuild of vLLM 0.26's Triton MXFP4 experts (tests/kernel_wrappers.py): the new version's swizzled values
    and scales go into the running wrappers' storage tensors, the wrappers and kernel objects stay the running
    ones (what the kernels and CUDA graphs hold), and the model then hashes as the new version's files."""
    from offpolicy.rollout.engines import fingerprint as fp
    from tests.kernel_wrappers import Model, checkpoint

    running = Model(checkpoint(0)[0])
    parts, files = checkpoint(1)
    fresh = Model(parts)
    old = running.layers[0].mlp.experts
    keep = (old.w13_weight, old.w13_weight.storage.data.data_ptr(), old.quant_method,
            old.quant_method.w13_precision_config.weight_scale.storage.data.data_ptr(), old.w13_bias.data_ptr())
    counts = adopt(dict(running.named_modules()), fresh, set())
    assert counts["moved"] == 0 and counts["copied"] == 2 * 4  # per layer: bias, values, scales, norm
    assert keep == (old.w13_weight, old.w13_weight.storage.data.data_ptr(), old.quant_method,
                    old.quant_method.w13_precision_config.weight_scale.storage.data.data_ptr(), old.w13_bias.data_ptr())
    assert torch.equal(old.w13_weight.storage.data, fresh.layers[0].mlp.experts.w13_weight.storage.data)
    assert fp.total(fp.model_fingerprints(running).values()) == fp.files_fingerprint(files, torch.bfloat16, True)
