"""Tiny tokenizer, built-in samples, span sampling and readers (no dataset writing here)."""

from __future__ import annotations

import gzip
import json
import random
import time

import pytest

from acre_train.data import builtin_qa, builtin_text, tiny_tokenizer
from acre_train.data.errors import DataError, InputProblems
from acre_train.data.readers import expand_inputs, read_files
from acre_train.data.spans import iter_spans, span_length


def test_tiny_tokenizer_is_fast_deterministic_and_has_distinct_pad():
    start = time.perf_counter()
    tok = tiny_tokenizer()
    assert time.perf_counter() - start < 5
    assert tok.pad_token_id is not None and tok.eos_token_id is not None
    assert tok.pad_token_id != tok.eos_token_id  # pad == eos would mask every EOS label
    text = "The Normans were descended from Norse raiders. def f(x): return x ** 2"
    assert tiny_tokenizer()(text)["input_ids"] == tok(text)["input_ids"]
    assert tok.decode(tok(text)["input_ids"]) == text


def test_tiny_tokenizer_chat_template_is_chatml():
    tok = tiny_tokenizer()
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]
    assert tok.apply_chat_template(messages, tokenize=False) == (
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nHello<|im_end|>\n")
    assert tok.apply_chat_template(messages[:1], tokenize=False, add_generation_prompt=True).endswith(
        "<|im_start|>assistant\n")
    # The special tokens are single tokens, not spelled out byte by byte.
    assert len(tok("<|im_end|>", add_special_tokens=False)["input_ids"]) == 1


def test_tokenizer_fingerprint_is_kept_per_tokenizer_and_follows_added_tokens():
    import hashlib

    from acre_train.data.tokenizer import tokenizer_fingerprint

    def recomputed(tok):  # the definition, without the per-object memo
        digest = hashlib.sha256(tok.backend_tokenizer.to_str().encode("utf-8"))
        for part in (tok.chat_template or "", str(tok.eos_token_id), str(tok.bos_token_id), str(tok.pad_token_id)):
            digest.update(b"\0" + str(part).encode("utf-8"))
        return digest.hexdigest()

    tok = tiny_tokenizer()
    first = tokenizer_fingerprint(tok)
    assert first == recomputed(tok) == tokenizer_fingerprint(tok)
    tok.add_tokens(["<zq-new-token>"])  # changes the ids some texts get: the memo must not survive it
    assert tokenizer_fingerprint(tok) == recomputed(tok) != first
    tok.chat_template = "{{ messages }}"  # not part of the memo: read on every call
    assert tokenizer_fingerprint(tok) == recomputed(tok)


def test_builtin_samples():
    text = builtin_text()
    assert len(text) > 50 and all(isinstance(r["text"], str) and r["text"] for r in text)
    qa = builtin_qa()
    paragraphs = [p for a in qa["data"] for p in a["paragraphs"]]
    assert len(paragraphs) >= 24
    for p in paragraphs:
        for q in p["qas"]:
            answer = q["answers"][0]
            assert p["context"][answer["answer_start"]:].startswith(answer["text"])
    from importlib import resources

    root = resources.files("acre_train.resources")
    assert len(root.joinpath("squad_v2_sample.json").read_bytes()) < 200_000
    readme = root.joinpath("README.md").read_text()
    assert "CC BY-SA 4.0" in readme and "Rajpurkar" in readme


@pytest.mark.parametrize("trial", range(40))
def test_spans_respect_bounds_budget_and_never_overlap(trial):
    rng = random.Random(trial)
    lo = rng.randint(1, 60)
    hi = rng.randint(lo, 200)
    budget = rng.choice([None, rng.randint(lo, 4000)])
    docs = [(i, rng.randint(1, 500)) for i in range(40)]
    spans = list(iter_spans(docs, min_length=lo, max_length=hi, token_budget=budget,
                            pack=rng.random() < 0.6, seed=trial))
    lengths = [span_length(s) for s in spans]
    assert all(lo <= n <= hi for n in lengths)
    if budget is not None:
        assert sum(lengths) <= budget
    used = set()
    for span in spans:
        for doc, start, end in span:
            assert 0 <= start < end <= dict(docs)[doc]
            covered = {(doc, k) for k in range(start, end)}
            assert not covered & used
            used |= covered


def test_spans_pack_short_documents_with_separators_and_stop_at_budget():
    docs = [(i, 10) for i in range(100)]
    unpacked = list(iter_spans(docs, min_length=30, max_length=40, pack=False))
    assert unpacked == []  # every document is shorter than a span
    packed = list(iter_spans(docs, min_length=30, max_length=40, token_budget=200, pack=True))
    assert packed and all(len(s) >= 3 for s in packed)
    assert sum(span_length(s) for s in packed) <= 200
    assert sum(span_length(s) for s in packed) > 200 - 40  # stopped because of the budget


def _write_jsonl(path, lines):
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "wt", encoding="utf-8") as f:
        f.write("\n".join(lines) + "\n")


def test_malformed_lines_are_reported_with_file_and_line(tmp_path, capsys):
    path = tmp_path / "bad.jsonl.gz"
    _write_jsonl(path, [json.dumps({"text": "ok"}), "{not json", "[1, 2]", "", json.dumps({"text": "ok2"})])
    problems = InputProblems()
    records = list(read_files(expand_inputs([path]), problems))
    assert [r.line for r in records] == [1, 6 - 1]  # the blank line 4 is skipped silently
    assert [(e["line"], e["reason"]) for e in problems.examples] == [(2, "malformed JSON"), (3, "not a JSON object")]
    assert f"{path}:2" in capsys.readouterr().err
    with pytest.raises(DataError, match=rf"{path}:2: malformed JSON"):
        list(read_files(expand_inputs([path]), InputProblems(strict=True)))


def test_missing_inputs_are_clear_errors(tmp_path):
    with pytest.raises(DataError, match="no such file"):
        expand_inputs([tmp_path / "nope.jsonl"])
    (tmp_path / "x.txt").write_text("hi")
    with pytest.raises(DataError, match="unsupported file type"):
        expand_inputs([tmp_path / "x.txt"])
    with pytest.raises(DataError, match="matches no file"):
        expand_inputs([str(tmp_path / "*.parquet")])
