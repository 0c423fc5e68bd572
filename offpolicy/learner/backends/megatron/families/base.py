"""What a model family of the Megatron backend provides: the `Family` hooks, one subclass per family module.

A family module (`llama.py`: Llama, Qwen2, Qwen3, Qwen3-MoE; `gpt_oss.py`: GPT-OSS) holds what is
particular to it: `from_hf` (its config.json fields -> `arch.Arch`), `layer_params` (the HF <-> Megatron
names of one decoder layer, see `mapping.Param`) and, where its checkpoint does not name one tensor per
Megatron parameter piece, a `reader` (checkpoint tensors -> the names `layer_params` uses) and an
`export` (those names -> checkpoint tensors, on rank 0), with `export_pieces`, its piece-wise twin for
the sharded publish (one parameter's tensors -> whole checkpoint tensors, or rows of a fused one). What families share (embedding, final norm,
output layer, the TP/EP sharding kinds, the TransformerConfig of `Arch`'s features) stays in `arch.py`,
`mapping.py` and `model.py`. Adding a family = adding a module and one entry in `families.FAMILIES`.
Imports run one way: arch <- mapping <- family <- llama, gpt_oss <- families (the lookup by model_type);
nothing here or in a family module imports `families`.
Invariant: `export(reader(...))` names and values equal the checkpoint's, tensor for tensor, and so do
the pieces `export_pieces` gives, put in place by their rows.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from offpolicy.learner.backends.megatron.arch import Arch

if TYPE_CHECKING:
    import torch

    from offpolicy.learner.backends.megatron.mapping import Param

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

    def as_is(self, name: str) -> bool:
        """Whether the checkpoint stores HF name `name` of `layer_params` as it is (`export_pieces` passes it
        through), so that each TP rank may write its own rows of it (the sharded publish's TP path)."""
        return True

    def export_pieces(self, arch: Arch, tensors: list[tuple[str, torch.Tensor]]) -> list[tuple[str, int | None, torch.Tensor]]:
        """One Megatron parameter's tensors (HF names of `layer_params`, `mapping.from_shards`) -> checkpoint
        pieces (name, first row, tensor): row None = the whole tensor, else rows row .. row + len of a
        checkpoint tensor that fuses several parameters' (the sharded publish writes each where it belongs)."""
        return [(n, None, t) for n, t in tensors]
