"""Prompt data sets: synthetic digit tasks from (seed, id), JSONL rows, and errors that name the fix."""

from __future__ import annotations

import sys

import pytest

from offpolicy.config import DataConfig, SyntheticConfig
from offpolicy.data import Prompt, RowsDataset, SyntheticDigits, load_dataset


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
