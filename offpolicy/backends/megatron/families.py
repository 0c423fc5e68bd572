"""The model families of the Megatron backend: one module each, found here by config.json `model_type`.

A family module (`llama.py`: Llama, Qwen2, Qwen3, Qwen3-MoE; `gpt_oss.py`: GPT-OSS) holds what is
particular to it: `from_hf` (its config.json fields -> `arch.Arch`), `layer_params` (the HF <-> Megatron
names of one decoder layer, see `mapping.Param`) and, where its checkpoint does not name one tensor per
Megatron parameter piece, a `reader` (checkpoint tensors -> the names `layer_params` uses) and an
`export` (those names -> checkpoint tensors, on rank 0). What families share (embedding, final norm,
output layer, the TP/EP sharding kinds, the TransformerConfig of `Arch`'s features) stays in `arch.py`,
`mapping.py` and `model.py`. Adding a family = adding a module and one entry in `_modules()`.
Invariant: `export(reader(...))` names and values equal the checkpoint's, tensor for tensor.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from offpolicy.backends.megatron.arch import Arch, ArchError

if TYPE_CHECKING:
    import torch

    from offpolicy.backends.megatron.mapping import Param

Getter = Callable[[str], "torch.Tensor"]


class Family:
    """Hooks of one family; the defaults fit checkpoints that name every tensor the mapping reads."""

    model_types: dict[str, str] = {}  # config.json model_type -> transformers class name
    te = True  # may build Transformer Engine's layer spec (learner.megatron.transformer_impl)

    def from_hf(self, cfg: dict) -> Arch:
        raise NotImplementedError

    def layer_params(self, arch: Arch, i: int, j: int, *, ep: int, te: bool, grouped: bool = True) -> list[Param]:
        """The Megatron parameters of global decoder layer `i` (local number `j` on its stage); experts
        stacked (`grouped`: experts.GroupedExperts) or SequentialMLP's (mapping.expert_params)."""
        raise NotImplementedError

    def reader(self, arch: Arch, source) -> Getter:
        """A `get(name)` of the HF names `layer_params` lists, reading `source` (source.HFSource:
        `get(name, row=None)` of checkpoint names, `row` = one index of the first dimension)."""
        return source.get

    def export(self, arch: Arch, tensors: Iterator[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """Rank 0's stream of (HF name of `layer_params`, tensor) -> the checkpoint's tensors."""
        return tensors


def _modules():
    from offpolicy.backends.megatron import gpt_oss, llama

    return (llama.FAMILY, gpt_oss.FAMILY)


def supported() -> dict[str, str]:
    """Every model_type the backend maps, with its transformers class."""
    return {t: cls for f in _modules() for t, cls in f.model_types.items()}


def get(model_type: str | None) -> Family:
    """The family of `model_type`; ArchError naming the supported ones otherwise."""
    for f in _modules():
        if model_type in f.model_types:
            return f
    raise ArchError(f"config.json model_type {model_type!r} is not supported by learner.backend=megatron: "
                     f"use one of {sorted(supported())} or learner.backend=torch")
