"""Training data as long as the evaluation, installable offline (the training issue's item 4).

* **Stage 1**: >= 1M distinct tokens of long text the evaluation never reads, from what every Python
  installation carries, plus the SQuAD *training* articles:
  - the Python Language Reference topics (``pydoc_data.topics``, PSF-2.0), one document per topic;
  - the SQuAD v2 dev articles of the training split (even index; CC BY-SA 4.0), one per article;
  - the Python standard library's own modules (``sysconfig`` stdlib folder, ``*.py`` at its top
    level, PSF-2.0), one document per file, in name order until the token target is reached.
  Each document is cut into pieces of at most ``max_doc_tokens`` tokens (4K-8K spans, so that the 4K
  and 8K cells are within training lengths); exact duplicates are dropped.
* **Stage 2**: >= 1,000 question/answer conversations, half SQuAD (training articles, in the
  evaluation's prompt) and half synthetic retrieval (needles, multi-key, variable tracking) at
  training seeds, with contexts of 1K-8K tokens.

The manifest beside the files records every source with its licence, documents and tokens (counted
with the study's tokenizer), the Python version whose stdlib was read, and the distinct counts.
"""

from __future__ import annotations

import hashlib
import json
import platform
import sysconfig
from pathlib import Path
from typing import Any

from acre_train.files import write_text_atomic

from .streams import STAGE2_SEED, split_articles, squad_articles, stage2_conversations, write_jsonl

STAGE1_TOKENS = 1_000_000
STAGE2_CONVERSATIONS = 1200
STAGE2_LENGTHS = (1024, 2048, 4096, 8192)
STAGE2_LARGE_SEED = STAGE2_SEED + 10_000  # apart from the 96-conversation streams (1000+) and the dev split (1000)
LICENCES = {"pydoc_data.topics": "PSF-2.0", "squad-v2-dev": "CC-BY-SA-4.0", "python-stdlib": "PSF-2.0"}


def _documents(squad_path: str | Path) -> list[tuple[str, str, str]]:
    """``(source, name, text)`` of every candidate document, in a fixed order."""
    from pydoc_data.topics import topics

    docs = [("pydoc_data.topics", name, text) for name, text in sorted(topics.items())]
    train, _ = split_articles(squad_path)
    articles = squad_articles(squad_path)
    docs += [("squad-v2-dev", str(articles[i].get("title", i)), "\n\n".join(p["context"] for p in articles[i]["paragraphs"]))
             for i in train]
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    docs += [("python-stdlib", f.name, f.read_text(encoding="utf-8", errors="replace")) for f in sorted(stdlib.glob("*.py"))]
    return docs


def _pieces(ids: list[int], limit: int) -> list[tuple[int, int]]:
    return [(a, min(a + limit, len(ids))) for a in range(0, len(ids), limit)]


def stage1_corpus(tokenizer: Any, squad_path: str | Path, out: str | Path, *, min_tokens: int = STAGE1_TOKENS,
                  max_doc_tokens: int = 8192, min_doc_tokens: int = 256) -> dict[str, Any]:
    """Write the stage-1 corpus JSONL at ``out``; returns its manifest section (per-source counts)."""
    rows, seen, per_source, total = [], set(), {}, 0
    for source, name, text in _documents(squad_path):
        if total >= min_tokens and source == "python-stdlib":
            break  # the first two sources always go in whole; the stdlib tops the corpus up
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        for k, (a, b) in enumerate(_pieces(ids, max_doc_tokens)):
            if b - a < min_doc_tokens:
                continue
            piece = tokenizer.decode(ids[a:b])
            digest = hashlib.sha256(piece.encode()).hexdigest()
            if digest in seen:
                continue
            seen.add(digest)
            rows.append({"text": piece, "meta": {"source": source, "name": name, "piece": k, "licence": LICENCES[source]}})
            stats = per_source.setdefault(source, {"licence": LICENCES[source], "documents": 0, "tokens": 0})
            stats["documents"] += 1
            stats["tokens"] += b - a
            total += b - a
    if total < min_tokens:
        raise ValueError(f"the offline sources hold {total:,} tokens, fewer than the {min_tokens:,} asked for")
    write_jsonl(rows, out)
    return {"file": Path(out).name, "documents": len(rows), "tokens": total, "max_doc_tokens": max_doc_tokens,
            "sources": per_source, "python": platform.python_version(), "stdlib": sysconfig.get_paths()["stdlib"]}


def stage2_large(tokenizer: Any, squad_train: str | Path, out: str | Path, *, num: int = STAGE2_CONVERSATIONS,
                 lengths: tuple[int, ...] = STAGE2_LENGTHS, seed: int = STAGE2_LARGE_SEED) -> dict[str, Any]:
    """Write >= ``num`` stage-2 conversations at ``out``; returns their manifest section."""
    rows = stage2_conversations(tokenizer, squad_train, num, lengths, seed=seed)
    write_jsonl(rows, out)
    # A question is the end of the user turn (the context comes before it); with its answer, one pair.
    distinct = {(r["task"], r["messages"][-2]["content"][-300:], r["messages"][-1]["content"]) for r in rows}
    by_task: dict[str, int] = {}
    for r in rows:
        by_task[r["task"]] = by_task.get(r["task"], 0) + 1
    return {"file": Path(out).name, "conversations": len(rows), "distinct_question_answer": len(distinct),
            "with_evidence": sum(1 for r in rows if r["evidence"]), "by_task": by_task, "lengths": list(lengths),
            "seeds": [seed, seed + num - 1], "licences": {"squad": LICENCES["squad-v2-dev"], "synthetic": "generated"}}


def write_corpus(tokenizer: Any, squad_path: str | Path, squad_train: str | Path, folder: str | Path, *,
                 tokens: int = STAGE1_TOKENS, conversations: int = STAGE2_CONVERSATIONS,
                 lengths: tuple[int, ...] = STAGE2_LENGTHS) -> dict[str, Any]:
    """Both files and ``corpus-manifest.json`` (written last: the corpus is complete when it exists)."""
    folder = Path(folder)
    manifest = {"stage1": stage1_corpus(tokenizer, squad_path, folder / "stage1-corpus.jsonl", min_tokens=tokens),
                "stage2": stage2_large(tokenizer, squad_train, folder / "stage2-large.jsonl", num=conversations,
                                       lengths=lengths)}
    write_text_atomic(folder / "corpus-manifest.json", json.dumps(manifest, indent=2) + "\n")
    return manifest
