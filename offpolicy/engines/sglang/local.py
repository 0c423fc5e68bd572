"""The in-process SGLang engine: `sglang.Engine` started inside the rollout daemon.

`engine_kwargs` turns the run config into `sglang.Engine(**kwargs)` arguments with SGLang's own
names (ServerArgs fields); it is pure, so it is tested without SGLang. `LocalBackend` imports SGLang
only when it is built. Invariants:
- generation and weight swaps never overlap: the daemon calls them one after the other, and
  `sglang.Engine.generate` blocks until its batch is done, so nothing runs during a swap and no
  pause is needed (SGLang's pause_generation is for its HTTP server);
- a swap goes through the engine's tokenizer manager with an `UpdateWeightFromDiskReqInput`, the
  same call `Engine.update_weights_from_disk` makes, because that method takes no `weight_version`
  in sglang 0.5.23; the version is then read back from `Engine.get_model_info()`.
"""

from __future__ import annotations

from typing import Any

from offpolicy.config import Config
from offpolicy.engines.sglang.wire import RequestRefused, WeightUpdateError


def engine_kwargs(cfg: Config, seed: int) -> dict[str, Any]:
    """`sglang.Engine` keyword arguments of this run (rollout.sglang, model.path, model.dtype)."""
    s = cfg.rollout.sglang
    kw: dict[str, Any] = {
        "model_path": cfg.model.path,
        "dtype": cfg.model.dtype,
        "tp_size": s.tp_size,
        "ep_size": s.ep_size,
        "attn_dp_size": s.attn_dp_size,
        "dp_size": s.dp_size,
        "random_seed": seed if s.random_seed is None else s.random_seed,
        "skip_tokenizer_init": s.skip_tokenizer_init,
        "enable_metrics": s.enable_metrics,
    }
    for name in ("quantization", "mem_fraction_static", "attention_backend", "load_format"):
        if getattr(s, name) is not None:
            kw[name] = getattr(s, name)
    return {**kw, **s.extra}


class LocalBackend:
    def __init__(self, cfg: Config, seed: int):
        import sglang  # late: CUDA-only, heavy

        self.load_format = cfg.rollout.sglang.load_format
        self.engine = sglang.Engine(**engine_kwargs(cfg, seed))
        self.version: int | None = -1

    def generate(self, rows: list[list[int]], sampling: list[dict], group: int, version: int) -> list[dict]:
        if self.version != version:
            raise WeightUpdateError(f"the in-process SGLang engine holds weight version {self.version}, not {version}: "
                                    "its last update failed; load a version again")
        try:
            outs = self.engine.generate(input_ids=rows, sampling_params=sampling, return_logprob=True)
        except ValueError as e:  # SGLang raises ValueError for a request it refuses (tokenizer_manager.py:1917)
            raise RequestRefused("sglang.Engine", ".generate", 400, str(e)) from None
        return outs

    def update_weights(self, path: str, version: int) -> None:
        from sglang.srt.managers.io_struct import UpdateWeightFromDiskReqInput

        req = UpdateWeightFromDiskReqInput(model_path=path, weight_version=str(version), load_format=self.load_format,
                                           flush_cache=True)
        manager = self.engine.tokenizer_manager
        success, message, _ = self.engine.loop.run_until_complete(manager.update_weights_from_disk(req, None))
        if not success:
            self.version = None  # SGLang's rollback re-reads the new path: the weights are not known to be the old
            raise WeightUpdateError(f"sglang.Engine refused weight version {version} from {path}; the engine keeps its "
                                    f"old version number and generates no more until a load succeeds: {message}")
        loaded = self.engine.get_model_info().get("weight_version")
        if str(loaded) != str(version):
            self.version = None
            raise WeightUpdateError(f"after the update sglang.Engine reports weight_version {loaded!r}, not {version}")
        self.version = version

    def close(self) -> None:
        self.engine.shutdown()
