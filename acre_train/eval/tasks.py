"""Evaluation tasks: built-in generators (SQuAD long-context QA, RULER-style needles).

The example and its JSONL format: ``eval/examples.py``.

Generators size the *context* (documents or haystack, without instruction and question) in tokens
of the given tokenizer, and are seeded: the same arguments give the same file.

Public task API (what the studies and training-data builders use; everything else is private):
:func:`build_task`, :func:`resolve_tasks`, :func:`load_squad`, :func:`needle_question`, :func:`filler_sentences`, :data:`WORDS`,
:data:`NEEDLE_INSTRUCTION`. Where an answer's evidence lies: ``eval.prompt.evidence_char_ranges``.
"""

from __future__ import annotations

import functools
import json
import random
import re
from pathlib import Path
from typing import Any

from .examples import Example, TokenCounter, load_jsonl

__all__ = ["build_task", "resolve_tasks", "load_squad", "needle_question", "filler_sentences", "WORDS",
           "NEEDLE_INSTRUCTION"]


# ---------------------------------------------------------------------------------------------
# SQuAD long-context QA
# ---------------------------------------------------------------------------------------------


def load_squad(path: str | Path | None = None) -> list[dict[str, Any]]:
    """SQuAD articles (``data`` list) from ``path``, or the packaged 48-paragraph sample when None."""
    if path is None:
        from ..data.builtin import builtin_qa

        return builtin_qa()["data"]
    return json.loads(Path(path).read_text(encoding="utf-8"))["data"]


def squad_qa(tokenizer, context_tokens: int, num_examples: int, seed: int = 0, path: str | Path | None = None,
             questions_per_context: int = 1) -> list[Example]:
    """Gold paragraph among paragraphs of *other* articles that do not contain an answer string.

    Documents are added until the next would pass ``context_tokens`` (counted per document, as the
    methods tokenize them); the gold lands at a seeded random index. Up to ``questions_per_context``
    answerable questions of the gold paragraph share one context (the harness encodes it once).
    ``path``: a SQuAD JSON file (default: the packaged sample).
    """
    data = load_squad(path)
    rng = random.Random(seed)
    count = TokenCounter(tokenizer)
    paragraphs = [(ai, p["context"]) for ai, art in enumerate(data) for p in art["paragraphs"]]
    golds = [
        (ai, p["context"], [qa for qa in p["qas"] if not qa.get("is_impossible") and qa["answers"]])
        for ai, art in enumerate(data) for p in art["paragraphs"]
    ]
    golds = [g for g in golds if g[2]]
    out: list[Example] = []
    context_no = 0
    while len(out) < num_examples:
        ai, gold, qas = rng.choice(golds)
        qas = rng.sample(qas, min(len(qas), questions_per_context, num_examples - len(out)))
        answers_of = [list(dict.fromkeys(a["text"] for a in qa["answers"])) for qa in qas]
        lowered = [a.lower() for answers in answers_of for a in answers]
        docs = [gold]
        total = count(gold)
        for other, text in rng.sample(paragraphs, len(paragraphs)):
            if other == ai or any(a in text.lower() for a in lowered):
                continue
            t = count(text)
            if total + t > context_tokens:
                break
            docs.append(text)
            total += t
        rng.shuffle(docs)
        for qa, answers in zip(qas, answers_of):
            out.append(Example(
                id=f"squad-{seed}-{len(out)}", question=qa["question"], answers=answers, documents=docs,
                gold_docs=[docs.index(gold)], task="squad", metric="qa_f1",
                meta={"context_tokens": total, "context_id": f"squad-{seed}-c{context_no}"},
            ))
        context_no += 1
    return out


# ---------------------------------------------------------------------------------------------
# RULER-style needles over real filler text (the Python Language Reference shipped with CPython)
# ---------------------------------------------------------------------------------------------

WORDS = (  # the key vocabulary of needle tasks ("eager-yonder")
    "amber brisk cedar dusty eager fabled gentle hollow ivory jolly keen lunar mellow nimble opal "
    "placid quiet rustic silver tidy umber vivid wistful young zesty anchor beacon canyon delta ember "
    "falcon glacier harbor island jungle kettle lantern meadow nectar orchard pebble quarry river "
    "summit thistle upland valley willow yonder zephyr"
).split()


NEEDLE_INSTRUCTION = ("Some special magic numbers are hidden within the following text. Make sure to memorize "
                      "them. I will quiz you about the numbers afterwards.")


def needle_question(key: str) -> str:
    """The question of the ``niah_single``/``niah_multikey`` tasks about ``key``."""
    return f"What is the special magic number for {key} mentioned in the provided text?"


