"""Methods offpolicy adds to every vLLM worker (`--worker-extension-cls offpolicy.rollout.engines.vllm.worker.Extension`).

vLLM mixes this class into its worker class, so `self` is a vLLM worker (`self.model_runner`,
`self.model_config`, `self.device`); the rollout daemon calls the methods by name through
`LLM.collective_rpc` (in process) or the server's `POST /collective_rpc` (VLLM_SERVER_DEV_MODE=1),
which passes only JSON strings and returns JSON. Every method returns plain lists and dicts.
- `offpolicy_baseline()`: right after the engine's own start-up load, the per-tensor fingerprints of
  the model and the fingerprint of the checkpoint it was launched from (their difference is the
  engine's constant offset, offpolicy/rollout/engines/fingerprint.py);
- `offpolicy_load(path, method, stage)`: load the version at `path` (vLLM's in-place reload, then what it misses of
  this model type, `misses.py`; for a model with Triton MXFP4 experts, which that reload cannot take, offpolicy's
  MXFP4 load, `kernels.py`; or a rebuild whose fresh model's tensors are copied into the running ones, `adopt.py`,
  which a model with other kernel-wrapped weights always gets, and one whose misses cannot be replayed in vLLM's
  layout, or an MXFP4 load that could not write every tensor), then return the per-tensor fingerprints of the model
  and the fingerprint of the version's files, read here by offpolicy's reader or safetensors, not by vLLM (a rebuild
  adds what it copied and moved; `method` says which load ran, `reason` why the worker rebuilt where an in-place
  load was asked for, `kernels` that offpolicy's MXFP4 load ran). The in-place reload
  takes the version as tensors staged by offpolicy's reader (`staging.py`; `stage` is `rollout.vllm.prefetch`):
  staged ahead by `offpolicy_prefetch`, or here where no prefetch was ever asked of this worker; `direct`: read onto
  the device a window at a time as the reload takes them (`staging.windows`), each tensor hashed for the proof as it
  passes (`staging.HashedAsRead`), with nothing read ahead; else (`hash`, a staging that failed) the files as vLLM
  reads them (safetensors, host tensors), by vLLM itself (`weights_path`) unless the reload misses
  tensors of this model type, which are then left out of what it is handed (`misses.Misses.taken`; the replay after
  it loads them from the device); a vLLM whose reload takes no tensors reads the files itself;
- `offpolicy_prefetch(path, stage)`: start staging (or only hashing, `stage` "hash"; nothing for "direct") the version
  at `path` in a thread, beside generation (`background.py`, `rollout.double_buffer`); its load then takes the staged
  tensors and their hash;
- `offpolicy_label()` / `offpolicy_set_label(label)`: the server's weight label where vLLM keeps none
  (0.26, `versions.py`); it lives as long as the worker, so a restarted server has none.
The daemon, not the worker, decides whether the load is proven (`VersionCheck`).
"""

from __future__ import annotations

import json
import logging
import time

import torch

from offpolicy.rollout.engines import fingerprint as fp
from offpolicy.rollout.engines.background import Background
from offpolicy.rollout.engines.fingerprint import checkpoint_tensors
from offpolicy.rollout.engines.staging import HashedAsRead, Prepare, Staged, Stager, plan, reader_maps, windows
from offpolicy.rollout.engines.vllm import kernels, progress
from offpolicy.rollout.engines.vllm.adopt import adopt, release
from offpolicy.rollout.engines.vllm.misses import RELOAD_MISSES, layout_holds, reload_missed
from offpolicy.rollout.engines.vllm.versions import reload_takes_tensors
from offpolicy.rollout.engines.vllm.where import resolve, stream

log = logging.getLogger("offpolicy.vllm")


