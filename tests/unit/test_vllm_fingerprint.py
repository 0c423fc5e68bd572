"""The weight fingerprint (offpolicy/rollout/engines/fingerprint.py) against a pure-Python reference, and
the layouts vLLM gives a checkpoint's tensors (fused, sharded, padded, tied, held by kernel objects)."""

import torch

from offpolicy.rollout.engines import fingerprint as fp


def reference(t: torch.Tensor) -> int:
    """Sum of splitmix64 over the non-zero elements' bit patterns, in plain Python integers."""
    size = t.element_size()
    view = {1: torch.uint8, 2: torch.int16, 4: torch.int32}[size]
    mask = (1 << (8 * size)) - 1
    bits = t.reshape(-1).view(view).tolist()
    return sum(fp.mix_reference(b & mask) for b, v in zip(bits, t.reshape(-1).tolist()) if v != 0) % fp.M


def test_matches_the_python_reference_for_each_dtype():
    g = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.float8_e4m3fn, torch.float8_e5m2):
        t = torch.randn(3000, generator=g).to(dtype)
        t[::7], t[::11] = 0.0, -0.0  # neither zero counts
        assert fp.tensor_fingerprint(t) == reference(t)
        assert fp.tensor_fingerprint(t, chunk=7) == reference(t)  # chunked sums agree


def test_byte_patterns_hash_by_value_not_by_bits():
    """1- and 2-byte elements are hashed by a histogram of their bit patterns: every pattern whose value is zero is
    left out (float8_e4m3fnuz's 0x80 is NaN, not -0: it counts), every other counts, as the element-wise sum does."""
    g = torch.Generator().manual_seed(1)
    every = torch.arange(256, dtype=torch.int64).to(torch.uint8)
    for dtype in (torch.uint8, torch.int8, torch.float8_e4m3fn, torch.float8_e4m3fnuz, torch.float8_e5m2):
        t = torch.cat([every, torch.randint(0, 256, (5000,), generator=g).to(torch.uint8)]).view(dtype)
        assert fp.tensor_fingerprint(t) == reference(t) == fp.tensor_fingerprint(t, chunk=100), dtype
    halves = torch.arange(1 << 16, dtype=torch.int32).to(torch.int16)  # every bf16 / fp16 pattern, NaNs included
    for dtype in (torch.bfloat16, torch.float16):
        assert fp.tensor_fingerprint(halves.view(dtype)) == reference(halves.view(dtype)), dtype


def test_layout_does_not_matter_but_every_element_does():
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(8, 4, generator=g) for _ in range(3))
    files = fp.total(fp.tensor_fingerprint(x) for x in (q, k, v))
    fused = torch.cat([q, k, v])  # vLLM's qkv_proj
    assert fp.tensor_fingerprint(fused) == files
    assert fp.tensor_fingerprint(fused.t().contiguous()) == files
    assert fp.tensor_fingerprint(torch.cat([fused, torch.zeros(5, 4), -torch.zeros(2, 4)])) == files  # padding
    shards = fused.chunk(2, dim=1)  # two TP ranks
    assert fp.combine([{"qkv": fp.tensor_fingerprint(shards[0])}, {"qkv": fp.tensor_fingerprint(shards[1])}]) == files
    stale = fused.clone()
    stale[3, 2] = torch.nextafter(stale[3, 2], torch.tensor(10.0))  # one element one ulp off
    assert fp.tensor_fingerprint(stale) != files


def test_combine_counts_replicated_tensors_once():
    norm = fp.tensor_fingerprint(torch.ones(4) * 0.5)
    shard_a, shard_b = fp.tensor_fingerprint(torch.tensor([1.0, 2.0])), fp.tensor_fingerprint(torch.tensor([3.0, 4.0]))
    ranks = [{"norm": norm, "w": shard_a}, {"norm": norm, "w": shard_b}]
    assert fp.combine(ranks) == fp.total([norm, shard_a, shard_b])
    assert fp.combine([{"norm": norm}]) == norm


class Impl:  # a kernel object holding its own reference to a weight (vLLM's attention impl and GPT-OSS sinks)
    def __init__(self, sinks):
        self.sinks = sinks


