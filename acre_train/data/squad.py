"""Long-context QA from SQuAD-style data: the gold paragraph at a random depth among distractors.

Each answerable question becomes one conversation: the user turn holds the context (paragraphs
joined by blank lines, the gold one at a random depth, other paragraphs drawn at random until the
context reaches a target token count) followed by the question; the assistant turn is the first gold
answer. The context's character range is returned so middle truncation never cuts the question.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Iterator

import numpy as np

from .errors import DataError, InputProblems
from .prompt import qa_messages
from .readers import Record

PARAGRAPH_SEPARATOR = "\n\n"
_DEPTH_STREAM = 0xC0


@dataclass(frozen=True)
class Paragraph:
    context: str
    title: str
    qas: tuple[dict[str, Any], ...]  # answerable questions only: {"id", "question", "answer"}


@dataclass(frozen=True)
class QAExample:
    """A built long-context QA conversation."""

    messages: list[dict[str, str]]
    context: tuple[int, int, int]  # (message index, char start, char end) of the context
    meta: dict[str, Any]
    # (message index, char start, char end) of the answer inside the gold paragraph: the evidence a
    # refill must bring back (empty if the answer text does not occur verbatim in the paragraph)
    evidence: tuple[tuple[int, int, int], ...] = ()


class _WrongType(Exception):
    """A SQuAD field of the wrong JSON type (reported with its path in the file)."""


def _answer_text(qa: dict[str, Any]) -> str | None:
    answers = qa.get("answers")
    if isinstance(answers, dict):  # hub layout: {"text": [...], "answer_start": [...]}
        texts = answers.get("text") or []
        if not isinstance(texts, list):
            raise _WrongType(f"'answers.text' is {type(texts).__name__}, expected a list")
    elif answers is None or isinstance(answers, list):
        if any(not isinstance(a, dict) for a in answers or []):
            raise _WrongType("'answers' holds a non-object entry")
        texts = [a.get("text") for a in answers or []]
    else:
        raise _WrongType(f"'answers' is {type(answers).__name__}, expected a list")
    texts = [t for t in texts if isinstance(t, str) and t.strip()]
    return texts[0] if texts else None


def _qa_entry(qa: Any, source: str, where: int | None, problems: InputProblems) -> dict | None:
    if not isinstance(qa, dict):
        problems.report(source, where, "wrong type", f"a question entry is {type(qa).__name__}, expected an object")
        return None
    try:
        return _qa_fields(qa, source, where, problems)
    except _WrongType as exc:
        problems.report(source, where, "wrong type", str(exc))
        return None


def _qa_fields(qa: dict[str, Any], source: str, where: int | None, problems: InputProblems) -> dict | None:
    if qa.get("is_impossible"):
        return None  # unanswerable questions have no answer to train on; not an error
    question, answer = qa.get("question"), _answer_text(qa)
    if not isinstance(question, str) or not question.strip():
        problems.report(source, where, "missing field 'question'")
        return None
    if answer is None:
        if "answers" not in qa:
            problems.report(source, where, "missing field 'answers'")
        return None  # an empty answer list marks an unanswerable question in SQuAD v2
    return {"id": str(qa.get("id", "")), "question": question.strip(), "answer": answer.strip()}


def paragraphs_from_squad_json(doc: dict[str, Any], source: str, problems: InputProblems) -> list[Paragraph]:
    """Paragraphs of a SQuAD JSON document (``data[].paragraphs[].{context, qas}``)."""
    if not isinstance(doc, dict) or not isinstance(doc.get("data"), list):
        raise DataError(f"{source}: not SQuAD JSON (expected a top-level 'data' list)")
    out = []
    for a, article in enumerate(doc["data"]):
        paragraphs = article.get("paragraphs", []) if isinstance(article, dict) else None
        if not isinstance(paragraphs, list):
            problems.report(f"{source} data[{a}]", None, "wrong type",
                            "an article must be an object whose 'paragraphs' is a list")
            continue
        for p, para in enumerate(paragraphs):
            where = f"{source} data[{a}].paragraphs[{p}]"
            if not isinstance(para, dict) or not isinstance(para.get("qas", []), list):
                problems.report(where, None, "wrong type", "a paragraph must be an object whose 'qas' is a list")
                continue
            context = para.get("context")
            if not isinstance(context, str) or not context.strip():
                problems.report(where, None, "missing field 'context'")
                continue
            qas = [q for i, qa in enumerate(para.get("qas", []))
                   if (q := _qa_entry(qa, f"{where}.qas[{i}]", None, problems))]
            out.append(Paragraph(context.strip(), str(article.get("title", "")), tuple(qas)))
    return out


def paragraphs_from_records(records: Iterable[Record], problems: InputProblems) -> list[Paragraph]:
    """Paragraphs from flat rows ``{context, question, answers, title?}`` (hub ``squad_v2`` layout),
    grouped by context in first-seen order."""
    groups: dict[str, tuple[str, list[dict]]] = {}
    for record in records:
        context = record.data.get("context")
        if not isinstance(context, str) or not context.strip():
            problems.report(record.source, record.line, "missing field 'context'")
            continue
        title, qas = groups.setdefault(context.strip(), (str(record.data.get("title", "")), []))
        if (qa := _qa_entry(record.data, record.source, record.line, problems)):
            qas.append(qa)
    return [Paragraph(c, t, tuple(q)) for c, (t, q) in groups.items()]


def load_squad_files(paths: Iterable[Path], problems: InputProblems) -> list[Paragraph]:
    """Paragraphs of SQuAD JSON files, in file order."""
    out = []
    for path in paths:
        try:
            doc = json.loads(Path(path).read_text(encoding="utf-8"))
        except json.JSONDecodeError as exc:
            raise DataError(f"{path}:{exc.lineno}: malformed JSON ({exc.msg})") from exc
        out.extend(paragraphs_from_squad_json(doc, str(path), problems))
    return out


def build_long_qa(
    paragraphs: list[Paragraph],
    paragraph_tokens: list[int],
    *,
    context_tokens: int,
    questions_per_paragraph: int = 1,
    seed: int = 0,
    share_context: bool = False,
) -> Iterator[QAExample]:
    """Yield one long-context QA conversation per answerable question (up to the per-paragraph cap).

    ``paragraph_tokens[i]``: token count of paragraph ``i`` (the caller's tokenizer). Distractors
    are drawn without replacement from all other paragraphs until gold + distractors reach
    ``context_tokens`` (or the pool runs out); the gold paragraph's depth is uniform over the
    ``len(distractors) + 1`` slots. Deterministic per (seed, question number), or with
    ``share_context`` per (seed, paragraph): a paragraph's questions then share one context (what
    ``pack_questions`` packs into one sample).
    """
    if len(paragraph_tokens) != len(paragraphs):
        raise ValueError("need one token count per paragraph")
    counts = np.asarray(paragraph_tokens, dtype=np.int64)
    number = 0
    for gold, para in enumerate(paragraphs):
        for qa in para.qas[:questions_per_paragraph]:
            draw = (seed, _DEPTH_STREAM, 1 << 40, gold) if share_context else (seed, _DEPTH_STREAM, number)
            rng = np.random.default_rng(np.random.SeedSequence(draw))
            order = rng.permutation(len(paragraphs))
            order = order[order != gold]
            # Paragraphs taken while the running total (gold included) is below the target.
            running = counts[gold] + np.cumsum(counts[order])
            take = int(np.searchsorted(running, context_tokens, side="left")) + 1
            distractors = order[: min(take, len(order))] if counts[gold] < context_tokens else order[:0]
            depth = int(rng.integers(0, len(distractors) + 1))
            chosen = [int(i) for i in distractors[:depth]] + [gold] + [int(i) for i in distractors[depth:]]
            context = PARAGRAPH_SEPARATOR.join(paragraphs[i].context for i in chosen)
            gold_at = sum(len(paragraphs[i].context) + len(PARAGRAPH_SEPARATOR) for i in chosen[:depth])
            found = para.context.find(qa["answer"])
            yield QAExample(
                messages=qa_messages(context, qa["question"], qa["answer"]),
                context=(0, 0, len(context)),
                evidence=((0, gold_at + found, gold_at + found + len(qa["answer"])),) if found >= 0 else (),
                meta={"id": qa["id"], "title": para.title, "gold_paragraph": gold, "gold_depth": depth,
                      "num_paragraphs": len(chosen), "answer": qa["answer"], "question": qa["question"]},
            )
            number += 1


# ------------------------------------------------------------------------ split by article
# The real-base study trains on SQuAD articles of even index and evaluates on odd ones; calibration
# (acre-train calibrate) and the quickstart use the same split so nothing is tuned on what is reported.

TRAIN_PARITY = 0  # article index % 2 == TRAIN_PARITY -> training; the rest -> evaluation


def squad_articles(path: str | Path) -> list[dict[str, Any]]:
    """The articles of a SQuAD JSON file (``data[].paragraphs[].{context, qas}``); anything else is a
    :class:`DataError` naming the file and what is wrong."""
    try:
        doc = json.loads(Path(path).read_text(encoding="utf-8"))
    except UnicodeDecodeError as exc:
        raise DataError(f"{path}: not UTF-8 text (byte {exc.start}); expected SQuAD JSON") from exc
    except json.JSONDecodeError as exc:
        raise DataError(f"{path}:{exc.lineno}: malformed JSON ({exc.msg})") from exc
    data = doc.get("data") if isinstance(doc, dict) else None
    if not isinstance(data, list) or not all(isinstance(a, dict) and isinstance(a.get("paragraphs"), list) for a in data):
        raise DataError(f"{path}: not SQuAD JSON (expected a top-level 'data' list of articles, each with a "
                        "'paragraphs' list)")
    return data


def split_articles(path: str | Path) -> tuple[list[int], list[int]]:
    """(training article indices, held-out article indices) of a SQuAD file."""
    n = len(squad_articles(path))
    train = [i for i in range(n) if i % 2 == TRAIN_PARITY]
    return train, [i for i in range(n) if i % 2 != TRAIN_PARITY]


def subset_squad(path: str | Path, indices: list[int], out: str | Path) -> Path:
    """A SQuAD JSON holding only the given articles (same layout)."""
    data = squad_articles(path)
    from ..files import write_text_atomic

    body = {"version": "subset", "source": str(path), "articles": indices, "data": [data[i] for i in indices]}
    write_text_atomic(out, json.dumps(body))
    return Path(out)
