"""Proof that an SGLang engine or server holds a weight version by fingerprint, where SGLang has no read-back.

The vLLM engine's proof (offpolicy/rollout/engines/fingerprint.py), run in SGLang's TP workers by offpolicy's custom
weight loader (`worker.py`): SGLang calls it through `update_weights_from_tensor` with one empty tensor whose name is
the request, and each worker writes a report file (docs/sglang.md, "The proof of a load"). `FingerprintProof` is one
engine's or server's state across loads:
- `send(name)` is how the backend asks SGLang for it: in process `sglang.Engine.update_weights_from_tensor`, over
  HTTP `POST /update_weights_from_tensor` with the request pickled as SGLang's own client does (`serialized`); it
  answers SGLang's (success, message). `unavailable` says why SGLang cannot run it at all (`why_unavailable`);
- `baseline(path)`, right after the engine's own start on the checkpoint at `path`: the offset of each module group
  (`worker.group_of`), the model's fingerprint minus the files'; constant buffers and padding are in it; and the same
  by group and tensor kind (`worker.kind_key`), for a failed proof's detail;
- `prove(path, version, where)`, after a load: proven when every group's fingerprint minus its offset equals the
  version's files' (TP shards summed, a tensor replicated on every rank or every attention-DP group counted once:
  `tensors`), and some group differs from the previous version this engine held (or there was none); a group that
  differs raises WeightUpdateError naming it, whether it holds the previous version's values, its tensors that
  kept their fingerprint of the last proven load, and which of its tensor kinds that both the model and the files
  have differ (`kinds_said`: SGLang's fused `qkv_proj.weight_scale_inv` against the files' `q/k/v_proj.` ones);
- a proof that cannot run (SGLang refuses the request, no report or an error in one) leaves the load unproven, with
  why, and is not asked again; once one ran on this engine, one that cannot fails the load. A start's own load
  defines the offset: it is recorded unproven; a restart (MXFP4) is proven against the offset of the first start.
"""

from __future__ import annotations

import base64
import json
import logging
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from offpolicy.rollout.engines import fingerprint as fp
from offpolicy.rollout.engines.errors import WeightUpdateError
from offpolicy.rollout.engines.sglang.pickling import pickled
from offpolicy.rollout.engines.sglang.worker import (KIND_SEP, LOADER, Cast, by_group, files_totals, group_of,
                                                     kind_key, request)

log = logging.getLogger("offpolicy.sglang")

SHOWN = 6  # groups (and tensors of a group) a failed proof names at most


class Unavailable(Exception):
    """The fingerprint proof could not run (why)."""


def serialized(name: str) -> str:
    """The request as one entry of `serialized_named_tensors`: [(name, empty float32 tensor)] pickled by the
    multiprocessing pickler with torch's reductions (`pickling.pickled`: a CPU tensor, which SGLang's device-UUID patch
    of the reductions cannot pickle), base64 (what SGLang's MultiprocessingSerializer makes, 0.5.14
    `utils/common.py:2339-2361`, and reads back with its SafeUnpickler, 2364-2452: only torch classes here)."""
    import torch

    return base64.b64encode(pickled([(name, torch.empty(0))])).decode()


