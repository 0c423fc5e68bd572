"""What each vLLM version speaks (offpolicy/rollout/engines/vllm/versions.py): pure functions, no vLLM. The
differences were read in vLLM 0.26.0's and 0.32.0's sources (docs/vllm.md)."""

import pytest

from offpolicy.config import load_config
from offpolicy.rollout.engines.vllm.launch import server_command
from offpolicy.rollout.engines.vllm.versions import (api, generate_request, installed, release, reload_takes_tensors,
                                                    server_flags)

CONFIG = "configs/quickstart-vllm.yaml"


@pytest.mark.parametrize("version, rel", [("0.32.0", (0, 32)), ("0.26.0+cu130", (0, 26)), ("v1.2", (1, 2)),
                                          ("0.27.2rc1.dev150+g311b3513a", (0, 27))])
def test_release_reads_major_and_minor(version, rel):
    assert release(version) == rel


def test_0_32_gates_the_tokens_api_and_labels_outputs_0_26_does_neither():
    new, old = api("0.32.0"), api("0.26.0")
    assert (new.scale_out_flag, new.engine_labels, new.output_mode) == (True, True, True)
    assert (old.scale_out_flag, old.engine_labels, old.output_mode) == (False, False, False)
    # 0.26 refuses the unknown --enable-scale-out; both report each request's prefix-cache hits when asked
    assert server_flags(new) == ["--enable-scale-out", "--enable-prompt-tokens-details"]
    assert server_flags(old) == ["--enable-prompt-tokens-details"]
    assert api("1.0.0").engine_labels and not api("0.31.9").engine_labels
    with pytest.raises(RuntimeError, match="vLLM 0.25.1 is older than 0.26"):
        api("0.25.1")
    with pytest.raises(ValueError, match="MAJOR.MINOR"):
        api("dev")


def test_generate_request_sends_output_mode_only_where_vllm_takes_it():
    body = generate_request(api("0.32.0"), [1, 2], {"n": 2}, "r-0")
    assert body == {"token_ids": [1, 2], "sampling_params": {"n": 2}, "request_id": "r-0", "output_mode": "tokens"}
    assert "output_mode" not in generate_request(api("0.26.0"), [1, 2], {"n": 2}, "r-0")


def test_each_request_is_salted_with_its_servers_version():
    """No request reuses KV blocks another version computed: the salt differs by version, and passes the field's
    check in vLLM 0.32 (a non-empty string of at most 128 characters, none of '@', '/', '\\' or NUL)."""
    salts = {generate_request(api(v), [1], {"n": 1}, "r-0", version)["cache_salt"]
             for v in ("0.26.0", "0.32.0") for version in (-1, 0, 7)}
    assert salts == {"offpolicy-v-1", "offpolicy-v0", "offpolicy-v7"}
    assert "cache_salt" not in generate_request(api("0.32.0"), [1], {"n": 1}, "r-0")


def test_0_26_asks_for_final_only_outputs_so_that_every_sample_comes_back():
    sampling = {"n": 4, "seed": 7}
    old = generate_request(api("0.26.0"), [1], sampling, "r-0")
    assert old["sampling_params"] == {"n": 4, "seed": 7, "output_kind": 2} and sampling == {"n": 4, "seed": 7}
    assert "output_kind" not in generate_request(api("0.32.0"), [1], sampling, "r-0")["sampling_params"]


def test_the_server_command_follows_the_vllm_version():
    cfg = load_config(CONFIG)
    new = server_command(cfg, "/m", 0, on_cpu=False, vllm_version="0.32.0")
    old = server_command(cfg, "/m", 0, on_cpu=False, vllm_version="0.26.0")
    assert "--enable-scale-out" in new and "--enable-scale-out" not in old
    assert [w for w in new if w != "--enable-scale-out"] == old
    for flag in ("--skip-tokenizer-init", "--worker-extension-cls", "--logprobs-mode",  # flags of both versions
                 "--enable-prompt-tokens-details"):
        assert flag in old


def test_installed_reads_the_version_without_importing_vllm():
    import importlib.util
    import sys

    if importlib.util.find_spec("vllm") is None:
        pytest.skip("vLLM is not installed")
    had = "vllm" in sys.modules
    assert release(installed()) >= (0, 26)
    assert ("vllm" in sys.modules) == had


def test_a_reload_that_passes_its_keywords_on_is_read_through_the_method_it_passes_them_to():
    def v1(self, weights_iterator=None, weights_path=None, is_checkpoint_format=True): ...

    def v2(self, *args, **kwargs): ...  # vLLM 0.26's V2 model runner (Llama, Qwen): hands them to V1's

    def old(self, weights_path=None): ...

    def refuses(self, *args): ...

    assert reload_takes_tensors(v1, lambda: old)
    assert reload_takes_tensors(v2, lambda: v1)
    assert not reload_takes_tensors(v2, lambda: old)
    assert not reload_takes_tensors(old, lambda: v1)
    assert not reload_takes_tensors(refuses, lambda: v1)
