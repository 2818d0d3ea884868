"""The long-context suite: tasks at 4K-128K tokens on text no training stream has seen, split dev/test.

Three families, each marking its evidence, each asking many questions of one context (the cache is
built once per context):

* ``long_needles``: eight keys per context, each a sentence of its own template and value format
  ("The access code of the Plum Quartz archive is KX-4821-QM.") between the entries of the haystack;
  every key is asked. Neither the template nor the key words nor the value format is used by any
  training set (the built-in needles' "special magic numbers" are).
* ``long_chain``: two pieces of evidence per answer, apart in the context ("The Plum Quartz archive is
  kept in the Cobalt room." ... "The door code of the Cobalt room is 4821."): the question names the
  archive, the answer is the room's code. Eight chains per context, all asked.
* ``long_qa``: questions written by people (SQuAD v2, held-out articles only) over many documents:
  four gold paragraphs with two questions each, among paragraphs of other held-out articles that
  contain none of the answers, then entries of the haystack text where those run out (64K and more).

Haystack: the Jargon File 4.4.7 (public domain), which the Debian/Ubuntu package ``jargon-text``
installs (:data:`JARGON`); no training stream uses it. Its entries are split between dev and test by
a hash of their headword, SQuAD's held-out articles by index (``index % 4``: 1 dev, 3 test), and the
seeds differ, so no dev context shares text or keys with a test context.

>>> [k for k in SPLITS]
['dev', 'test']
"""

from __future__ import annotations

import functools
import gzip
import hashlib
import os
import random
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from .examples import Example, TokenCounter

LONG_TASKS = ("long_needles", "long_chain", "long_qa")
LENGTHS = (4096, 16384, 32768, 65536, 131072)
SPLITS = {"dev": 1, "test": 3}  # held-out SQuAD article index % 4; the seed base of the split
QUESTIONS_PER_CONTEXT = 8


@dataclass(frozen=True)
class TextSource:
    """A haystack text a registry package installs, with what a report must say about it."""

    name: str
    package: str
    version: str
    licence: str
    install: str
    paths: tuple[str, ...]
    env: str = "ACRE_TRAIN_HAYSTACK"

    def locate(self, path: str | Path | None = None) -> Path:
        """The file: ``path``, else ``$ACRE_TRAIN_HAYSTACK``, else where the package installs it."""
        for candidate in (path, os.environ.get(self.env), *self.paths):
            if candidate and Path(candidate).is_file():
                return Path(candidate)
        raise FileNotFoundError(f"the {self.name} haystack is not installed: {self.install} (package {self.package} "
                                f"{self.version}), or point {self.env} at a copy of the file")

    def manifest(self) -> dict[str, str]:
        return {"name": self.name, "package": self.package, "version": self.version, "licence": self.licence}


JARGON = TextSource(
    name="The Jargon File 4.4.7", package="jargon-text (Debian, Ubuntu)", version="4.4.7-4.1",
    licence="public domain (\"This document (the Jargon File) is in the public domain\")",
    install="apt-get install jargon-text", paths=("/usr/share/doc/jargon-text/jargon.txt.gz",),
)


def _read(path: Path) -> str:
    raw = path.read_bytes()
    return (gzip.decompress(raw) if raw[:2] == b"\x1f\x8b" else raw).decode("utf-8")


@functools.lru_cache(maxsize=2)
def jargon_entries(path: str | None = None) -> tuple[tuple[str, str], ...]:
    """``(headword, text)`` of every lexicon entry of the Jargon File (whitespace and ``{cross-ref}``
    braces normalised), entries under 200 characters left out."""
    text = _read(JARGON.locate(path))
    body = text[text.find("\n   :"):]
    out = []
    for block in re.split(r"\n(?=   :[^\n]+?:)", body):
        m = re.match(r"\s*:(.+?):(.*)", block, flags=re.S)
        if not m:
            continue
        head = m.group(1).strip()
        words = re.sub(r"\s+", " ", re.sub(r"[{}]", "", m.group(2))).strip()
        if len(words) >= 200 and "Appendix" not in words[:40]:
            out.append((head, f"{head}: {words}"))
    return tuple(out)


