"""The shipped miniature base (acre_train/resources/mini_base, docs/miniature.md): it loads offline with
plain transformers and reproduces the retrieval accuracy its mini_eval.json states."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import acre_train

MINI_BASE = Path(acre_train.__file__).parent / "resources" / "mini_base"


def test_shipped_base_is_small_and_self_describing():
    size = sum(p.stat().st_size for p in MINI_BASE.iterdir())
    assert size <= 25 * 2**20, f"{size / 2**20:.1f} MiB"
    stated = json.loads((MINI_BASE / "mini_eval.json").read_text())
    assert {"task", "context_tokens", "examples", "seed", "score", "answer_nll_per_token"} <= set(stated)


@pytest.mark.slow
def test_shipped_base_loads_offline_and_reproduces_its_stated_accuracy(one_thread):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from acre_train.mini.study import self_check

    model = AutoModelForCausalLM.from_pretrained(str(MINI_BASE), local_files_only=True)
    tokenizer = AutoTokenizer.from_pretrained(str(MINI_BASE), local_files_only=True)
    assert model.config.model_type == "qwen2" and len(tokenizer) == model.config.vocab_size

    stated = json.loads((MINI_BASE / "mini_eval.json").read_text())
    got = self_check(MINI_BASE, task=stated["task"], context_tokens=stated["context_tokens"],
                     examples=stated["examples"])
    assert got["seed"] == stated["seed"]
    # Greedy decoding on CPU fp32: the same answers up to one flipped example; the likelihood within 1 %.
    assert abs(got["score"] - stated["score"]) <= 1 / stated["examples"] + 1e-9, (got, stated)
    assert got["answer_nll_per_token"] == pytest.approx(stated["answer_nll_per_token"], rel=0.01)