def why_unavailable(args: dict[str, Any], weights_format: str) -> tuple[str, int]:
    """Why SGLang with these ServerArgs (an Engine's keyword arguments, or a server's /server_info) cannot run the
    fingerprint ("" when it can), and the attention TP size (ranks per attention-DP group)."""
    tp = int(args.get("tp_size") or 1)
    dp = int(args.get("dp_size") or 1)
    if args.get("enable_dp_attention"):  # 0.5.14: dp_size is the attention-DP group count
        attn_dp, replicas = dp, 1
    else:
        attn_dp, replicas = int(args.get("attn_dp_size") or 1), dp
    if LOADER not in (args.get("custom_weight_loader") or []):
        return (f"SGLang was not started with offpolicy's fingerprint loader (custom_weight_loader {LOADER}: the "
                f"in-process engine adds it; launch a server with --custom-weight-loader {LOADER})"), tp
    if replicas > 1:
        return ("dp_size > 1 without DP attention: SGLang's update_weights_from_tensor needs dp_size 1 (0.5.14 "
                "managers/tokenizer_control_mixin.py:470-472)"), tp
    if int(args.get("pp_size") or 1) > 1:
        return "pp_size > 1: the fingerprint's replicated tensors are told apart within one pipeline stage only", tp
    if args.get("quantization") and weights_format == "native":
        return (f"SGLang quantizes the model itself (quantization {args.get('quantization')!r}): its weights are not "
                "the version's values"), tp
    return "", max(1, tp // max(1, attn_dp))


def tensors(reports: list[dict], attn_tp_size: int) -> dict[str, int]:
    """Each tensor's fingerprint over the ranks (rank order): replicated on every rank, or identical in every
    attention-DP group (`attn_tp_size` consecutive ranks, SGLang's layout: 0.5.14 `layers/dp_attention.py:245-259`),
    it counts once (one group); else its shards are summed (`fingerprint.combined`)."""
    ranks = [{k: int(v) for k, v in r["tensors"].items()} for r in reports]
    size = attn_tp_size if 0 < attn_tp_size < len(ranks) and len(ranks) % attn_tp_size == 0 else len(ranks)
    out = {}
    for name in sorted({n for r in ranks for n in r}):
        values = [r.get(name) for r in ranks]
        chunks = [values[i:i + size] for i in range(0, len(values), size)]
        if len(chunks) > 1 and all(c == chunks[0] for c in chunks):
            values = chunks[0]
        out[name] = fp.combined([v for v in values if v is not None], len(values))
    return out


def grouped(per_name: dict[str, int]) -> dict[str, int]:
    return fp.totals((group_of(name), value) for name, value in per_name.items())


def by_kind(per_name: dict[str, int]) -> dict[str, int]:
    """Fingerprints by tensor name summed by `worker.kind_key`."""
    return fp.totals((kind_key(name), value) for name, value in per_name.items())


def files_of(reports: list[dict]) -> dict[str, int]:
    """The version's files' fingerprint by group: each rank hashed its share."""
    return fp.totals((g, int(value)) for r in reports for g, value in (r.get("files") or {}).items())


def kinds_of(reports: list[dict]) -> dict[str, int] | None:
    """The version's files' fingerprint by group and tensor kind (`worker.kind_key`), or None where a report has
    none (a worker of an older offpolicy)."""
    if any("files_kinds" not in r for r in reports):
        return None
    return fp.totals((k, int(value)) for r in reports for k, value in r["files_kinds"].items())


def split(ahead: dict[str, int]) -> tuple[dict[str, int], dict[str, int] | None]:
    """Files hashed by the daemon (`FingerprintProof.files_hash`: by `worker.kind_key`) by group, and by group and
    kind (None where they came by group alone)."""
    kinds = {k: v for k, v in ahead.items() if KIND_SEP in k}
    return by_group(ahead), kinds if len(kinds) == len(ahead) else None


def offsets(model: dict[str, int], files: dict[str, int]) -> dict[str, int]:
    """The model's fingerprint minus the files', key by key (a group, or a `kind_key`)."""
    return {k: fp.sub(model.get(k, fp.ZERO), files.get(k, fp.ZERO)) for k in {*model, *files}}


def kinds_said(group: str, held: dict[str, int], files: dict[str, int]) -> str:
    """What a differing group's tensor kinds say (`held`: the model's fingerprints by `worker.kind_key` less their
    offsets; `files`: the version's): which of the kinds both sides have differ and which match, then the kinds of one
    side only (SGLang's `w13_weight`, the files' `gate_up_proj`), not compared; "" where the group has no kinds."""
    ours, theirs = ({k.partition(KIND_SEP)[2]: v for k, v in d.items() if k.partition(KIND_SEP)[0] == group}
                    for d in (held, files))
    both = sorted(ours.keys() & theirs.keys())
    differ = [k for k in both if ours[k] != theirs[k]]
    match = [k for k in both if ours[k] == theirs[k]]
    parts = [f"{_listed(differ)} differ{'s' * (len(differ) == 1)}" if differ else "",
             f"{_listed(match)} match{'es' * (len(match) == 1)}" if match else "",
             f"only SGLang's: {_listed(sorted(ours.keys() - theirs.keys()))}" if ours.keys() - theirs.keys() else "",
             f"only the files': {_listed(sorted(theirs.keys() - ours.keys()))}" if theirs.keys() - ours.keys() else ""]
    said = "; ".join(p for p in parts if p)
    return f" (by tensor kind: {said})" if said else ""


def _listed(names: list[str]) -> str:
    return ", ".join(names[:SHOWN]) + (f" and {len(names) - SHOWN} more" if len(names) > SHOWN else "")


class FingerprintProof:
    def __init__(self, send: Callable[[str], tuple[bool, str]], attn_tp_size: int = 1, unavailable: str = ""):
        self.send, self.attn_tp_size, self.unavailable = send, attn_tp_size, unavailable
        self.offset: dict[str, int] | None = None  # per group, from the baseline
        self.kind_offset: dict[str, int] | None = None  # per `worker.kind_key`, from the baseline (None: no kinds)
        self.why = unavailable or "no fingerprint baseline was taken (the engine's start)"  # while offset is None
        self.ran = False  # a proof ran on this engine
        # the last proven load (or the baseline): its label, the version (None: the baseline), files and tensors
        self.last: tuple[str, int | None, dict[str, int], dict[str, int]] | None = None
        self.cast: Cast | None = None  # how the model holds the files' tensors (the baseline's reports): files_hash

    def files_hash(self, tensors) -> dict[str, int] | None:
        """The files' half of a proof, computed by the caller (ahead of the load, `files_ahead.py`): the fingerprint of a
        version's (name, tensor) pairs as the workers would hash them, by group and tensor kind (`worker.kind_key`:
        fingerprints of windows add up key by key); None until a baseline gave the cast, or for no tensors (the
        workers then hash the files at the load)."""
        if self.cast is None or self.offset is None:
            return None
        totals, count = files_totals(tensors, self.cast)
        return totals if count else None

    def collect(self, files: str | None) -> list[dict]:
        """Every worker's report (rank order); raises Unavailable."""
        where = Path(tempfile.mkdtemp(prefix="offpolicy-sglang-fingerprint-", dir=report_root()))
        try:
            ok, message = self.send(request(str(where), files))
            if not ok:
                raise Unavailable(f"SGLang refused the fingerprint request: {message}")
            reports = [json.loads(p.read_text()) for p in sorted(where.glob("rank*.json"))]
        finally:
            shutil.rmtree(where, ignore_errors=True)
        if not reports:
            raise Unavailable("SGLang took the fingerprint request but no worker wrote a report (a draft model's "
                              "worker, or another SGLang?)")
        wrong = [f"rank {r.get('rank')}: {r['error']}" for r in reports if "error" in r]
        if wrong:
            raise Unavailable(f"offpolicy's fingerprint loader failed in SGLang's workers: {'; '.join(wrong)}")
        reports.sort(key=lambda r: r["rank"])
        if [r["rank"] for r in reports] != list(range(int(reports[0]["world"]))):
            raise Unavailable(f"reports of ranks {[r['rank'] for r in reports]} of a world of {reports[0]['world']}")
        if files is not None and not sum(int(r.get("files_tensors", 0)) for r in reports):
            raise Unavailable(f"{files} holds no safetensors files SGLang's workers could read")
        if any(r.get("replicated_kv") for r in reports):
            raise Unavailable("SGLang repeats KV heads on several TP ranks (tp_size > num_key_value_heads): those rows "
                              "count several times in the model's fingerprint, once in the files'")
        return reports

    def baseline(self, path: str) -> None:
        """The offset of each group, right after the engine's own start on the checkpoint at `path`."""
        if self.offset is not None or self.unavailable:  # kept across restarts (MXFP4); or SGLang cannot run it
            return
        try:
            reports = self.collect(path)
        except Unavailable as e:
            self.why = f"no fingerprint baseline of the launch checkpoint {path}: {e}"
            log.warning("%s; SGLang loads without a read-back are recorded unproven", self.why)
            return
        model, files, kinds = tensors(reports, self.attn_tp_size), files_of(reports), kinds_of(reports)
        self.offset = offsets(grouped(model), files)
        self.kind_offset = None if kinds is None else offsets(by_kind(model), kinds)
        self.cast = Cast.from_json(reports)
        self.last = ("the launch checkpoint", None, files, model)
        log.info("fingerprint baseline of %s: %d tensors in %d groups, %d hashed of the files", path, len(model),
                 len(self.offset), sum(int(r.get("files_tensors", 0)) for r in reports))

    def prove(self, path: str, version: int, where: str, start: bool = False,
              ahead: dict[str, int] | None = None) -> dict:
        """The load's record (`verified`, `groups`, `changed`, `proof_seconds`, `files_ahead`, `why` when unproven);
        raises WeightUpdateError when a group differs (the module docstring). `start`: the engine has just started on
        this version, whose load defined the offset. `ahead`: the version's files already hashed (`files_hash`): the
        workers then hash only the model."""
        t0 = time.perf_counter()
        record: dict[str, Any] = {"proof": "fingerprint", "verified": False, "tensors": [], "groups": [],
                                  "changed": []}

        def unproven(why: str) -> dict:
            return {**record, "why": why, "proof_seconds": time.perf_counter() - t0}

        if self.offset is None:
            return unproven(self.why)
        if start:
            return unproven("the engine started on this version: its own load defines the fingerprint's offset")
        try:
            reports = self.collect(path if ahead is None else None)
        except Unavailable as e:
            if self.ran:
                raise WeightUpdateError(f"{where}: after loading weight version {version} from {path} the fingerprint "
                                        f"proof, which ran before, could not: {e}") from None
            self.offset, self.why = None, str(e)
            log.warning("%s: %s; its loads are recorded unproven", where, e)
            return unproven(self.why)
        model = tensors(reports, self.attn_tp_size)
        files, kinds = (files_of(reports), kinds_of(reports)) if ahead is None else split(ahead)
        held = grouped(model)
        groups = sorted({*held, *files, *self.offset})
        held = {g: fp.sub(held.get(g, fp.ZERO), self.offset.get(g, fp.ZERO)) for g in groups}
        wrong = [g for g in groups if held[g] != files.get(g, fp.ZERO)]
        if wrong:
            what = self._described(wrong, held, model, files, self._kinds(model, kinds))
            raise WeightUpdateError(f"{where}: after loading weight version {version} from {path} the fingerprints of "
                                    f"SGLang's tensors are not the version's: {what}; it generates no more until a "
                                    "load succeeds (docs/sglang.md, 'The proof of a load')")
        self.ran = True
        last = self.last if self.last is not None and self.last[1] is not None else None
        changed = [g for g in groups  # the groups of the version's files that differ from the last version's
                   if (g in files if last is None else files.get(g, fp.ZERO) != last[2].get(g, fp.ZERO))]
        self.last = (f"version {version}", version, files, model)
        parts = {k: max(float(r.get(f"{k}_seconds", 0.0)) for r in reports) for k in ("hash_model", "hash_files")}
        record.update(groups=groups, changed=changed, proof_seconds=time.perf_counter() - t0,
                      files_ahead=ahead is not None, **{f"{k}_seconds": v for k, v in parts.items()})
        if last is not None and not changed:
            return {**record, "why": f"the version's files hold the same values as version {last[1]}'s: the "
                                     "fingerprint cannot tell this load from none"}
        return {**record, "verified": True}

    def _kinds(self, model: dict[str, int], files: dict[str, int] | None) -> tuple[dict, dict] | None:
        """The model's fingerprints by `worker.kind_key` less their offsets, and the files' (`kinds_said`); None where
        the baseline or this proof has no kinds."""
        if files is None or self.kind_offset is None:
            return None
        return {k: fp.sub(v, self.kind_offset.get(k, fp.ZERO)) for k, v in by_kind(model).items()}, files

    def _described(self, wrong: list[str], held: dict[str, int], model: dict[str, int],
                   files: dict[str, int], kinds: tuple[dict, dict] | None = None) -> str:
        """Each differing group, with whether it holds the last proven load's files, which of its tensors kept their
        fingerprint of that load, or, where the version's files of the group did not change, which changed anyway
        (a tensor SGLang changes itself: a cache or buffer the proof should leave out); then, with `kinds`, which of
        its tensor kinds differ (`kinds_said`; not for a group that holds the last load's values: all that changed)."""
        out = []
        for g in wrong[:SHOWN]:
            text, said = g, kinds_said(g, *kinds) if kinds is not None else ""
            if self.last is not None:
                label, _, files_then, tensors_then = self.last
                mine = {n: v for n, v in model.items() if group_of(n) == g}
                if held[g] == files_then.get(g, fp.ZERO):
                    text, said = text + f" (it still holds {label}'s values)", ""  # its kinds say no more
                elif files.get(g, fp.ZERO) == files_then.get(g, fp.ZERO):
                    moved = [n for n, v in mine.items() if tensors_then.get(n) != v]
                    text += f" ({', '.join(moved[:SHOWN]) or 'nothing'} changed since {label}, the files did not)"
                else:
                    kept = [n for n, v in mine.items() if tensors_then.get(n) == v]
                    if kept:
                        text += f" ({', '.join(kept[:SHOWN])} unchanged since {label})"
            out.append(text + said)
        return "; ".join(out) + (f"; and {len(wrong) - SHOWN} more groups" if len(wrong) > SHOWN else "")


def report_root() -> str | None:
    """Where the workers' reports go: /dev/shm where there is one (an SGLang server on this node reads the weight
    store there already), else the temporary directory."""
    return "/dev/shm" if Path("/dev/shm").is_dir() else None
