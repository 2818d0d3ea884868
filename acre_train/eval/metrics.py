"""Answer-quality metrics, defined as the seed papers' benchmarks define them.

Per-example functions return a value in [0, 1]; ``aggregate`` reports means × 100.

* ``qa_f1``: LongBench's ``qa_f1_score``: lower-case, drop ASCII punctuation (``string.punctuation``),
  drop the articles a/an/the as whole words, collapse whitespace; F1 over the token multisets; max
  over gold answers. An empty prediction scores 0, and so does an empty prediction against an empty
  gold (LongBench behaviour; the SQuAD script would give 1 there).
* ``exact_match``: normalised strings equal, max over golds.
* ``substring_match``: normalised gold is a substring of the normalised prediction.
  ``mode="any"``: 1 if any gold appears; ``"all"``: 1 only if every gold appears;
  ``"fraction"``: share of golds that appear (RULER's ``string_match_all``).
* ``rouge_l``: the ``rouge-score`` package's ``rougeL`` F-measure (not ``rougeLsum``), no stemming,
  its default tokenizer (lower-case, non-alphanumerics dropped); max over golds. LongBench uses
  the ``rouge`` package instead: numbers differ slightly.
* ``recall_at_k``: share of gold evidence ids among the first ``k`` of a ranking;
  ``evidence_recall``: share of gold ids among a kept set.
"""

from __future__ import annotations

import random
import re
import string
from collections import Counter
from typing import Iterable, Sequence

_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCT = set(string.punctuation)


def normalize_answer(text: str) -> str:
    """LongBench/SQuAD normalisation: lower, strip punctuation, then articles, collapse spaces."""
    text = text.lower()
    text = "".join(ch for ch in text if ch not in _PUNCT)
    text = _ARTICLES.sub(" ", text)
    return " ".join(text.split())


def _golds(golds: Sequence[str] | str) -> list[str]:
    if isinstance(golds, str):
        golds = [golds]
    golds = list(golds)
    if not golds:
        raise ValueError("at least one gold answer is needed")
    return golds


def _f1(prediction: str, gold: str) -> float:
    pred_tokens = normalize_answer(prediction).split()
    gold_tokens = normalize_answer(gold).split()
    common = Counter(pred_tokens) & Counter(gold_tokens)
    same = sum(common.values())
    if same == 0:
        return 0.0
    precision = same / len(pred_tokens)
    recall = same / len(gold_tokens)
    return 2 * precision * recall / (precision + recall)


def qa_f1(prediction: str, golds: Sequence[str] | str) -> float:
    """LongBench QA F1 (token multiset), max over gold answers."""
    return max(_f1(prediction, g) for g in _golds(golds))


def exact_match(prediction: str, golds: Sequence[str] | str) -> float:
    """1.0 if the normalised prediction equals some normalised gold."""
    pred = normalize_answer(prediction)
    return float(any(pred == normalize_answer(g) for g in _golds(golds)))


def substring_match(prediction: str, golds: Sequence[str] | str, mode: str = "any") -> float:
    """Normalised gold(s) contained in the normalised prediction; see module docstring for modes.

    Golds that normalise to the empty string are rejected: they would match every prediction.
    """
    pred = normalize_answer(prediction)
    normed = [normalize_answer(g) for g in _golds(golds)]
    if any(not g for g in normed):
        raise ValueError(f"a gold answer normalises to the empty string: {list(golds)!r}")
    hits = [g in pred for g in normed]
    if mode == "any":
        return float(any(hits))
    if mode == "all":
        return float(all(hits))
    if mode == "fraction":
        return sum(hits) / len(hits)
    raise ValueError(f"substring mode must be 'any', 'all' or 'fraction', got {mode!r}")


_ROUGE = None


def rouge_l(prediction: str, golds: Sequence[str] | str) -> float:
    """rouge-score ``rougeL`` F-measure (no stemming), max over golds; 0 for an empty prediction."""
    global _ROUGE
    if _ROUGE is None:
        from ..errors import require

        rouge_scorer = require("rouge_score.rouge_scorer", "eval")

        _ROUGE = rouge_scorer.RougeScorer(["rougeL"], use_stemmer=False)
    return max(_ROUGE.score(g, prediction)["rougeL"].fmeasure for g in _golds(golds))


