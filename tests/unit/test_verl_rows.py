"""verl's RL schema, read unchanged: a parquet file written by pyarrow as verl's preprocess scripts write
it loads as chat prompts with ground truths and data sources; bad rows are refused naming file, row and
field, or dropped and counted; data_source picks the reward."""

from __future__ import annotations

import json

import pytest

from offpolicy.config import load_config
from offpolicy.data.datasets import RowsDataset, load_dataset
from offpolicy.data.encoding import load_prompts
from offpolicy.data.rewards import RewardRouter
from offpolicy.data.tokenizer import load_tokenizer
from tests.hf_tokenizer import build_tokenizer

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")


def verl_row(i: int, source: str = "openai/gsm8k", truth="42") -> dict:
    """A row as verl's examples/data_preprocess/gsm8k.py writes it."""
    return {"data_source": source,
            "prompt": [{"role": "user", "content": f"Question {i}: what is 6*7? Let's think step by step and "
                                                   "output the final answer after \"####\"."}],
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": truth},
            "extra_info": {"split": "train", "index": i, "answer": "6*7 = 42 #### 42", "question": f"Question {i}"}}


def write_parquet(path, rows) -> str:
    pq.write_table(pa.Table.from_pylist(rows), path)
    return str(path)


def test_a_verl_parquet_loads_unchanged(tmp_path):
    rows = [verl_row(i) for i in range(3)] + [verl_row(3, "lighteval/MATH", "\\frac{1}{2}")]
    path = write_parquet(tmp_path / "train.parquet", rows)
    ds = RowsDataset(path, "prompt", "answer")
    assert ds.format == "verl" and len(ds) == 4
    p = ds[0]
    assert p.messages == (("user", rows[0]["prompt"][0]["content"]),)
    assert p.text == rows[0]["prompt"][0]["content"] and p.answer == "42" and p.data_source == "openai/gsm8k"
    assert ds[3].answer == "\\frac{1}{2}" and ds[3].data_source == "lighteval/MATH"


def test_jsonl_in_the_same_schema_loads_the_same(tmp_path):
    rows = [verl_row(i, truth=7) for i in range(2)]
    path = tmp_path / "train.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    ds = load_dataset(load_config(None, ["model.arch={model_type: llama}", f"data.source={path}"]).data)
    assert [p.answer for p in ds.prompts] == ["7", "7"]  # a non-string ground truth reaches the reward as JSON


