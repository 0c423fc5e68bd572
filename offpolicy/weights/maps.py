"""Page-locked maps of shard files, registered with CUDA once and used for every later version.

With `weights.reuse_files` the store writes each new version into the shard files (inodes) of
collected ones, so the same few files come back again and again. A process keeps a shared map
(MAP_SHARED) of each such file, page-locked once with `cudaHostRegister`; from then on the GPU's copy
engine writes a tensor straight into the file (publish) or reads it straight out of it (load): no
pinned staging buffer, no host copy, no `pwrite`/`preadv` (`transfer.write_files`, `read_files`).
Registering is what costs (every page is pinned: doing it again for every version was measured
slower than the staged path, docs/weights.md "Registered maps"), so it happens once per file.

Rules of `MapCache`:
- Entries are keyed by the file's (st_dev, st_ino) and keep a descriptor of their own, so the inode
  (and its number) lives as long as its entry.
- A file is registered on its second sighting: the first time a process meets an inode it only
  remembers it (the staged path copies it); when the file comes back (recycled) it is mapped and
  registered, and that copy already goes through the map. Without `reuse_files` no inode comes back,
  so nothing is pinned in vain.
- An entry is valid while its file keeps its size. A shared-memory file keeps its pages, and a pinned
  page stays the file's page, unless the file is truncated: a file shrunk and grown again would leave
  the pinned pages orphaned (the GPU would read or write bytes nobody else sees). The store therefore
  never resizes a recycled file (it takes a free file of exactly the size it needs, store.py), and an
  entry whose file changed size, or was deleted (link count 0), is unregistered and unmapped at its
  next use, at the start of every call and by a sweeper thread every SWEEP_S seconds: pages of a
  deleted file are not kept alive for longer than that.
- Bounded: the least recently used entries beyond `versions` times the largest call's bytes (a version's:
  `read_files`' `extent` where a call reads one shard or window) are unregistered (the store asks for
  keep + 2 versions, the rollout engine too).
- Failure is never fatal: a map or registration that fails logs one warning (the first), its file
  takes the staged path, and after MAX_FAILURES failures the process stops trying.
- Reads map read-only and register with cudaHostRegisterReadOnly: CUDA documents the flag as required
  to register memory mapped read-only (unless the GPU uses the host's page tables), the likely cause
  of the earlier attempt's "CUDA error 1, invalid argument". A device without support for the flag
  gets a read-write map instead (never written by a load).
- CUDA calls run on a thread of their own: a failed call leaves its error as that thread's last CUDA
  error, which torch's next kernel-launch check would raise in the caller's thread.
- Threads: one lock; an entry in use by a call is never evicted. Fork: a child forgets the parent's
  entries without a CUDA call (its maps are its own copies; the registrations were the parent's).

Gaps between a publish's copies into maps, for the learner's own small copies: weights/gaps.py.
"""

from __future__ import annotations

import atexit
import fcntl
import hashlib
import logging
import mmap
import os
import stat
import threading
import warnings
import weakref
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

from offpolicy.weights.profile import count, stage

log = logging.getLogger("offpolicy.weights")

PORTABLE, READ_ONLY = 1, 8  # cudaHostRegisterPortable, cudaHostRegisterReadOnly
SEEN = 4096  # inodes remembered for their second sighting
MAX_FAILURES = 3  # failed registrations after which a process stops trying
SWEEP_S = 5.0  # seconds between two checks for deleted or resized files


