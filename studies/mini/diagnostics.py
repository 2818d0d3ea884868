"""Diagnostics that explain a score of zero: how much the model knows about the gold answer.

``answer_nll``: mean negative log-likelihood (nats per token) of the gold answer's tokens after the
harness prompt, full attention. A model that cannot retrieve the needle's value can still learn the
answer's *format* (7 digits): chance for a uniformly random digit is ln 10 = 2.303 nats.

``drill_accuracy`` / ``needle_accuracy``: teacher-forced answers on the pretraining drills and on the
harness's needle tasks, split into *whole answer* and *first digit*: the first digit needs the lookup
(which needle), the other six the copy's continuation, and a base can have one without the other.
"""

from __future__ import annotations

import math
from typing import Any

import torch


def _answer_logits(model, tokenizer, ex) -> tuple[torch.Tensor, torch.Tensor]:
    """Teacher-forced logits predicting each token of ``" " + answer`` after the harness prompt, and
    those answer token ids."""
    from acre_train.eval.prompt import prepare_example
    from .data import answer_text

    prompt = prepare_example(tokenizer, ex).prompt_ids()
    answer = tokenizer(" " + answer_text(ex), add_special_tokens=False)["input_ids"]
    logits = model(input_ids=torch.tensor([prompt + answer])).logits[0, len(prompt) - 1 : -1].float()
    return logits, torch.tensor(answer)


@torch.no_grad()
def answer_nll(model, tokenizer, examples) -> dict[str, Any]:
    total, count = 0.0, 0
    for ex in examples:
        logits, answer = _answer_logits(model, tokenizer, ex)
        nll = torch.nn.functional.cross_entropy(logits, answer, reduction="none")
        # Score the answer's content tokens only (the leading-space token is format, not knowledge).
        keep = [i for i, t in enumerate(answer.tolist()) if tokenizer.decode([t]).strip()]
        total += float(nll[keep].sum())
        count += len(keep)
    return {"nll_per_token": total / count, "examples": len(examples), "digit_chance": math.log(10)}


def _first_and_exact(hit: torch.Tensor) -> tuple[bool, bool]:
    """``hit``: per-token argmax hits of one answer (leading space first); (first digit, every token)."""
    return (bool(hit[1]) if len(hit) > 1 else False), bool(hit.all())


@torch.no_grad()
def needle_accuracy(model, tokenizer, task: str, context_tokens: int, examples: int = 20,
                    seed: int | None = None) -> dict[str, Any]:
    """Teacher-forced accuracy on a harness needle task (full attention, the harness's prompt): the
    share of answers whose every token is the argmax, of answers whose first digit is, and of answer
    tokens after the leading space that are (``digits``: if each digit is found with probability p,
    whole answers come out about p**7 of the time).

    >>> needle_accuracy(model, tokenizer, "niah_single", 256)  # doctest: +SKIP
    {'task': 'niah_single', 'context_tokens': 256, 'examples': 20, 'exact': 0.1, 'first_digit': 0.3, 'digits': 0.6}
    """
    from acre_train.eval.tasks import build_task
    from .data import EVAL_SEED

    exs = build_task(task, tokenizer, context_tokens, examples, EVAL_SEED + 1 if seed is None else seed)
    exact = first = 0
    digits: list[float] = []
    for ex in exs:
        logits, answer = _answer_logits(model, tokenizer, ex)
        hit = logits.argmax(-1) == answer
        f, e = _first_and_exact(hit)
        first, exact = first + f, exact + e
        digits.append(float(hit[1:].float().mean()))
    return {"task": task, "context_tokens": context_tokens, "examples": len(exs),
            "exact": round(exact / len(exs), 3), "first_digit": round(first / len(exs), 3),
            "digits": round(sum(digits) / len(digits), 3)}


@torch.no_grad()
def drill_accuracy(model, tokenizer, facts: int, drills: int = 12, seed: int = 12345) -> dict[str, Any]:
    """Teacher-forced accuracy on key-value drills with ``facts`` needles (``data.drill_conversation``):
    the share of answers whose every label token (space, 7 digits, end of turn) is the argmax, and of
    answers whose first digit is. Chance for a first digit is about 1/10; picking a random one of the
    drill's values gives 1/facts.

    >>> drill_accuracy(model, tokenizer, facts=2)  # doctest: +SKIP
    {'facts': 2, 'answers': 24, 'exact': 0.29, 'first_digit': 0.58}
    """
    import random

    from acre_train.data.chat import render_conversation
    from .data import drill_conversation

    rng = random.Random(seed)
    exact = first = answers = 0
    for _ in range(drills):
        r = render_conversation(tokenizer, drill_conversation(rng, facts))
        ids = torch.as_tensor(r.input_ids)[None]
        labels = torch.as_tensor(r.labels)
        pred = model(input_ids=ids).logits[0, :-1].argmax(-1)
        keep = labels[1:] != -100
        hit, starts = (pred[keep] == labels[1:][keep]), torch.nonzero(keep).flatten()
        # Label runs are answers: a new answer starts where the label positions jump.
        bounds = [0] + [i for i in range(1, len(starts)) if starts[i] != starts[i - 1] + 1] + [len(starts)]
        for a, b in zip(bounds, bounds[1:]):
            answers += 1
            f, e = _first_and_exact(hit[a:b])
            first, exact = first + f, exact + e
    return {"facts": facts, "answers": answers, "exact": round(exact / answers, 3), "first_digit": round(first / answers, 3)}
