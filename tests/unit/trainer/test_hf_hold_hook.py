"""The HF callback's test hook is parsed per attempt, and a malformed value names the entry (hf.py)."""

import pytest

pytest.importorskip("transformers")
from kubetrain_trainer.hf import parse_holds  # after the skip


@pytest.mark.parametrize("raw, attempt, expected", [
    ("1:save:10,2:step:17", 1, {"save": 10}),
    ("1:save:10,2:step:17", 2, {"step": 17}),
    ("1:save:10,2:step:17", 3, {}),
    (" 1:step:4 , 1:save:8 ", 1, {"step": 4, "save": 8}),
    ("", 1, {}),
])
def test_holds_apply_to_their_attempt_only(raw, attempt, expected):
    assert parse_holds(raw, attempt) == expected


@pytest.mark.parametrize("raw", ["1:mid:3", "1:save", "x:save:3", "1:save:-3"])
def test_a_malformed_hold_names_the_variable_and_the_entry(raw):
    with pytest.raises(ValueError, match=r"KUBETRAIN_TEST_HF_HOLD: .* is not <attempt>:step:<N>"):
        parse_holds(raw, 1)