class Mapped:
    """One registered map: `array` (numpy) and `tensor` (torch, CPU) are flat uint8 views of its bytes."""

    def __init__(self, key: tuple[int, int], fd: int, size: int, mm: mmap.mmap, writable: bool, device):
        self.key, self.fd, self.size, self.map, self.writable, self.device = key, fd, size, mm, writable, device
        self.array = np.frombuffer(mm, dtype=np.uint8, count=size)
        self.ptr = self.array.ctypes.data
        self.length = -(-size // mmap.PAGESIZE) * mmap.PAGESIZE  # the map covers whole pages
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # a read-only map: torch warns that it must not be written
            self.tensor = torch.from_numpy(self.array)
        self.users = 0

    def close(self) -> None:
        self.tensor = self.array = None
        try:
            self.map.close()
        except BufferError:
            pass  # a view of it is still alive somewhere: the map goes when that does
        os.close(self.fd)


class MapCache:
    """Registered maps of shard files by inode (see the module doc). `take` at a call's start, `give`
    at its end; `register(ptr, length, flags, device)` and `unregister(ptr, device)` return None or
    an error message (CUDA's by default; tests pass fakes, and `host=True` lets host tensors use maps)."""

    def __init__(self, versions: int = 5, register=None, unregister=None, host: bool = False):
        self.versions, self.host = versions, host
        self._register = register or _cuda_register
        self._unregister = unregister or _cuda_unregister
        self._entries: OrderedDict[tuple[int, int], Mapped] = OrderedDict()  # least recently used first
        self._seen: OrderedDict[tuple[int, int], None] = OrderedDict()
        self._failed: set[tuple[int, int]] = set()
        self._lock = threading.RLock()
        self.largest = 0  # bytes of the largest call so far
        self.registered = self.evicted = self.failures = 0
        self.readonly = True  # reads try read-only maps until the device refuses one
        self._sweeper: threading.Thread | None = None
        self._stop = threading.Event()
        _caches.add(self)

    @property
    def enabled(self) -> bool:
        return self.failures < MAX_FAILURES

    @property
    def bytes(self) -> int:
        return sum(e.size for e in list(self._entries.values()))

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, fd: int) -> bool:
        st = os.fstat(fd)
        return (st.st_dev, st.st_ino) in self._entries

    def take(self, fd: int, device, writable: bool) -> Mapped | None:
        """The registered map of the open file `fd` (held until `give`), or None: first sighting, a
        failure, or the cache gave up. `writable`: the caller writes into it (a publish)."""
        if not self.enabled:
            return None
        st = os.fstat(fd)
        if st.st_size == 0 or not stat.S_ISREG(st.st_mode):
            return None
        key = (st.st_dev, st.st_ino)
        with self._lock:
            e = self._entries.get(key)
            if e is not None:
                if e.size == st.st_size and (e.writable or not writable):
                    e.users += 1
                    self._entries.move_to_end(key)
                    count("maps.hit")
                    return e
                if e.users:
                    return None  # another call uses it as it was: the staged path this time
                self._evict(e)  # resized (its pages may not be the file's) or read-only where we write
            elif key not in self._seen:
                self._seen[key] = None
                while len(self._seen) > SEEN:
                    self._seen.popitem(last=False)
                count("maps.first_sighting")
                return None
            if key in self._failed:
                return None
            e = self._open(fd, st.st_size, key, device, writable)
            if e is None:
                self._failed.add(key)
                return None
            e.users = 1
            self._entries[key] = e
            self._start_sweeper()
            return e

    def give(self, entries: list[Mapped], nbytes: int) -> None:
        """End of a call that took `entries` and moved `nbytes` (one version): trim to the bound."""
        with self._lock:
            for e in entries:
                e.users -= 1
            self.largest = max(self.largest, nbytes)
            total, limit = self.bytes, self.versions * self.largest
            for e in list(self._entries.values()):  # least recently used first
                if total <= limit:
                    break
                if not e.users:
                    total -= e.size
                    self._evict(e)

    def sweep(self) -> int:
        """Unregister and unmap every entry not in use whose file was deleted or resized; how many."""
        n = 0
        with self._lock:
            for e in list(self._entries.values()):
                if e.users:
                    continue
                try:
                    st = os.fstat(e.fd)
                    gone = st.st_nlink == 0 or st.st_size != e.size
                except OSError:
                    gone = True
                if gone:
                    self._evict(e)
                    n += 1
        return n

    def clear(self) -> None:
        """Unregister and unmap every entry not in use (and forget every sighting)."""
        with self._lock:
            for e in list(self._entries.values()):
                if not e.users:
                    self._evict(e)
            self._seen.clear()

    def _open(self, fd: int, size: int, key, device, writable: bool) -> Mapped | None:
        tries = [(True, PORTABLE)]  # a read-write map: what a publish needs, and a load's fallback
        if not writable and self.readonly:
            tries.insert(0, (False, PORTABLE | READ_ONLY))
        errors = []
        for rw, flags in tries:
            try:
                own = _reopen(fd, rw)
            except OSError as exc:
                errors.append(f"reopen {'read-write' if rw else 'read-only'}: {exc}")
                continue
            try:
                prot = mmap.PROT_READ | (mmap.PROT_WRITE if rw else 0)
                e = Mapped(key, own, size, mmap.mmap(own, size, flags=mmap.MAP_SHARED, prot=prot), rw, device)
            except (OSError, ValueError) as exc:
                os.close(own)
                errors.append(f"mmap: {exc}")
                continue
            with stage("maps.register"):
                try:
                    err = self._register(e.ptr, e.length, flags, device)
                except Exception as exc:  # no CUDA runtime, a broken driver: the staged path
                    err = repr(exc)
            if err is None:
                self.registered += 1
                count("maps.registered")
                count("maps.registered_bytes", size)
                _check_pinned(e, device)
                return e
            errors.append(f"cudaHostRegister of {e.length} bytes with flags {flags}: {err}")
            e.close()
            if flags & READ_ONLY:
                self.readonly = False  # this device takes no read-only registrations: map read-write
        self.failures += 1
        count("maps.failed")
        level = logging.WARNING if self.failures == 1 else logging.DEBUG
        log.log(level, "could not page-lock a shard map (weights.register_maps), so that file takes the staged "
                "path; after %d failures this process stops trying: %s", MAX_FAILURES, "; ".join(errors))
        return None

    def _evict(self, e: Mapped) -> None:
        del self._entries[e.key]
        try:
            err = self._unregister(e.ptr, e.device)
        except Exception as exc:
            err = repr(exc)
        if err is not None:
            log.debug("cudaHostUnregister of a shard map: %s", err)
        e.close()
        self.evicted += 1
        count("maps.evicted")

    def _start_sweeper(self) -> None:
        if self._sweeper is None or not self._sweeper.is_alive():
            self._sweeper = threading.Thread(target=_sweep_loop, args=(weakref.ref(self), self._stop), daemon=True,
                                             name="offpolicy-map-sweeper")
            self._sweeper.start()

    def _forget(self) -> None:
        """In a forked child: drop everything without a CUDA call (the registrations were the parent's)."""
        self._lock = threading.RLock()  # the parent's may have been held by a thread the child lacks
        for e in self._entries.values():
            e.close()
        self._entries.clear()
        self._seen.clear()
        self._sweeper, self._stop = None, threading.Event()