def split_of_headword(head: str) -> str:
    """``dev`` or ``test``: where a haystack entry may appear (a stable hash of its headword)."""
    return "dev" if hashlib.sha256(head.encode("utf-8")).digest()[0] % 2 == 0 else "test"


def haystack_documents(split: str, path: str | None = None) -> list[str]:
    return [text for head, text in jargon_entries(path) if split_of_headword(head) == split]


# --------------------------------------------------------------------------------------- needles

_NAMES = ("Plum Saffron Juniper Walnut Quince Fennel Mulberry Hazel Clove Sorrel Tamarind Persimmon Nutmeg "
          "Rhubarb Damson Lychee Medlar Loquat Bramble Chervil").split()
_STONES = ("Quartz Basalt Garnet Obsidian Jasper Onyx Agate Beryl Gneiss Flint Marble Shale Topaz Slate Cinnabar "
           "Pumice Feldspar Zircon Galena Mica").split()
_ROOMS = ("Cobalt Vermilion Ochre Indigo Crimson Teal Magenta Saffron-Yellow Cerulean Umber-Brown Scarlet Olive "
          "Maroon Turquoise Charcoal Lavender").split()
_LETTERS = "ABCDEFGHJKLMNPQRSTUVWXYZ"


def _archive(rng: random.Random, split: str) -> str:
    """An archive's name; dev and test draw the first word from halves of the list (no key in both)."""
    names = _NAMES[::2] if split == "dev" else _NAMES[1::2]
    return f"{rng.choice(names)} {rng.choice(_STONES)}"


def _code(rng: random.Random) -> str:
    """``KX-4821-QM``: a value format no training set uses (the built-in needles' are 7-digit numbers)."""
    return (f"{rng.choice(_LETTERS)}{rng.choice(_LETTERS)}-{rng.randint(1000, 9999)}-"
            f"{rng.choice(_LETTERS)}{rng.choice(_LETTERS)}")


def _fill(rng: random.Random, count: TokenCounter, docs: Sequence[str], budget: int) -> list[str]:
    """Consecutive haystack documents from a seeded start, up to ``budget`` tokens (wrapping around)."""
    start, out, total = rng.randrange(len(docs)), [], 0
    for k in range(len(docs)):
        d = docs[(start + k) % len(docs)]
        t = count(d + "\n\n")
        if total + t > budget:  # a long entry passes; a shorter one further on may still fit
            if total >= budget * 0.98:
                break
            continue
        out.append(d)
        total += t
    if total < budget * 0.9:
        raise ValueError(f"the haystack's split holds {total:,} tokens; {budget:,} were asked for")
    return out


def _place(rng: random.Random, filler: list[str], facts: list[list[str]]) -> tuple[str, list[list[list[int]]]]:
    """Insert each group's facts between haystack documents (a group's facts in its order, at seeded depths
    apart); return the text (documents joined by blank lines) and each group's character spans."""
    slots: list[tuple[int, int, int, str]] = []  # (slot, group, order, fact)
    for g, group in enumerate(facts):
        depths = sorted(rng.sample(range(len(filler) + 1), len(group)))
        slots += [(d, g, i, fact) for i, (d, fact) in enumerate(zip(depths, group))]
    slots.sort()
    pieces: list[tuple[str, Any]] = []
    j = 0
    for i in range(len(filler) + 1):
        while j < len(slots) and slots[j][0] == i:
            pieces.append((slots[j][3], (slots[j][1], slots[j][2])))
            j += 1
        if i < len(filler):
            pieces.append((filler[i], None))
    text, spans, pos = [], [[None] * len(g) for g in facts], 0
    for s, tag in pieces:
        if tag is not None:
            spans[tag[0]][tag[1]] = [pos, pos + len(s)]
        text.append(s)
        pos += len(s) + 2
    return "\n\n".join(text), spans


