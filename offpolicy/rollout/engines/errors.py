"""Errors of the rollout engines that drive an inference library or servers (SGLang, vLLM).

One hierarchy for every engine, so the daemon and the tests catch the same classes whichever engine
runs; each message names the servers involved and what to do.
"""

from __future__ import annotations


class EngineError(RuntimeError):
    """An engine or its servers did not do what the rollout engine needs; the message says why."""


class ServerUnavailable(EngineError):
    """No server (or engine) can take the work: down, unreachable, or on another version."""


class RequestRefused(EngineError):
    """A server answered a request with a 4xx status: the request itself is wrong, so no retry."""

    def __init__(self, where: str, path: str, status: int, message: str):
        super().__init__(f"{where}{path} refused the request (HTTP {status}): {message}")
        self.status, self.message = status, message


class WeightUpdateError(EngineError):
    """A weight update failed (or could not be proven); the engine keeps its old version number."""


class VersionMismatch(EngineError):
    """A sample came back from other weights than the version the engine loaded."""


class RetriesExhausted(EngineError):
    """Samples were still aborted after the engine's max_retries new attempts."""


class EngineLost(EngineError):
    """The engine is gone for good under the daemon (SGLang's scheduler process died under the in-process engine):
    every later generate and load raises it, and the daemon exits so that its supervisor restarts it."""


class Stopped(EngineError):
    """The daemon stops: the engine's call in flight was cut (`RolloutEngine.interrupt`). Not a failure: a stopping
    daemon exits cleanly whether its generate call ended by the cut or was cancelled before."""


class VersionRefused(WeightUpdateError):
    """A version could not be loaded, and the engine's weights were not touched: the version it holds keeps
    serving (the torch engine's double buffer: the version failed to read into the spare weights)."""
