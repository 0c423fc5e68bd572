"""A stand-in `sglang` for the in-process engine (rollout.sglang.mode=engine), with the process behaviour of sglang
0.5.14 that the rollout daemon has to survive when a scheduler dies.

- `Engine` starts a real scheduler process (multiprocessing, spawn, as SGLang does: 0.5.14
  `entrypoints/engine.py:611-645, 1322`) named `sglang::scheduler_TP0`, and sends it every generate, weight update and
  read-back; the answer comes back on the engine's event loop (`Engine.loop`, 269-273), and a scheduler that is gone
  answers nothing, ever: the call waits, as SGLang's does on its ZMQ sockets.
- The scheduler first asks the kernel to SIGKILL it when its parent dies, before it says it is ready
  (`kill_itself_when_parent_died`, `utils/common.py:2538-2543`: prctl(PR_SET_PDEATHSIG, SIGKILL)); the parent is the
  thread that started the Engine, so the scheduler dies when that thread ends (offpolicy's `sglang/owner.py`).
- A scheduler whose request raised sends SIGQUIT to its parent and returns, exit code 0
  (`managers/scheduler.py:4229-4232`); a thread of the engine's process checks it every 0.2 s and, once it exited
  with a nonzero code (SIGKILLed), sends SIGQUIT to its own process (SubprocessWatchdog, `utils/watchdog.py:166-221`).
- An Engine started in the main thread puts SGLang's launch-phase SIGQUIT handler in place
  (`entrypoints/engine.py:1293-1307`): it SIGKILLs the engine's processes and its own (`kill_process_tree`,
  `utils/common.py:1248-1302`); with `KILL_ON_SIGQUIT = False` (in-process tests) it only records the signal in
  `SIGQUITS_TAKEN`. Off the main thread it puts in none, as SGLang.
- `Engine.shutdown` (also at exit: atexit, 224) stops the watchdog thread, then SIGKILLs the scheduler (898-913) and
  says so on stderr.
- The environment variable SGLANG_STANDIN (JSON, the plan) makes the scheduler fail: `hang_at` N (its N-th generate never
  ends), `fail_at` N (its N-th generate raises), `fail_start` (it raises before it is ready: SIGQUIT, and the Engine's
  start raises as 0.5.14's `_wait_for_scheduler_ready`); `dir` (where it writes its pid, `scheduler.pid`, and how many
  generates it took, `generates`); `sigquit_on_shutdown` (Engine.shutdown sends its process a SIGQUIT first);
  `skip_update_at` N (with `model`: its N-th update_weights_from_disk loads nothing and answers success, a load that
  never happened).
- Outputs are `tests/sglang_fake.py`'s toy samples in SGLang's output shape, whatever the weights; `get_weights_by_name`
  answers None (a model class without a read-back, as GPT-OSS's).
- With `"model": true` in the plan the scheduler holds a real model, as 0.5.14's TP worker does (one rank, on the CPU): before
  it says it is ready it loads the checkpoint at the Engine's `model_path` with transformers in the Engine's `dtype`
  (HF names: transformers' Llama layout, unfused); `update_weights_from_disk` loads the safetensors files of the
  request's `model_path` into it (`load_state_dict`: the model's dtype, in place; a file tensor the model has no
  parameter for fails the update); `update_weights_from_tensor(named_tensors, load_format)` with a `load_format` among
  the Engine's `custom_weight_loader` imports it as SGLang's `dynamic_import` ("a.b.func") and calls
  `func(model, named_tensors)` in the scheduler, answering (True, "Success") (`model_executor/model_runner.py:
  2066-2094`; what the loader raises ends the scheduler, as there); the tokenizer manager's
  `update_weights_from_tensor(req)` with `load_format` None (SGLang's model loader) sends rank 0's pickle
  (`MultiprocessingSerializer`) to the scheduler, which unpickles it (CPU tensors in shared memory) and loads the
  tensors into its model as from disk (the model's `load_weights`, which the stand-in gives it as SGLang's model
  classes have one), or with a `load_format` among the custom loaders calls that loader on them, then sets
  `weight_version` (`skip_update_at` counts these loads too). So
  offpolicy's fingerprint loader
  (`sglang/worker.py`) proves loads here as on a GPU (`ServerArgs` has 0.5.14's `custom_weight_loader`, so the
  backend registers it and asks). Without `model` (or with another `load_format`)
  `update_weights_from_tensor` refuses: loads are recorded unproven.

`python -m tests.sglang_inprocess --config ...`, from the repository root, runs the rollout daemon with it.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import ctypes
import dataclasses
import itertools
import json
import multiprocessing
import os
import signal
import sys
import threading
import time
import traceback
import types
from collections.abc import Iterator
from pathlib import Path

from offpolicy.rollout.engines.sglang.worker import LOADER as FINGERPRINT_LOADER

ENV = "SGLANG_STANDIN"
PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
KILL_ON_SIGQUIT = True  # SGLang's launch-phase handler: kill the process tree; False: only record (in-process tests)
SIGQUITS_TAKEN: list[int] = []  # SIGQUITs the stand-in's own handler took (KILL_ON_SIGQUIT False)


@dataclasses.dataclass
class ServerArgs:
    """The 0.5.14 ServerArgs fields engine_kwargs looks at (no attn_dp_size, no fp8_gemm_runner_backend)."""

    model_path: str = ""
    tp_size: int = 1
    dp_size: int = 1
    enable_dp_attention: bool = False
    custom_weight_loader: list[str] | None = None


@dataclasses.dataclass
class UpdateWeightFromDiskReqInput:
    model_path: str
    weight_version: str | None = None
    load_format: str | None = None
    flush_cache: bool = True


@dataclasses.dataclass
class UpdateWeightsFromTensorReqInput:  # 0.5.14 `managers/io_struct.py:1522-1541`
    serialized_named_tensors: list
    load_format: str | None = None
    flush_cache: bool = True
    abort_all_requests: bool = False
    weight_version: str | None = None
    disable_draft_model: bool | None = None
    torch_empty_cache: bool = False


class MultiprocessingSerializer:
    """SGLang's (0.5.14 `utils/common.py:2339-2378`): the multiprocessing pickler with torch's reductions (a CPU tensor
    travels in shared memory, its file descriptor passed between the processes; a CUDA one by CUDA IPC)."""

    @staticmethod
    def serialize(obj) -> bytes:
        import io
        from multiprocessing.reduction import ForkingPickler

        import torch.multiprocessing  # noqa: F401 - registers torch's reductions with ForkingPickler

        buf = io.BytesIO()
        ForkingPickler(buf).dump(obj)
        return buf.getvalue()

    @staticmethod
    def deserialize(data: bytes | str):
        """Bytes, or the same base64 (as an HTTP request carries them)."""
        import base64
        import pickle

        import torch.multiprocessing  # noqa: F401

        return pickle.loads(base64.b64decode(data, validate=True) if isinstance(data, str) else data)


REDUCTIONS_PATCHED: list[int] = []  # calls of monkey_patch_torch_reductions in this process


def monkey_patch_torch_reductions() -> None:
    """SGLang's device-UUID patch of torch's reductions (`utils/patch_torch.py:41-74`), as far as a CPU shows it: its
    reduce_tensor rewrites the 7th of the reduction's arguments (a CUDA tensor's device; here left as it is), so that
    pickling a CPU tensor (3 arguments) in this process raises IndexError from now on, as with SGLang.
    `restore_torch_reductions` undoes it (tests/conftest.py, after each test)."""
    from torch.multiprocessing import reductions

    REDUCTIONS_PATCHED.append(1)
    if hasattr(reductions, "_reduce_tensor_original"):
        return
    reductions._reduce_tensor_original = original = reductions.reduce_tensor

    def reduce_tensor_modified(*args, **kwargs):
        fn, out = original(*args, **kwargs)
        return fn, (*out[:6], out[6], *out[7:])

    reductions.reduce_tensor = reduce_tensor_modified
    reductions.init_reductions()


def restore_torch_reductions() -> None:
    """Torch's reductions as they were before `monkey_patch_torch_reductions`."""
    from torch.multiprocessing import reductions

    original = getattr(reductions, "_reduce_tensor_original", None)
    if original is not None:
        reductions.reduce_tensor = original
        del reductions._reduce_tensor_original
        reductions.init_reductions()


