"""Metrics against hand-computed values (LongBench QA F1, EM, substring, ROUGE-L, recall)."""

from __future__ import annotations

import pytest

from acre_train.eval import metrics as M


def test_normalize_answer_longbench_rules():
    # lower-case, ASCII punctuation out, articles out as whole words only, spaces collapsed
    assert M.normalize_answer("  The Cat's  hat, AN apple!  ") == "cats hat apple"
    assert M.normalize_answer("theatre another") == "theatre another"  # 'the'/'an' inside words stay


def test_qa_f1_hand_computed():
    # pred tokens [new, york, city], gold [new, york]: P = 2/3, R = 1, F1 = 0.8
    assert M.qa_f1("New York City", ["new york"]) == pytest.approx(0.8)
    # multiset: pred [a? no: 'a' is an article] -> "dog dog cat" vs "dog cat cat": common dog:1 cat:1 -> P=R=2/3
    assert M.qa_f1("a dog dog cat", "dog cat cat") == pytest.approx(2 / 3)
    # max over golds: 0 for the first, 1 for the second
    assert M.qa_f1("Paris.", ["London", "paris"]) == 1.0
    assert M.qa_f1("", ["Paris"]) == 0.0  # empty prediction
    assert M.qa_f1("", [""]) == 0.0  # LongBench: no common tokens -> 0, even when both empty
    assert M.qa_f1("the", ["a"]) == 0.0  # both normalise to nothing


def test_exact_and_substring():
    assert M.exact_match("The Eiffel Tower.", ["eiffel tower"]) == 1.0
    assert M.exact_match("Eiffel", ["eiffel tower"]) == 0.0
    assert M.exact_match("", ["x"]) == 0.0
    pred = "The numbers are 1234567 and 7654321."
    assert M.substring_match(pred, ["1234567", "999"], "any") == 1.0
    assert M.substring_match(pred, ["1234567", "999"], "all") == 0.0
    assert M.substring_match(pred, ["1234567", "999"], "fraction") == 0.5
    assert M.substring_match(pred, ["1234567", "7654321"], "all") == 1.0
    assert M.substring_match("", ["1234567"], "any") == 0.0
    with pytest.raises(ValueError, match="empty string"):
        M.substring_match(pred, ["the"])  # would match everything
    with pytest.raises(ValueError, match="mode"):
        M.substring_match(pred, ["1"], "some")
    with pytest.raises(ValueError, match="at least one"):
        M.qa_f1("x", [])


def test_rouge_l_hand_computed():
    # LCS("the cat sat on the mat", "the cat lay on the mat") = the cat on the mat = 5; P = R = 5/6
    assert M.rouge_l("the cat lay on the mat", ["the cat sat on the mat"]) == pytest.approx(5 / 6)
    # LCS = 2 of pred 2, gold 4: P = 1, R = 0.5, F = 2/3; max over golds picks the exact one
    assert M.rouge_l("red fox", ["the red quick fox"]) == pytest.approx(2 / 3)
    assert M.rouge_l("red fox", ["blue", "red fox"]) == 1.0
    assert M.rouge_l("", ["red fox"]) == 0.0


def test_recall_and_aggregate():
    assert M.recall_at_k([3, 1, 2, 0], [1, 0], k=2) == 0.5
    assert M.recall_at_k([3, 1, 2, 0], [1, 0], k=4) == 1.0
    assert M.recall_at_k([3], [1], k=0) == 0.0
    assert M.evidence_recall([2, 5], [5]) == 1.0
    with pytest.raises(ValueError):
        M.evidence_recall([1], [])
    agg = M.aggregate([{"f1": 0.5, "r": None}, {"f1": 1.0, "r": 0.25}])
    assert agg == {"f1": 75.0, "r": 25.0}


def test_score_answer_skips_golds_that_normalise_to_nothing():
    row = M.score_answer("the cat", ["The", "cat"], "all")
    assert row["substring"] == 1.0 and row["exact_match"] == 1.0
    assert M.score_answer("x", ["the"])["substring"] is None
