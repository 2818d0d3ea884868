"""Built-in sample data, so the quickstart and the tests need no download.

* Text: the Python Language Reference topics shipped with every CPython (``pydoc_data.topics``,
  79 documents, ~465K characters).
* QA: 48 SQuAD v2.0 dev paragraphs with 143 answerable questions (CC BY-SA 4.0, Rajpurkar, Jia and
  Liang, ACL 2018; see ``acre_train/resources/README.md``).
"""

from __future__ import annotations

import json
from functools import lru_cache
from importlib import resources
from typing import Any

BUILTIN_TEXT_SOURCE = "builtin:pydoc_data.topics"
BUILTIN_QA_SOURCE = "builtin:squad_v2_sample.json"


def builtin_text() -> list[dict[str, Any]]:
    """The built-in text corpus as RedPajama-style records ``{"text", "meta"}``, in a fixed order."""
    from pydoc_data.topics import topics

    return [
        {"text": text, "meta": {"source": "pydoc_data.topics", "topic": name}}
        for name, text in sorted(topics.items())
    ]


@lru_cache(maxsize=1)
def _qa_json() -> str:
    return resources.files("acre_train.resources").joinpath("squad_v2_sample.json").read_text("utf-8")


def builtin_qa() -> dict[str, Any]:
    """The built-in SQuAD v2 subset, in SQuAD's own JSON layout (a fresh copy on every call)."""
    return json.loads(_qa_json())
