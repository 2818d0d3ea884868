"""Training inputs of the real-base study, split from the evaluation by SQuAD article.

SQuAD articles with an even index train (stage-1 text, stage-2 QA); odd ones are held out for
evaluation. The split is written into every file's manifest so a report can say which was which.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

TRAIN_PARITY = 0  # article index % 2 == TRAIN_PARITY -> training; the rest -> evaluation


def squad_articles(path: str | Path) -> list[dict[str, Any]]:
    return json.loads(Path(path).read_text(encoding="utf-8"))["data"]


def split_articles(path: str | Path) -> tuple[list[int], list[int]]:
    """(training article indices, held-out article indices) of a SQuAD file."""
    n = len(squad_articles(path))
    train = [i for i in range(n) if i % 2 == TRAIN_PARITY]
    return train, [i for i in range(n) if i % 2 != TRAIN_PARITY]


def subset_squad(path: str | Path, indices: list[int], out: str | Path) -> Path:
    """A SQuAD JSON holding only the given articles (same layout)."""
    data = squad_articles(path)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    body = {"version": "subset", "source": str(path), "articles": indices, "data": [data[i] for i in indices]}
    tmp = out.with_suffix(".tmp")
    tmp.write_text(json.dumps(body), encoding="utf-8")
    tmp.replace(out)
    return out


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
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
    tmp.replace(out)
    return out
