"""Methods offpolicy adds to every vLLM worker (`--worker-extension-cls offpolicy.rollout.engines.vllm.worker.Extension`).

vLLM mixes this class into its worker class, so `self` is a vLLM worker (`self.model_runner`,
`self.model_config`, `self.device`); the rollout daemon calls the methods by name through
`LLM.collective_rpc` (in process) or the server's `POST /collective_rpc` (VLLM_SERVER_DEV_MODE=1),
which passes only JSON strings and returns JSON. Every method returns plain lists and dicts.
- `offpolicy_baseline()`: right after the engine's own start-up load, the per-tensor fingerprints of
  the model and the fingerprint of the checkpoint it was launched from (their difference is the
  engine's constant offset, offpolicy/rollout/engines/fingerprint.py);
- `offpolicy_load(path, method)`: load the version at `path` (vLLM's in-place reload, then what it misses of
  this model type, `misses.py`; or a rebuild whose fresh model's tensors are copied into the running ones,
  `adopt.py`, which a model with kernel-wrapped weights always gets, and one whose misses cannot be replayed in
  vLLM's layout), then return the per-tensor fingerprints of the model and the fingerprint of the version's files,
  read here by safetensors, not by vLLM (a rebuild adds what it copied and moved; `method` says which load ran,
  `reason` why the worker rebuilt where an in-place load was asked for);
- `offpolicy_prefetch(path)`: start hashing the files of the version at `path` in a thread, beside generation
  (`background.py`, `rollout.double_buffer`); its load then takes that hash;
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
from offpolicy.rollout.engines.fingerprint import checkpoint_tensors
from offpolicy.rollout.engines.vllm.adopt import adopt
from offpolicy.rollout.engines.vllm.background import Background
from offpolicy.rollout.engines.vllm.misses import RELOAD_MISSES, layout_holds, reload_missed

log = logging.getLogger("offpolicy.vllm")


class Extension:
    """Mixed into vLLM's worker class (vLLM's `worker_extension_cls`)."""

    def _offpolicy_report(self, files_path: str) -> dict:
        model = self.model_runner.get_model()
        t0 = time.perf_counter()
        tensors = fp.model_fingerprints(model)
        t1 = time.perf_counter()
        # the proof's two halves: the model's tensors as the server holds them, the version's files read from disk
        # (hashed in the background since the version was announced, `offpolicy_prefetch`, or now)
        ahead, done = getattr(self, "_offpolicy_ahead", None), None
        try:
            done = ahead.result(files_path) if ahead is not None else None
        except Exception as e:  # hash the files now instead
            log.warning("hashing %s in the background failed (%s: %s); hashing it now", files_path,
                        type(e).__name__, e)
        files = done.value if done is not None else self._offpolicy_files_hash(files_path)()
        t2 = time.perf_counter()
        empty = sorted(name for name, t in model.named_parameters() if t.numel() == 0)
        report = {"tensors": {k: str(v) for k, v in tensors.items()}, "files": str(files), "path": files_path,
                  "empty": empty, "hash_seconds": t2 - t0, "hash_model_seconds": t1 - t0,
                  "hash_files_seconds": t2 - t1}
        if done is not None:  # the background hash's own time and start; hash_files_seconds is the wait for it
            report.update(prefetch_seconds=done.seconds, prefetch_began=done.began)
        return report

    def _offpolicy_files_hash(self, path: str):
        """The fingerprint of the files of the version at `path` as this model holds them, as a function to call."""
        model = self.model_runner.get_model()
        device, dtype = str(next(model.parameters()).device), self.model_config.dtype
        widened = fp.widened_expert_biases(model, dtype)
        return lambda: fp.files_fingerprint(checkpoint_tensors(path, device), dtype, widened)

    def offpolicy_prefetch(self, path: str) -> str:
        """Start hashing the files of the version at `path` in the background (`background.py`), while the server
        goes on generating; the load of that version then takes the hash instead of reading the files itself. A
        newer request replaces an older one. Returns at once (JSON)."""
        ahead = getattr(self, "_offpolicy_ahead", None)
        if ahead is None or ahead.key != path:
            device = next(self.model_runner.get_model().parameters()).device
            self._offpolicy_ahead = Background(path, self._offpolicy_files_hash(path), device)
        return json.dumps({"path": path})

    @torch.inference_mode()
    def offpolicy_baseline(self) -> str:
        """Fingerprints of the freshly loaded model and of its launch checkpoint (JSON); also checks, off the first
        load's critical path, whether what the in-place reload misses can be loaded after it (`misses.py`)."""
        report = self._offpolicy_report(str(self.model_config.model))
        self._offpolicy_inplace_refused()
        return json.dumps(report)

    @torch.inference_mode()
    def offpolicy_load(self, path: str, method: str = "inplace") -> str:
        """Load the version at `path` ("inplace": vLLM's reload_weights, then what it misses; "rebuild": a fresh model
        whose tensors replace the running model's); then its fingerprints (JSON)."""
        t0 = time.perf_counter()
        adopted, reason = None, None
        if method == "inplace":
            reason = self._offpolicy_inplace_refused()
            method = "inplace" if reason is None else "rebuild"
        if method == "inplace":
            from vllm.config import set_current_vllm_config

            with set_current_vllm_config(self.vllm_config):  # 0.32's worker sets it itself, 0.26's does not
                self.reload_weights(weights_path=path, is_checkpoint_format=True)
                try:
                    self._offpolicy_reload_misses(path)
                except Exception as e:  # the running tensors are partly the new version's: vLLM's start-up path
                    reason = f"loading what vLLM's reload missed failed ({type(e).__name__}: {e})"
                    log.warning("%s; loading %s by rebuild", reason, path)
                    method = "rebuild"
        if method == "rebuild":
            adopted = self._offpolicy_rebuild(path)
        seconds = time.perf_counter() - t0
        report = self._offpolicy_report(path)
        report["load_seconds"] = seconds
        report["method"] = method
        if reason is not None:
            report["reason"] = reason
        if adopted is not None:
            report["adopted"] = adopted
        return json.dumps(report)

    def _offpolicy_inplace_refused(self) -> str | None:
        """Why this model cannot be loaded in place (None: it can). Kernel-wrapped weights (vLLM 0.26's Triton MXFP4
        experts on Hopper): the reload raises (`attribute 'w13_weight' already exists`) halfway, leaving the modules
        before the first MoE layer as meta tensors. Tensors the reload misses (`RELOAD_MISSES`) whose replay does not
        lay them out as vLLM's own load did (`misses.layout_holds`, checked once against the checkpoint held now)."""
        if fp.kernel_wrapped(self.model_runner.get_model()):
            return ("the server keeps weights in kernel wrappers (vLLM's Triton MXFP4 experts), which its in-place "
                    "reload cannot take")
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

    def _offpolicy_reader(self, path: str):
        device = str(next(self.model_runner.get_model().parameters()).device)
        return lambda keep: checkpoint_tensors(path, device, keep)

    def _offpolicy_reload_misses(self, path: str) -> None:
        """Load what the in-place reload leaves behind for this model type (`RELOAD_MISSES`, `misses.py`)."""
        misses = RELOAD_MISSES.get(self.model_config.hf_config.model_type)
        if misses is not None:
            reload_missed(self.model_runner.get_model(), misses, self._offpolicy_reader(path))

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
        vLLM's runner, compiled graphs and CUDA graphs hold."""
        from vllm.config import set_current_vllm_config
        from vllm.model_executor.model_loader import get_model_loader

        cfg = self.vllm_config
        layers = cfg.compilation_config.static_forward_context  # attention layers register here by name
        saved = dict(layers)
        layers.clear()
        cfg.model_config.model = path
        try:
            with set_current_vllm_config(cfg):
                fresh = get_model_loader(cfg.load_config).load_model(vllm_config=cfg, model_config=cfg.model_config)
        finally:
            layers.clear()
            layers.update(saved)
        # in the running tensors' memory, which CUDA graphs captured at start-up read (adopt.py)
        adopted = adopt(dict(self.model_runner.get_model().named_modules()), fresh, {id(layer) for layer in saved.values()})
        del fresh
        return adopted
