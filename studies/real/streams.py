"""Training inputs of the real-base study, split from the evaluation by SQuAD article.

SQuAD articles with an even index train (stage-1 text, stage-2 QA); odd ones are held out for
evaluation. The split is written into every file's manifest so a report can say which was which.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from acre_train.data.squad import split_articles, squad_articles


def write_text_mix(squad_path: str | Path, out: str | Path) -> Path:
    """Stage-1 long text from two sources: the Python Language Reference (pydoc topics, one document per
    topic) and the training SQuAD articles (paragraphs of one article joined into one document)."""
    from pydoc_data.topics import topics

    train, _ = split_articles(squad_path)
    data = squad_articles(squad_path)
    rows = [{"text": text, "meta": {"source": "pydoc_data.topics", "topic": name}}
            for name, text in sorted(topics.items())]
    for i in train:
        art = data[i]
        rows.append({"text": "\n\n".join(p["context"] for p in art["paragraphs"]),
                     "meta": {"source": "squad-v2-dev", "article": i, "title": art.get("title")}})
    return write_jsonl(rows, out)


# Seeds of the training conversations; evaluation uses EVAL_SEED (never used here).
STAGE2_SEED = 1000
EVAL_SEED = 777
NEEDLE_KINDS = ("niah_single", "niah_multikey", "vt")


def answer_text(example) -> str:
    """The reference answer a training conversation ends with."""
    if example.substring_mode == "fraction":  # every value / variable name is asked for
        return ", ".join(example.answers)
    return example.answers[0]


def stage2_conversations(tokenizer, squad_train: str | Path, num: int, lengths: tuple[int, ...],
                         seed: int = STAGE2_SEED, questions_per_context: int = 1) -> list[dict[str, Any]]:
    """Long-context QA conversations, half SQuAD (training articles) and half synthetic retrieval.

    Built with the evaluation's own task generators and prompt pieces (instruction, documents,
    question), at training seeds, so stage 2 trains on exactly the format the study evaluates.
    ``questions_per_context`` > 1: ``num`` contexts, each SQuAD and multi-key one asked up to that many
    questions (consecutive conversations with the same context, which ``data.prepare.pack_questions``
    packs into one sample); a single needle or a variable-tracking context has one question to ask.
    """
    from acre_train.data.prompt import context_span, qa_messages
    from acre_train.eval.prompt import evidence_char_ranges, example_context, example_instruction
    from acre_train.eval.tasks import build_task

    rows = []
    for i in range(num):
        length = lengths[i % len(lengths)]
        kind = "squad" if i % 2 == 0 else NEEDLE_KINDS[(i // 2) % len(NEEDLE_KINDS)]
        asked = questions_per_context if kind in ("squad", "niah_multikey") else 1
        examples = build_task(kind, tokenizer, length, asked, seed + i, squad_path=squad_train,
                              questions_per_context=asked)
        for ex in examples:
            if example_context(ex) != example_context(examples[0]):
                break  # (a paragraph with fewer questions: the rest would come from another context)
            instruction = example_instruction(ex)
            messages = qa_messages(example_context(ex), ex.question, answer_text(ex), instruction=instruction)
            shift = context_span(example_context(ex), instruction)[0]  # the context's place in the user turn
            evidence = [[0, shift + a, shift + b] for a, b in evidence_char_ranges(ex)]
            rows.append({"messages": messages, "task": kind, "context_tokens": length, "seed": seed + i,
                         "evidence": evidence})
    return rows


def write_jsonl(rows: list[dict[str, Any]], out: str | Path) -> Path:
    from acre_train.files import atomic_path

    with atomic_path(out) as tmp, open(tmp, "w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
    return Path(out)
