"""DigitTokenizer: the 16-id vocabulary of the synthetic tasks."""

from __future__ import annotations

import numpy as np
import pytest

from offpolicy.data.tokenizer import DigitTokenizer, load_tokenizer


def test_encode_adds_bos_and_maps_each_character():
    tok = DigitTokenizer()
    assert tok.encode("12=") == [11, 1, 2, 12]
    assert tok.encode("0 9") == [11, 0, 14, 9]
    assert tok.encode("") == [11]
    assert tok.encode("9876543210") == [11, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0]


def test_special_ids_and_vocabulary():
    tok = DigitTokenizer()
    assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id) == (10, 11, 13)
    assert tok.vocab_size == 16
    ids = {i for c in "0123456789= " for i in tok.encode(c)}
    assert max(ids) < tok.vocab_size and len(ids) == 13  # 12 characters + BOS, all distinct


def test_decode_stops_at_the_first_eos():
    tok = DigitTokenizer()
    assert tok.decode([3, 2, 1, 13, 5, 6, 13]) == "321"
    assert tok.decode([13, 1, 2]) == ""
    assert tok.decode([4, 12, 14, 5]) == "4= 5"  # no EOS: everything


def test_decode_accepts_numpy_arrays():
    tok = DigitTokenizer()
    assert tok.decode(np.array([7, 0, 13, 1], dtype=np.int32)) == "70"
    assert tok.decode(np.array([7, 0], dtype=np.int64)) == "70"


def test_decode_inverts_encode_after_the_bos():
    tok = DigitTokenizer()
    for text in ["", "0", "31415=", "9 9 9"]:
        assert tok.decode(tok.encode(text)[1:]) == text
        assert tok.decode(tok.encode(text)[1:] + [tok.eos_token_id, 3]) == text


@pytest.mark.parametrize("text,bad", [("12a", "a"), ("1+2", "+"), ("12\n", "\n")])
def test_encode_refuses_unknown_characters_naming_them(text, bad):
    with pytest.raises(ValueError) as e:
        DigitTokenizer().encode(text)
    assert repr(bad) in str(e.value)
    assert "digits" in str(e.value)


def test_load_tokenizer_digits():
    assert isinstance(load_tokenizer("digits"), DigitTokenizer)


def test_stop_at_ends_decode_at_any_added_id_as_well_as_eos():
    tok = DigitTokenizer().stop_at([12, np.int64(14)])  # '=' and ' ' as a model's extra stop ids
    assert tok.decode([3, 2, 12, 5]) == "32"
    assert tok.decode([3, 14, 5]) == "3"
    assert tok.decode([3, 13, 12]) == "3"  # EOS still ends it
    assert tok.stop_ids == {12, 13, 14}