def modules() -> dict[str, object]:
    """The sys.modules entries that make `import sglang` (and what local.py imports of it) this stand-in."""
    me = sys.modules[__name__]
    return {"sglang": me, "sglang.srt": types.SimpleNamespace(),
            "sglang.srt.server_args": types.SimpleNamespace(ServerArgs=ServerArgs),
            "sglang.srt.managers": types.SimpleNamespace(),
            "sglang.srt.managers.io_struct": types.SimpleNamespace(
                UpdateWeightFromDiskReqInput=UpdateWeightFromDiskReqInput,
                UpdateWeightsFromTensorReqInput=UpdateWeightsFromTensorReqInput),
            "sglang.srt.utils": types.SimpleNamespace(),
            "sglang.srt.utils.common": types.SimpleNamespace(MultiprocessingSerializer=MultiprocessingSerializer),
            "sglang.srt.utils.patch_torch": types.SimpleNamespace(
                monkey_patch_torch_reductions=monkey_patch_torch_reductions)}


@contextlib.contextmanager
def installed(monkeypatch) -> Iterator[None]:
    """This stand-in as `sglang` for in-process tests (`monkeypatch` undoes it): its SIGQUIT handler records instead
    of killing pytest; afterwards the SIGQUIT handler is the one before, and a watch a failed test left is restored."""
    from offpolicy.rollout.engines.sglang import sigquit

    for name, module in modules().items():
        monkeypatch.setitem(sys.modules, name, module)
    monkeypatch.setattr(sys.modules[__name__], "KILL_ON_SIGQUIT", False)
    SIGQUITS_TAKEN.clear()
    before = signal.getsignal(signal.SIGQUIT)
    try:
        yield
    finally:
        if sigquit._current is not None:  # a test that failed before closing its engine
            sigquit.restore(sigquit._current)
        signal.signal(signal.SIGQUIT, before)


