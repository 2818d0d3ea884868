"""Diagnostics that explain a score of zero: how much the model knows about the gold answer.

``answer_nll``: mean negative log-likelihood (nats per token) of the gold answer's tokens after the
harness prompt, full attention. A model that cannot retrieve the needle's value can still learn the
answer's *format* (7 digits): chance for a uniformly random digit is ln 10 = 2.303 nats.
"""

from __future__ import annotations

import math
from typing import Any

import torch


@torch.no_grad()
def answer_nll(model, tokenizer, examples) -> dict[str, Any]:
    from ..eval.prompt import prepare_example
    from .data import answer_text

    total, count = 0.0, 0
    for ex in examples:
        prompt = prepare_example(tokenizer, ex).prompt_ids()
        answer = tokenizer(" " + answer_text(ex), add_special_tokens=False)["input_ids"]
        ids = torch.tensor([prompt + answer])
        logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1].float()
        nll = torch.nn.functional.cross_entropy(logits, torch.tensor(answer), reduction="none")
        # Score the answer's content tokens only (the leading-space token is format, not knowledge).
        keep = [i for i, t in enumerate(answer) if tokenizer.decode([t]).strip()]
        total += float(nll[keep].sum())
        count += len(keep)
    return {"nll_per_token": total / count, "examples": len(examples), "digit_chance": math.log(10)}