# ---------------------------------------------------------------- copies through registered maps


def map_device(maps, tensors: list[torch.Tensor]):
    """The device whose copy engine would move these tensors through a registered map, or None (staged):
    they are on one GPU (host tensors among them are copied by the CPU), or, with a cache made with
    host=True (tests without a GPU), all on the host."""
    if not maps.enabled:
        return None
    gpus = {t.device for t in tensors if t.is_cuda}
    if len(gpus) == 1:
        return gpus.pop()
    return torch.device("cpu") if not gpus and maps.host else None


_streams: dict[int, torch.cuda.Stream] = {}
_streams_lock = threading.Lock()


def device_index(device: torch.device) -> int:
    """The index of a CUDA device ("cuda" alone: the current one)."""
    return device.index if device.index is not None else torch.cuda.current_device()


def _stream(device: torch.device) -> torch.cuda.Stream:
    """The stream of the copies through registered maps on `device` (one per device, kept; the highest priority,
    for `gaps.CopyGaps`' kernels: the copy engine itself ignores priorities)."""
    key = device_index(device)
    with _streams_lock:
        if key not in _streams:
            _streams[key] = torch.cuda.Stream(device=key, priority=-1)
        return _streams[key]


def issue_write(entry, chunks: list[tuple[torch.Tensor, int]], checksum: bool, device: torch.device,
                after: torch.cuda.Event | None = None, gaps=None):
    """Start copying `chunks` (in file order) into the registered map `entry`: GPU chunks (all on
    `device`) asynchronously on its map stream, after the event `after` (the producer's: its sources are
    made by then), or without one after what the caller's stream has queued (the sources were written
    there), with `gaps` between them (`gaps.CopyGaps`); host chunks at once. Returns ([(end offset, event or None)]
    to hash behind, the last event)."""
    marks: list[tuple[int, torch.cuda.Event | None]] = []
    if device.type != "cuda":
        for src, offset in chunks:
            np.copyto(entry.array[offset:offset + src.numel()], src.numpy())
            marks.append((offset + src.numel(), None))
        return marks, None
    stream = _stream(device)
    copies_after(stream, after, torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        for src, offset in chunks:
            n = src.numel()
            event = None
            if src.is_cuda:
                if gaps is not None:
                    gaps.before(n, device)
                entry.tensor[offset:offset + n].copy_(src, non_blocking=True)
                if checksum:
                    event = torch.cuda.Event()
                    event.record(stream)
            else:
                np.copyto(entry.array[offset:offset + n], src.numpy())
            marks.append((offset + n, event))
        done = torch.cuda.Event()
        done.record(stream)
    return marks, done


def copies_after(stream: torch.cuda.Stream, event: torch.cuda.Event | None, producer: torch.cuda.Stream) -> None:
    """Order `stream`'s next copies after the event `event`, or without one after all `producer` has queued."""
    if event is not None:
        stream.wait_event(event)
    else:
        stream.wait_stream(producer)


def finish_write(entry, size: int, issued, checksum: bool) -> str:
    """Wait for a file's copies into its map; hash it from the map (in file order, each chunk as soon as
    its copy is done, the header between them read from the map as well)."""
    marks, done = issued
    if not checksum:
        if done is not None:
            with stage("write.dma_wait"):
                done.synchronize()
        return ""
    h, pos = hashlib.sha256(), 0
    for end, event in marks:
        if event is not None:
            with stage("write.dma_wait"):
                event.synchronize()
        with stage("write.hash"):
            h.update(entry.array[pos:end])  # hashlib drops the GIL for large buffers
        pos = end
    if done is not None:
        with stage("write.dma_wait"):
            done.synchronize()
    with stage("write.hash"):
        h.update(entry.array[pos:size])
    return h.hexdigest()


def issue_read(entry, pieces: list[tuple[int, torch.Tensor]], device: torch.device) -> set:
    """Start copying each (offset, dst) out of the registered map `entry`: into GPU tensors (all on
    `device`) asynchronously on its map stream (after what the caller's stream has queued: the
    destinations may still be read there), into host tensors at once. Returns the streams used."""
    if device.type != "cuda":
        for offset, dst in pieces:
            np.copyto(dst.numpy(), entry.array[offset:offset + dst.numel()])
        return set()
    stream = _stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        for offset, dst in pieces:
            src = entry.tensor[offset:offset + dst.numel()]
            if dst.is_cuda:
                dst.copy_(src, non_blocking=True)
            else:
                np.copyto(dst.numpy(), entry.array[offset:offset + dst.numel()])
    return {stream}


def _check_pinned(e: Mapped, device) -> None:
    """Say once a process where torch does not see a registered map as page-locked (`is_pinned`): its GPU copies
    would take CUDA's pageable path, several times slower (docs/benchmarks.md), though registered."""
    global _unpinned_said
    if not _unpinned_said and getattr(device, "type", None) == "cuda" and not e.tensor.is_pinned():
        _unpinned_said = True
        log.warning("a shard map registered with cudaHostRegister is not page-locked as torch sees it (is_pinned is "
                    "False; a %s map of %d bytes): its copies run at pageable speed (weights.register_maps)",
                    "read-write" if e.writable else "read-only", e.size)


def _sweep_loop(ref, stop: threading.Event) -> None:
    while not stop.wait(SWEEP_S):
        cache = ref()
        if cache is None or not cache._entries:
            return  # started again by the next registration
        cache.sweep()
        del cache


def _reopen(fd: int, writable: bool) -> int:
    """A descriptor of our own for the file open as `fd`, read-write if asked (through /proc, so a
    read-only descriptor can be reopened for a read-write map)."""
    if not writable:
        return os.dup(fd)
    try:
        return os.open(f"/proc/self/fd/{fd}", os.O_RDWR)
    except OSError:
        if fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_ACCMODE == os.O_RDWR:
            return os.dup(fd)
        raise


_registrar: ThreadPoolExecutor | None = None
_registrar_lock = threading.Lock()


def _on_registrar(fn):
    """Run a CUDA call on a thread of its own (its failure stays that thread's last error)."""
    global _registrar
    with _registrar_lock:
        if _registrar is None:
            _registrar = ThreadPoolExecutor(1, thread_name_prefix="offpolicy-cuda-register")
        pool = _registrar
    return pool.submit(fn).result()


def _error(cudart, res) -> str:
    return f"CUDA error {int(res)} ({cudart.cudaGetErrorString(res)})"


def _cuda_call(device, name: str, *args) -> str | None:
    """cudart's `name`(*args) on `device`, on the registration thread: None, or CUDA's error."""
    def call():
        with torch.cuda.device(device):
            cudart = torch.cuda.cudart()
            res = getattr(cudart, name)(*args)
            return None if res == cudart.cudaError.success else _error(cudart, res)
    return _on_registrar(call)


def _cuda_register(ptr: int, length: int, flags: int, device) -> str | None:
    return _cuda_call(device, "cudaHostRegister", ptr, length, flags)


def _cuda_unregister(ptr: int, device) -> str | None:
    return _cuda_call(device, "cudaHostUnregister", ptr)


def host_register(ptr: int, length: int, device) -> str | None:
    """Page-lock `length` bytes of host memory at `ptr` for `device` (portable); None, or CUDA's error."""
    return _cuda_register(ptr, length, PORTABLE, device)


def host_unregister(ptr: int, device) -> str | None:
    return _cuda_unregister(ptr, device)


_caches: weakref.WeakSet[MapCache] = weakref.WeakSet()
_shared: MapCache | None = None
_shared_lock = threading.Lock()
_unpinned_said = False  # _check_pinned warned


def shared(versions: int = 5) -> MapCache:
    """This process's cache (one registration per file and process, whether it writes or reads it),
    bounded to the most `versions` any caller asked for."""
    global _shared
    with _shared_lock:
        if _shared is None:
            _shared = MapCache(versions)
        _shared.versions = max(_shared.versions, versions)
        return _shared


def _after_fork() -> None:
    global _registrar, _registrar_lock, _shared_lock
    _registrar, _registrar_lock, _shared_lock = None, threading.Lock(), threading.Lock()
    for cache in list(_caches):
        cache._forget()


def _stop_sweepers() -> None:
    for cache in list(_caches):
        cache._stop.set()  # no sweep (and no CUDA call) while the interpreter shuts down


os.register_at_fork(after_in_child=_after_fork)
atexit.register(_stop_sweepers)
