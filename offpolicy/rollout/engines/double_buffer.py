"""Double-buffered weights of the embedded torch engine (`rollout.double_buffer`): the next version loads
beside the current one, which keeps generating, and goes live between generate calls by a pointer swap.

`DoubleBuffer(model, read, device)` keeps two banks of the model's tensors (its parameters and persistent
buffers, tied ones once): bank 0 is the storage the model was built with, bank 1 a second copy allocated
once. The model's tensors point at the live bank; the other, the spare, is where a worker thread reads the
next version (`read(weights, dest)` with `dest` the spare's tensors under checkpoint names: the engine's
own loader, so a version is checked and read exactly as an in-place load reads it). On CUDA the read runs
on the buffer's own stream, which first waits for what the default stream still had queued on the spare
(it was live until the last swap), and the worker waits for that stream alone before it calls the version
ready, never for the generation beside it.

- `prefetch(weights)` asks for a version and returns at once: the worker reads it into the spare. The
  buffer takes a hold of its own on the version (`WeightVersion`), so the store keeps its files until the
  read is over whoever closes theirs. A request not yet started is replaced by a newer one ("superseded");
  a read already running is finished, then the newer one is read over it. A version that failed is not
  read again.
- `swap_in(version)` (between generate calls, from the engine's `load`) waits until that version is ready
  in the spare (asking for it if nobody did), then points every model tensor at the spare bank
  (`tensor.data = ...`: no copy; the old live bank becomes the spare). What it waited is the load's cost on
  the critical path. A version that failed to read raises `VersionRefused`, naming the error, with the live
  weights untouched: the version the engine holds keeps serving. While a swap waits for its version, the
  worker starts no other read over it.
- `take_ready(newer_than)` (between decode steps of a generation, `rollout.inflight_updates`) swaps in the
  version ready in the spare if it is newer than `newer_than`, without waiting: the version it swapped in, or
  None. Under the lock a ready version means the worker is not reading into the spare, so the flip is safe
  whenever it is called; the generation's next forward reads the new bank.
- `wait_ready(version, timeout)` waits until `version` is ready in the spare (or failed, or the buffer closed)
  without swapping it in; True if it is ready.
- A restarted learner publishes version numbers again, with other weights: the buffer tells the publishes of
  one number apart by their manifests' `created_unix` (`swap_in(version, made)`, `prefetch`), so a version read
  before the restart is read over, never swapped in as the new one.
- `drain()` hands over one `PrefetchRecord` per finished request since the last call: `swapped` (with the
  read's background seconds; `inflight` for a swap between decode steps, with its wall time), `superseded`
  (replaced before a swap took it) or `failed`.
- `close()` ends it: a waiting swap raises, a request not started is dropped, a read in progress runs to
  its end and then only releases its version, and nothing is swapped afterwards.

Captured CUDA graphs read the addresses they were captured with, so the engine keys its decode graphs by
`live` (one set per bank, captured once each); both banks keep their storage for the engine's life.

`double_buffered(setting, weight_bytes, device)` resolves `rollout.double_buffer: auto`.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from offpolicy.models.build import checkpoint_tensors
from offpolicy.plumbing.trace import now
from offpolicy.rollout.engines.errors import EngineError, VersionRefused
from offpolicy.weights import WeightVersion

log = logging.getLogger("offpolicy.rollout.engines.torch")

RESERVE = 0.2  # auto: the fraction of the GPU's memory that must stay free after the spare bank (KV cache, graphs)


@dataclass(frozen=True)
class PrefetchRecord:
    version: int
    outcome: str  # "swapped", "superseded", "failed" or "unstaged" (switched to in flight with nothing read ahead)
    seconds: float = 0.0  # the background read (0 for a request replaced before it started)
    began: float = 0.0  # when the read started (plumbing.trace.now())
    error: str = ""
    inflight: bool = False  # swapped in between decode steps of a generation (take_ready), not between calls
    swapped_at: float = 0.0  # when the swap was (plumbing.trace.now()), for an in-flight one
    swap_seconds: float = 0.0  # how long that swap held the generation (0 for the torch engine's pointer swap; a
    # vLLM server's pause, load and resume)
    cpu_seconds: float | None = None  # the background read's thread's CPU time (time.thread_time; None: unknown)
    proofs: tuple[tuple[str, bool], ...] = ()  # an in-flight swap's load per server: method, proven (a load between
    # calls is counted from the engine's `last_loads`)


def outcomes(asked: set[int], loaded: int, loads: list[dict]) -> list[PrefetchRecord]:
    """What became of the versions `asked` for ahead once version `loaded` was loaded (the engine's last load records
    `loads`): `swapped` for `loaded` where every record took its background work (`prefetch`: seconds, began),
    `superseded` for older ones; the versions settled are taken out of `asked` (newer ones stay). A load during a
    generate call (`inflight_at` in its records: a vLLM server's update in flight) is marked `inflight`, and is
    `unstaged` where not every record took background work (rollout.vllm.prefetch=direct reads nothing ahead): the
    switch is reported either way. A load between calls without background work is not reported."""
    out = []
    ahead = [r["prefetch"] for r in loads if "prefetch" in r]
    at = [r["inflight_at"] for r in loads if "inflight_at" in r]  # switched in flight (vLLM servers)
    switch = dict(inflight=True, swapped_at=min(at), swap_seconds=max(r["seconds"] for r in loads),
                  proofs=tuple((r["method"], bool(r["verified"])) for r in loads)) if at else {}
    for v in sorted(v for v in asked if v <= loaded):
        if v == loaded and ahead and len(ahead) == len(loads):
            cpu = [a["cpu_seconds"] for a in ahead if "cpu_seconds" in a]
            out.append(PrefetchRecord(v, "swapped", seconds=max(a["seconds"] for a in ahead),
                                      began=min(a["began"] for a in ahead),
                                      cpu_seconds=max(cpu) if len(cpu) == len(ahead) else None, **switch))
        elif v == loaded and at:
            out.append(PrefetchRecord(v, "unstaged", **switch))
        elif v < loaded:
            out.append(PrefetchRecord(v, "superseded"))
        asked.discard(v)
    return out


def switch_outcomes(asked: set[int], engine) -> list[PrefetchRecord]:
    """`outcomes` of each version a server engine switched to in flight since the last call (`engine.switched`: its
    version and load records, taken out), each from its own switch's records, then of its last load (`version`,
    `last_loads`): what a vLLM or SGLang prefetcher's `drain` reports."""
    switched = engine.switched[:]
    del engine.switched[:len(switched)]
    out = [r for version, loads in switched for r in outcomes(asked, version, loads)]
    return out + outcomes(asked, engine.version, engine.last_loads)