@functools.lru_cache(maxsize=1)
def filler_sentences() -> list[str]:
    """Sentences of the haystack text (the Python Language Reference shipped with CPython)."""
    from pydoc_data.topics import topics

    text = " ".join(topics[k] for k in sorted(topics))
    text = re.sub(r"\s+", " ", text)
    return [s.strip() for s in re.split(r"(?<=[.!?])\s+", text) if len(s.strip()) > 20]


def _haystack(rng: random.Random, count: TokenCounter, sentences: list[str], budget: int) -> list[str]:
    """Consecutive filler sentences from a seeded start, up to ``budget`` tokens (wrapping around)."""
    start = rng.randrange(len(sentences))
    out: list[str] = []
    total = 0
    for k in range(len(sentences)):
        s = sentences[(start + k) % len(sentences)]
        t = count(s + " ")
        if total + t > budget:
            break
        out.append(s)
        total += t
    return out


def _assemble(filler: list[str], needles: list[str], rng: random.Random) -> tuple[str, list[list[int]]]:
    """Insert needles at seeded depths between filler sentences; return text and needle char spans."""
    slots = sorted(rng.randint(0, len(filler)) for _ in needles)
    order = list(needles)
    rng.shuffle(order)
    pieces: list[tuple[str, bool]] = [(s, False) for s in filler]
    for slot, needle in sorted(zip(slots, order), key=lambda x: -x[0]):
        pieces.insert(slot, (needle, True))
    return _join_pieces(pieces)


def _join_pieces(pieces: list[tuple[str, bool]]) -> tuple[str, list[list[int]]]:
    """Space-join text pieces; return the text and the character span of every needle piece."""
    text, spans, pos = [], [], 0
    for s, is_needle in pieces:
        if is_needle:
            spans.append([pos, pos + len(s)])
        text.append(s)
        pos += len(s) + 1
    return " ".join(text), spans


def _key(rng: random.Random) -> str:
    return f"{rng.choice(WORDS)}-{rng.choice(WORDS)}"


def _needle_examples(kind: str, tokenizer, context_tokens: int, num_examples: int, seed: int,
                     num_needles: int = 4, num_hops: int = 4, questions_per_context: int = 1) -> list[Example]:
    rng = random.Random(f"{kind}-{seed}")
    count = TokenCounter(tokenizer)
    sentences = filler_sentences()
    instruction = NEEDLE_INSTRUCTION
    out: list[Example] = []
    n = 0
    while len(out) < num_examples:
        keys = list(dict.fromkeys(_key(rng) for _ in range(4 * num_needles)))[:num_needles]
        values = [str(rng.randint(10**6, 10**7 - 1)) for _ in range(num_needles)]
        key = keys[0]
        metric, mode = "substring", "any"
        if kind == "niah_single":
            needles = [f"One of the special magic numbers for {key} is: {values[0]}."]
            question, answers = needle_question(key), [values[0]]
        elif kind == "niah_multikey":
            needles = [f"One of the special magic numbers for {k} is: {v}." for k, v in zip(keys, values)]
            question, answers = needle_question(key), [values[0]]
        elif kind == "niah_multivalue":
            needles = [f"One of the special magic numbers for {key} is: {v}." for v in values]
            question = f"What are all the special magic numbers for {key} mentioned in the provided text?"
            answers, mode = values, "fraction"
        elif kind == "vt":
            names = list(dict.fromkeys("".join(rng.choice("ABCDEFGHIJKLMNOPQRSTUVWXYZ") for _ in range(5))
                                       for _ in range(4 * num_hops)))[: num_hops + 1]
            needles = [f"VAR {names[0]} = {values[0]}."] + [
                f"VAR {names[i + 1]} = VAR {names[i]}." for i in range(num_hops)]
            question = f"Find all variables that are assigned the value {values[0]} in the text above."
            answers, mode = names, "fraction"
            instruction = "Memorize and track the chain(s) of variable assignment hidden in the following text."
        else:
            raise ValueError(f"unknown needle task {kind!r}")
        budget = context_tokens - sum(count(s + " ") for s in needles)
        if budget <= 0:
            raise ValueError(f"context_tokens={context_tokens} is too small for the {kind} needles")
        if kind == "vt":  # a variable must be assigned before it is copied: keep the chain's order
            text, spans = _assemble_in_order(rng, count, sentences, budget, needles)
        else:
            text, spans = _assemble(_haystack(rng, count, sentences, budget), needles, rng)
        asked = [(question, answers)]
        if kind == "niah_multikey":  # every key is a question on the same haystack
            asked += [(needle_question(k), [v]) for k, v in zip(keys[1:], values[1:])]
        for question, answers in asked[:min(questions_per_context, num_examples - len(out))]:
            out.append(Example(
                id=f"{kind}-{seed}-{len(out)}", question=question, answers=answers, context=text, gold_spans=spans,
                task=kind, metric=metric, substring_mode=mode, instruction=instruction,
                meta={"context_id": f"{kind}-{seed}-c{n}"},
            ))
        n += 1
    return out


