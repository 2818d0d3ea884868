"""Stage-2 preparation: chat rendering, label masks, formats, SQuAD long-context QA, truncation."""

from __future__ import annotations

import json

import datasets
import numpy as np
import pytest

from acre_train.cli import main
from acre_train.data import DataError, Stage2Settings, builtin_qa, load_prepared, prepare_stage2, tiny_tokenizer
from acre_train.data.chat import render_conversation, truncate_middle
from acre_train.data.formats import to_messages
from acre_train.modeling.interleave import IGNORE_INDEX

datasets.disable_progress_bars()

PLAN = dict(first_chunk=64, stride=32, intervals=(4, 8))
CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "What is two plus two?"},
    {"role": "assistant", "content": "Four."},
    {"role": "user", "content": "And three plus three?"},
    {"role": "assistant", "content": "Six, of course."},
]


def _runs(mask: np.ndarray) -> list[tuple[int, int]]:
    edges = np.flatnonzero(np.diff(np.concatenate([[0], mask.astype(int), [0]])))
    return list(zip(edges[::2], edges[1::2]))


def test_golden_labels_cover_exactly_the_assistant_answers():
    tok = tiny_tokenizer()
    rendered = render_conversation(tok, CONVERSATION)
    ids, labels = rendered.input_ids, rendered.labels
    assert ids.tolist() == tok(rendered.text, add_special_tokens=False)["input_ids"]
    runs = _runs(labels != IGNORE_INDEX)
    assert [tok.decode(ids[a:b]) for a, b in runs] == ["Four.<|im_end|>", "Six, of course.<|im_end|>"]
    for a, b in runs:
        assert (labels[a:b] == ids[a:b]).all()
        assert tok.decode(ids[:a]).endswith("<|im_start|>assistant\n")  # the prompt is not trained
        assert tok.decode(ids[b:b + 1]) == "\n"  # template glue after the end-of-turn: not trained
    assert rendered.num_answer_tokens == sum(b - a for a, b in runs)


def test_prepared_row_targets_are_the_answer_tokens(tmp_path):
    path = tmp_path / "chat.jsonl"
    path.write_text(json.dumps({"messages": CONVERSATION}) + "\n")
    ds, manifest = load_prepared(prepare_stage2(Stage2Settings(inputs=(str(path),), output=tmp_path / "o", **PLAN)))
    row = ds.with_format("numpy")[0]
    tok = tiny_tokenizer()
    raw_slots = ~row["is_l1"].astype(bool)
    raw_ids, raw_labels = row["input_ids"][raw_slots], row["labels"][raw_slots]
    # Labels are shifted over the raw sequence: raw token p predicts raw token p + 1.
    targets = np.zeros(len(raw_ids), dtype=bool)
    targets[1:] = raw_labels[:-1] != IGNORE_INDEX
    assert [tok.decode(raw_ids[a:b]) for a, b in _runs(targets)] == ["Four.<|im_end|>", "Six, of course.<|im_end|>"]
    assert (raw_labels[:-1][raw_labels[:-1] != IGNORE_INDEX] == raw_ids[1:][targets[1:]]).all()
    assert row["num_answer_tokens"] == targets.sum() == manifest["counts"]["answer_tokens"]


def test_messages_sharegpt_and_alpaca_give_the_same_sample(tmp_path):
    user, answer = "Summarise: the cat sat on the mat.", "A cat sat."
    records = [
        {"messages": [{"role": "user", "content": user}, {"role": "assistant", "content": answer}]},
        {"conversations": [{"from": "human", "value": user}, {"from": "gpt", "value": answer}]},
        {"instruction": "Summarise:", "input": "the cat sat on the mat.", "output": answer},
    ]
    records[2]["instruction"] = "Summarise: the cat sat on the mat."
    records[2]["input"] = ""
    assert to_messages(records[0]) == to_messages(records[1]) == to_messages(records[2])
    path = tmp_path / "mixed.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    ds, _ = load_prepared(prepare_stage2(Stage2Settings(inputs=(str(path),), output=tmp_path / "o",
                                                        intervals=(8,), first_chunk=64, stride=32)))
    assert ds[0]["input_ids"] == ds[1]["input_ids"] == ds[2]["input_ids"]
    assert ds[0]["labels"] == ds[1]["labels"] == ds[2]["labels"]


