"""The base diagnostics score what they say: teacher-forced whole answers vs first digits."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from studies.mini.data import train_tokenizer
from studies.mini.diagnostics import drill_accuracy, needle_accuracy


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return train_tokenizer(tmp_path_factory.mktemp("tok"), vocab_size=512)


class Oracle(torch.nn.Module):
    """Predicts the true next token everywhere, except (``miss_last``) at the next-to-last position,
    i.e. it gets the final token of the sequence wrong."""

    def __init__(self, vocab: int, miss_last: bool = False):
        super().__init__()
        self.vocab, self.miss_last = vocab, miss_last

    def forward(self, input_ids, **_):
        nxt = torch.roll(input_ids, -1, dims=1)
        if self.miss_last:
            nxt[:, -2] = (nxt[:, -2] + 1) % self.vocab
        return SimpleNamespace(logits=torch.nn.functional.one_hot(nxt, self.vocab).float())


class Echo(Oracle):
    """Predicts the current token as the next one: never a digit of the answer after a space."""

    def forward(self, input_ids, **_):
        return SimpleNamespace(logits=torch.nn.functional.one_hot(input_ids, self.vocab).float())


def test_needle_accuracy_separates_the_first_digit_from_the_whole_answer(tok):
    v = len(tok)
    assert needle_accuracy(Oracle(v), tok, "niah_single", 128, 3) == {
        "task": "niah_single", "context_tokens": 128, "examples": 3, "exact": 1.0, "first_digit": 1.0, "digits": 1.0}
    last_wrong = needle_accuracy(Oracle(v, miss_last=True), tok, "niah_single", 128, 3)
    assert (last_wrong["exact"], last_wrong["first_digit"], last_wrong["digits"]) == (0.0, 1.0, round(6 / 7, 3))
    echo = needle_accuracy(Echo(v), tok, "niah_multikey", 160, 3)
    assert echo["exact"] == echo["first_digit"] == 0.0 and echo["digits"] < 0.5  # (a repeated digit can hit)


def test_drill_accuracy_counts_every_answer_of_a_drill(tok):
    v = len(tok)
    got = drill_accuracy(Oracle(v), tok, facts=3, drills=2)
    assert got == {"facts": 3, "answers": 6, "exact": 1.0, "first_digit": 1.0}
    echo = drill_accuracy(Echo(v), tok, facts=2, drills=2)
    assert echo["answers"] == 4 and (echo["exact"], echo["first_digit"]) == (0.0, 0.0)


def test_a_trained_tokenizer_saved_beside_a_qwen2_model_loads_as_trained(tok, tmp_path):
    """transformers 5 would load it as Qwen2Tokenizer (by config.json's model_type), whose own
    pre-tokenizer splits text differently from the tokenizer the model was trained with."""
    from acre_train.data.tokenizer import auto_tokenizer, load_tokenizer
    from acre_train.tiny import tiny_model

    tiny_model("qwen2", vocab_size=len(tok), eos_token_id=tok.eos_token_id).save_pretrained(str(tmp_path))
    tok.save_pretrained(str(tmp_path))
    text = "The value is: 8316078.\n\nQuestion: What is it?"
    want = tok(text, add_special_tokens=False)["input_ids"]
    for loaded in (auto_tokenizer(str(tmp_path)), load_tokenizer(str(tmp_path))):
        assert loaded(text, add_special_tokens=False)["input_ids"] == want
        assert loaded.chat_template == tok.chat_template and loaded.eos_token_id == tok.eos_token_id