def outputs(rows: list[list[int]], sps: list[dict], version: str) -> list[dict]:
    """SGLang's Engine.generate answer of the toy samples (tests/sglang_fake.py's shapes)."""
    from tests.sglang_fake import toy_sampler

    out = []
    for i, (row, sp, (tokens, logprobs, kind)) in enumerate(zip(rows, sps, toy_sampler(rows, sps))):
        reason = ({"type": "stop", "matched": tokens[-1]} if kind == "stop" and len(tokens) < sp["max_new_tokens"]
                  else {"type": "length", "length": len(tokens)})
        out.append({"output_ids": list(tokens), "meta_info": {
            "id": f"standin-{i}", "finish_reason": reason, "prompt_tokens": len(row), "weight_version": version,
            "output_token_logprobs": [[lp, t, None] for lp, t in zip(logprobs, tokens)],
            "completion_tokens": len(tokens)}})
    return out


def kill_itself_when_parent_died() -> None:
    """As SGLang's (0.5.14 `srt/utils/common.py:2538-2543`): SIGKILL this process when the thread that started it
    ends."""
    if sys.platform == "linux":
        ctypes.CDLL("libc.so.6").prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


def load_model(path: str, dtype: str):
    """The checkpoint at `path` as transformers builds it, in `dtype` (an Engine's `dtype`), on the CPU."""
    import torch
    from transformers import AutoModelForCausalLM

    kind = {"auto": None, "float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[dtype]
    return AutoModelForCausalLM.from_pretrained(path, dtype=kind).eval()


def load_files(model, path: str) -> tuple[bool, str]:
    """update_weights_from_disk's load: every tensor of the safetensors files at `path` into `model`'s parameter of
    that name, in the parameter's dtype."""
    from safetensors.torch import load_file

    state: dict = {}
    for f in sorted(Path(path).glob("*.safetensors")):
        state.update(load_file(f))
    if not state:
        return False, f"no safetensors files in {path}"
    return load_named(model, state, path)


def sglang_like(model):
    """`model` with SGLang's model-class method `load_weights(named_tensors)`, which raises on a tensor it has no
    parameter for (as SGLang's loaders fail)."""

    def load_weights(named_tensors) -> None:
        ok, message = load_named(model, dict(named_tensors), "the tensors sent")
        if not ok:
            raise KeyError(message)

    model.load_weights = load_weights
    return model


def load_named(model, state: dict, where: str) -> tuple[bool, str]:
    """A model's load_weights of named tensors: each into `model`'s parameter of that name, in its dtype, in place."""
    import torch

    with torch.no_grad():
        _, unexpected = model.load_state_dict(state, strict=False)
    if unexpected:
        return False, f"the model has no parameters {sorted(unexpected)[:4]} of {where}"
    return True, "Succeeded to update model weights."


def dynamic_import(path: str):
    """SGLang's `dynamic_import` (0.5.14 `srt/utils/common.py`): "a.b.func" is `func` of module `a.b`."""
    import importlib

    module, _, name = path.rpartition(".")
    if not module:
        raise ValueError(f"Invalid import path: {path}")
    return vars(importlib.import_module(module))[name]


def run_scheduler(conn, plan: dict, server: dict | None = None) -> None:
    """The scheduler process: answers requests until its engine goes away; fails as `plan` says, holds a model when
    it says `model` (module doc); `server`: the Engine's `model_path`, `dtype` and `custom_weight_loader`."""
    kill_itself_when_parent_died()
    where = Path(plan["dir"]) if plan.get("dir") else None
    if where is not None:
        (where / "scheduler.pid").write_text(str(os.getpid()))
    server = server or {}
    loaders = list(server.get("custom_weight_loader") or [])
    generates, updates, model = 0, 0, None
    try:
        if plan.get("fail_start"):
            raise RuntimeError("stand-in scheduler: CUDA out of memory while loading the model")
        if plan.get("model"):
            model = sglang_like(load_model(server["model_path"], str(server.get("dtype") or "auto")))
        conn.send({"status": "ready"})
        while True:
            try:
                rid, kind, args = conn.recv()
            except EOFError:
                return  # the engine's process is gone
            answer = None
            if kind == "generate":
                generates += 1
                if where is not None:
                    (where / "generates").write_text(str(generates))
                if generates == plan.get("hang_at"):
                    time.sleep(3600)
                if generates == plan.get("fail_at"):
                    raise RuntimeError("stand-in scheduler: CUDA error: an illegal memory access was encountered")
                answer = outputs(*args)
            elif kind == "update" and model is not None:
                updates += 1
                answer = (True, "skipped") if updates == plan.get("skip_update_at") else load_files(model, args[0])
            elif kind == "load_tensors" and model is not None:  # update_weights_from_tensor
                serialized, load_format = args
                named = MultiprocessingSerializer.deserialize(serialized)
                updates += load_format != FINGERPRINT_LOADER  # the proof's requests load nothing
                if load_format != FINGERPRINT_LOADER and updates == plan.get("skip_update_at"):
                    answer = (True, "skipped")
                elif load_format is None:  # SGLang's model loader
                    answer = load_named(model, dict(named), "the tensors sent")
                elif load_format in loaders:  # a custom loader: what it raises ends the scheduler, as in SGLang
                    dynamic_import(load_format)(model, named)
                    answer = (True, "Success")
                else:
                    answer = (False, f"Unknown load_format={load_format}")
            elif kind == "tensor":
                named_tensors, load_format = args
                if model is None or load_format not in loaders:
                    answer = (False, f"the stand-in scheduler runs no custom weight loader {load_format} (model "
                                     f"{'held' if model is not None else 'not held'}; loaders {loaders})")
                else:
                    dynamic_import(load_format)(model, named_tensors)
                    answer = (True, "Success")
            conn.send((rid, answer))
    except Exception:  # noqa: BLE001 - as SGLang's scheduler: any failure is reported to the parent
        print(f"Scheduler hit an exception: {traceback.format_exc()}", file=sys.stderr, flush=True)
        os.kill(os.getppid(), signal.SIGQUIT)  # then returns: exit code 0, as SGLang's scheduler


def _launch_phase_sigquit_handler(signum, frame) -> None:
    print("Received sigquit from a child process. It usually means the child failed.", file=sys.stderr, flush=True)
    if not KILL_ON_SIGQUIT:
        SIGQUITS_TAKEN.append(signum)
        return
    for p in multiprocessing.active_children():
        p.kill()
    os.kill(os.getpid(), signal.SIGKILL)


def _settle(future: asyncio.Future, answer) -> None:
    if not future.done():
        future.set_result(answer)


class Engine:
    def __init__(self, **kwargs):
        self.kwargs = kwargs
        self.plan = json.loads(os.environ.get(ENV) or "{}")
        self.closed, self.scheduler, self._watchdog = False, None, None
        self._stop = threading.Event()
        args = types.SimpleNamespace(weight_version=str(kwargs.get("weight_version", "default")))
        self.tokenizer_manager = types.SimpleNamespace(server_args=args, update_weights_from_disk=self._update,
                                                       update_weights_from_tensor=self._update_tensors)
        atexit.register(self.shutdown)
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGQUIT, _launch_phase_sigquit_handler)
        ctx = multiprocessing.get_context("spawn")
        self._conn, child = ctx.Pipe()
        server = {k: kwargs.get(k) for k in ("model_path", "dtype", "custom_weight_loader")}
        self.scheduler = ctx.Process(target=run_scheduler, args=(child, self.plan, server),
                                     name="sglang::scheduler_TP0")
        self.scheduler.start()
        child.close()
        if not self._conn.poll(120):
            raise RuntimeError("the stand-in scheduler did not start within 120 s")
        try:
            self._conn.recv()
        except EOFError:  # as 0.5.14 `entrypoints/engine.py:1332-1339, 1355-1358`
            self.scheduler.join(10)
            raise RuntimeError(f"Rank 0 scheduler died during initialization (exit code: {self.scheduler.exitcode}). "
                               "If exit code is -9 (SIGKILL), a common cause is the OS OOM killer.") from None
        try:
            self.loop = asyncio.get_running_loop()
        except RuntimeError:
            self.loop = asyncio.new_event_loop()
            asyncio.set_event_loop(self.loop)
        self._waiting: dict[int, asyncio.Future] = {}
        self._ids = itertools.count()
        threading.Thread(target=self._answers, name="standin-answers", daemon=True).start()
        self._watchdog = threading.Thread(target=self._watch, name="subprocess-watchdog", daemon=True)
        self._watchdog.start()

    def _answers(self) -> None:
        while True:
            try:
                rid, answer = self._conn.recv()
            except (EOFError, OSError):
                return  # the scheduler is gone: nothing answers any more
            future = self._waiting.pop(rid, None)
            if future is not None:
                self.loop.call_soon_threadsafe(_settle, future, answer)

    def _watch(self) -> None:
        while not self._stop.wait(0.2):
            p = self.scheduler
            if p.is_alive() or p.exitcode == 0:
                continue
            print(f"Subprocess scheduler_0 (pid={p.pid}) crashed with exit code {p.exitcode}. Triggering SIGQUIT for "
                  "cleanup...", file=sys.stderr, flush=True)
            os.kill(os.getpid(), signal.SIGQUIT)
            return

    async def _ask(self, kind: str, *args):
        rid = next(self._ids)
        future = self.loop.create_future()
        self._waiting[rid] = future
        try:
            self._conn.send((rid, kind, args))
        except OSError:  # the scheduler is gone: its answer never comes
            pass
        return await future

    def generate(self, input_ids, sampling_params, return_logprob=False):
        version = self.tokenizer_manager.server_args.weight_version
        return self.loop.run_until_complete(self._ask("generate", input_ids, sampling_params, version))

    async def _update(self, req, request):
        answer = await self._ask("update", req.model_path)
        if answer is not None and not answer[0]:  # the model held is not known to be either version's now
            return False, f"Failed to update weights: {answer[1]}", 0
        self.tokenizer_manager.server_args.weight_version = req.weight_version
        return True, "Succeeded to update model weights.", 0

    async def _update_tensors(self, req, request):
        """The tokenizer manager's update_weights_from_tensor: rank 0's pickle to the scheduler, which loads the tensors
        into its model with SGLang's own loader (`load_format` None) or the custom loader named; the weight_version
        set on success."""
        answer = await self._ask("load_tensors", req.serialized_named_tensors[0], req.load_format)
        if answer is None or not answer[0]:
            return False, f"Failed to update weights: {answer and answer[1]}"
        if req.weight_version is not None:
            self.tokenizer_manager.server_args.weight_version = req.weight_version
        return True, "Success."

    def get_weights_by_name(self, name: str, truncate_size: int = 100):
        return self.loop.run_until_complete(self._ask("weights", name))

    def update_weights_from_tensor(self, named_tensors, load_format=None, flush_cache=True):
        """The scheduler runs the custom weight loader `load_format` on its model (the module doc), else refuses."""
        return self.loop.run_until_complete(self._ask("tensor", list(named_tensors), load_format))

    def shutdown(self) -> None:
        if self.closed or self.scheduler is None:
            return
        self.closed = True
        self._stop.set()
        if self._watchdog is not None:
            self._watchdog.join(2)
        if self.plan.get("sigquit_on_shutdown"):
            os.kill(os.getpid(), signal.SIGQUIT)
        if self.scheduler.is_alive():
            self.scheduler.kill()
        self.scheduler.join(10)
        print(f"stand-in sglang.Engine: shut down (scheduler exit code {self.scheduler.exitcode})", file=sys.stderr,
              flush=True)


if __name__ == "__main__":
    import importlib

    # the module by its name, not __main__: the scheduler process (spawn) finds run_scheduler there
    sys.modules.update(importlib.import_module("tests.sglang_inprocess").modules())
    from offpolicy.services.rollout import main

    sys.exit(main())