def _made(weights: WeightVersion) -> float:
    """Which publish of its version number `weights` is (a restarted learner publishes a number again)."""
    return weights.manifest.created_unix


def double_buffered(setting: bool | str, weight_bytes: int, device: torch.device) -> bool:
    """`rollout.double_buffer` resolved: explicit values stand; auto is on with a GPU whose free memory holds
    a second copy of the weights with `RESERVE` of the GPU left over, off on the CPU (the background read and
    the generation share its cores, and its memory is the host's)."""
    if setting != "auto":
        return bool(setting)
    if device.type != "cuda":
        return False
    free, total = torch.cuda.mem_get_info(device)
    on = free - weight_bytes >= RESERVE * total
    log.info("rollout.double_buffer auto: %s (a second copy of the weights is %.2f GiB; %.2f of %.2f GiB free)",
             "on" if on else "off", weight_bytes / 2**30, free / 2**30, total / 2**30)
    return on


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of the model's parameters and persistent buffers, tied tensors once: what a second bank costs."""
    seen: dict[int, int] = {}
    for t in model.state_dict(keep_vars=True).values():
        seen[id(t)] = t.numel() * t.element_size()
    return sum(seen.values())


class DoubleBuffer:
    def __init__(self, model: torch.nn.Module, read: Callable[[WeightVersion, dict[str, torch.Tensor]], None],
                 device: torch.device):
        self.device, self._read = device, read
        self._slots: list[tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]] = []  # (model tensor, banks)
        pairs: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        banks: tuple[dict, dict] = ({}, {})
        with torch.no_grad():
            for name, t in model.state_dict(keep_vars=True).items():
                if id(t) not in pairs:  # a tied tensor appears under two names: one pair of banks
                    pairs[id(t)] = (t.detach(), torch.empty_like(t))
                    self._slots.append((t, pairs[id(t)]))
                banks[0][name], banks[1][name] = pairs[id(t)]
        self.banks = tuple(checkpoint_tensors(model, b) for b in banks)  # each bank under checkpoint names
        self.live = 0  # the bank the model's tensors point at
        self._cv = threading.Condition()
        self._job: WeightVersion | None = None  # asked for, not started (the buffer's own hold)
        self._loading: int | None = None  # being read into the spare
        self._ready: int | None = None  # complete in the spare
        self._made: dict[str, float] = {}  # "loading" / "ready": its manifest's created_unix (which publish of it)
        self._ready_read: tuple[float, float, float] = (0.0, 0.0, 0.0)  # its read's (began, seconds, CPU seconds)
        self._awaited: int | None = None  # the version a swap is waiting for: not to be read over
        self._awaited_made: float | None = None  # and which publish of it (None: any)
        self._failed: dict[int, tuple[float, str]] = {}  # version -> (created_unix, error)
        self._records: list[PrefetchRecord] = []
        self._closed = False
        cuda = device.type == "cuda"
        self._stream = torch.cuda.Stream(device=device) if cuda else None
        self._released = None  # CUDA: recorded after a swap on the swapping stream; the next read waits for it
        self.thread = threading.Thread(target=self._work, name="weights-prefetch", daemon=True)
        self.thread.start()

    @property
    def ready(self) -> int | None:
        """The version complete in the spare bank and not yet swapped in, if any."""
        with self._cv:
            return self._ready

    def prefetch(self, weights: WeightVersion) -> None:
        """Start reading `weights` into the spare bank in the background (see the module doc); returns at once."""
        with self._cv:
            v, made = weights.version, _made(weights)
            if self._closed or self._failed_as(v, made) or self._is("ready", v, made) or self._is("loading", v, made) \
                    or (self._job is not None and self._job.version == v and _made(self._job) == made):
                return
            try:
                hold = WeightVersion(weights.path)  # our own hold: the caller may close theirs meanwhile
            except FileNotFoundError:
                return  # collected already: a newer one is on its way
            if self._job is not None:
                self._records.append(PrefetchRecord(self._job.version, "superseded"))
                self._job.close()
            self._job = hold
            self._cv.notify_all()

    def swap_in(self, version: int, made: float | None = None) -> None:
        """Wait until `version` is ready in the spare bank, then make it the live one (see the module doc). `made`:
        the manifest's created_unix of the publish wanted (a restarted learner publishes a version number again,
        with other weights): one read from another publish of that number is not taken."""
        with self._cv:
            self._awaited, self._awaited_made = version, made
            try:
                self._cv.wait_for(lambda: self._settled(version, made))
                if self._closed:
                    raise EngineError(f"the torch engine closed while weight version {version} was being swapped in")
                if not self._is("ready", version, made):
                    why = self._failed[version][1] if self._failed_as(version, made) else \
                        "it was never asked for, or its files were gone"
                    raise VersionRefused(f"weight version {version} could not be read into the spare weights, so "
                                         f"the engine keeps the version it holds: {why}")
                self._flip()
                began, seconds, cpu = self._ready_read
                self._records.append(PrefetchRecord(version, "swapped", seconds, began, cpu_seconds=cpu))
                self._ready = None
            finally:
                self._awaited = None
                self._cv.notify_all()

    def take_ready(self, newer_than: int) -> int | None:
        """Swap in the version ready in the spare if it is newer than `newer_than`, without waiting (see the
        module doc); returns it, or None (nothing ready, an older one, a swap waiting, or closed)."""
        with self._cv:
            v = self._ready
            if self._closed or v is None or v <= newer_than or self._awaited is not None:
                return None
            self._flip()
            began, seconds, cpu = self._ready_read
            self._records.append(PrefetchRecord(v, "swapped", seconds, began, inflight=True, swapped_at=now(),
                                                cpu_seconds=cpu))
            self._ready = None
            self._cv.notify_all()
            return v

    def wait_ready(self, version: int, timeout: float | None = None) -> bool:
        """Wait until `version` is ready in the spare (not swapped in), it failed, or the buffer closed; True if
        it is ready."""
        with self._cv:
            self._cv.wait_for(lambda: self._settled(version), timeout)
            return self._ready == version

    def _settled(self, version: int, made: float | None = None) -> bool:
        """Whether a wait for `version` (of the publish `made`, when given) is over: it is ready in the spare, its
        read failed, nobody reads it or asked for it, or the buffer closed."""
        return (self._closed or self._is("ready", version, made) or self._failed_as(version, made)
                or not self._coming(version))

    def _is(self, state: str, version: int, made: float | None) -> bool:
        """Whether `version` (of the publish `made`, when given) is the one loading or ready."""
        held = self._loading if state == "loading" else self._ready
        return held == version and (made is None or self._made.get(state) == made)

    def _failed_as(self, version: int, made: float | None) -> bool:
        """Whether the read of `version` (of the publish `made`, when given) failed."""
        return version in self._failed and (made is None or self._failed[version][0] == made)

    def drain(self) -> list[PrefetchRecord]:
        """The requests finished since the last call (swapped, superseded, failed), oldest first."""
        with self._cv:
            out, self._records = self._records, []
            return out

    def close(self) -> None:
        """Stop: wake a waiting swap (it raises), drop the request not yet started; a read in progress ends
        with its current copy and then releases its version (join `thread` to wait for that)."""
        with self._cv:
            self._closed = True
            if self._job is not None:
                self._job.close()
                self._job = None
            self._cv.notify_all()

    def _coming(self, version: int) -> bool:
        return self._loading == version or (self._job is not None and self._job.version == version)

    def _flip(self) -> None:
        """Point every model tensor at the spare bank; the live one becomes the spare. Called with the lock held
        and the worker idle (a version is ready and awaited, so it starts nothing)."""
        spare = 1 - self.live
        with torch.no_grad():
            for t, pair in self._slots:
                t.data = pair[spare]
        self.live = spare
        if self._stream is not None:  # what the swapping stream queued may still read the old bank, now the spare
            self._released = torch.cuda.Event()
            self._released.record(torch.cuda.current_stream(self.device))

    def _work(self) -> None:
        while True:
            with self._cv:
                # a ready version a swap waits for is not read over
                self._cv.wait_for(lambda: self._closed or self._job is not None and not (
                    self._ready is not None and self._is("ready", self._awaited, self._awaited_made)))
                if self._closed:
                    return
                job, self._job = self._job, None
                if self._ready is not None:  # complete, never swapped in, now read over
                    self._records.append(PrefetchRecord(self._ready, "superseded", self._ready_read[1],
                                                        self._ready_read[0]))
                self._loading, self._ready = job.version, None
                self._made["loading"] = _made(job)
                self._failed.pop(job.version, None)  # another publish of a number that failed: its own verdict
                spare, released = self.banks[1 - self.live], self._released
            began, t0, c0, error = now(), time.perf_counter(), time.thread_time(), ""
            try:
                self._fill(job, spare, released)
            except Exception as e:  # any failure of the read is the version's: reported below and by swap_in
                error = f"{type(e).__name__}: {e}"
            finally:
                job.close()
            seconds, cpu = time.perf_counter() - t0, time.thread_time() - c0
            with self._cv:
                self._loading = None
                if self._closed:
                    return
                if error:
                    self._failed[job.version] = (self._made["loading"], error)
                    self._records.append(PrefetchRecord(job.version, "failed", seconds, began, error))
                    log.error("weight version %d failed to read into the spare weights (%s); the engine keeps "
                              "serving the version it holds", job.version, error)
                else:
                    self._ready, self._ready_read = job.version, (began, seconds, cpu)
                    self._made["ready"] = self._made["loading"]
                self._cv.notify_all()

    def _fill(self, job: WeightVersion, spare: dict[str, torch.Tensor], released) -> None:
        if self._stream is None:
            self._read(job, spare)
            return
        with torch.cuda.stream(self._stream):
            if released is not None:
                self._stream.wait_event(released)
            self._read(job, spare)
        self._stream.synchronize()  # every copy into the spare is done before it is called ready
