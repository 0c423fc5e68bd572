"""What vLLM's in-place reload misses, loaded after it (offpolicy/rollout/engines/vllm/misses.py), on stand-ins of
vLLM's GPT-OSS modules: a loader that copies the sinks and experts straight into the parameters (as
`_load_weights_other` does), and an experts quant method that prepacks only on its first processing (as vLLM 0.32's
CPU experts do; a weight update skips it). The real vLLM path: tests/integration/test_vllm_engine.py."""

from __future__ import annotations

import torch

from offpolicy.rollout.engines import fingerprint as fp
from offpolicy.rollout.engines.vllm.misses import RELOAD_MISSES, layout_holds, reload_missed

E, H, I, HEADS, LAYERS = 3, 8, 4, 2, 2
MISSES = RELOAD_MISSES["gpt_oss"]


def prepack(w: torch.Tensor) -> torch.Tensor:
    return w.flip(-1).contiguous()  # a permutation: the same multiset of elements, another layout


class Kernel:
    def __init__(self, layer):
        self.w13, self.w2 = layer.w13_weight, layer.w2_weight  # what the kernel computes with


class Method(torch.nn.Module):
    """Prepacks the experts and sets its kernel up on the first call only (vLLM 0.32's `_setup_kernel`)."""

    def __init__(self):
        super().__init__()
        self.moe_kernel = None

    def process_weights_after_loading(self, layer):
        if self.moe_kernel is None:
            for name in ("w13_weight", "w2_weight"):
                layer._parameters[name] = torch.nn.Parameter(prepack(layer._parameters[name].data), requires_grad=False)
            self.moe_kernel = Kernel(layer)


class StickyMethod(Method):
    """Prepacks once, keyed by a flag of its own: a replay with the kernel unset does not reproduce that."""

    packed = False

    def process_weights_after_loading(self, layer):
        if not self.packed:
            super().process_weights_after_loading(layer)
            self.packed = True


class Experts(torch.nn.Module):
    def __init__(self, method):
        super().__init__()
        for name, shape in (("w13_weight", (E, 2 * I, H)), ("w13_bias", (E, 2 * I)), ("w2_weight", (E, H, I)),
                            ("w2_bias", (E, H))):
            self.register_parameter(name, torch.nn.Parameter(torch.zeros(shape), requires_grad=False))
        self.quant_method = method()


class Impl:
    def __init__(self, sinks):
        self.sinks = sinks  # the attention backend's own reference


class Attention(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.sinks = torch.nn.Parameter(torch.zeros(HEADS), requires_grad=False)
        self.impl = Impl(self.sinks)


class Model(torch.nn.Module):
    """vLLM's GPT-OSS module tree and its loader's copies (model.layers.N.attn / .mlp.experts.routed_experts)."""

    def __init__(self, method=Method):
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.ModuleDict({"attn": Attention(), "mlp": torch.nn.ModuleDict(
            {"experts": torch.nn.ModuleDict({"routed_experts": Experts(method)})})}) for _ in range(LAYERS))

    def load_weights(self, weights):
        params = dict(self.named_parameters())  # as vLLM's loader: the parameters registered at the call
        for name, t in weights:
            i = name.split(".layers.")[1].split(".")[0]
            experts = f"layers.{i}.mlp.experts.routed_experts"
            if name.endswith(".sinks"):
                params[f"layers.{i}.attn.sinks"].data.copy_(t)
            elif name.endswith("gate_up_proj"):
                params[f"{experts}.w13_weight"].copy_(t.permute(0, 2, 1))
            elif name.endswith("down_proj"):
                params[f"{experts}.w2_weight"].copy_(t.permute(0, 2, 1))
            elif name.endswith("_bias"):
                params[f"{experts}.{'w13' if 'gate_up' in name else 'w2'}_bias"].copy_(t)
            else:
                continue  # the attention's projections: not held by the stand-in

    def start(self, ckpt):
        """vLLM's start-up load: the loader, then each layer's processing."""
        self.load_weights(ckpt.items())
        for layer in self.layers:
            experts = layer["mlp"]["experts"]["routed_experts"]
            experts.quant_method.process_weights_after_loading(experts)
        return self


