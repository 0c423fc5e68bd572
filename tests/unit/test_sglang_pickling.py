"""offpolicy's pickles for SGLang's update_weights_from_tensor (offpolicy/rollout/engines/sglang/pickling.py): a CPU
tensor (the fingerprint proof's request) still pickles once SGLang's device-UUID patch of torch's reductions is in, as
the stand-in reproduces it (tests/sglang_inprocess.py)."""

import io
import pickle
from multiprocessing.reduction import ForkingPickler

import pytest
import torch

import tests.sglang_inprocess as standin
from offpolicy.rollout.engines.sglang.fingerprint_proof import serialized
from offpolicy.rollout.engines.sglang.pickling import pickled
from offpolicy.rollout.engines.sglang.worker import request


def test_the_patch_breaks_the_multiprocessing_pickle_of_a_cpu_tensor_as_sglangs_does():
    standin.monkey_patch_torch_reductions()
    with pytest.raises(IndexError):
        ForkingPickler(io.BytesIO()).dump([("x", torch.empty(0))])


@pytest.mark.parametrize("patched", [False, True])
def test_pickled_cpu_tensors_read_back_with_and_without_the_patch(patched):
    if patched:
        standin.monkey_patch_torch_reductions()
    t = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    [(name, back)] = pickle.loads(pickled([("w", t)]))
    assert name == "w" and torch.equal(back, t)


def test_the_fingerprint_request_reads_back_under_the_patch():
    standin.monkey_patch_torch_reductions()
    name = request("/tmp/report", "/tmp/version")
    [(back, tensor)] = standin.MultiprocessingSerializer.deserialize(serialized(name))
    assert back == name and tensor.numel() == 0


def test_the_patch_is_undone_after_each_test():
    from torch.multiprocessing import reductions

    assert not hasattr(reductions, "_reduce_tensor_original")
    ForkingPickler(io.BytesIO()).dump([("x", torch.empty(0))])