def test_bad_conversations_reported_with_line_numbers(tmp_path):
    path = tmp_path / "bad.jsonl"
    good = json.dumps({"messages": CONVERSATION})
    path.write_text("\n".join([good, json.dumps({"messages": [{"role": "user", "content": "hi"}]}),
                               json.dumps({"foo": 1}), "{oops", good]) + "\n")
    _, manifest = load_prepared(prepare_stage2(Stage2Settings(inputs=(str(path),), output=tmp_path / "o", **PLAN)))
    assert [e["line"] for e in manifest["skipped"]["examples"]] == [2, 3, 4]
    assert manifest["counts"]["samples"] == 2
    with pytest.raises(DataError, match=rf"{path}:2: no assistant turn"):
        prepare_stage2(Stage2Settings(inputs=(str(path),), output=tmp_path / "s", strict=True, **PLAN))


@pytest.fixture(scope="module")
def squad(tmp_path_factory):
    out = tmp_path_factory.mktemp("squad") / "o"
    settings = Stage2Settings(builtin=True, output=out, context_tokens=1000, max_length=100_000,
                              questions_per_paragraph=2, **PLAN)
    return load_prepared(prepare_stage2(settings))


def test_gold_paragraph_is_in_every_built_context(squad):
    ds, manifest = squad
    tok = tiny_tokenizer()
    paragraphs = [p["context"] for a in builtin_qa()["data"] for p in a["paragraphs"]]
    depths = set()
    assert len(ds) > 60 and manifest["counts"]["truncated"] == 0
    for row in ds:
        meta = json.loads(row["meta"])
        text = tok.decode([t for t, l1 in zip(row["input_ids"], row["is_l1"]) if not l1])
        assert paragraphs[meta["gold_paragraph"]] in text
        assert meta["question"] in text and text.rstrip().endswith(meta["answer"] + "<|im_end|>")
        assert meta["num_paragraphs"] > 1
        depths.add(meta["gold_depth"])
    assert len(depths) > 2  # the gold paragraph moves around


def test_middle_truncation_keeps_question_and_answer_and_drop_counts(tmp_path, squad):
    full, _ = squad
    limit = int(np.median(full["num_raw_tokens"]))
    over = sum(n > limit for n in full["num_raw_tokens"])
    assert 5 < over < len(full)
    common = dict(builtin=True, context_tokens=1000, max_length=limit, questions_per_paragraph=2, **PLAN)
    ds, manifest = load_prepared(prepare_stage2(Stage2Settings(output=tmp_path / "t", **common)))
    tok = tiny_tokenizer()
    assert manifest["counts"]["truncated"] == over and len(ds) == len(full)
    for row in ds:
        assert row["num_raw_tokens"] <= limit
        meta = json.loads(row["meta"])
        raw = np.asarray([t for t, l1 in zip(row["input_ids"], row["is_l1"]) if not l1])
        text = tok.decode(raw)
        assert f"Question: {meta['question']}<|im_end|>" in text
        assert text.endswith(f"<|im_start|>assistant\n{meta['answer']}<|im_end|>\n")
        assert text.startswith("<|im_start|>user\n")
    _, dropped = load_prepared(prepare_stage2(Stage2Settings(output=tmp_path / "d", overlong="drop", **common)))
    assert dropped["counts"]["dropped"] == over and dropped["counts"]["samples"] == len(full) - over


def test_truncate_middle_cuts_only_the_context():
    tok = tiny_tokenizer()
    context = " ".join(f"word{i}" for i in range(200))
    messages = [{"role": "user", "content": context + "\nQ: which?"}, {"role": "assistant", "content": "That."}]
    rendered = render_conversation(tok, messages, (0, 0, len(context)))
    cut = truncate_middle(rendered, len(rendered.input_ids) - 300)
    assert len(cut.input_ids) == len(rendered.input_ids) - 300
    text = tok.decode(cut.input_ids)
    assert "word0 " in text and "word199" in text and "word100 " not in text and "\nQ: which?" in text
    assert tok.decode(cut.input_ids[cut.labels != IGNORE_INDEX]) == "That.<|im_end|>"
    assert truncate_middle(rendered, 10) is None  # the rest alone does not fit