NEEDLE_INSTRUCTION = ("The text below is a long reference document. Somewhere in it are notes about archives; "
                      "read carefully, a question about them follows.")


def _needle_contexts(kind: str, tokenizer, context_tokens: int, num_contexts: int, split: str,
                     path: str | None = None) -> list[Example]:
    rng = random.Random(f"{kind}-{split}-{SPLITS[split]}-{context_tokens}")
    count = TokenCounter(tokenizer)
    docs = haystack_documents(split, path)
    out: list[Example] = []
    for c in range(num_contexts):
        archives = list(dict.fromkeys(_archive(rng, split) for _ in range(64)))[:QUESTIONS_PER_CONTEXT]
        codes = [_code(rng) for _ in archives]
        if kind == "long_needles":
            facts = [[f"The access code of the {a} archive is {v}."] for a, v in zip(archives, codes)]
            asked = [(f"What is the access code of the {a} archive?", [v]) for a, v in zip(archives, codes)]
        else:
            rooms = rng.sample(_ROOMS, len(archives))
            doors = [str(rng.randint(1000, 9999)) for _ in archives]
            facts = [[f"The {a} archive is kept in the {r} room.", f"The door code of the {r} room is {d}."]
                     for a, r, d in zip(archives, rooms, doors)]
            asked = [(f"What is the door code of the room where the {a} archive is kept?", [d])
                     for a, d in zip(archives, doors)]
        budget = context_tokens - sum(count(f + "\n\n") for g in facts for f in g)
        filler, state = _fill(rng, count, docs, budget), rng.getstate()
        while True:  # pieces counted apart can merge a few tokens differently once joined: trim to the size
            rng.setstate(state)
            text, spans = _place(rng, filler, facts)
            over = len(tokenizer(text, add_special_tokens=False)["input_ids"]) - context_tokens
            if over <= 0 or len(filler) < 2:
                break
            sizes = [count(d + "\n\n") for d in filler]  # drop the smallest entry that makes up the excess
            fits = [i for i, t in enumerate(sizes) if t >= over]
            drop = min(fits, key=lambda i: sizes[i]) if fits else len(filler) - 1
            filler = filler[:drop] + filler[drop + 1:]
        order = list(range(len(asked)))
        rng.shuffle(order)
        cid = f"{kind}-{split}-{context_tokens}-c{c}"
        for i in order:
            question, answers = asked[i]
            out.append(Example(id=f"{cid}-q{i}", question=question, answers=answers, context=text,
                               gold_spans=spans[i], task=kind, metric="substring", instruction=NEEDLE_INSTRUCTION,
                               meta={"context_id": cid, "split": split, "context_tokens": context_tokens,
                                     "evidence_pieces": len(spans[i]), "haystack": JARGON.name}))
    return out


# -------------------------------------------------------------------------------------------- QA

def heldout_articles(data: list[dict[str, Any]], split: str) -> list[int]:
    """SQuAD article indices of a split: odd indices are held out from training (``data.squad``), and of
    those ``index % 4 == 1`` is dev, ``3`` test."""
    from ..data.squad import TRAIN_PARITY

    return [i for i in range(len(data)) if i % 2 != TRAIN_PARITY and i % 4 == SPLITS[split]]


