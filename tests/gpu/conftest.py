"""Fixtures of the GPU tests."""

import pytest


@pytest.fixture
def fresh_parallel_state():
    """Each test builds its own MegatronBackend in this process: reset Megatron's parallel state after it."""
    yield
    from megatron.core import parallel_state

    parallel_state.destroy_model_parallel()


@pytest.fixture(autouse=True)
def restored_matmul_precision():
    """A MegatronBackend on a GPU sets torch's float32 matmul precision process-wide (model.tf32): put it back
    after each test, so that no test runs under the precision another one left (the float32 kernel tests
    compared TF32 products after a backend test had run)."""
    import torch

    before = torch.get_float32_matmul_precision()
    yield
    torch.set_float32_matmul_precision(before)
