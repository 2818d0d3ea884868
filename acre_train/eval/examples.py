"""The evaluation example and its JSONL file (what ``acre-train eval --tasks FILE`` reads and the
generators in ``eval/tasks.py`` and ``eval/long_tasks.py`` write).

Task file format (one JSON object per line; bring your own)::

    {"id": "q17",                       # unique string
     "question": "Who ...?",            # asked after the context
     "answers": ["Ann", "Ann Smith"],   # gold answers (at least one)
     "documents": ["...", "..."],       # EITHER a list of documents (retrieval-style QA)
     "context": "...",                  # OR one long text (split into chunks of --chunk-tokens)
     "gold_docs": [3],                  # optional: indices of gold documents (evidence recall)
     "gold_spans": [[1200, 1260]],      # optional, with "context": character spans of the evidence
     "task": "squad",                   # optional: a name to group results by
     "metric": "qa_f1",                 # optional primary metric: qa_f1 | exact_match | substring | rouge_l
     "substring_mode": "any",           # optional: any | all | fraction (how several golds count)
     "instruction": "..."}              # optional: replaces the default instruction line

"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Iterable

from ..files import atomic_path

_METRICS = {"qa_f1", "exact_match", "substring", "rouge_l"}
_MODES = {"any", "all", "fraction"}


@dataclass
class Example:
    """One evaluation example (see the module docstring for the JSONL fields)."""

    id: str
    question: str
    answers: list[str]
    context: str | None = None
    documents: list[str] | None = None
    gold_docs: list[int] | None = None
    gold_spans: list[list[int]] | None = None
    task: str = "custom"
    metric: str = "qa_f1"
    substring_mode: str = "any"
    instruction: str | None = None
    meta: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        where = f"example {self.id!r}"
        if not isinstance(self.question, str) or not self.question.strip():
            raise ValueError(f"{where}: 'question' must be a non-empty string")
        if not isinstance(self.answers, list) or not self.answers or not all(isinstance(a, str) for a in self.answers):
            raise ValueError(f"{where}: 'answers' must be a non-empty list of strings")
        if (self.context is None) == (self.documents is None):
            raise ValueError(f"{where}: give exactly one of 'context' (string) or 'documents' (list of strings)")
        if self.documents is not None and (not self.documents or not all(isinstance(d, str) for d in self.documents)):
            raise ValueError(f"{where}: 'documents' must be a non-empty list of strings")
        if self.gold_docs is not None:
            if self.documents is None:
                raise ValueError(f"{where}: 'gold_docs' needs 'documents' (use 'gold_spans' with 'context')")
            bad = [i for i in self.gold_docs if not 0 <= i < len(self.documents)]
            if bad:
                raise ValueError(f"{where}: gold_docs {bad} out of range for {len(self.documents)} documents")
        if self.gold_spans is not None:
            if self.context is None:
                raise ValueError(f"{where}: 'gold_spans' needs 'context'")
            for span in self.gold_spans:
                if len(span) != 2 or not 0 <= span[0] < span[1] <= len(self.context):
                    raise ValueError(f"{where}: bad gold span {span} for a context of {len(self.context)} chars")
        if self.metric not in _METRICS:
            raise ValueError(f"{where}: metric must be one of {sorted(_METRICS)}, got {self.metric!r}")
        if self.substring_mode not in _MODES:
            raise ValueError(f"{where}: substring_mode must be one of {sorted(_MODES)}, got {self.substring_mode!r}")

    @classmethod
    def from_dict(cls, d: dict[str, Any], where: str = "") -> "Example":
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"{where}unknown field(s) {unknown}; known fields: {sorted(known)}")
        missing = [k for k in ("id", "question", "answers") if k not in d]
        if missing:
            raise ValueError(f"{where}missing field(s) {missing}")
        return cls(**{**d, "id": str(d["id"])})

    def to_dict(self) -> dict[str, Any]:
        return {k: v for k, v in asdict(self).items() if v is not None and v != {}}


def load_jsonl(path: str | Path) -> list[Example]:
    """Read a task file; errors name the file and line."""
    from ..data.readers import read_jsonl_strict

    out = [Example.from_dict(r.data, where=f"{r.where}: ") for r in read_jsonl_strict(path)]
    if not out:
        raise ValueError(f"{path}: no examples")
    ids = [e.id for e in out]
    if len(set(ids)) != len(ids):
        raise ValueError(f"{path}: duplicate example ids")
    return out


def save_jsonl(examples: Iterable[Example], path: str | Path) -> None:
    """Write ``examples`` one per line; the file appears whole or not at all (an interrupted write leaves
    no half file under the final name)."""
    with atomic_path(path) as tmp, open(tmp, "w", encoding="utf-8") as f:
        for e in examples:
            f.write(json.dumps(e.to_dict(), ensure_ascii=False) + "\n")


class TokenCounter:
    """Counts tokens of strings with a tokenizer, memoised (generators count many paragraphs)."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.cache: dict[str, int] = {}

    def __call__(self, text: str) -> int:
        if text not in self.cache:
            self.cache[text] = len(self.tokenizer(text, add_special_tokens=False)["input_ids"])
        return self.cache[text]