def _assemble_in_order(rng: random.Random, count: TokenCounter, sentences: list[str], budget: int,
                       needles: list[str]) -> tuple[str, list[list[int]]]:
    """Like ``_assemble`` but the needles keep their order (a variable is assigned before it is used)."""
    filler = _haystack(rng, count, sentences, budget)
    slots = sorted(rng.randint(0, len(filler)) for _ in needles)
    pieces: list[tuple[str, bool]] = []
    j = 0
    for i in range(len(filler) + 1):
        while j < len(needles) and slots[j] == i:
            pieces.append((needles[j], True))
            j += 1
        if i < len(filler):
            pieces.append((filler[i], False))
    return _join_pieces(pieces)


NEEDLE_TASKS = ("niah_single", "niah_multikey", "niah_multivalue", "vt")
LONG_TASK_NAMES = ("long_needles", "long_chain", "long_qa")  # eval/long_tasks.py: unseen text, dev/test split
TASK_NAMES = ("squad", *NEEDLE_TASKS, "ruler", *LONG_TASK_NAMES)


def build_task(name: str, tokenizer, context_tokens: int, num_examples: int, seed: int = 0, *,
               squad_path: str | Path | None = None, questions_per_context: int = 1, split: str | None = None,
               haystack: str | None = None) -> list[Example]:
    """A built-in task by name: ``squad``, one of ``NEEDLE_TASKS``, ``ruler`` (all four needle tasks), or
    one of the long suite's ``LONG_TASK_NAMES`` (``eval/long_tasks.py``).

    ``num_examples`` counts questions; with ``questions_per_context`` > 1, ``squad`` asks several
    questions of the gold paragraph and ``niah_multikey`` asks for several of its keys on one context.
    The long tasks ask eight questions of every context (``num_examples`` rounds up to whole contexts)
    and take their seeds from ``split`` (``dev`` or ``test``), not from ``seed``.
    """
    if context_tokens <= 0 or num_examples <= 0 or questions_per_context <= 0:
        raise ValueError("context_tokens, num_examples and questions_per_context must be positive")
    if name in LONG_TASK_NAMES:
        from .long_tasks import QUESTIONS_PER_CONTEXT, build_long_task

        contexts = -(-num_examples // QUESTIONS_PER_CONTEXT)
        return build_long_task(name, tokenizer, context_tokens, contexts, split or "dev", squad_path=squad_path,
                               haystack=haystack)
    if split is not None:
        raise ValueError(f"--split applies to the long suite ({', '.join(LONG_TASK_NAMES)}); {name} is seeded by --seed")
    if name == "squad":
        return squad_qa(tokenizer, context_tokens, num_examples, seed, squad_path, questions_per_context)
    if name in NEEDLE_TASKS:
        return _needle_examples(name, tokenizer, context_tokens, num_examples, seed,
                                questions_per_context=questions_per_context)
    if name == "ruler":
        return [e for k in NEEDLE_TASKS for e in _needle_examples(k, tokenizer, context_tokens, num_examples, seed,
                                                                  questions_per_context=questions_per_context)]
    raise ValueError(f"unknown task {name!r}; built-in tasks: {', '.join(TASK_NAMES)} (or give a .jsonl file)")


def resolve_tasks(spec: str, tokenizer, context_tokens: int, num_examples: int, seed: int = 0, *,
                  squad_path: str | Path | None = None, questions_per_context: int = 1, split: str | None = None,
                  haystack: str | None = None) -> list[Example]:
    """``spec``: a JSONL path, or comma-separated built-in task names."""
    if Path(spec).is_file():
        return load_jsonl(spec)
    if spec.endswith(".jsonl"):
        raise FileNotFoundError(f"task file not found: {spec}")
    return [e for name in spec.split(",") if name.strip()
            for e in build_task(name.strip(), tokenizer, context_tokens, num_examples, seed,
                                squad_path=squad_path, questions_per_context=questions_per_context, split=split,
                                haystack=haystack)]
