"""The study's larger training data (studies/real/corpus.py): sized, distinct, sourced, apart from the evaluation."""

from __future__ import annotations

import json

from acre_train.data.builtin import builtin_qa
from acre_train.data.tiny_tokenizer import tiny_tokenizer
from studies.real.corpus import stage1_corpus, stage2_large
from acre_train.data.squad import split_articles, subset_squad


def test_stage1_corpus_reaches_its_token_target_in_bounded_distinct_pieces(tmp_path):
    tok = tiny_tokenizer()
    squad = tmp_path / "squad.json"
    squad.write_text(json.dumps(builtin_qa()))
    section = stage1_corpus(tok, squad, tmp_path / "c.jsonl", min_tokens=60_000, max_doc_tokens=512)
    rows = [json.loads(x) for x in (tmp_path / "c.jsonl").read_text().splitlines()]
    assert section["tokens"] >= 60_000 and section["documents"] == len(rows)
    assert sum(s["tokens"] for s in section["sources"].values()) == section["tokens"]
    assert {"pydoc_data.topics", "squad-v2-dev"} <= set(section["sources"])
    assert all(r["meta"]["licence"] in ("PSF-2.0", "CC-BY-SA-4.0") for r in rows)
    assert len({r["text"] for r in rows}) == len(rows)  # no duplicate piece
    assert max(len(tok(r["text"], add_special_tokens=False)["input_ids"]) for r in rows) <= 512 + 8  # (re-tokenized)
    train, held = split_articles(squad)
    titles = {a["title"] for i, a in enumerate(builtin_qa()["data"]) if i in held}
    assert not {r["meta"]["name"] for r in rows if r["meta"]["source"] == "squad-v2-dev"} & titles


def test_stage2_large_counts_distinct_pairs_by_task(tmp_path):
    tok = tiny_tokenizer()
    squad = tmp_path / "squad.json"
    squad.write_text(json.dumps(builtin_qa()))
    train, _ = split_articles(squad)
    subset_squad(squad, train, tmp_path / "train.json")
    section = stage2_large(tok, tmp_path / "train.json", tmp_path / "s2.jsonl", num=8, lengths=(200, 300))
    rows = [json.loads(x) for x in (tmp_path / "s2.jsonl").read_text().splitlines()]
    assert section["conversations"] == len(rows) == 8 and section["by_task"]["squad"] == 4
    assert section["distinct_question_answer"] <= 8 and section["with_evidence"] == sum(1 for r in rows if r["evidence"])


def test_packed_stream_asks_several_questions_of_one_context_and_packs_them(tmp_path):
    """The packed ladder row's stream (sim.py --row stage2-sim-packed): same seeds and kinds, each SQuAD and
    multi-key context asked up to 4 questions, consecutively, so data prep packs them into one sample."""
    from studies.real.streams import stage2_conversations

    tok = tiny_tokenizer()
    squad = tmp_path / "squad.json"
    squad.write_text(json.dumps(builtin_qa()))
    plain = stage2_conversations(tok, squad, 4, (300,))
    packed = stage2_conversations(tok, squad, 4, (300,), questions_per_context=4)
    assert [r["seed"] for r in plain] == [1000, 1001, 1002, 1003]
    by_seed: dict[int, list] = {}
    for r in packed:
        by_seed.setdefault(r["seed"], []).append(r)
    assert sorted(by_seed) == [1000, 1001, 1002, 1003]
    for seed, rows in by_seed.items():
        contexts = {r["messages"][0]["content"].split("Question:")[0] for r in rows}
        assert len(contexts) == 1 and len(rows) <= 4 and all(r["evidence"] for r in rows)
    # (SQuAD itself repeats a question now and then, under another id: the questions are not always distinct)
    assert len(by_seed[1000]) > 1 and len(by_seed[1001]) == 1  # SQuAD asks several; a single needle one
