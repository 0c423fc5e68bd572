"""Methods offpolicy adds to every vLLM worker (`--worker-extension-cls offpolicy.rollout.engines.vllm.worker.Extension`).

vLLM mixes this class into its worker class, so `self` is a vLLM worker (`self.model_runner`,
`self.model_config`, `self.device`); the rollout daemon calls the methods by name through
`LLM.collective_rpc` (in process) or the server's `POST /collective_rpc` (VLLM_SERVER_DEV_MODE=1),
which passes only JSON strings and returns JSON. Every method returns plain lists and dicts.
- `offpolicy_baseline()`: right after the engine's own start-up load, the per-tensor fingerprints of
  the model and the fingerprint of the checkpoint it was launched from (their difference is the
  engine's constant offset, offpolicy/rollout/engines/vllm/fingerprint.py);
- `offpolicy_load(path, method)`: load the version at `path` (vLLM's in-place reload, then what it misses of
  this model type, `RELOAD_MISSES`; or a rebuild whose fresh model's tensors are copied into the running ones,
  `adopt.py`, which a model with kernel-wrapped weights always gets), then return the per-tensor fingerprints of
  the model and the fingerprint of the version's files, read here by safetensors, not by vLLM (a rebuild adds
  what it copied and moved; `method` says which load ran);
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
from pathlib import Path

import torch

from offpolicy.rollout.engines.vllm import fingerprint as fp
from offpolicy.rollout.engines.vllm.adopt import adopt
from offpolicy.rollout.engines.vllm.background import Background

log = logging.getLogger("offpolicy.vllm")

# Checkpoint tensors (by name suffix) that vLLM's in-place reload does not reach, per model type: GPT-OSS's loader
# copies the attention sinks into `param.data` past the reload's hooks (the param is a meta placeholder then, the copy
# a no-op), and the reload puts the old sinks back. The model's own `load_weights` over just these, once the reload
# is done, copies them where they belong (TP slicing included).
RELOAD_MISSES = {"gpt_oss": (".sinks",)}


def checkpoint_tensors(path: str, device: str, suffixes: tuple[str, ...] = ()):
    """(name, tensor) of every safetensors shard in an HF directory (sorted by shard name); with `suffixes`, only
    the tensors whose name ends with one of them (the others are not read)."""
    from safetensors import safe_open

    for shard in sorted(Path(path).glob("*.safetensors")):
        with safe_open(str(shard), framework="pt", device=device) as f:
            for name in f.keys():
                if not suffixes or name.endswith(suffixes):
                    yield name, f.get_tensor(name)


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
        """Fingerprints of the freshly loaded model and of its launch checkpoint (JSON)."""
        return json.dumps(self._offpolicy_report(str(self.model_config.model)))

    @torch.inference_mode()
    def offpolicy_load(self, path: str, method: str = "inplace") -> str:
        """Load the version at `path` ("inplace": vLLM's reload_weights; "rebuild": a fresh model whose
        tensors replace the running model's); then its fingerprints (JSON)."""
        t0 = time.perf_counter()
        adopted = None
        if method == "inplace" and self._offpolicy_kernel_wrapped():
            method = "rebuild"  # vLLM's reload cannot take it and leaves the server broken (below)
        if method == "rebuild":
            adopted = self._offpolicy_rebuild(path)
        else:
            from vllm.config import set_current_vllm_config

            with set_current_vllm_config(self.vllm_config):  # 0.32's worker sets it itself, 0.26's does not
                self.reload_weights(weights_path=path, is_checkpoint_format=True)
                self._offpolicy_reload_misses(path)
        seconds = time.perf_counter() - t0
        report = self._offpolicy_report(path)
        report["load_seconds"] = seconds
        report["method"] = method
        if adopted is not None:
            report["adopted"] = adopted
        return json.dumps(report)

    def _offpolicy_kernel_wrapped(self) -> bool:
        """Whether the model keeps weights in kernel tensor wrappers (vLLM 0.26's Triton MXFP4 experts on Hopper):
        its in-place reload then raises (`attribute 'w13_weight' already exists`) halfway, leaving the modules before
        the first MoE layer as meta tensors and that layer without its biases, so those models load by rebuild."""
        return fp.kernel_wrapped(self.model_runner.get_model())

    def _offpolicy_reload_misses(self, path: str) -> None:
        """Load what the in-place reload leaves behind for this model type (`RELOAD_MISSES`) with its own loader."""
        suffixes = RELOAD_MISSES.get(getattr(self.model_config.hf_config, "model_type", ""), ())
        if suffixes:
            model = self.model_runner.get_model()
            model.load_weights(checkpoint_tensors(path, str(next(model.parameters()).device), suffixes))

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