def recall_at_k(ranking: Sequence[int], gold: Iterable[int], k: int) -> float:
    """Share of gold ids among ``ranking[:k]``. Raises on an empty gold set (undefined)."""
    gold = set(gold)
    if not gold:
        raise ValueError("recall is undefined without gold evidence")
    if k < 0:
        raise ValueError(f"k must be >= 0, got {k}")
    return len(gold & set(ranking[:k])) / len(gold)


def evidence_recall(kept: Iterable[int], gold: Iterable[int]) -> float:
    """Share of gold ids in the set a method kept or refilled."""
    gold = set(gold)
    if not gold:
        raise ValueError("recall is undefined without gold evidence")
    return len(gold & set(kept)) / len(gold)


def score_answer(prediction: str, golds: Sequence[str], substring_mode: str = "any") -> dict[str, float | None]:
    """All answer metrics of one example, each in [0, 1].

    Golds that normalise to nothing (e.g. "The") are left out of substring matching (they would
    match anything); if no gold is left, ``substring`` is None (undefined, skipped by ``aggregate``).
    """
    usable = [g for g in _golds(golds) if normalize_answer(g)]
    return {
        "qa_f1": qa_f1(prediction, golds),
        "exact_match": exact_match(prediction, golds),
        "substring": substring_match(prediction, usable, substring_mode) if usable else None,
        "rouge_l": rouge_l(prediction, golds),
    }


def aggregate(rows: Sequence[dict[str, float | None]]) -> dict[str, float | None]:
    """Mean × 100 of every metric over rows, ignoring ``None`` (metric undefined for that row)."""
    keys = sorted({k for r in rows for k in r})
    out: dict[str, float | None] = {}
    for k in keys:
        vals = [r[k] for r in rows if r.get(k) is not None]
        out[k] = 100.0 * sum(vals) / len(vals) if vals else None
    return out


BOOTSTRAP = 2000


def bootstrap_ci(values: list[float], seed: int = 0, rounds: int = BOOTSTRAP) -> tuple[float, float, float]:
    """(mean, low, high): the mean and its 95 % percentile-bootstrap interval (resampling questions)."""
    if not values:
        return float("nan"), float("nan"), float("nan")
    rng = random.Random(seed)
    n = len(values)
    means = sorted(sum(rng.choice(values) for _ in range(n)) / n for _ in range(rounds))
    return sum(values) / n, means[int(0.025 * rounds)], means[int(0.975 * rounds) - 1]


def refill_split(rows: Sequence[dict]) -> dict[str, float | int | list[float] | None]:
    """Read a refilling row as recall × answered-when-found.

    Over the rows that carry ``refill_coverage`` (the evidence is known): ``score_when_refilled`` /
    ``score_when_missed`` (means × 100 of ``score`` where the whole evidence was, or was not, visible
    after refilling), each with its ``_n`` and a 95 % bootstrap interval (``_ci``); and the means × 100
    of overlap recall and token coverage.
    """
    known = [r for r in rows if r.get("refill_coverage") is not None]
    out: dict[str, float | int | list[float] | None] = {}
    for name, part in (("refilled", [r for r in known if r["refill_coverage"] >= 1.0]),
                       ("missed", [r for r in known if r["refill_coverage"] < 1.0])):
        values = [100.0 * r["score"] for r in part]
        mean, low, high = bootstrap_ci(values)
        out[f"score_when_{name}"] = mean if values else None
        out[f"score_when_{name}_n"] = len(values)
        out[f"score_when_{name}_ci"] = [low, high] if values else None
    out["refill_coverage"] = 100.0 * sum(r["refill_coverage"] for r in known) / len(known) if known else None
    out["refill_covered"] = 100.0 * sum(r["refill_coverage"] >= 1.0 for r in known) / len(known) if known else None
    return out