def _long_qa(tokenizer, context_tokens: int, num_contexts: int, split: str, squad_path: str | Path,
             path: str | None = None, golds_per_context: int = 4, questions_per_gold: int = 2) -> list[Example]:
    from ..data.squad import TRAIN_PARITY, squad_articles

    data = squad_articles(squad_path)
    rng = random.Random(f"long_qa-{split}-{SPLITS[split]}-{context_tokens}")
    count = TokenCounter(tokenizer)
    mine = heldout_articles(data, split)
    every_heldout = [i for i in range(len(data)) if i % 2 != TRAIN_PARITY]
    golds = [(ai, p["context"], [qa for qa in p["qas"] if not qa.get("is_impossible") and qa.get("answers")])
             for ai in mine for p in data[ai]["paragraphs"]]
    golds = [g for g in golds if len(g[2]) >= questions_per_gold]
    distractors = [(ai, p["context"]) for ai in every_heldout for p in data[ai]["paragraphs"]]
    haystack = haystack_documents(split, path)
    out: list[Example] = []
    for c in range(num_contexts):
        chosen = []
        for g in rng.sample(golds, len(golds)):  # gold paragraphs from different articles
            if all(g[0] != x[0] for x in chosen):
                chosen.append(g)
            if len(chosen) == golds_per_context:
                break
        asked = [(gold, qa) for _, gold, qas in chosen for qa in rng.sample(qas, questions_per_gold)]
        answers_of = [list(dict.fromkeys(a["text"] for a in qa["answers"])) for _, qa in asked]
        lowered = [a.lower() for answers in answers_of for a in answers]
        docs = [g[1] for g in chosen]
        total = sum(count(d) for d in docs)
        sources = {"squad": 0, "haystack": 0}
        golden = {x[0] for x in chosen}
        pool = [(d, "squad") for ai, d in rng.sample(distractors, len(distractors)) if ai not in golden]
        start = rng.randrange(len(haystack))
        pool += [(haystack[(start + k) % len(haystack)], "haystack") for k in range(len(haystack))]
        for text, where in pool:
            if any(a in text.lower() for a in lowered):
                continue
            t = count(text)
            if total + t > context_tokens:
                if total >= context_tokens * 0.97:
                    break
                continue
            docs.append(text)
            sources[where] += 1
            total += t
        gold_texts = [g[1] for g in chosen]
        rng.shuffle(docs)
        cid = f"long_qa-{split}-{context_tokens}-c{c}"
        for i, ((gold, qa), answers) in enumerate(zip(asked, answers_of)):
            out.append(Example(
                id=f"{cid}-q{i}", question=qa["question"], answers=answers, documents=docs,
                gold_docs=[docs.index(gold)], task="long_qa", metric="qa_f1",
                meta={"context_id": cid, "split": split, "context_tokens": total, "gold_docs_in_context":
                      sorted(docs.index(g) for g in gold_texts), "distractors": sources,
                      "source": "SQuAD v2.0 dev, held-out articles (CC BY-SA 4.0)"}))
    return out


def build_long_task(name: str, tokenizer, context_tokens: int, num_contexts: int, split: str = "dev", *,
                    squad_path: str | Path | None = None, haystack: str | None = None) -> list[Example]:
    """``num_contexts`` contexts of ``context_tokens`` tokens, eight questions each, of one split."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {', '.join(SPLITS)}, got {split!r}")
    if name in ("long_needles", "long_chain"):
        return _needle_contexts(name, tokenizer, context_tokens, num_contexts, split, haystack)
    if name == "long_qa":
        if squad_path is None:
            raise ValueError("long_qa needs the SQuAD v2.0 dev JSON (--squad): its held-out articles are the questions")
        return _long_qa(tokenizer, context_tokens, num_contexts, split, squad_path, haystack)
    raise ValueError(f"unknown long task {name!r}; choose from {', '.join(LONG_TASKS)}")


def manifest(split: str) -> dict[str, Any]:
    """What a long-suite run records about its texts."""
    return {"split": split, "haystack": JARGON.manifest(),
            "qa": {"name": "SQuAD v2.0 dev, held-out articles", "licence": "CC BY-SA 4.0",
                   "articles": f"index % 4 == {SPLITS[split]}"},
            "questions_per_context": QUESTIONS_PER_CONTEXT}
