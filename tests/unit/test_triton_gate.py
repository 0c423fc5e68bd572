"""plumbing/triton_gate.py: the one gate of the learner's and the quantizers' Triton kernels."""

from offpolicy.plumbing import triton_gate


def test_cuda_runs_cpu_only_in_the_interpreter_and_each_switch_turns_its_family_off(monkeypatch):
    monkeypatch.setattr(triton_gate, "triton_imports", lambda: True)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.delenv("OFFPOLICY_EAGER_KERNELS", raising=False)
    assert triton_gate.runs("cuda", "OFFPOLICY_EAGER_KERNELS")
    assert not triton_gate.runs("cpu", "OFFPOLICY_EAGER_KERNELS")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert triton_gate.runs("cpu", "OFFPOLICY_EAGER_KERNELS")
    monkeypatch.setenv("OFFPOLICY_EAGER_KERNELS", "1")
    assert not triton_gate.runs("cuda", "OFFPOLICY_EAGER_KERNELS")
    assert triton_gate.runs("cuda", "OFFPOLICY_EAGER_QUANT")  # another family's switch leaves it on
    monkeypatch.setattr(triton_gate, "triton_imports", lambda: False)  # no triton: nothing runs
    assert not triton_gate.runs("cuda", "OFFPOLICY_EAGER_QUANT")


def test_triton_imports_says_whether_the_module_imports(monkeypatch):
    import builtins
    import importlib.util

    assert triton_gate.triton_imports() == (importlib.util.find_spec("triton") is not None)
    real = builtins.__import__

    def no_triton(name, *a, **k):
        if name == "triton":
            raise ImportError("no triton here")
        return real(name, *a, **k)

    monkeypatch.setattr(builtins, "__import__", no_triton)
    assert not triton_gate.triton_imports.__wrapped__()
