"""What autograd saves per layer of GPT-OSS-20B's (or, ARCH=qwen3, Qwen3-30B-A3B's) full-size layers: the
memory model's activation terms (offpolicy/learner/backends/megatron/memory.py, docs/megatron.md "What a layer saves").

CPU, bf16, `model.build` with a reduced vocabulary; sums the unique storages that
`torch.autograd.graph.saved_tensors_hooks` sees during one forward of `--tokens` packed tokens (documents of
`--seq`), parameters excluded, by module. `--experts grouped` runs the grouped GEMMs on the CPU;
`--attention flash` replaces the core attention's flash function by one saving what `attention._Flash` saves.
Run with TRITON_INTERPRET=1 for the GPU's Triton norm and GLU kernels (their saved tensors):
    TRITON_INTERPRET=1 python benchmarks/saved_activations.py --tokens 512 --layers 1
"""
import argparse
import collections
import os
import sys

import torch

sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[1]))

p = argparse.ArgumentParser()
p.add_argument("--tokens", type=int, default=1024)
p.add_argument("--seq", type=int, default=512)
p.add_argument("--layers", type=int, default=2)
p.add_argument("--experts", default="grouped")  # grouped | sequential
p.add_argument("--attention", default="flash")  # flash (emulated: saves what _Flash saves) | reference
p.add_argument("--vocab", type=int, default=512)
args = p.parse_args()

os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
os.environ.setdefault("MASTER_PORT", "29533")
from offpolicy.learner.backends.megatron.cpu import install as _shim

_shim()
import torch.distributed as dist
from megatron.core import parallel_state as ps
from megatron.core import tensor_parallel

dist.init_process_group("gloo", rank=0, world_size=1)
ps.initialize_model_parallel(1, 1)
tensor_parallel.model_parallel_cuda_manual_seed(0)

from offpolicy.learner.backends.megatron import arch as A
from offpolicy.learner.backends.megatron import families
from offpolicy.learner.backends.megatron import model as model_mod
from offpolicy.learner.backends.megatron.kernels import attention, permutation
from offpolicy.learner.backends.megatron.kernels import experts as X
from offpolicy.learner.backends.megatron.memory import GPT_OSS_20B

QWEN3 = dict(model_type="qwen3_moe", vocab_size=2048, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8, norm_topk_prob=True, num_hidden_layers=2, num_attention_heads=32, num_key_value_heads=4, head_dim=128, tie_word_embeddings=False)
base = QWEN3 if os.environ.get("ARCH") == "qwen3" else GPT_OSS_20B
hf = {**base, "num_hidden_layers": args.layers, "vocab_size": args.vocab}
arch = families.from_hf(hf)
tconfig = A.transformer_config(arch, tp=1, pp=1, sequence_parallel=False, dtype=torch.bfloat16, recompute="none",
                               recompute_layers=1, fused=False)
permutation.install("gather", tconfig)
model = model_mod.build(arch, tconfig, pre=True, post=True, use_te=False, grouped=args.experts == "grouped")
torch.manual_seed(0)
with torch.no_grad():
    for n, q in model.named_parameters():
        if "norm" in n or "layernorm" in n:
            q.fill_(1.0)
        else:
            q.normal_(0, 0.02)

if args.experts == "grouped":
    X.grouped_mm_runs = lambda *a: True  # torch._grouped_mm runs on the CPU in bf16 (tests/unit/test_megatron_experts.py)

if args.attention == "flash":
    class FakeFlash(torch.autograd.Function):
        """_Flash's forward (reference math), saving exactly what _Flash saves: q, k, v, out, lse [H, T] fp32, cu,
        rng, unused, sink."""

        @staticmethod
        def forward(ctx, q, k, v, sink, cu, longest, scale, left):
            bounds = cu.tolist()
            out = attention.reference_attention(q, k, v, bounds, scale, left, sink)
            lse = torch.empty(q.shape[1], q.shape[0], dtype=torch.float32)
            rng, unused = torch.empty(2, dtype=torch.int64), torch.empty(0)
            ctx.save_for_backward(q, k, v, out, lse, cu, rng, unused, sink)
            return out

        @staticmethod
        def backward(ctx, g):
            raise NotImplementedError

    attention._Flash = FakeFlash
    attention.kernel = lambda query, sink: "flash"

params = {q.untyped_storage().data_ptr() for q in model.parameters()}
stack = ["-"]
saved = collections.OrderedDict()  # storage ptr -> (bytes, module, shape, dtype)


def pre(name):
    def f(mod, inp):
        stack.append(name)
    return f


def post(name):
    def f(mod, inp, out):
        stack.pop()
    return f


for name, mod in model.named_modules():
    mod.register_forward_pre_hook(pre(name))
    mod.register_forward_hook(post(name))


def pack(t):
    if isinstance(t, torch.Tensor) and t.device.type != "meta":
        s = t.untyped_storage()
        ptr = s.data_ptr()
        if ptr not in params and ptr not in saved and s.nbytes():
            import traceback
            fn = [f for f in traceback.extract_stack()[:-1] if "site-packages/torch/" not in f.filename][-1]
            saved[ptr] = (s.nbytes(), stack[-1], tuple(t.shape), str(t.dtype).replace("torch.", ""),
                          f"{os.path.basename(fn.filename)}:{fn.lineno}")
    return t


T, s = args.tokens, args.seq
bounds = list(range(0, T + 1, s))
ids = torch.randint(0, args.vocab, (1, T))
positions = (torch.arange(T) % s)[None]
pk = attention.packing(bounds, torch.device("cpu"))
with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), model_mod.hidden_states(model, positions[0], s):
    hidden = model(input_ids=ids, position_ids=positions, attention_mask=None, packed_seq_params=pk)
print("hidden", hidden.shape, hidden.dtype)

by = collections.defaultdict(int)
for nb, mod, shape, dt, where in saved.values():
    print(f"{nb / T:10.1f} B/token  {mod:55s} {shape!s:28s} {dt:9s} {where}")
    by[mod] += nb
print("\nper module (bytes per token):")
layer = collections.defaultdict(float)
for mod, nb in by.items():
    print(f"  {mod:55s} {nb / T:10.1f}")
    parts = mod.split(".")
    if "layers" in parts:
        i = parts.index("layers")
        layer[int(parts[i + 1])] += nb / T
print("per layer:", {k: round(v, 1) for k, v in layer.items()})
