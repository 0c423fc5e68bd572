"""Fixtures of the GPU tests."""

import pytest


@pytest.fixture
def fresh_parallel_state():
    """Each test builds its own MegatronBackend in this process: reset Megatron's parallel state after it."""
    yield
    from megatron.core import parallel_state

    parallel_state.destroy_model_parallel()
