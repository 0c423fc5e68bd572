"""The in-process SGLang engine: `sglang.Engine` started inside the rollout daemon.

`engine_kwargs` turns the run config into `sglang.Engine(**kwargs)` arguments with SGLang's own
names (ServerArgs fields); it is pure, so it is tested without SGLang. `LocalBackend` imports SGLang
only when it is built. Invariants:
- generation and weight swaps never overlap: the daemon calls them one after the other, and
  `sglang.Engine.generate` blocks until its batch is done, so nothing runs during a swap and no
  pause is needed (SGLang's pause_generation is for its HTTP server);
- a swap goes through the engine's tokenizer manager with an `UpdateWeightFromDiskReqInput`, the
  same call `Engine.update_weights_from_disk` makes, because that method takes no `weight_version`
  in sglang 0.5.23; the version is then read back from the tokenizer manager's `server_args` (what
  `Engine.get_model_info()` reports in 0.5.23; 0.5.14's Engine has no such method);
- after every load (an update, a start on a version) the weights are proven against the version's files
  (`rollout.sglang.proof`, `proof.by_mode`): by SGLang's own read-back `Engine.get_weights_by_name` where the model has
  one (`proof.py`), else by a fingerprint of every tensor computed in SGLang's workers (`fingerprint_proof.py`), which
  `Engine.update_weights_from_tensor` runs through offpolicy's custom weight loader (`worker.py`, registered by
  `engine_kwargs`) and whose offset each start on model.path or a first low-bit version measures; a load whose tensors
  differ fails, and the engine generates no more until a load succeeds; each load leaves a record in `swaps`;
- with a low-bit `rollout.weights_format` (fp8, mxfp4) the engine starts on the first version it
  loads, a pre-quantized checkpoint: SGLang takes its quantization from the checkpoint it starts with
  (`configs/model_config.py` `_verify_quantization`, 2000-2150) and an update only loads tensors into
  the parameters that exist (`model_runner_components/weight_updater.py` 174-258), so a model started
  from `model.path` (unquantized) could never take an fp8 or mxfp4 version;
- an mxfp4 version after the first is loaded by starting the engine again on it (`RESTART_FORMATS`), never
  with update_weights_from_disk: SGLang's MXFP4 MoE (`layers/quantization/mxfp4.py`, `Mxfp4MoEMethod`)
  repacks the experts once loaded, and with the triton_kernels backend (what SGLang picks for GPT-OSS on
  Hopper) deletes `w13_weight` / `w2_weight` (0.5.14 mxfp4.py:807-836, 0.5.23 1046-1075), so a second load
  finds no parameter to load into (0.5.14 `models/gpt_oss.py:969`: KeyError '...experts.w13_weight'); the
  other backends (marlin, flashinfer_mxfp4, the bf16 fallback) replace them with repacked parameters of other
  shapes and no weight loader. Neither 0.5.14 nor 0.5.23 undoes this before a reload (0.5.23's
  `restore_weights_before_loading`, `model_loader/loader.py:1092-1100`, has no MXFP4 override), and the
  failed update's rollback (0.5.14 `model_executor/model_runner.py:1799`) raises the same error outside its
  `try`, which takes the scheduler down. `Engine.shutdown` waits until the scheduler has released the GPU. Where
  `rollout.sglang.mxfp4_load` (auto: an engine of one GPU, `staged.mxfp4_in_place`) lets it, later versions go in as
  tensors through offpolicy's MXFP4 loader instead (`mxfp4_inplace.py`: the experts swizzled into the running
  kernels' storage: a small fraction of a restart's time, docs/sglang.md "Low-bit versions"), staged or
  direct, never from disk;
- an fp8 version in blocks other than 128 x 128 (`weights.fp8_block_size: auto` gives GPT-OSS 64 x 64) starts the
  engine with `fp8_gemm_runner_backend="triton"` unless `rollout.sglang.extra` names one: SGLang's `auto` picks
  DeepGEMM on Hopper where deep_gemm imports (0.5.14 `layers/quantization/fp8_utils.py:489-507`), runs it on every
  linear with N % 64 == 0 and K % 128 == 0 (713) and quantizes the activations in groups of the block, but
  DeepGEMM's sm90 recipe is 128-wide scale groups (its `sf.size(-1) == ceil_div(k, gran_k)` check); CUTLASS
  (503, 670) assumes 128 x 128 too; the Triton block GEMM takes the checkpoint's block;
- SIGQUIT, which SGLang's processes send this one when one of them fails, is ours (`sigquit.py`) from the backend's
  start on: the engine is then lost, the call in flight and every later one raise `EngineLost` (the engine's event
  loop is stopped, so a generate or load waiting on a dead scheduler ends), and the daemon is told
  (`SGLangEngine.on_lost`). Every start of the engine runs off the main thread (`owner.EngineOwner`), where
  SGLang installs no handler of its own (in the main thread its handler would kill the process tree, the daemon
  included, when a scheduler fails at its start): a failed first start raises in the daemon, which logs why;
- the thread that started the engine lives until the engine is shut down (`self.owner`, released after every
  shutdown: close, an mxfp4 restart, a start that failed): SGLang's scheduler and detokenizer are SIGKILLed by the
  kernel when the thread that started them ends (PR_SET_PDEATHSIG, 0.5.14 `srt/utils/common.py:2538-2543`; owner.py).
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
from pathlib import Path
from typing import Any

from offpolicy.config import Config
from offpolicy.plumbing.logs import kept_root_logging
from offpolicy.rollout.engines import sent_samples_first
from offpolicy.rollout.engines.background import Done
from offpolicy.rollout.engines.placement import shared_with_learner
from offpolicy.rollout.engines.sglang import sigquit
from offpolicy.rollout.engines.sglang.files_ahead import FilesAhead
from offpolicy.rollout.engines.sglang.fingerprint_proof import FingerprintProof, serialized, why_unavailable
from offpolicy.rollout.engines.sglang.mxfp4_inplace import LOADER as MXFP4_LOADER
from offpolicy.rollout.engines.sglang.owner import EngineOwner
from offpolicy.rollout.engines.sglang.proof import by_mode, expect, prove
from offpolicy.rollout.engines.sglang.staged import (WindowsHash, direct_requests, engine_device, engine_maps,
                                                     mxfp4_in_place, prefetch_of, staged_loads, staged_record,
                                                     tensor_request, unstaged_of)
from offpolicy.rollout.engines.sglang.worker import LOADER, SYNCED_LOADER
from offpolicy.rollout.engines.sglang.wire import RequestRefused, WeightUpdateError
from offpolicy.rollout.engines.staging import Staged
from offpolicy.weights.formats import NATIVE

log = logging.getLogger("offpolicy.sglang")

# Weight formats whose later versions restart the engine instead of update_weights_from_disk (the module docstring)
RESTART_FORMATS = frozenset({"mxfp4"})


def dp_attention_kwargs(attn_dp_size: int, dp_size: int, fields: set[str] | None) -> dict[str, Any]:
    """SGLang's names for data-parallel attention groups inside TP: `attn_dp_size` where its ServerArgs has that
    field (`fields`; None = assume it does, 0.5.23), else (0.5.14, the GPU machines' build) `enable_dp_attention`
    with `dp_size` as the group count, which then cannot also mean replicas."""
    if fields is None or "attn_dp_size" in fields:
        return {"attn_dp_size": attn_dp_size, "dp_size": dp_size}
    if attn_dp_size == 1:
        return {"dp_size": dp_size}
    if dp_size != 1:
        raise ValueError(f"rollout.sglang.attn_dp_size={attn_dp_size} with dp_size={dp_size}: this SGLang has no "
                         "attn_dp_size (its DP attention takes dp_size as the group count); set dp_size to 1")
    return {"enable_dp_attention": True, "dp_size": attn_dp_size}


def server_args_fields() -> set[str]:
    """The field names of the installed SGLang's ServerArgs (a dataclass)."""
    import dataclasses

    from sglang.srt.server_args import ServerArgs  # late: CUDA-only, heavy

    return {f.name for f in dataclasses.fields(ServerArgs)}


def engine_kwargs(cfg: Config, seed: int, model_path: str | None = None,
                  weight_version: int | None = None, fields: set[str] | None = None) -> dict[str, Any]:
    """`sglang.Engine` keyword arguments of this run (rollout.sglang, model.path, model.dtype); `model_path`
    and `weight_version` start it on a published version instead (a low-bit rollout.weights_format); `fields`:
    the installed ServerArgs' field names (`server_args_fields`), None = 0.5.23's."""
    s = cfg.rollout.sglang
    kw: dict[str, Any] = {
        "model_path": model_path or cfg.model.path,
        "dtype": cfg.model.dtype,
        "tp_size": s.tp_size,
        "ep_size": s.ep_size,
        **dp_attention_kwargs(s.attn_dp_size, s.dp_size, fields),
        "random_seed": seed if s.random_seed is None else s.random_seed,
        "skip_tokenizer_init": s.skip_tokenizer_init,
        "enable_metrics": s.enable_metrics,
    }
    for name in ("quantization", "mem_fraction_static", "attention_backend", "load_format"):
        if getattr(s, name) is not None:
            kw[name] = getattr(s, name)
    if weight_version is not None:
        kw["weight_version"] = str(weight_version)  # srt/arg_groups/fields/serving.py:172-175
    if model_path is not None and (fields is None or "fp8_gemm_runner_backend" in fields):
        kw.update(fp8_gemm_kwargs(model_path))
    extra = dict(s.extra)
    if fields is None or "custom_weight_loader" in fields:  # offpolicy's fingerprint loader (worker.py), beside any
        theirs = extra.pop("custom_weight_loader", None) or []  # the run's extra names
        ours = (LOADER, SYNCED_LOADER, MXFP4_LOADER)
        kw["custom_weight_loader"] = [*ours, *(x for x in theirs if x not in ours)]
    return {**kw, **extra}


def fp8_gemm_kwargs(model_path: str) -> dict[str, Any]:
    """`fp8_gemm_runner_backend="triton"` for an fp8 checkpoint in blocks other than 128 x 128 (the module
    docstring), else nothing; reads the checkpoint's config.json."""
    try:
        config = json.loads((Path(model_path) / "config.json").read_text())
    except (OSError, ValueError):
        return {}
    qc = config.get("quantization_config") or {}
    if qc.get("quant_method") != "fp8" or list(qc.get("weight_block_size") or (128, 128)) == [128, 128]:
        return {}
    return {"fp8_gemm_runner_backend": "triton"}


def shared_gpu_warning(cfg: Config) -> str | None:
    """What to say when the run puts a rollout's in-process engine on a learner GPU with SGLang's KV pool unbounded:
    SGLang sizes the pool from the memory free when it starts, and the learner grows after it (docs/sglang.md,
    "Beside the learner on one GPU"); None otherwise."""
    shared = shared_with_learner(cfg)
    if not shared or "max_total_tokens" in cfg.rollout.sglang.extra:
        return None
    return (f"the in-process SGLang engine shares GPU {', '.join(shared)} with the learner (run.learner_gpus, "
            f"run.rollout_gpus) and its KV pool is unbounded: SGLang sizes it from the memory free at its start "
            f"({_share(cfg.rollout.sglang.mem_fraction_static)} of the GPU), which the learner needs later; set "
            "rollout.sglang.extra.max_total_tokens (docs/sglang.md, 'Beside the learner on one GPU')")


def _share(fraction: float | None) -> str:
    return "SGLang's default share" if fraction is None else f"rollout.sglang.mem_fraction_static {fraction}"


class LocalBackend:
    def __init__(self, cfg: Config, seed: int):
        self.cfg, self.seed = cfg, seed
        self.load_format = cfg.rollout.sglang.load_format
        inplace = mxfp4_in_place(cfg)
        self.restart = cfg.rollout.weights_format in RESTART_FORMATS and not inplace  # a new engine each version
        self.tensor_loader = MXFP4_LOADER if inplace else None  # the loader of tensor updates (None: SGLang's)
        self._warned = False
        self.version: int | None = -1
        self.swaps: list[dict] = []  # a record per load (method, proof, seconds): the engine takes them
        self.proof: dict = {}  # proof.prove's state across loads (and restarts: the model class stays)
        self.mode = cfg.rollout.sglang.proof  # read_back, fingerprint or auto (proof.by_mode)
        self.fingerprint: FingerprintProof | None = None  # made at the first start, kept across restarts
        self.loaders: list[str] = []  # the custom weight loaders the engine was started with (_started)
        self.quantizes = cfg.rollout.sglang.quantization is not None  # online: linear weights differ from the files
        self.watch = sigquit.SchedulerWatch()  # SGLang's SIGQUIT: a process of the engine failed (the module doc)
        self.watch.listeners.append(self._unblock)
        sigquit.install(self.watch)  # now: a start off the main thread (a low-bit format's) puts in no handler
        self.engine = None  # a low-bit format starts on its first version (update_weights)
        self.owner: EngineOwner | None = None  # the thread that started self.engine, alive as long as it (owner.py)
        self.prefetch = prefetch_of(cfg)  # rollout.sglang.prefetch, auto resolved
        self.unstaged = unstaged_of(cfg)  # how a version loads that is not staged: direct or disk
        if inplace and self.unstaged == "disk":  # SGLang's own MXFP4 reload raises in its scheduler (the docstring)
            raise ValueError("rollout.sglang.mxfp4_load=inplace loads versions as tensors on the engine's GPU, but "
                             f"this process has no CUDA device (rollout.device={cfg.rollout.device}), so versions "
                             "would load from disk: run the rollout on a GPU, or use mxfp4_load=restart")
        said = {"disk": "from disk (update_weights_from_disk)", "device": "from a copy staged on the engine's GPU",
                "direct": "from the files read onto the engine's GPU a window at a time"}
        log.info("rollout.sglang.prefetch=%s: versions load %s%s", cfg.rollout.sglang.prefetch, said[self.prefetch],
                 f", else {said[self.unstaged]}" if self.unstaged != self.prefetch else "")
        self.staged = staged_loads(cfg, self.restart, self._files_hash)  # prefetch=device (staged.py), else None
        # the files of each version hashed ahead for its proof (files_ahead.py) where SGLang reads them (disk); a
        # direct load hashes what it reads (staged.WindowsHash), a staged one what its staging read
        self.files_ahead = (FilesAhead(lambda: self.fingerprint, engine_device(cfg))
                            if self.prefetch == "disk" and not self.restart else None)
        if (warning := shared_gpu_warning(cfg)) is not None:
            log.warning("%s", warning)
        if cfg.rollout.weights_format == NATIVE:
            kwargs = engine_kwargs(cfg, seed, fields=server_args_fields())
            self.engine = self._start(kwargs)
            try:
                self._started(kwargs)
            except BaseException:  # a backend never returned is never closed: its engine goes now
                self._shutdown()
                raise

    def _start(self, kwargs: dict[str, Any]):
        import sglang  # late: CUDA-only, heavy

        # kept_root_logging: its start re-configures the root logger (plumbing/logs.py); off the main thread: a start
        # in the main thread puts in SGLang's SIGQUIT handler, which kills the whole process tree when a scheduler
        # fails to start (0.5.14 `entrypoints/engine.py:1293-1307`), before the daemon could say why; in a thread that
        # lives as long as the engine: SGLang's processes die with the thread that started them (owner.py)
        owner = EngineOwner()
        try:
            with self.watch.guard(), self.watch.starting(), kept_root_logging("sglang"):
                engine = owner.start(lambda: sglang.Engine(**kwargs), "sglang-start")
        except BaseException:
            owner.release()  # ended already if the start raised; else what it started dies with it
            raise
        self.owner = owner
        sigquit.install(self.watch)  # ours again, whatever the start did
        return engine

    def _started(self, kwargs: dict[str, Any]) -> None:
        """After a start of `self.engine` with `kwargs`: the fingerprint's state (made at the first start, kept across
        restarts) and its baseline on the checkpoint the engine started on."""
        self.loaders = list(kwargs.get("custom_weight_loader") or [])
        if self.fingerprint is None:
            why, attn_tp_size = why_unavailable(kwargs, self.cfg.rollout.weights_format)
            self.fingerprint = FingerprintProof(self._send, attn_tp_size, why)
        if self.mode != "read_back":
            with self.watch.guard():
                self.fingerprint.baseline(kwargs["model_path"])  # a restart keeps the first start's

    def _send(self, name: str) -> tuple[bool, str]:
        """The fingerprint request (`fingerprint_proof`): SGLang's update_weights_from_tensor of the one empty tensor
        `name` through offpolicy's loader, which loads nothing (0.5.14 `entrypoints/engine.py:1052-1074`), pickled by
        offpolicy (`fingerprint_proof.serialized`): the engine's own pickling of a CPU tensor raises once SGLang's
        device-UUID patch of torch's reductions is in, as after a staged load (`pickling`)."""
        from sglang.srt.managers.io_struct import UpdateWeightsFromTensorReqInput  # late: heavy, CUDA-only

        ranks = self.cfg.rollout.sglang.tp_size
        req = UpdateWeightsFromTensorReqInput(serialized_named_tensors=[serialized(name)] * ranks, load_format=LOADER,
                                              flush_cache=False)
        success, message = self.engine.loop.run_until_complete(
            self.engine.tokenizer_manager.update_weights_from_tensor(req, None))
        return bool(success), str(message)

    def _unblock(self, why: str) -> None:
        """SGLang's scheduler died (a listener of the watch): end a generate or load waiting on the engine's event loop,
        which nothing would answer now (it then raises EngineLost, `SchedulerWatch.guard`)."""
        engine = self.engine
        if engine is not None:
            try:
                engine.loop.call_soon_threadsafe(engine.loop.stop)
            except RuntimeError:  # its loop is closed: nothing waits on it
                pass

    def generate(self, rows: list[list[int]], sampling: list[dict], group: int, version: int) -> list[dict]:
        with self.watch.guard():
            if self.version != version:
                raise WeightUpdateError(f"the in-process SGLang engine holds weight version {self.version}, not "
                                        f"{version}: its last update failed; load a version again")
            engine = self.engine
            try:  # each prompt's first sample sent first: the rest share its prefill (`samples_first`)
                outs = sent_samples_first(lambda r, sp: engine.generate(input_ids=r, sampling_params=sp,
                                                                        return_logprob=True), rows, sampling, group)
            except ValueError as e:  # SGLang raises ValueError for a request it refuses (tokenizer_manager.py:1917)
                raise RequestRefused("sglang.Engine", ".generate", 400, str(e)) from None
        return outs

    def update_weights(self, path: str, version: int) -> None:
        """Load the version at `path`, read its weight_version back and prove it (`proof.by_mode`); records the load in
        `swaps`. Raises WeightUpdateError (the engine then generates no more until a load succeeds), EngineLost once
        SGLang's scheduler died."""
        running = self.engine is not None
        try:
            self._update(path, version)
        except WeightUpdateError:
            if running:  # a load into the running engine, not its start
                self._in_place_failed(version)
            raise

    def _update(self, path: str, version: int) -> None:
        """`update_weights`' load and proof, and its record in `swaps`."""
        t0 = time.perf_counter()
        with self.watch.guard():
            expected = expect(path, version)  # before the engine is touched: a version that does not open fails here
            with self._staging(path) as (staged, ahead):  # the arena held until the proof has read the model
                t1 = time.perf_counter()
                method, as_read = self._load(path, version, staged)
                t_load = time.perf_counter() - t1
                files, hashed = self._hashed(path, staged, as_read)  # the files' half of the proof, if hashed
                where, fingerprint = "the in-process SGLang engine", self.fingerprint
                assert fingerprint is not None  # made by the start
                try:
                    record = by_mode(self.mode, lambda: prove(expected, self._read, self.proof, where,
                                                              linear=not self.quantizes), self.proof,
                                     lambda: fingerprint.prove(path, version, where, start=method == "start",
                                                               ahead=files))
                except WeightUpdateError:
                    self.version = None
                    raise
        self.swaps.append({"method": method, **record, "seconds": time.perf_counter() - t0, "load": t_load,
                           **staged_record(staged, ahead),  # staged: the load was a "device" one
                           **({"direct": True} if method == "direct" else {}),
                           **({"files_hash": {"seconds": hashed.seconds, "waited": hashed.waited}} if hashed else {}),
                           **({"files_hash": {"seconds": as_read.seconds, "as_read": True}}
                              if as_read is not None and as_read.totals is not None else {})})

    def _in_place_failed(self, version: int) -> None:
        """With `rollout.sglang.mxfp4_load: auto`, an MXFP4 version written in place by offpolicy's loader that was
        refused (its proof failed, or SGLang refused the write): every later version restarts the engine instead (the
        start-up load, which SGLang does itself), as vLLM's engine rebuilds after an in-place load that failed. An
        explicit `inplace` keeps trying."""
        if self.tensor_loader is None or self.cfg.rollout.sglang.mxfp4_load != "auto" or self.restart:
            return
        log.warning("the in-place MXFP4 load of weight version %d was refused; every later MXFP4 version starts "
                    "sglang.Engine again (rollout.sglang.mxfp4_load auto; inplace would keep loading in place)",
                    version)
        self.restart, self.tensor_loader = True, None
        if self.staged is not None:  # nothing staged beside the restarts: the memory is the engine's again
            self.staged.close()
            self.staged = None

    def stages_ahead(self) -> bool:
        """Whether a version heard of now is staged ahead (`StagedPrefetcher`): only into a running engine that loads
        versions (not before a low-bit format's first version has started it, nor where each version restarts it:
        memory staged beside a start is memory SGLang sizes its KV pool without)."""
        return self.engine is not None and not self.restart

    def _files_hash(self, tensors) -> dict[str, int] | None:
        """A staged version's tensors hashed for its load's proof (`StagedLoads`), once the engine's proof has a
        baseline."""
        return None if self.fingerprint is None else self.fingerprint.files_hash(tensors)

    def _hashed(self, path: str, staged: Staged | None,
                as_read: WindowsHash | None = None) -> tuple[dict[str, int] | None, Done | None]:
        """The files of the version at `path` hashed for its proof by the load (`as_read`: a direct load's windows),
        by its staging, or ahead (`files_ahead`; waited for if it still runs), and the hash ahead's outcome; (None, None)
        where the workers are to hash them."""
        if as_read is not None:
            return as_read.totals, None
        if staged is not None:
            return staged.files, None
        if self.files_ahead is None:
            return None, None
        return self.files_ahead.take(path)

    def _staging(self, path: str):
        """`StagedLoads.held` where versions are staged into the running engine (`stages_ahead`; a start reads its
        files), else nothing."""
        if self.staged is None or not self.stages_ahead():
            return contextlib.nullcontext((None, None))
        return self.staged.held(path)

    def _read(self, name: str, rows: int):
        """SGLang's read-back of one parameter (0.5.14 `entrypoints/engine.py:1110-1115`): its first `rows` entries
        as nested lists of floats, or None (a model class without one, or an unknown name)."""
        return self.engine.get_weights_by_name(name, truncate_size=rows)

    def _load(self, path: str, version: int, staged: Staged | None = None) -> tuple[str, WindowsHash | None]:
        """Load the version: "start" (a low-bit format's first), "restart" (an mxfp4 version after it), "device"
        (update_weights_from_tensor of `staged`, the version on the engine's GPU: staged.py), "direct" (the same a
        window of tensors at a time, read at the load: staged.direct_requests, each window hashed for the proof as it
        is read: the WindowsHash handed back) or "disk" (update_weights_from_disk)."""
        method, as_read = "disk", None
        if self.engine is not None and self.restart:  # mxfp4: SGLang cannot load it into a running model
            if not self._warned:
                log.warning("SGLang cannot reload MXFP4 weights into a running engine (its MoE deletes the loaded "
                            "parameters after repacking them): every %s version starts sglang.Engine again, a "
                            "whole start-up per load; offpolicy's loader writes them in place for an engine of one "
                            "GPU (rollout.sglang.mxfp4_load auto or inplace: tp_size, ep_size and dp_size 1, its "
                            "versions read onto that GPU), else use rollout.engine=vllm or "
                            "rollout.weights_format=native",
                            self.cfg.rollout.weights_format)
                self._warned = True
            self.version = None
            self._shutdown()  # returns once the scheduler has released the GPU
            method = "restart"
        if self.engine is None:  # low-bit: start on this pre-quantized version
            kwargs = engine_kwargs(self.cfg, self.seed, model_path=path, weight_version=version,
                                   fields=server_args_fields())
            self.engine = self._start(kwargs)
            self._started(kwargs)
            self._read_back(version)
            return ("start" if method == "disk" else method), None
        from sglang.srt.managers.io_struct import UpdateWeightFromDiskReqInput

        manager = self.engine.tokenizer_manager
        if staged is not None:
            req = tensor_request(staged, self.cfg.rollout.sglang.tp_size, version, load_format=self.tensor_loader)
            success, message = self.engine.loop.run_until_complete(manager.update_weights_from_tensor(req, None))
            method = "device"
        elif self.unstaged == "direct":  # a window of tensors a request, read onto the GPU now;
            # between two of them the model is part old, part new: nothing generates then (the daemon loads between
            # its generate calls, never beside one)
            success, message = False, f"{path} holds no tensors"
            # the loader whose answer means its copies are done (the MXFP4 one, or worker.SYNCED_LOADER)
            synced = self.tensor_loader or (SYNCED_LOADER if SYNCED_LOADER in self.loaders else None)
            as_read = WindowsHash(self._files_hash)
            for req, named in direct_requests(path, engine_device(self.cfg), self.cfg.rollout.sglang.tp_size, version,
                                              load_format=synced, maps=engine_maps(self.cfg)):
                as_read.add(named)  # before SGLang takes the window: its loaders may write into it
                success, message = self.engine.loop.run_until_complete(manager.update_weights_from_tensor(req, None))
                if not success:  # the model holds part of the version: not known to be either (below)
                    break
            method = "direct"
        else:
            req = UpdateWeightFromDiskReqInput(model_path=path, weight_version=str(version),
                                               load_format=self.load_format, flush_cache=True)
            success, message, _ = self.engine.loop.run_until_complete(manager.update_weights_from_disk(req, None))
        if not success:
            self.version = None  # SGLang's rollback re-reads the new path: the weights are not known to be the old
            raise WeightUpdateError(f"sglang.Engine refused weight version {version} from {path}; the engine keeps its "
                                    f"old version number and generates no more until a load succeeds: {message}")
        self._read_back(version)
        return method, as_read

    def _read_back(self, version: int) -> None:
        # the tokenizer manager's server_args: what it stamps every output's meta_info with, and what
        # update_weights_from_disk sets (0.5.14 and 0.5.23 alike; 0.5.14's Engine has no get_model_info)
        loaded = self.engine.tokenizer_manager.server_args.weight_version
        if str(loaded) != str(version):
            self.version = None
            raise WeightUpdateError(f"after the update sglang.Engine reports weight_version {loaded!r}, not {version}")
        self.version = version

    def _shutdown(self) -> None:
        """Shut the engine down (no SIGQUIT expected, sigquit.py: one would be the shutdown's), then release the thread
        that started it (owner.py), also when the shutdown failed: what is left of its processes dies with it."""
        engine, owner, self.engine, self.owner = self.engine, self.owner, None, None
        try:
            if engine is not None:
                with self.watch.shutting_down():
                    engine.shutdown()
        finally:
            if owner is not None:
                owner.release()

    def close(self) -> None:
        if self.staged is not None:
            self.staged.close()
        self._shutdown()
        sigquit.restore(self.watch)
