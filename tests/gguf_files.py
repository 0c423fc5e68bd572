"""A tiny GGUF model file written on this machine (no download), in the layout llama.cpp's converter writes.

`write_gguf(path)` draws a tiny Llama with tied embeddings (transformers, seeded) and writes it with the
`gguf` package's writer: the llama.* hyperparameters, a byte-level BPE vocabulary ("gpt2": ChatML's
special tokens first, then one token per byte in GPT-2's alphabet, then two merges), a ChatML chat
template, and the tensors under GGUF names with q_proj/k_proj rows reordered as llama.cpp stores them
(its rotary layout: within each head, the first and second halves of the rotary pairs interleaved).
The MLP weights are stored as Q4_1 (4-bit, the SmolLM2 package's format), the rest as F32. Returns the
HF model and the float32 tensors a correct import must give back: the drawn ones, with the Q4_1
tensors replaced by the gguf package's own dequantization of what was written.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from tests.hf_tokenizer import _byte_alphabet

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MERGES = [("h", "e"), ("Ġ", "t")]
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
ARCH = dict(model_type="llama", hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=128, rms_norm_eps=1e-5, rope_theta=10000.0,
            tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, pad_token_id=0)
LAYER = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
         "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output", "post_attention_layernorm": "ffn_norm",
         "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}


def vocabulary() -> list[str]:
    return SPECIALS + _byte_alphabet() + ["".join(m) for m in MERGES]


def _rotary_rows(w: np.ndarray, heads: int) -> np.ndarray:
    """q/k rows in llama.cpp's order: per head, rows (0, d/2, 1, d/2+1, ...) of HF's rotate-half layout."""
    d = w.shape[0] // heads
    return w.reshape(heads, 2, d // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def gguf_name(hf: str) -> str:
    if hf == "model.embed_tokens.weight":
        return "token_embd.weight"
    if hf == "model.norm.weight":
        return "output_norm.weight"
    _, _, i, rest = hf.split(".", 3)
    return f"blk.{i}.{LAYER[rest.removesuffix('.weight')]}.weight"


def write_gguf(path: str | Path, seed: int = 0) -> tuple[torch.nn.Module, dict[str, torch.Tensor]]:
    import gguf
    from gguf.quants import dequantize, quantize
    from transformers import AutoConfig, AutoModelForCausalLM

    vocab = vocabulary()
    arch = dict(ARCH, vocab_size=len(vocab))
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**arch), dtype=torch.float32).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn(p.shape))  # norms not all 1: a wrong mapping shows
    q4 = gguf.GGMLQuantizationType.Q4_1
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name("tiny-llama")
    w.add_context_length(arch["max_position_embeddings"])
    w.add_embedding_length(arch["hidden_size"])
    w.add_block_count(arch["num_hidden_layers"])
    w.add_feed_forward_length(arch["intermediate_size"])
    w.add_head_count(arch["num_attention_heads"])
    w.add_head_count_kv(arch["num_key_value_heads"])
    w.add_rope_dimension_count(arch["hidden_size"] // arch["num_attention_heads"])
    w.add_rope_freq_base(arch["rope_theta"])
    w.add_layer_norm_rms_eps(arch["rms_norm_eps"])
    w.add_vocab_size(len(vocab))
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(vocab)
    w.add_token_types([gguf.TokenType.CONTROL] * len(SPECIALS) + [gguf.TokenType.NORMAL] * (len(vocab) - 3))
    w.add_token_merges([" ".join(m) for m in MERGES])
    w.add_bos_token_id(arch["bos_token_id"])
    w.add_eos_token_id(arch["eos_token_id"])
    w.add_pad_token_id(arch["pad_token_id"])
    w.add_add_bos_token(False)
    w.add_chat_template(CHATML)
    expected = {}
    for name, t in model.state_dict().items():
        if name == "lm_head.weight":
            continue  # tied: a GGUF without output.weight
        a = t.numpy().astype(np.float32)
        if name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = arch["num_attention_heads" if "q_proj" in name else "num_key_value_heads"]
            a = _rotary_rows(a, heads)
        if ".mlp." in name:
            packed = quantize(a, q4)
            w.add_tensor(gguf_name(name), packed, raw_shape=packed.shape, raw_dtype=q4)
            expected[name] = torch.from_numpy(dequantize(packed, q4).reshape(t.shape).copy())
        else:
            w.add_tensor(gguf_name(name), a)
            expected[name] = t.clone()
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return model, expected