def test_cli_stage2_debug_plain_markers(capsys):
    assert main(["preprocess", "stage2", "--builtin", "--context-tokens", "200", "--first-chunk", "64",
                 "--stride", "32", "--debug", "1", "--color", "never"]) == 0
    out = capsys.readouterr().out
    assert "[L1]" in out and "{{" in out and "<|im_end|>}}" in out and "\033[" not in out


def test_squad_fields_of_the_wrong_type_are_reported_with_their_path():
    from acre_train.data.errors import DataError, InputProblems
    from acre_train.data.squad import paragraphs_from_squad_json

    ok = {"context": "Ada wrote it.", "qas": [{"id": "1", "question": "Who?", "answers": [{"text": "Ada"}]}]}
    doc = {"data": [
        {"title": "A", "paragraphs": [ok, {"context": "x", "qas": "not a list"},
                                      {"context": "y", "qas": [{"question": "Q?", "answers": "Ada"}]},
                                      {"context": "z", "qas": [["not", "an", "object"]]}]},
        {"title": "B", "paragraphs": {"not": "a list"}},
        "not an article",
    ]}
    problems = InputProblems()
    paragraphs = paragraphs_from_squad_json(doc, "f.json", problems)
    assert [p.context for p in paragraphs] == ["Ada wrote it.", "y", "z"] and len(paragraphs[0].qas) == 1
    where = [e["source"] for e in problems.examples]
    assert where == ["f.json data[0].paragraphs[1]", "f.json data[0].paragraphs[2].qas[0]",
                     "f.json data[0].paragraphs[3].qas[0]", "f.json data[1]", "f.json data[2]"]
    assert problems.counts["wrong type"] == 5
    with pytest.raises(DataError, match=r"f.json data\[0\].paragraphs\[1\]: wrong type"):
        paragraphs_from_squad_json(doc, "f.json", InputProblems(strict=True))


# ----------------------------------------------------------------------------- evidence positions

def _raw(row, column):
    raw = ~np.asarray(row["is_l1"], dtype=bool)
    return np.asarray(row[column])[raw]


def test_squad_rows_record_the_answer_as_evidence_and_the_question(squad):
    ds, manifest = squad
    tok = tiny_tokenizer()
    assert manifest["counts"]["with_evidence"] == len(ds)  # every builtin answer occurs in its paragraph
    for row in ds.select(range(20)):
        meta = json.loads(row["meta"])
        raw = _raw(row, "input_ids")
        a, b = row["evidence"][:2]
        assert meta["answer"] in tok.decode(raw[a:b]) and b - a <= len(tok(meta["answer"])["input_ids"]) + 2
        qa, qb = row["question"]
        asked = tok.decode(raw[qa:qb])
        assert asked.startswith("\n\nAnswer the question") and meta["question"] in asked
        assert asked.endswith("<|im_start|>assistant\n")  # the question ends where the answer starts


def test_truncation_moves_evidence_with_its_tokens(tmp_path, squad):
    full, _ = squad
    limit = int(np.median(full["num_raw_tokens"]))
    common = dict(builtin=True, context_tokens=1000, max_length=limit, questions_per_paragraph=2, **PLAN)
    ds, manifest = load_prepared(prepare_stage2(Stage2Settings(output=tmp_path / "t", **common)))
    tok = tiny_tokenizer()
    kept = 0
    for row in ds:
        meta = json.loads(row["meta"])
        if len(row["evidence"]):
            a, b = row["evidence"][:2]
            assert meta["answer"] in tok.decode(_raw(row, "input_ids")[a:b])
            kept += 1
    assert 0 < manifest["counts"]["with_evidence"] == kept <= len(ds)


def test_messages_evidence_is_located_and_bad_evidence_reported(tmp_path):
    context = "alpha beta gamma. The code is 4711. delta epsilon."
    good = {"messages": [{"role": "user", "content": context + " What is the code?"},
                         {"role": "assistant", "content": "4711"}],
            "evidence": [[0, context.index("4711"), context.index("4711") + 4]]}
    bad = {**good, "evidence": [[0, 5, 900]]}
    path = tmp_path / "chat.jsonl"
    path.write_text(json.dumps(good) + "\n" + json.dumps(bad) + "\n")
    ds, manifest = load_prepared(prepare_stage2(Stage2Settings(inputs=(str(path),), output=tmp_path / "o", **PLAN)))
    tok = tiny_tokenizer()
    assert len(ds) == 1 and manifest["counts"]["with_evidence"] == 1
    a, b = ds[0]["evidence"]
    assert tok.decode(_raw(ds[0], "input_ids")[a:b]).strip() == "4711"
    assert [e["line"] for e in manifest["skipped"]["examples"]] == [2]
    with pytest.raises(DataError, match=r"chat.jsonl:2.*outside message 0"):
        prepare_stage2(Stage2Settings(inputs=(str(path),), output=tmp_path / "s", strict=True, **PLAN))


