"""The study's larger training data (studies/real/corpus.py): sized, distinct, sourced, apart from the evaluation."""

from __future__ import annotations

import json

from acre_train.data.builtin import builtin_qa
from acre_train.data.tiny_tokenizer import tiny_tokenizer
from studies.real.corpus import stage1_corpus, stage2_large
from studies.real.streams import split_articles, subset_squad


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