class Extension:
    """Mixed into vLLM's worker class (vLLM's `worker_extension_cls`)."""

    def _offpolicy_report(self, files_path: str, files: int | None = None, done=None, ahead: bool = True) -> dict:
        """The model's per-tensor fingerprints and the files' fingerprint: `files` (hashed by a staging), or the
        background work's for `files_path` (`offpolicy_prefetch`; `done`, or waited for here unless `ahead` is False:
        it failed), or hashed now."""
        model = self.model_runner.get_model()
        t0 = time.perf_counter()
        tensors = fp.model_fingerprints(model)
        t1 = time.perf_counter()
        if files is None and done is None and ahead:
            done = self._offpolicy_ahead_of(files_path)[0]
        if files is None and done is not None:
            files = done.value.files if isinstance(done.value, Staged) else done.value
        if files is None:
            files = self._offpolicy_files_hash(files_path)()
        t2 = time.perf_counter()
        empty = sorted(name for name, t in model.named_parameters() if t.numel() == 0)
        report = {"tensors": {k: str(v) for k, v in tensors.items()}, "files": str(files), "path": files_path,
                  "empty": empty, "hash_seconds": t2 - t0, "hash_model_seconds": t1 - t0,
                  "hash_files_seconds": t2 - t1}
        if done is not None:  # the background work's own time, start and the load's wait for it
            report.update(prefetch_seconds=done.seconds, prefetch_began=done.began, prefetch_waited=done.waited,
                          prefetch_cpu_seconds=done.cpu_seconds)
        return report

    def _offpolicy_ahead_of(self, path: str):
        """The background work started for `path` (waited for), or None; and its error, or None."""
        ahead = getattr(self, "_offpolicy_ahead", None)
        try:
            return (ahead.result(path) if ahead is not None else None), None
        except Exception as e:  # the load reads and hashes the files itself
            log.warning("staging or hashing %s in the background failed (%s: %s); the load reads it itself", path,
                        type(e).__name__, e)
            return None, f"{type(e).__name__}: {e}"

    def _offpolicy_fingerprint(self):
        """The fingerprint of a version's (name, tensor) pairs as this model holds them, as a function (the tensors
        are hashed on the model's device: host ones are copied there first)."""
        model, device, dtype = self.model_runner.get_model(), self._offpolicy_device(), self.model_config.dtype
        widened = fp.widened_expert_biases(model, dtype)
        return lambda tensors: fp.files_fingerprint(((n, t.to(device, non_blocking=True)) for n, t in tensors), dtype,
                                                    widened)

    def _offpolicy_files_hash(self, path: str):
        """The fingerprint of the files of the version at `path` as this model holds them, as a function to call."""
        fingerprint, device = self._offpolicy_fingerprint(), self._offpolicy_device()
        return lambda: fingerprint(checkpoint_tensors(path, str(device)))

    def _offpolicy_device(self) -> torch.device:
        return next(self.model_runner.get_model().parameters()).device

    def _offpolicy_stager(self) -> Stager:
        if getattr(self, "_offpolicy_staging", None) is None:
            self._offpolicy_staging = Stager(self._offpolicy_device())
        self._offpolicy_staging.maps = self._offpolicy_maps()
        self._offpolicy_staging.threads = getattr(self, "_offpolicy_stage_threads", 0) or None
        return self._offpolicy_staging

    def _offpolicy_maps(self):
        """The registered maps this worker's reads onto its GPU go through (`staging.reader_maps`), as the daemon's
        last request asked (`maps`: the versions to keep registered, `staging.map_versions`; 0 = none)."""
        return reader_maps(getattr(self, "_offpolicy_map_versions", 0), self._offpolicy_device())

    def _offpolicy_where(self, path: str, stage: str, ahead: bool = True) -> str:
        """Where the version at `path` is staged under rollout.vllm.prefetch = `stage` ("hash": nothing staged, also
        where vLLM's reload takes no tensors); `ahead` False: at the load, with nothing staged ahead, where auto reads
        "direct" rather than stage on the device (a staging now would read the version and then copy it, slower than
        reading it direct: docs/vllm.md, "Staged loads"); said in the log whenever it changes."""
        if stage in ("hash", "direct"):  # nothing staged: no room to count
            where, why = resolve(stage, self._offpolicy_device(), 0, None)
        else:
            stager = self._offpolicy_stager()
            where, why = resolve(stage, stager.device, plan(path)[1], stager.free_device())
        if not ahead and stage == "auto" and where == "device":
            where, why = "direct", "auto at the load, nothing staged ahead: read once, not staged and then copied"
        if where != "hash" and not self._offpolicy_takes_tensors():
            where, why = "hash", "this vLLM's reload_weights takes no weights_iterator"
        self._offpolicy_why = why  # the load's record carries it (vLLM's logging shows no info of ours)
        if (stage, where) != getattr(self, "_offpolicy_said", None):
            self._offpolicy_said = (stage, where)
            log.info("rollout.vllm.prefetch=%s: versions are staged %s (%s)", stage,
                     {"hash": "nowhere (the files are read at the load)", "host": "in host memory",
                      "device": "on the device",
                      "direct": "nowhere (offpolicy reads the files onto the device at the load)"}[where], why)
        return where

    def _offpolicy_takes_tensors(self) -> bool:
        """Whether vLLM's in-place reload takes a weights iterator (0.26 and 0.32 both do: `reload_weights(
        weights_iterator=None, weights_path=None, is_checkpoint_format=True)` of the model runner, V1's or, through
        it, V2's: `versions.reload_takes_tensors`)."""
        return reload_takes_tensors(self.model_runner.reload_weights, _v1_reload)

    def offpolicy_prefetch(self, path: str, stage: str = "hash", maps: int = 0, threads: int = 0) -> str:
        """Start staging the version at `path` (`staging.py`, where `stage`, rollout.vllm.prefetch, says), or only
        hashing its files ("hash"), in the background (`background.py`), while the server goes on generating; the load
        of that version then takes the staged tensors and their hash instead of reading the files. A newer request
        replaces an older one (a staging in progress stops). `maps`: reads onto the GPU go through registered maps of
        the shard files met before, keeping that many versions' (0: none; `staging.reader_maps`). `threads`: the
        reader's threads for a staging (rollout.vllm.stage_threads; 0: the reader's default). Returns at once (JSON)."""
        self._offpolicy_map_versions, self._offpolicy_stage_threads = maps, threads
        ahead = getattr(self, "_offpolicy_ahead", None)
        if ahead is None or ahead.key != path:
            where = self._offpolicy_where(path, stage)
            stop = self._offpolicy_stager().begin()  # a staging in progress stops: its version was passed over
            if where == "direct":  # nothing ahead: the load hashes the windows it reads (staging.HashedAsRead)
                self._offpolicy_ahead, self._offpolicy_ahead_stage, self._offpolicy_direct = None, where, path
                return json.dumps({"path": path, "stage": where})
            if where == "hash":  # nothing staged: only the proof's hash of the files runs ahead
                compute = self._offpolicy_files_hash(path)
            else:
                stager, fingerprint, prepare = self._offpolicy_stager(), self._offpolicy_fingerprint(), None
                if where == "device":
                    prepare = self._offpolicy_prepare()
                compute = lambda: stager.stage(path, where, fingerprint, stop, prepare)  # noqa: E731
            self._offpolicy_ahead = Background(path, compute, self._offpolicy_device())
            self._offpolicy_ahead_stage = where
        return json.dumps({"path": path, "stage": self._offpolicy_ahead_stage})

    def _offpolicy_prepare(self) -> Prepare | None:
        """What a staging on the GPU makes ahead for this model's load: its MXFP4 experts swizzled as their Triton
        kernels hold them (`kernels.prepare`), where offpolicy's MXFP4 load writes them (`_offpolicy_kernels`, known
        since the server's baseline), so that the swap only copies them; None for any other model."""
        if not getattr(self, "_offpolicy_kernels", False):
            return None
        if getattr(self, "_offpolicy_preparer", None) is None:  # the wrappers hold for the server's life: counted once,
            model = self.model_runner.get_model()  # not on every prefetch (an RPC between the server's steps)
            self._offpolicy_preparer = Prepare(lambda tensors: kernels.prepare(model, tensors),
                                               kernels.prepared_bytes(model), "the MXFP4 experts' kernel layout")
        return self._offpolicy_preparer

    def _offpolicy_staged(self, path: str, stage: str) -> tuple[Staged | None, object, dict, str | None]:
        """The version at `path` staged for an in-place load: the background's (`offpolicy_prefetch`), or staged now
        where no prefetch was ever asked of this worker and `stage` stages; the background work's outcome (for the
        report); what the report says of the staging; where this load's version was resolved to be staged
        (`_offpolicy_where`: when its background work began, or here), None where it was not."""
        done, error = self._offpolicy_ahead_of(path)
        if error is not None:
            return None, None, {"staging_error": error}, None
        if done is not None:
            value = done.value
            ok = isinstance(value, Staged) and self._offpolicy_takes_tensors()
            said = {"staged": value.record(ahead=True)} if ok else {}
            return (value if ok else None), done, said, getattr(self, "_offpolicy_ahead_stage", None)
        if getattr(self, "_offpolicy_ahead", None) is not None:
            return None, None, {}, None  # the background works for another version (and may hold the arena)
        where = self._offpolicy_where(path, stage, ahead=False)
        if where in ("hash", "direct"):
            return None, None, {}, where
        try:
            staged = self._offpolicy_stager().stage(path, where, self._offpolicy_fingerprint())
        except Exception as e:  # StagingRefused names rollout.vllm.prefetch and the fix
            log.warning("staging %s failed (%s: %s); vLLM reads its files itself", path, type(e).__name__, e)
            return None, None, {"staging_error": f"{type(e).__name__}: {e}"}, where
        return staged, None, {"staged": staged.record(ahead=False)}, where

    @torch.inference_mode()
    def offpolicy_baseline(self) -> str:
        """Fingerprints of the freshly loaded model and of its launch checkpoint (JSON); also checks, off the first
        load's critical path, whether what the in-place reload misses can be loaded after it (`misses.py`)."""
        report = self._offpolicy_report(str(self.model_config.model))
        self._offpolicy_inplace_refused()
        return json.dumps(report)

    @torch.inference_mode()
    def offpolicy_load(self, path: str, method: str = "inplace", stage: str = "hash", maps: int = 0,
                       threads: int = 0) -> str:
        """Load the version at `path` ("inplace": vLLM's reload_weights, from the tensors staged where `stage`,
        rollout.vllm.prefetch, says, then what it misses; "rebuild": a fresh model whose tensors replace the running
        model's); then its fingerprints (JSON). `maps` and `threads` as in `offpolicy_prefetch`."""
        t0 = time.perf_counter()
        self._offpolicy_map_versions, self._offpolicy_stage_threads = maps, threads
        adopted, reason, staged, done, said, as_read = None, None, None, None, {}, None
        if method == "inplace":
            reason = self._offpolicy_inplace_refused()
            method = "inplace" if reason is None else "rebuild"
        if method == "inplace":
            from vllm.config import set_current_vllm_config

            staged, done, said, where = self._offpolicy_staged(path, stage)
            if staged is None and where is None:  # the background staged another version, or failed: resolved now
                where = self._offpolicy_where(path, stage, ahead=False)
            said.update(where=where, where_why=getattr(self, "_offpolicy_why", None))
            with set_current_vllm_config(self.vllm_config):  # 0.32's worker sets it itself, 0.26's does not
                t1 = time.perf_counter()
                read = staged.read if staged is not None else None
                if staged is not None and stage == "stream" and staged.where == "host":  # each tensor to the GPU
                    device, host = self._offpolicy_device(), staged.read
                    read, said["stream"] = (lambda keep=None: stream(host(keep), device)), True
                elif staged is None and where == "direct":  # the files, a window
                    device, pieces = self._offpolicy_device(), plan(path)[0]  # at a time; the headers read once,
                    as_read = HashedAsRead(self._offpolicy_fingerprint())  # each tensor hashed as the load takes it
                    maps = self._offpolicy_maps()
                    read = lambda keep=None: as_read.through(windows(path, device, keep, pieces=pieces,  # noqa: E731
                                                                     maps=maps))
                    said["direct"] = True
                kernel = self._offpolicy_kernels
                taken = None if kernel else self._offpolicy_taken()
                if kernel:  # MXFP4 experts into their kernels' storage, the rest by the model's load_weights
                    reason = self._offpolicy_kernel_load(read if read is not None else self._offpolicy_reader(path),
                                                         staged.take_prepared() if staged is not None else None)
                    method = "inplace" if reason is None else "rebuild"
                    said["kernels"] = True
                elif read is not None:  # the staged tensors: no file is read; nothing of what the reload misses
                    self.reload_weights(weights_iterator=read(taken), is_checkpoint_format=True)
                elif taken is not None and self._offpolicy_takes_tensors():  # the files read as vLLM reads them
                    self.reload_weights(weights_iterator=checkpoint_tensors(path, "cpu", taken),  # (host tensors),
                                        is_checkpoint_format=True)                             # less what it misses
                else:
                    self.reload_weights(weights_path=path, is_checkpoint_format=True)
                said["reload_seconds"] = _synced(self._offpolicy_device(), t1)  # the phases, for the bench
                try:
                    t1 = time.perf_counter()
                    if not kernel:  # the kernel load took every tensor
                        self._offpolicy_reload_misses(read if read is not None else self._offpolicy_reader(path))
                    said["misses_seconds"] = _synced(self._offpolicy_device(), t1)
                except Exception as e:  # the running tensors are partly the new version's: vLLM's start-up path
                    reason = f"loading what vLLM's reload missed failed ({type(e).__name__}: {e})"
                    log.warning("%s; loading %s by rebuild", reason, path)
                    method = "rebuild"
        if method == "rebuild":
            adopted = self._offpolicy_rebuild(path)
        files = staged.files if staged is not None else None
        if as_read is not None and method == "inplace":  # the files' half of the proof: what the load read, and
            files = as_read.total([p.name for p in pieces], self._offpolicy_reader(path))  # what it did not
            said["hash_read_seconds"] = as_read.seconds
        seconds = time.perf_counter() - t0 - (done.waited if done is not None else 0.0)  # the wait: prefetch_waited
        report = self._offpolicy_report(path, files, done, ahead="staging_error" not in said and as_read is None)
        report.update(said, load_seconds=seconds, method=method)
        if reason is not None:
            report["reason"] = reason
        if adopted is not None:
            report["adopted"] = adopted
        return json.dumps(report)

    def _offpolicy_inplace_refused(self) -> str | None:
        """Why this model cannot be loaded in place (None: it can). Kernel-wrapped weights (vLLM 0.26's Triton MXFP4
        experts on Hopper), which vLLM's reload cannot take (it raises `attribute 'w13_weight' already exists` halfway,
        leaving the modules before the first MoE layer as meta tensors): loaded in place by offpolicy's MXFP4 load
        (`kernels.py`, `self._offpolicy_kernels`) where it knows every wrapper and how the experts are cut, else
        refused. Tensors the reload misses (`RELOAD_MISSES`) whose replay does not lay them out as vLLM's own load did
        (`misses.layout_holds`, checked once against the checkpoint held now)."""
        if not hasattr(self, "_offpolicy_kernels"):  # the model's structure holds for the server's life
            model = self.model_runner.get_model()
            wrapped = fp.kernel_wrapped(model)
            self._offpolicy_kernel_why = (kernels.writable(model) or kernels.uncut(
                model, getattr(self.vllm_config, "parallel_config", None))) if wrapped else None
            self._offpolicy_kernels = wrapped and self._offpolicy_kernel_why is None
        if self._offpolicy_kernels:
            return None  # in place by offpolicy's MXFP4 load (kernels.py)
        if self._offpolicy_kernel_why is not None:
            return (f"the server keeps weights in kernel wrappers, which vLLM's in-place reload cannot take, and "
                    f"offpolicy's MXFP4 load does not write them ({self._offpolicy_kernel_why})")
        misses = RELOAD_MISSES.get(self.model_config.hf_config.model_type)
        if misses is None:
            return None
        if not hasattr(self, "_offpolicy_layout"):
            from vllm.config import set_current_vllm_config

            held = str(self.model_config.model)
            try:
                with set_current_vllm_config(self.vllm_config):
                    why = layout_holds(self.model_runner.get_model(), misses, self._offpolicy_reader(held))
            except Exception as e:
                why = f"{type(e).__name__}: {e}"
            self._offpolicy_layout = why and (f"vLLM's in-place reload misses {', '.join(misses.params)}, and loading "
                                              f"them after it was not shown to lay them out as vLLM's own load does "
                                              f"(checked against {held}): {why}")
            if why:
                log.warning("%s; this server loads by rebuild", self._offpolicy_layout)
        return self._offpolicy_layout

    def _offpolicy_kernel_load(self, read, prepared: dict | None = None) -> str | None:
        """The version's tensors from `read(keep)` into a model with Triton MXFP4 experts (`kernels.load`; its experts
        from `prepared`, a staging's, where made ahead); why the load must rebuild instead (None: every tensor
        written)."""
        try:
            refused = kernels.load(self.model_runner.get_model(), read(None), prepared)
        except Exception as e:  # the running tensors are partly the new version's: the rebuild writes them all
            refused = [f"{type(e).__name__}: {e}"]
        if not refused:
            return None
        reason = f"offpolicy's MXFP4 load could not write {len(refused)} tensors ({'; '.join(refused[:3])})"
        log.warning("%s; loading by rebuild", reason)
        return reason

    def _offpolicy_reader(self, path: str):
        device = str(self._offpolicy_device())
        return lambda keep: checkpoint_tensors(path, device, keep)

    def _offpolicy_taken(self):
        """The names of the checkpoint tensors the in-place reload loads (None: all): not what it misses of this model
        type (`Misses.taken`), which the replay after it loads from tensors on the device."""
        misses = RELOAD_MISSES.get(self.model_config.hf_config.model_type)
        return misses.taken if misses is not None else None

    def _offpolicy_reload_misses(self, read) -> None:
        """Load what the in-place reload leaves behind for this model type (`RELOAD_MISSES`, `misses.py`) from the
        version's tensors `read(keep)` gives (the staged ones, or the files'), each on the model's device first (the
        replay's slices and permutes then run there, not on the host)."""
        misses = RELOAD_MISSES.get(self.model_config.hf_config.model_type)
        if misses is not None:
            device = self._offpolicy_device()
            reload_missed(self.model_runner.get_model(), misses, lambda keep: stream(read(keep), device))

    def offpolicy_ready(self, path: str) -> str:
        """Whether the version at `path` is ready to load without waiting (JSON `{"ready": bool}`): its background work
        (`offpolicy_prefetch`) has ended; false while it runs and where it was never asked for. A version asked for
        "direct" has no work ahead and is ready at once: its load reads the files onto the device a window at a time
        during the switch's pause, as between calls (false there would leave such a server never switched in flight).
        Asked between the server's steps before a weight update in flight (rollout.inflight_updates): never waits."""
        ahead = getattr(self, "_offpolicy_ahead", None)
        if ahead is None:
            return json.dumps({"ready": getattr(self, "_offpolicy_direct", None) == path})
        return json.dumps({"ready": ahead.done(path) is True})

    def offpolicy_progress(self) -> str:
        """Every request this worker's model runner holds -> the tokens it has sampled (JSON), asked while the server
        is paused with mode=keep: where a weight update in flight splits each response (`progress.py`)."""
        return json.dumps(progress.sampled_lengths(self.model_runner))

    def offpolicy_label(self) -> str:
        """The label set last on this worker (JSON; null when none was)."""
        return json.dumps({"label": getattr(self, "_offpolicy_label", None)})

    def offpolicy_set_label(self, label: str) -> str:
        self._offpolicy_label = label
        return json.dumps({"label": label})

    def _offpolicy_rebuild(self, path: str) -> dict:
        """Build the model afresh from `path` with vLLM's own loader (the start-up path: load_weights, then each
        layer's process_weights_after_loading), then give each running module the fresh one's state (parameters, buffers,
        and what its kernels derived from them) in its own tensors' memory (`adopt.adopt`; its counts are returned);
        attention layers keep their KV-cache binding and take only their tensors. The running modules stay the ones
        vLLM's runner, compiled graphs and CUDA graphs hold. The fresh model's memory is released before it returns."""
        from vllm.config import set_current_vllm_config
        from vllm.model_executor.model_loader import get_model_loader

        cfg = self.vllm_config
        layers = cfg.compilation_config.static_forward_context  # attention layers register here by name
        saved = dict(layers)
        layers.clear()
        cfg.model_config.model = path
        fresh, running = None, dict(self.model_runner.get_model().named_modules())
        try:
            with set_current_vllm_config(cfg):
                fresh = get_model_loader(cfg.load_config).load_model(vllm_config=cfg, model_config=cfg.model_config)
            # in the running tensors' memory, which CUDA graphs captured at start-up read (adopt.py)
            return adopt(running, fresh, {id(layer) for layer in saved.values()})
        finally:
            layers.clear()
            layers.update(saved)
            if fresh is not None:
                release(fresh, running)  # its memory now, not when the cyclic collector runs (adopt.release)


def _v1_reload():
    """vLLM's V1 model runner's `reload_weights`, which the V2 runner's passes its arguments to."""
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    return GPUModelRunner.reload_weights


def _synced(device: torch.device, t0: float) -> float:
    """Seconds since `t0` once what the GPU was given meanwhile has run (the proof waits for it anyway)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - t0