def test_alpaca_evidence_is_located_and_evidence_in_the_answer_is_reported(tmp_path):
    """Alpaca records count their built turns (0: instruction + input, 1: output), so their evidence is
    kept (it was always refused); evidence placed in the answer is a reported record, not a silent
    sample without evidence."""
    context = "alpha beta gamma. The code is 4711. delta epsilon."
    user = "Answer from the text.\n\n" + context
    good = {"instruction": "Answer from the text.", "input": context, "output": "4711",
            "evidence": [[0, user.index("4711"), user.index("4711") + 4]]}
    in_answer = {**good, "evidence": [[1, 0, 4]]}
    path = tmp_path / "alpaca.jsonl"
    path.write_text(json.dumps(good) + "\n" + json.dumps(in_answer) + "\n")
    ds, manifest = load_prepared(prepare_stage2(Stage2Settings(inputs=(str(path),), output=tmp_path / "o", **PLAN)))
    assert len(ds) == 1 and manifest["counts"]["with_evidence"] == 1
    a, b = ds[0]["evidence"]
    assert tiny_tokenizer().decode(_raw(ds[0], "input_ids")[a:b]).strip() == "4711"
    with pytest.raises(DataError, match=r"alpaca.jsonl:2.*an assistant turn"):
        prepare_stage2(Stage2Settings(inputs=(str(path),), output=tmp_path / "s", strict=True, **PLAN))


def test_packed_questions_equal_their_single_conversations(tmp_path):
    """pack_questions: a paragraph's questions share one context and become one row; training that row in the
    refilled layout gives the loss of its single conversations, and the preparation records the packing."""
    import torch

    from acre_train.data.errors import InputProblems
    from acre_train.data.stage2 import iter_examples, pack_rows, stage2_row
    from acre_train.data.tokenizer import open_tokenizer
    from acre_train.modeling.scorer_spec import ScorerSettings
    from acre_train.modeling import attach_acre
    from acre_train.tiny import tiny_model
    from acre_train.train.refill_sim import SimSettings, collate_sim, sim_loss_sum, sim_sample

    settings = Stage2Settings(builtin=True, output=tmp_path / "packed", context_tokens=160, max_length=400,
                              questions_per_paragraph=3, pack_questions=3, first_chunk=32, stride=16, intervals=(4,),
                              max_samples=9)
    tok, l1_id, _ = open_tokenizer(settings)
    examples = list(iter_examples(settings, tok, InputProblems(strict=True)))[:9]
    singles = [stage2_row(ex, i, tok, settings, l1_id) for i, ex in enumerate(examples)]
    singles = [r for r in singles if r["status"] == "ok"]
    packed = pack_rows(singles, 3, settings, l1_id)
    assert len(packed) < len(singles) and sum(len(r["question"]) // 2 for r in packed) == len(singles)
    sim = SimSettings(first_chunk=32, stride=16, interval=4, working_window=10_000, max_refill=8,
                      scorer=ScorerSettings.parse("l2:layers=-1"))
    model = attach_acre(tiny_model("qwen2", seed=0, vocab_size=tok.vocab_size, eos_token_id=0))
    with torch.no_grad():
        got = sim_loss_sum(model, collate_sim([sim_sample(r, sim) for r in packed]), sim)
        want = sim_loss_sum(model, collate_sim([sim_sample(r, sim) for r in singles]), sim)
    assert got[1] == want[1] > 0
    torch.testing.assert_close(got[0], want[0], atol=1e-4, rtol=1e-6)

    prepare_stage2(settings, log=lambda *_: None)
    dataset, manifest = load_prepared(tmp_path / "packed")
    assert manifest["counts"]["pack_questions"] == 3 and manifest["counts"]["questions"] > len(dataset)
    assert "evidence_question" in dataset.column_names
