"""studies/scorer/confusions.py: a wrong answer is classed by where its number comes from."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scorer"))

from confusions import classify  # noqa: E402


class WordTokenizer:
    """One token per whitespace-separated word: distances are word counts."""

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": text.split()}


CONTEXT = ("Grass is green. One of the special magic numbers for jolly-cedar is: 9343606. The sky is blue and "
           "so is the sea. One of the special magic numbers for gentle-river is: 5374386. Done.")


def test_another_needles_value_with_its_distance():
    kind, distance = classify("The number is 5374386.", CONTEXT, "9343606", WordTokenizer())
    between = len("9343606. The sky is blue and so is the sea. One of the special magic numbers for "
                  "gentle-river is:".split())
    assert kind == "another needle's value"
    assert distance == between  # positive: the given needle lies after the asked one, nearer the question
    assert classify("It is 9343606.", CONTEXT, "5374386", WordTokenizer()) == ("another needle's value", -between)


def test_a_garbled_copy_and_no_number():
    assert classify("It is 934360.", CONTEXT, "9343606", WordTokenizer()) == ("a number in no needle", None)
    assert classify("gentle-river", CONTEXT, "9343606", WordTokenizer()) == ("no number", None)