def checkpoint(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = {}
    for i in range(LAYERS):
        p = f"model.layers.{i}"
        for name, shape in ((f"{p}.self_attn.sinks", (HEADS,)), (f"{p}.mlp.experts.gate_up_proj", (E, H, 2 * I)),
                            (f"{p}.mlp.experts.gate_up_proj_bias", (E, 2 * I)),
                            (f"{p}.mlp.experts.down_proj", (E, I, H)), (f"{p}.mlp.experts.down_proj_bias", (E, H)),
                            (f"{p}.self_attn.q_proj.weight", (H, H))):
            out[name] = torch.randn(shape, generator=g)
    return out


def reader(ckpt, calls=None):
    def read(keep):
        names = [n for n in ckpt if keep(n)]
        if calls is not None:
            calls.append(names)
        return [(n, ckpt[n]) for n in names]
    return read


def tensors(model):
    return {n: t.detach().clone() for n, t in fp.module_tensors(model)}


def test_the_missed_tensors_load_into_the_running_memory_laid_out_as_a_fresh_start_lays_them():
    v0, v1 = checkpoint(0), checkpoint(1)
    model = Model().start(v0)
    experts = model.layers[0]["mlp"]["experts"]["routed_experts"]
    kernel, ptrs = experts.quant_method.moe_kernel, {n: t.data_ptr() for n, t in model.named_parameters()}
    calls = []
    assert reload_missed(model, MISSES, reader(v1, calls)) == LAYERS * 5
    fresh = tensors(Model().start(v1))
    held = tensors(model)
    assert held.keys() == fresh.keys() and all(torch.equal(held[n], fresh[n]) for n in fresh)  # element for element
    # the storages vLLM's kernels (and CUDA graphs) read stay, and so do the kernel objects
    assert {n: t.data_ptr() for n, t in model.named_parameters()} == ptrs
    assert experts.quant_method.moe_kernel is kernel and torch.equal(kernel.w13, prepack(v1[
        "model.layers.0.mlp.experts.gate_up_proj"].permute(0, 2, 1)))
    assert model.layers[1]["attn"].impl.sinks is model.layers[1]["attn"].sinks
    # one layer at a time, and only the tensors the reload missed (never q_proj)
    assert [sorted(c) for c in calls] == [sorted(n for n in v1 if f".layers.{i}." in n and "q_proj" not in n)
                                          for i in range(LAYERS)]


def test_the_replay_is_checked_element_for_element_since_the_fingerprint_cannot_see_a_layout():
    v0 = checkpoint(0)
    assert layout_holds(Model().start(v0), MISSES, reader(v0)) is None
    # a kernel whose layout the replay does not reproduce: the tensors would hold the right values in the wrong
    # places, which the fingerprint (a multiset hash) takes for the version
    model = Model(StickyMethod).start(v0)
    why = layout_holds(model, MISSES, reader(v0))
    assert why is not None and "w13_weight" in why and "does not lay the checkpoint out" in why
    reload_missed(model, MISSES, reader(checkpoint(1)))
    held, fresh = tensors(model), tensors(Model(StickyMethod).start(checkpoint(1)))
    wrong = [n for n in fresh if not torch.equal(held[n], fresh[n])]
    assert wrong and all(fp.tensor_fingerprint(held[n]) == fp.tensor_fingerprint(fresh[n]) for n in wrong)
    # a model not holding what the checkpoint says (another version): not the start-up layout either
    assert layout_holds(Model().start(v0), MISSES, reader(checkpoint(2))) is not None


def test_a_checkpoint_without_the_missed_tensors_is_no_proof_of_the_layout():
    model = Model().start(checkpoint(0))
    assert "holds none of" in layout_holds(model, MISSES, reader({}))


def test_the_reload_is_handed_only_what_it_loads_and_the_replay_the_rest():
    names = list(checkpoint(0))
    taken = [n for n in names if MISSES.taken(n)]
    assert taken and all("q_proj" in n or ".layers." not in n or not n.endswith(MISSES.checkpoint) for n in taken)
    assert not any(n.endswith(MISSES.checkpoint) for n in taken)  # no sink, no expert: the reload would drop them
    assert len(taken) + LAYERS * 5 == len(names)  # each missed tensor is the replay's, once