def test_chat_prompts_go_through_the_chat_template(tmp_path):
    tok = load_tokenizer(str(build_tokenizer(tmp_path / "tok")))
    rows = [{**verl_row(0), "prompt": [{"role": "system", "content": "Be brief."},
                                       {"role": "user", "content": "What is 6*7?"}]}]
    path = write_parquet(tmp_path / "t.parquet", rows)
    cfg = load_config(None, ["model.arch={model_type: llama}", f"data.source={path}"]).data  # chat_template off
    ds, enc = load_prompts(cfg, tok)
    want = tok.apply_chat_template([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 6*7?"}])
    assert enc.encode(ds[0], 0) == want
    text = tok._tok.decode(want)
    assert "Be brief." in text and text.endswith("<|start|>assistant")


@pytest.mark.parametrize("change, field, problem", [
    (lambda r: r.pop("prompt"), "'prompt'", "is missing"),
    (lambda r: r.update(prompt="What is 6*7?"), "'prompt'", "is a str, not a list"),
    (lambda r: r.update(prompt=[]), "'prompt'", "is an empty list"),
    (lambda r: r.update(prompt=[{"role": "user"}]), "'prompt[0].content'", "is missing"),
    (lambda r: r.update(prompt=[{"role": "wizard", "content": "x"}]), "'prompt[0].role'", "'wizard'"),
    (lambda r: r.pop("reward_model"), "'reward_model'", "is missing"),
    (lambda r: r.update(reward_model={"style": "rule"}), "'reward_model.ground_truth'", "is missing"),
    (lambda r: r.update(reward_model="42"), "'reward_model'", "is a str"),
    (lambda r: r.update(data_source=3), "'data_source'", "is a int"),
])
def test_a_bad_row_is_refused_naming_file_row_and_field(tmp_path, change, field, problem):
    rows = [verl_row(i) for i in range(4)]
    change(rows[2])
    path = tmp_path / "train.jsonl"  # JSONL: each row may have its own shape
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(ValueError) as e:
        RowsDataset(str(path), "prompt", "answer", format="verl")
    msg = str(e.value)
    assert str(path) in msg and "line 3" in msg and field in msg and problem in msg and "data.bad_rows=drop" in msg


def test_bad_rows_are_dropped_and_counted_when_asked(tmp_path, caplog):
    rows = [verl_row(i) for i in range(5)]
    rows[1]["reward_model"] = {"style": "rule"}
    path = tmp_path / "train.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows[:3]) + "{not json\n" + json.dumps(rows[3]) + "\n")
    cfg = load_config(None, ["model.arch={model_type: llama}", f"data.source={path}", "data.bad_rows=drop"]).data
    tok = load_tokenizer(str(build_tokenizer(tmp_path / "tok")))
    ds, enc = load_prompts(cfg, tok)
    assert len(ds) == 3 and [p.text.split(":")[0] for p in (ds[0], ds[1], ds[2])] == ["Question 0", "Question 2", "Question 3"]
    assert [ds[i].id for i in range(3)] == [0, 1, 2]
    assert enc.counts.dropped_bad_rows == 2
    assert "2 bad rows" in caplog.text and "line 2" in caplog.text


def test_a_parquet_of_only_bad_rows_is_refused(tmp_path):
    path = write_parquet(tmp_path / "t.parquet", [{"data_source": "x", "prompt": [{"role": "user", "content": "a"}],
                                                   "reward_model": {"style": "rule", "ground_truth": None}}])
    with pytest.raises(ValueError, match=r"row 1: field 'reward_model.ground_truth' is missing"):
        RowsDataset(path, "prompt", "answer")
    with pytest.raises(ValueError, match="holds no rows usable .1 dropped"):
        RowsDataset(path, "prompt", "answer", bad_rows="drop")


def test_data_source_picks_the_reward():
    router = RewardRouter("exact_match", {"openai/gsm8k": "math"})
    assert router("q", "42", "so #### 42", "openai/gsm8k") == 1.0  # math reads the #### answer
    assert router("q", "42", "so #### 42", "other") == 0.0  # exact_match does not
    assert router("q", "42", "42") == 1.0
    with pytest.raises(ValueError, match="rollout.reward 'nope' is unknown"):
        RewardRouter("exact_match", {"a": "nope"})


def test_source_parquet_reads_the_files_in_order_as_one_data_set(tmp_path):
    a = write_parquet(tmp_path / "gsm8k.parquet", [verl_row(i) for i in range(3)])
    b = write_parquet(tmp_path / "math.parquet", [verl_row(i, "lighteval/MATH", "1/2") for i in range(2)])
    ds = load_dataset(load_config(None, ["model.arch={model_type: llama}", "data.source=parquet",
                                         f"data.files=[{a}, {b}]"]).data)
    assert [(p.id, p.data_source) for p in ds.prompts] == [(0, "openai/gsm8k"), (1, "openai/gsm8k"), (2, "openai/gsm8k"),
                                                           (3, "lighteval/MATH"), (4, "lighteval/MATH")]


@pytest.mark.parametrize("overrides, field", [
    (["data.source=parquet"], "data.files: is empty with source parquet"),
    (["data.source=jsonl", "data.files=[a.parquet]"], "data.files: ['a.parquet'] are not .jsonl/.jsonl.gz files"),
    (["data.files=[a.parquet]"], "data.files: is set but data.source is 'synthetic'"),
    (["data.source=csv"], "data.source: 'csv' is none of"),
])
def test_file_sources_are_checked(overrides, field):
    from offpolicy.config import ConfigError

    with pytest.raises(ConfigError, match=field.replace("[", r"\[").replace("]", r"\]").replace(".", r"\.")):
        load_config(None, ["model.arch={model_type: llama}", *overrides])
