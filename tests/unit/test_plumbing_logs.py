"""kept_root_logging: a library that re-configures the root logger as it starts (sglang.Engine) leaves ours alone."""

import logging
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
