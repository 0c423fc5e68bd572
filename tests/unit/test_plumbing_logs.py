"""kept_root_logging: a library that re-configures the root logger as it starts (sglang.Engine) leaves ours alone;
dead_process_log: a dead server's first traceback (vLLM's root cause) beside its log's end."""

import logging
import subprocess
import sys
import types

import pytest

from offpolicy.plumbing.logs import kept_root_logging, setup_logging
from offpolicy.rollout.engines.sglang import sigquit
from offpolicy.rollout.engines.sglang.local import LocalBackend


class Kept(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.lines: list[str] = []

    def emit(self, record):
        self.lines.append(f"{record.name} {record.levelname} {record.getMessage()}")


@pytest.fixture(autouse=True)
def root_restored():
    """The root logger's handlers and level, and the test libraries' levels, put back with setLevel (which also
    clears the loggers' cached levels, unlike an attribute restored as it was)."""
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    libs = {name: logging.getLogger(name).level for name in ("fakelib", "fakelib2", "sglang")}
    yield
    root.handlers[:] = handlers
    root.setLevel(level)
    for name, lib_level in libs.items():
        logging.getLogger(name).setLevel(lib_level)


def start_like_sglang(**kwargs):
    """What sglang.Engine does to logging in the caller's process (0.5.14 utils/common.py:1370-1375)."""
    logging.basicConfig(level=logging.ERROR, format="[sglang] %(message)s", force=True)
    return kwargs


def test_the_daemons_handler_and_level_come_back_and_the_library_keeps_its_own_level():
    root = logging.getLogger()
    logging.getLogger("fakelib").setLevel(logging.NOTSET)
    setup_logging("rollout[0]", "INFO")
    ours = Kept()
    root.addHandler(ours)
    with kept_root_logging("fakelib"):
        start_like_sglang()
        assert ours not in root.handlers  # what the library did inside the block
    assert ours in root.handlers and root.level == logging.INFO
    logging.getLogger("offpolicy.sglang").warning("restarting on mxfp4")
    logging.getLogger("offpolicy.rollout").info("loaded version 3")
    logging.getLogger("fakelib.scheduler").info("chatter")
    logging.getLogger("fakelib.scheduler").error("scheduler died")
    assert ours.lines == ["offpolicy.sglang WARNING restarting on mxfp4", "offpolicy.rollout INFO loaded version 3",
                          "fakelib.scheduler ERROR scheduler died"]


def test_a_library_logger_with_its_own_level_keeps_it():
    root = logging.getLogger()
    root.setLevel(logging.INFO)
    lib = logging.getLogger("fakelib2")
    lib.setLevel(logging.DEBUG)
    with kept_root_logging("fakelib2"):
        start_like_sglang()
    assert lib.level == logging.DEBUG and root.level == logging.INFO


def test_the_in_process_sglang_engine_starts_inside_it(monkeypatch):
    """LocalBackend._start: an engine whose start re-configures logging (as sglang.Engine's does) leaves the daemon's
    warnings flowing (the GPU run's MXFP4 restart warning was lost without it)."""
    root = logging.getLogger()
    root.setLevel(logging.INFO)
    logging.getLogger("sglang").setLevel(logging.NOTSET)
    monkeypatch.setitem(sys.modules, "sglang", types.SimpleNamespace(Engine=start_like_sglang))
    ours = Kept()
    root.addHandler(ours)
    backend = LocalBackend.__new__(LocalBackend)  # only what _start uses: the scheduler watch, its owner
    backend.watch = sigquit.SchedulerWatch()
    backend.owner = None
    try:
        assert backend._start({"model_path": "m"}) == {"model_path": "m"}
    finally:
        sigquit.restore(backend.watch)  # the SIGQUIT handler _start installs
        if backend.owner is not None:
            backend.owner.release()  # the thread that started it (sglang/owner.py)
    logging.getLogger("offpolicy.sglang").warning("SGLang cannot reload MXFP4 weights")
    assert ours.lines == ["offpolicy.sglang WARNING SGLang cannot reload MXFP4 weights"]
    assert logging.getLogger("sglang").level == logging.ERROR


VLLM_DEATH = """(APIServer pid=7) INFO 07:20:01 starting
(EngineCore_DP0 pid=9) ERROR 07:20:09 EngineCore failed to start.
(EngineCore_DP0 pid=9) Traceback (most recent call last):
(EngineCore_DP0 pid=9)   File "/tmp/vsite/vllm/v1/engine/core.py", line 1, in run_engine_core
(EngineCore_DP0 pid=9)     engine_core = EngineCoreProc(*args, **kwargs)
(EngineCore_DP0 pid=9) ValueError: the root cause: head_dim 45 is not supported by FlashAttention
(EngineCore_DP0 pid=9) more after it
""" + "(APIServer pid=7)   noise of the API server's own traceback\n" * 200 + (
    "(APIServer pid=7) RuntimeError: Engine core initialization failed. See root cause above. Failed core proc(s): {}\n")


def test_a_dead_servers_log_gives_its_first_traceback_and_its_end():
    from offpolicy.plumbing.logs import dead_process_log

    said = dead_process_log(VLLM_DEATH)
    assert "its first traceback:" in said and "ValueError: the root cause" in said  # cut off by the end alone
    assert "more after it" not in said.split("[...]")[0]  # the traceback ends at its exception's line
    assert said.rstrip().endswith("Failed core proc(s): {}")
    short = "Traceback (most recent call last):\n  File \"x\", line 1\nKeyError: 'k'\n"
    assert dead_process_log(short) == short  # all of it in the end already: said once
    assert dead_process_log("no traceback at all\n" * 400) == ("no traceback at all\n" * 400)[-3000:]


def test_a_vllm_server_that_dies_at_start_is_reported_with_its_root_cause(tmp_path):
    from offpolicy.rollout.engines.launch import wait_healthy

    log = tmp_path / "vllm.log"
    log.write_text(VLLM_DEATH)
    proc = subprocess.Popen([sys.executable, "-m", "offpolicy_no_such_server"], stderr=subprocess.DEVNULL)
    proc.wait()  # the error names the server's module (SGLang's servers are waited for here too)
    with pytest.raises(RuntimeError, match="(?s)the server offpolicy_no_such_server exited with 1 before it was "
                                           "ready.*the root cause: head_dim 45"):
        wait_healthy("http://127.0.0.1:9", proc, log, timeout=30)
