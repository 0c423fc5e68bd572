"""A test-only SGLang custom weight loader that loads nothing: it saves, from each TP worker, every tensor its model
holds (`fingerprint._model_owned`: parameters, buffers and tensors of the modules' plain objects) whose name begins
with a prefix, as CPU copies, and the fingerprints the proof takes of them (`fingerprint.model_fingerprints`: kernel
storage unswizzled, kept sources left out), to `<path>.rank<r>` (torch.save: {"tensors": {name: tensor},
"fingerprints": {name: int}}), for tests/gpu/test_sglang_lowbit_gpu.py to compare with a version's files tensor by
tensor. Registered through `rollout.sglang.extra.custom_weight_loader`; the request is one empty tensor whose name is
JSON ({"dump": path, "prefix": prefix}), sent as offpolicy's fingerprint request is (local.py `_send`)."""

from __future__ import annotations

import json

import torch

from offpolicy.rollout.engines import fingerprint as fp
from offpolicy.rollout.engines.sglang.worker import rank_world

LOADER = "tests.gpu.sglang_dump.dump"


def dump(model: torch.nn.Module, named_tensors: list) -> None:
    for name, _ in named_tensors:
        req = json.loads(name)
        rank, _ = rank_world()
        with torch.inference_mode():
            saved = {"tensors": {n: t.detach().to("cpu", copy=True) for n, _, t in fp._model_owned(model)
                                 if n.startswith(req["prefix"])},
                     "fingerprints": {n: v for n, v in fp.model_fingerprints(model).items()
                                      if n.startswith(req["prefix"])}}
        torch.save(saved, f"{req['dump']}.rank{rank}")
