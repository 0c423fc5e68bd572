"""Every backend and engine meets its protocol in full, and no caller probes one with hasattr/getattr.

The protocols are `offpolicy.learner.backends.LearnerBackend` and `offpolicy.rollout.engines.RolloutEngine`.
Each implementation is read, not built (the Megatron backend and the server engines need their libraries
and servers): every protocol method is defined on the class with the protocol's parameters, and every
protocol attribute is assigned as `self.<name>` in the class's `__init__`."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pytest

from offpolicy.learner.backends import LearnerBackend
from offpolicy.rollout.engines import RolloutEngine

ROOT = Path(__file__).resolve().parents[2]
BACKENDS = {"offpolicy/learner/backends/torch_backend.py": "TorchBackend",
            "offpolicy/learner/backends/megatron/backend.py": "MegatronBackend"}
ENGINES = {"offpolicy/rollout/engines/torch_engine.py": "TorchEngine",
           "offpolicy/rollout/engines/vllm/engine.py": "VLLMEngine",
           "offpolicy/rollout/engines/sglang/engine.py": "SGLangEngine"}


def members(protocol) -> tuple[dict[str, list[str]], set[str]]:
    """The protocol's methods (name -> parameter names) and attributes."""
    methods = {n: list(inspect.signature(f).parameters) for n, f in vars(protocol).items()
               if inspect.isfunction(f) and not n.startswith("_")}
    return methods, set(protocol.__annotations__)


def implementation(path: str, name: str) -> tuple[dict[str, list[str]], set[str]]:
    """A class's methods (name -> parameter names) and the `self.x` its `__init__` assigns."""
    tree = ast.parse((ROOT / path).read_text())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == name)
    methods, assigned = {}, set()
    for fn in cls.body:
        if not isinstance(fn, ast.FunctionDef):
            continue
        a = fn.args
        methods[fn.name] = [x.arg for x in (*a.posonlyargs, *a.args, *a.kwonlyargs)]
        if fn.name == "__init__":
            for node in ast.walk(fn):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(
                    node, ast.AnnAssign) else []
                for t in targets:
                    for e in ast.walk(t):
                        if isinstance(e, ast.Attribute) and isinstance(e.value, ast.Name) and e.value.id == "self":
                            assigned.add(e.attr)
    return methods, assigned


def gaps(protocol, path: str, name: str) -> list[str]:
    want_methods, want_attrs = members(protocol)
    have_methods, have_attrs = implementation(path, name)
    out = [f"{name}.{m}: missing" for m in want_methods if m not in have_methods]
    out += [f"{name}.{m}{tuple(have_methods[m])}: the protocol takes {tuple(p)}" for m, p in want_methods.items()
            if m in have_methods and have_methods[m] != p]
    out += [f"{name}.{a}: never set in __init__" for a in sorted(want_attrs - have_attrs)]
    return out


@pytest.mark.parametrize("path, name", BACKENDS.items())
def test_each_backend_meets_the_backend_protocol(path, name):
    assert gaps(LearnerBackend, path, name) == []


@pytest.mark.parametrize("path, name", ENGINES.items())
def test_each_engine_meets_the_engine_protocol(path, name):
    assert gaps(RolloutEngine, path, name) == []


def test_the_protocols_hold_what_callers_use():
    """The members the loop, the publisher, the daemon and the swapper call are in the protocols."""
    backend_methods, backend_attrs = members(LearnerBackend)
    assert {"train_step", "weights", "hf_config", "save_checkpoint", "load_checkpoint", "publish", "serve",
            "close"} <= set(backend_methods) and "startup" in backend_attrs
    engine_methods, engine_attrs = members(RolloutEngine)
    assert {"load", "generate", "interrupt", "close"} <= set(engine_methods)
    assert {"version", "aborted", "last_loads"} <= engine_attrs


def probes(text: str) -> list[str]:
    """hasattr/getattr calls whose object is a backend or an engine (a name or attribute so called)."""
    out = []
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("hasattr", "getattr"):
            obj = node.args[0] if node.args else None
            named = obj.id if isinstance(obj, ast.Name) else obj.attr if isinstance(obj, ast.Attribute) else ""
            if named in ("backend", "engine"):
                out.append(f"{node.lineno}: {ast.unparse(node)}")
    return out


def test_no_caller_probes_a_backend_or_an_engine():
    found = [f"{p.relative_to(ROOT)}:{line}" for p in sorted((ROOT / "offpolicy").rglob("*.py"))
             for line in probes(p.read_text())]
    assert found == [], "put the member in the protocol and in every implementation instead:\n" + "\n".join(found)


def test_the_checks_can_fail(tmp_path):
    """A class missing a method, with other parameters and without an attribute is named; a probe is found."""
    (tmp_path / "x.py").write_text("class E:\n    def __init__(self):\n        self.version = -1\n"
                                   "    def load(self, w):\n        return 0.0\n")
    import offpolicy.rollout.engines as engines

    global ROOT
    root, ROOT = ROOT, tmp_path
    try:
        found = gaps(engines.RolloutEngine, "x.py", "E")
    finally:
        ROOT = root
    assert "E.generate: missing" in found and "E.load('self', 'w'): the protocol takes ('self', 'weights')" in found
    assert "E.aborted: never set in __init__" in found
    assert probes("x = getattr(self.engine, 'aborted', 0)\ny = hasattr(backend, 'publish')\n") == [
        "1: getattr(self.engine, 'aborted', 0)", "2: hasattr(backend, 'publish')"]
