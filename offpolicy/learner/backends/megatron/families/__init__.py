"""The model families of the Megatron backend, found by config.json `model_type`: the one module that
imports every family module (`llama.py`, `gpt_oss.py`; their hooks: `family.Family`), and nothing
among them imports it back. `from_hf` turns an HF config.json into an `arch.Arch` through its family,
`stage_params` lists a pipeline stage's Megatron parameters (the shared embedding, final norm and
output layer from `mapping`, each decoder layer from its family's `layer_params`). Adding a family =
adding a module and one entry in `FAMILIES`.
"""

from __future__ import annotations

from typing import Any

from offpolicy.learner.backends.megatron.arch import Arch, ArchError
from offpolicy.learner.backends.megatron.families import gpt_oss, llama
from offpolicy.learner.backends.megatron.families.base import Family
from offpolicy.learner.backends.megatron.mapping import Param

FAMILIES: tuple[Family, ...] = (llama.FAMILY, gpt_oss.FAMILY)


def supported() -> dict[str, str]:
    """Every model_type the backend maps, with its transformers class."""
    return {t: cls for f in FAMILIES for t, cls in f.model_types.items()}


def get(model_type: str | None) -> Family:
    """The family of `model_type`; ArchError naming the supported ones otherwise."""
    for f in FAMILIES:
        if model_type in f.model_types:
            return f
    raise ArchError(f"config.json model_type {model_type!r} is not supported by learner.backend=megatron: "
                     f"use one of {sorted(supported())} or learner.backend=torch")


def from_hf(cfg: dict[str, Any]) -> Arch:
    """The `Arch` of an HF config.json mapping; raises ArchError for what is not supported."""
    return get(cfg.get("model_type")).from_hf(cfg)


def stage_params(arch: Arch, pp_rank: int, pp: int, *, te: bool = False, ep: int = 1,
                 grouped: bool = True) -> list[Param]:
    """Every parameter of pipeline stage `pp_rank`, in module order (experts of every EP rank; stacked
    when `grouped`, else SequentialMLP's)."""
    family = get(arch.model_type)
    per = arch.num_layers // pp
    out: list[Param] = []
    if pp_rank == 0:
        out.append(Param("embedding.word_embeddings.weight", "vocab", ("model.embed_tokens.weight",)))
    for j in range(per):
        out.extend(family.layer_params(arch, pp_rank * per + j, j, ep=ep, te=te, grouped=grouped))
    if pp_rank == pp - 1:
        out.append(Param("decoder.final_layernorm.weight", "rep", ("model.norm.weight",)))
        if not arch.tie_embeddings:
            out.append(Param("output_layer.weight", "vocab", ("lm_head.weight",)))
        elif pp > 1:  # Megatron keeps a copy of the tied embedding on the last stage
            out.append(Param("output_layer.weight", "vocab", ("model.embed_tokens.weight",), export=False))
    return out
