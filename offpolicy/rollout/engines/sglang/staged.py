"""The in-process SGLang engine's loads from a version staged on its GPU (`rollout.sglang.prefetch: device`).

SGLang's `update_weights_from_disk` reads the version's files in its scheduler while the engine waits, on the rollout's
critical path (measured: docs/sglang.md, "Staged loads"). With `device` the daemon reads the version onto the engine's
GPU itself (`staging.Stager`, offpolicy's parallel reader through pinned slots), ahead in a thread beside generation
when the daemon hands it the version (`prefetch`, `rollout.double_buffer`; `background.Background`), else at the load;
the load then hands those tensors to SGLang's `update_weights_from_tensor` (0.5.14 `managers/io_struct.py:1522-1541`,
with `weight_version`; `tokenizer_control_mixin.py:464-490`): SGLang's `MultiprocessingSerializer` pickles them with
torch's CUDA IPC reductions (device named by UUID: SGLang's `monkey_patch_torch_reductions`,
`utils/patch_torch.py:41-52`), and each TP worker's `model.load_weights` copies them into the model, device to device
(`model_executor/model_runner.py:2066-2094`, `load_format` None). Nothing changes in the proof: it is against the
version's files, as after a load from disk. Versions staged so (while the engine generated) load faster than `direct`
ones (measured: docs/sglang.md, "Staged loads"): `auto` stages where the version fits in AUTO_DEVICE_SHARE of the GPU's
free memory beside the engine (`prefetch_of`, `unstaged_of`).
With `direct` nothing is staged and no memory kept: at the load the version is read onto the GPU a window
(DIRECT_WINDOW bytes) at a time, each window handed over by a request of its own (`direct_requests`; the last one
flushes the cache and sets the weight_version), for versions too large to stage whole beside the engine (GPT-OSS-20B's
41.8 GB in bf16): SGLang's GPT-OSS loader transposes each expert tensor it is given (0.5.14 `models/gpt_oss.py:1212`),
which its copy makes contiguous on the tensor's side, the host when SGLang reads the files itself. Each window is
hashed for the load's proof as it is read (`WindowsHash`). Beside the learner a `direct` load was faster than one
from disk (docs/sglang.md, "Staged loads").

Invariants:
- `held(path)` gives the staged version at `path` (the background's, waited for, or staged now), or None where the
  staging failed or does not fit (`StagingRefused`: said in the log, naming `rollout.sglang.prefetch` and the fix;
  auto's refusal said once, at info); the load then reads `direct` where the engine takes tensors, else from disk
  (`unstaged_of`). A newer `prefetch` stops an older staging (`Stager.begin`).
- While a load uses the staged tensors (`held`, from the update through the load's proof, whose reads in the scheduler
  come after the load's copies on its stream), no staging starts: one asked for meanwhile starts when the load is
  over (the newest only).
- The arena is kept for the next version (a model's versions have one size): the version's bytes of GPU memory
  beside the engine's `mem_fraction_static` share, for the engine's life.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from contextlib import contextmanager

import torch

from offpolicy.config import Config
from offpolicy.rollout.engines import fingerprint as fp
from offpolicy.rollout.engines.background import Background, Done
from offpolicy.rollout.engines.double_buffer import PrefetchRecord, outcomes
from offpolicy.rollout.engines.gpu_room import AUTO_DEVICE_SHARE
from offpolicy.rollout.engines.placement import shared_with_learner
from offpolicy.rollout.engines.sglang.pickling import pickled
from offpolicy.rollout.engines.staging import (Cancelled, Names, Staged, Stager, StagingRefused, map_versions,
                                               files_bytes, read_window, reader_maps, window_plan)
from offpolicy.weights import WeightVersion
from offpolicy.weights.formats import NATIVE

log = logging.getLogger("offpolicy.sglang")

NAMES = Names("rollout.sglang.prefetch", "rollout.sglang.mem_fraction_static", "disk")


DIRECT_WINDOW = 1 << 30  # direct: bytes of tensors one update request hands SGLang (a larger tensor alone)


def engine_device(cfg: Config) -> torch.device:
    """Where the daemon puts the tensors it hands the engine: its first GPU (SGLang's base_gpu_id); on a CPU (the
    tests' stand-in engine) host memory."""
    gpu = cfg.rollout.device != "cpu" and torch.cuda.is_available()
    return torch.device("cuda", int(cfg.rollout.sglang.extra.get("base_gpu_id", 0))) if gpu else torch.device("cpu")


def _no_hash(_tensors) -> None:
    return None  # the proof's workers hash the files at the load (fingerprint_proof.py)


def mxfp4_in_place(cfg: Config) -> bool:
    """Whether later MXFP4 versions go into the running engine through offpolicy's loader (mxfp4_inplace.py) rather
    than a restart each: `rollout.sglang.mxfp4_load` inplace, or auto where the loader can (an in-process engine of
    one GPU, tp_size, ep_size and dp_size 1, its versions read onto that GPU: a CUDA device here, rollout.device and
    rollout.sglang.prefetch not the host's or disk)."""
    s = cfg.rollout.sglang
    if cfg.rollout.weights_format != "mxfp4" or s.mxfp4_load == "restart":
        return False
    return s.mxfp4_load == "inplace" or (
        s.mode == "engine" and s.tp_size == s.ep_size == s.dp_size == 1 and s.prefetch != "disk"
        and engine_device(cfg).type == "cuda")


def from_tensors(cfg: Config) -> bool:
    """Whether the in-process engine can take versions as tensors (`device`, `direct`): on a GPU (`engine_device`)
    with native (bf16) versions, or MXFP4 ones loaded in place (`mxfp4_in_place`: rollout.sglang.mxfp4_load),
    and one data-parallel replica (SGLang updates from tensors with one); fp8 versions from tensors
    are not measured."""
    s = cfg.rollout.sglang
    return (s.mode == "engine" and s.dp_size == 1 and (cfg.rollout.weights_format == NATIVE or mxfp4_in_place(cfg))
            and engine_device(cfg).type == "cuda")


def prefetch_of(cfg: Config) -> str:
    """rollout.sglang.prefetch as the in-process engine applies it: "auto" is "device" where the engine takes tensors
    (`from_tensors`) on a GPU of its own and versions are staged ahead (rollout.double_buffer not false), "direct"
    where that GPU is a learner's too (its free memory is the learner's to grow into: `placement.shared_with_learner`)
    or nothing is staged ahead, else "disk"; an auto staging takes at most AUTO_DEVICE_SHARE of the
    GPU's free memory (`staged_loads`) and a version that does not fit loads `direct` (`unstaged_of`). Loads from the
    GPU were the fastest and the pipeline's steps the shortest, then `direct`, then disk (measured: docs/sglang.md,
    "Staged loads")."""
    s = cfg.rollout.sglang
    if s.prefetch != "auto":
        return s.prefetch
    if not from_tensors(cfg):
        return "disk"
    # staged at the load, not ahead (rollout.double_buffer false), a version would be read and then copied: direct
    # reads it once. MXFP4 versions in place stage too, once the first version has started the engine
    # (`StagedPrefetcher`'s `ready`: a staging beside that start would hold memory the engine sizes its KV pool beside)
    direct = shared_with_learner(cfg) or cfg.rollout.double_buffer is False
    return "direct" if direct else "device"


def unstaged_of(cfg: Config) -> str:
    """How a version loads that is not staged (`prefetch_of` is not device, or its staging did not fit or failed):
    "direct" where the engine takes tensors (`from_tensors`) and rollout.sglang.prefetch is not disk, else "disk"."""
    how = prefetch_of(cfg)
    if how == "device":
        return "direct" if from_tensors(cfg) else "disk"
    return how


def staged_loads(cfg: Config, restart: bool, files_hash: Callable = _no_hash) -> StagedLoads | None:
    """The engine's StagedLoads where rollout.sglang.prefetch is device (or auto's device) and versions load into the
    running engine (not a format that starts an engine per version, `restart`), on `engine_device`; `files_hash`
    hashes the staged tensors for the load's proof (`FingerprintProof.files_hash`). Auto's stagings take at most
    AUTO_DEVICE_SHARE of the GPU's free memory; a version that is not staged loads as `unstaged_of` says."""
    if prefetch_of(cfg) != "device" or restart:
        return None
    share = AUTO_DEVICE_SHARE if cfg.rollout.sglang.prefetch == "auto" else 1.0
    return StagedLoads(engine_device(cfg), files_hash, share, unstaged_of(cfg), engine_maps(cfg))


def engine_maps(cfg: Config):
    """The registered maps the engine's reads onto its GPU go through (`staging.reader_maps`: weights.register_maps)."""
    return reader_maps(map_versions(cfg.weights), engine_device(cfg))


def staged_record(staged: Staged | None, ahead: Done | None) -> dict:
    """What a load record says of a staged load: `staged` (where, bytes, read seconds, whether ahead) and, where it
    was staged in the background, `prefetch` (its seconds, when it began, how long the load waited for it, its
    thread's CPU seconds)."""
    if staged is None:
        return {}
    out: dict = {"staged": staged.record(ahead=ahead is not None)}
    if ahead is not None:
        out["prefetch"] = {"seconds": ahead.seconds, "began": ahead.began, "waited": ahead.waited,
                           "cpu_seconds": ahead.cpu_seconds}
    return out


class StagedLoads:
    """Versions staged on `device` (the engine's first GPU) for `update_weights_from_tensor`, each hashed by
    `files_hash` once read (`Staged.files`: the files' half of the load's proof, None where it gave none)."""

    def __init__(self, device: torch.device, files_hash: Callable = _no_hash, share: float = 1.0,
                 otherwise: str = "disk", maps=None):
        self.device, self.files_hash = device, files_hash
        self.stager = Stager(device, NAMES, share, maps)  # share: of the GPU's free memory a staging may take
        self.otherwise = otherwise  # how a version that is not staged loads: "disk" or "direct" (`unstaged_of`)
        self._ahead: Background | None = None
        self._lock = threading.Lock()  # guards the fields below
        self._held = False  # a load reads the arena: a staging asked for meanwhile waits in _pending
        self._pending: str | None = None
        self.refused: str | None = None  # the last reason a version was not staged, said once each

    def prefetch(self, path: str) -> None:
        """Start staging the version at `path` in the background (a newer request stops an older staging; while a load
        reads the arena it starts when that load is over); returns at once."""
        with self._lock:
            if self._held:
                self._pending = path
            else:
                self._start(path)

    def _start(self, path: str) -> None:  # under _lock
        if self._ahead is not None and self._ahead.key == path:
            return
        stop = self.stager.begin()
        self._ahead = Background(path, lambda: self.stager.stage(path, "device", self.files_hash, stop), self.device)

    @contextmanager
    def held(self, path: str):
        """(the version at `path` staged, or None where that failed: the load reads as `otherwise`; the background
        work's `Done` where it was staged ahead, else None), with the arena held until the block ends: the load's update
        and proof."""
        with self._lock:
            self._held, ahead = True, self._ahead
        try:
            yield self._take(path, ahead)
        finally:
            with self._lock:
                self._held, pending, self._pending = False, self._pending, None
                if pending is not None:
                    self._start(pending)

    def _take(self, path: str, ahead: Background | None) -> tuple[Staged | None, Done | None]:
        try:
            done = ahead.result(path) if ahead is not None else None
            if done is not None:
                return done.value, done
        except Cancelled:  # passed over for a newer version before it ended: this load stages its own now
            pass
        except Exception as e:  # refused or unreadable: said, and the load reads as `otherwise`
            self._say(e, path)
            return None, None
        with self._lock:  # the arena is this load's now: no background result describes it any more
            self._ahead = None
        try:
            return self.stager.stage(path, "device", self.files_hash, self.stager.begin()), None  # not (or no longer) ahead
        except Exception as e:
            self._say(e, path)
            return None, None

    def _say(self, e: Exception, path: str) -> None:
        why = (str(e) if isinstance(e, StagingRefused)
               else f"staging {path} on {self.device} failed ({type(e).__name__}: {e})")
        if why != self.refused:
            how = ("direct (read onto the GPU a window at a time)" if self.otherwise == "direct"
                   else "from disk (update_weights_from_disk)")
            # auto's refusal is its choice, not a failure: said at info
            chose = self.stager.share < 1 and isinstance(e, StagingRefused)
            if chose and self.refused == "auto":
                return  # said once: the free memory it names differs from load to load
            log.log(logging.INFO if chose else logging.WARNING, "%s; this version loads %s", why, how)
            self.refused = "auto" if chose else why

    def close(self) -> None:
        self.stager.close()


def tensor_request(staged: Staged, tp_size: int, version: int, load_format: str | None = None):
    """SGLang's UpdateWeightsFromTensorReqInput for the staged tensors (`_request`), the cache flushed and the
    version's number as its weight_version; `load_format` the loader SGLang runs (None: its model's own)."""
    return _request(list(staged.read()), tp_size, str(version), load_format=load_format)


def direct_requests(path: str, device: torch.device, tp_size: int, version: int, window: int | None = None,
                    load_format: str | None = None, maps=None):
    """`rollout.sglang.prefetch=direct`: the version at `path` as update requests of a window of tensors each
    (`staging.window_plan`), each window read onto `device` by offpolicy's reader as its request is made: (request,
    its tensors, to be held until SGLang has taken them). The last flushes the cache and sets the weight_version; the
    earlier ones leave both (SGLang keeps the label a request gives none, 0.5.14 `tokenizer_control_mixin.py:874-879`).
    `window`: bytes a request (DIRECT_WINDOW). `load_format`: the loader SGLang runs (worker.SYNCED_LOADER, whose
    answer means its copies out of the window are done: the window's memory is then free for the next; None:
    SGLang's own, whose copies may still run when it answers)."""
    groups = window_plan(path, window=window or DIRECT_WINDOW)
    extent = files_bytes([p for group in groups for p in group])  # the version's (the registered maps' bound)
    for i, group in enumerate(groups):
        named = read_window(path, group, device, maps, extent)
        last = i == len(groups) - 1
        yield _request(named, tp_size, str(version) if last else None, flush=last, load_format=load_format), named


class WindowsHash:
    """The files' half of a `direct` load's proof (`FingerprintProof.files_hash`), hashed a window at a time as the
    load reads them, on the engine's GPU, before SGLang's loaders take them (some write into what they are given:
    WRITTEN_BY_LOADERS): the version's files are read once, by the load, where a hash ahead (`files_ahead.py`) read
    them a second time beside it, and the loads waited for that hash (docs/sglang.md, "The proof's files hashed ahead").
    `totals` is None where a window's hash gave none (no baseline yet) or failed (said once per reason): the proof's
    workers then hash the files at the load, as without it."""

    def __init__(self, files_hash: Callable):
        self.files_hash = files_hash  # (name, tensor) pairs -> the fingerprint by group and kind, or None
        self.totals: dict[str, int] | None = {}
        self.seconds = 0.0
        self.failed: str | None = None  # why the last hash failed, said once each

    def add(self, named: list) -> None:
        """Hash one window's (name, tensor) pairs into `totals`."""
        if self.totals is None:
            return
        t0 = time.perf_counter()
        try:
            part = self.files_hash(named)
        except Exception as e:  # noqa: BLE001 - any: the workers hash the files at the load instead
            why = f"{type(e).__name__}: {e}"
            if why != self.failed:
                log.warning("hashing a direct load's window failed (%s); SGLang's workers hash its files at the load",
                            why)
                self.failed = why
            part = None
        if part is None:
            self.totals = None
            return
        for g, v in part.items():
            self.totals[g] = fp.add(self.totals.get(g, fp.ZERO), v)
        self.seconds += time.perf_counter() - t0


# checkpoint tensors SGLang's loaders write into on some ranks: 0.5.14's GPT-OSS loader zeroes the experts'
# down-projection bias it is given on MoE-TP ranks other than 0 (`models/gpt_oss.py:1213-1214`)
WRITTEN_BY_LOADERS = (".mlp.experts.down_proj_bias",)


def for_rank(named: list, rank: int) -> list:
    """The (name, tensor) pairs TP rank `rank` is handed: the ranks share the tensors (CUDA IPC: one memory), except
    those a loader writes into (WRITTEN_BY_LOADERS), which every rank but 0 gets a copy of (small: a bias)."""
    if rank == 0:
        return named
    return [(n, t.clone() if n.endswith(WRITTEN_BY_LOADERS) else t) for n, t in named]


def _request(named: list, tp_size: int, weight_version: str | None, flush: bool = True,
             load_format: str | None = None):
    """SGLang's UpdateWeightsFromTensorReqInput for `named` tensors: one pickle per TP rank (as 0.5.14's
    `Engine.update_weights_from_tensor` builds it, `entrypoints/engine.py:1052-1074`; `for_rank`), loaded by
    `load_format` (None: SGLang's model loader), pickled as its MultiprocessingSerializer does (`pickling.pickled`)."""
    from sglang.srt.managers.io_struct import UpdateWeightsFromTensorReqInput  # late: heavy, CUDA-only
    from sglang.srt.utils.patch_torch import monkey_patch_torch_reductions

    monkey_patch_torch_reductions()  # CUDA tensors named by device UUID, which SGLang's workers resolve
    return UpdateWeightsFromTensorReqInput(
        serialized_named_tensors=[pickled(for_rank(named, r)) for r in range(tp_size)],
        load_format=load_format, flush_cache=flush, weight_version=weight_version)


class StagedPrefetcher:
    """The in-process engine's `Prefetcher` (`rollout.double_buffer`): each version the daemon hears of is staged in
    the background (`StagedLoads.prefetch`, `rollout.sglang.prefetch: device`) or its files hashed for the load's proof
    (`files_ahead.FilesAhead.prefetch`, `disk`), while the engine generates with the version before;
    `drain` says after a load what became of them (`double_buffer.outcomes`)."""

    def __init__(self, loads, engine, ready: Callable[[], bool] = lambda: True):
        self.loads = loads  # StagedLoads or FilesAhead: prefetch(path)
        self.engine = engine  # the SGLangEngine: its version and last_loads
        self.ready = ready  # whether versions are staged now (`LocalBackend.stages_ahead`: not before the engine runs)
        self._asked: set[int] = set()
        self._lock = threading.Lock()

    def prefetch(self, weights: WeightVersion) -> None:
        if not self.ready():  # that version loads as it would unstaged (`unstaged_of`), and says so in its record
            return
        with self._lock:
            self._asked.add(weights.version)
        self.loads.prefetch(str(weights.path))

    def drain(self) -> list[PrefetchRecord]:
        with self._lock:
            return outcomes(self._asked, self.engine.version, self.engine.last_loads)

    def close(self) -> None:
        """The backend closes the staging (`StagedLoads.close`)."""
