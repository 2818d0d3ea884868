"""Checks on the real pretrained base; they run only where it is fetched (never downloaded here).

    acre-train base fetch qwen2.5-coder-0.5b-instruct
"""

from __future__ import annotations

import json

import pytest

from acre_train.base.fetch import base_dir
from acre_train.cli import main as cli_main

BASE = "qwen2.5-coder-0.5b-instruct"
pytestmark = [pytest.mark.slow, pytest.mark.skipif(not (base_dir(BASE) / "acre_base.json").is_file(),
                                                   reason=f"the real base is not fetched (acre-train base fetch {BASE})")]


def test_the_converted_base_answers_a_squad_question_through_generate(tmp_path):
    from acre_train.data.builtin import builtin_qa

    paragraph = builtin_qa()["data"][0]["paragraphs"][0]  # SQuAD v2 dev, "Normans", first paragraph
    (tmp_path / "in.jsonl").write_text(json.dumps({"context": paragraph["context"],
                                                   "question": "In what country is Normandy located?"}) + "\n")
    out = tmp_path / "out.jsonl"
    assert cli_main(["generate", f"base:{BASE}", "--input", str(tmp_path / "in.jsonl"), "--output", str(out),
                     "--max-new-tokens", "12"]) == 0
    answer = json.loads(out.read_text())["answer"]
    assert "France" in answer, answer