class Layer(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(4, 4, bias=False)
        self.sinks = torch.nn.Parameter(torch.randn(2))
        self.impl = Impl(self.sinks.data)
        self.register_buffer("kv_cache", torch.randn(16))  # changes with every request: left out
        self.packed = self.proj.weight.data.t().contiguous()  # a kernel's repacked copy: counted


def test_module_tensors_sees_kernel_copies_once_and_skips_caches():
    torch.manual_seed(0)
    layer = Layer()
    names = dict(fp.module_tensors(layer))
    assert set(names) == {"proj.weight", "sinks", "packed"}  # impl.sinks shares sinks' storage: counted once
    before = fp.combine([fp.model_fingerprints(layer)])
    layer.kv_cache.add_(1.0)
    assert fp.combine([fp.model_fingerprints(layer)]) == before
    layer.impl.sinks = layer.sinks.data.clone() + 1.0  # the kernel object keeps a stale copy: the hash sees it
    assert fp.combine([fp.model_fingerprints(layer)]) != before


def test_files_fingerprint_casts_to_the_engine_dtype():
    w = torch.randn(64, dtype=torch.float32)
    assert fp.files_fingerprint([("w", w)], torch.bfloat16) == fp.tensor_fingerprint(w.to(torch.bfloat16))
    assert fp.files_fingerprint([("w", w)], None) == fp.tensor_fingerprint(w)


def test_fp8_scales_count_as_stored_as_the_loaders_keep_them_float32():
    """vLLM keeps an fp8 version's `weight_scale_inv` float32 in a bf16 model: cast to bf16, their hash would
    change with every version's values, so the engine - files offset would not be constant."""
    s = torch.rand(4, 4, dtype=torch.float32) + 0.5
    q = torch.randn(8, 8).to(torch.float8_e4m3fn)
    got = fp.files_fingerprint([("m.weight", q), ("m.weight_scale_inv", s)], torch.bfloat16)
    assert got == fp.add(fp.tensor_fingerprint(q), fp.tensor_fingerprint(s))
    assert got != fp.add(fp.tensor_fingerprint(q), fp.tensor_fingerprint(s.to(torch.bfloat16)))


def test_kernel_wrapped_experts_hash_like_their_checkpoint(monkeypatch):
    """vLLM 0.26's Triton MXFP4 experts (tests/kernel_wrappers.py): the swizzled values are unswizzled (a few experts
    at a time) before hashing, the scales found in the quant method's precision config, and the float32 biases
    compared with the files' biases as float32: the model then hashes like the checkpoint, with no offset."""
    from tests.kernel_wrappers import Model, checkpoint

    parts, files = checkpoint(0)
    model = Model(parts)
    assert fp.kernel_wrapped(model) and not fp.kernel_wrapped(Layer())
    names = fp.model_fingerprints(model)
    assert {"layers.0.mlp.experts.w13_weight.storage",
            "layers.0.mlp.experts.quant_method.w13_precision_config.weight_scale.storage"} <= set(names)
    blocks = parts[0][0]
    assert names["layers.0.mlp.experts.w13_weight.storage"] == fp.tensor_fingerprint(blocks)
    swizzled = model.layers[0].mlp.experts.w13_weight.storage.data
    assert fp.tensor_fingerprint(swizzled) != fp.tensor_fingerprint(blocks)  # why the unswizzle is needed
    assert fp.widened_expert_biases(model, torch.bfloat16) and not fp.widened_expert_biases(model, torch.float32)
    engine = fp.total(names.values())
    assert engine == fp.files_fingerprint(files, torch.bfloat16, widened_biases=True)
    assert engine != fp.files_fingerprint(files, torch.bfloat16)  # the biases as bf16: another hash
    for per_call in (1, 1 << 40):  # one expert a call, all at once: the same hash
        monkeypatch.setattr(fp, "UNSWIZZLE_BYTES", per_call)
        assert fp.total(fp.model_fingerprints(model).values()) == engine


def test_scales_kept_beside_their_kernel_copy_count_once():
    """SGLang 0.5.14's MXFP4 experts on Hopper keep the scales' Parameter beside the triton_kernels copy (on the GPU,
    twenty-third session, each restart's proof failed by the scales counted twice): counted once, the model hashes
    like the checkpoint; a kept Parameter that differs from the kernel's copy (one of them written by a load) counts."""
    from tests.kernel_wrappers import Model, checkpoint

    parts, files = checkpoint(1)
    model = Model(parts, kept_scales=True)
    names = fp.model_fingerprints(model)
    assert "layers.0.mlp.experts.w13_weight_scale" not in names
    assert fp.total(names.values()) == fp.files_fingerprint(files, torch.bfloat16, widened_biases=True)
    with torch.no_grad():
        model.layers[0].mlp.experts.w13_weight_scale.add_(1)  # the kernel's copy not rewritten
    names = fp.model_fingerprints(model)
    assert "layers.0.mlp.experts.w13_weight_scale" in names
    assert fp.total(names.values()) != fp.files_fingerprint(files, torch.bfloat16, widened_biases=True)


def test_files_fingerprint_widens_only_the_experts_biases():
    b = torch.randn(64).to(torch.bfloat16)
    widened = [("m.experts.up_bias", b, b.float()), ("m.experts.up_proj", b, b), ("m.attn.o_bias", b, b)]
    for name, t, held in widened:
        assert fp.files_fingerprint([(name, t)], torch.bfloat16, widened_biases=True) == fp.tensor_fingerprint(held)
