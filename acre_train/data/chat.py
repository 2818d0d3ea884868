"""Chat-template rendering with an assistant-only label mask, and middle truncation of the context.

The text is rendered once with the tokenizer's own chat template and tokenized in pieces cut where
inference cuts it (the end of the context, the start of every answer: ``acre_train.data.prompt``),
so token boundaries are exactly what the model will see at inference; prefix renderings only locate
the assistant answers and the context in that text. Tokenizing the rendered text uses
``add_special_tokens=False``: templates already write BOS where the model wants it (adding it again
is the classic double-BOS bug).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from ..modeling.interleave import IGNORE_INDEX
from .errors import DataError
from .prompt import context_end

Message = dict[str, str]


@dataclass
class Rendered:
    """A rendered conversation: raw ids, unshifted labels (token id on answer tokens, else -100)."""

    input_ids: np.ndarray
    labels: np.ndarray
    context_tokens: tuple[int, int]  # [start, end) token range that middle truncation may cut
    text: str
    evidence_tokens: tuple[tuple[int, int], ...] = ()  # [start, end) token ranges holding the evidence
    question_tokens: tuple[int, int] = (0, 0)  # after the context, before the first answer (what refill scores)

    @property
    def num_answer_tokens(self) -> int:
        return int((self.labels != IGNORE_INDEX).sum())


def _render(tokenizer: Any, messages: Sequence[Message], generation_prompt: bool = False) -> str:
    return tokenizer.apply_chat_template(
        list(messages), tokenize=False, add_generation_prompt=generation_prompt
    )


def answer_char_ranges(tokenizer: Any, messages: Sequence[Message], full: str) -> list[tuple[int, int]]:
    """Character ranges of every assistant answer in ``full``, end-of-turn token included.

    An answer starts where the generation prompt for its turn ends and stops where the rendering
    up to that turn ends, minus trailing whitespace (the newline after ``<|im_end|>`` is template
    glue, not something the model must generate).
    """
    ranges = []
    for k, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        before = _render(tokenizer, messages[:k], generation_prompt=True)
        through = _render(tokenizer, messages[: k + 1])
        if not (through.startswith(before) and full.startswith(through)):
            raise DataError(
                "the chat template does not render conversations prefix-consistently "
                f"(turn {k}); cannot locate the assistant answer to label it"
            )
        end = len(through.rstrip())
        if end <= len(before):
            raise DataError(f"assistant turn {k} renders empty")
        ranges.append((len(before), end))
    return ranges


def content_char_start(tokenizer: Any, messages: Sequence[Message], index: int, full: str) -> int:
    """Where message ``index``'s content starts in ``full``."""
    prefix = _render(tokenizer, messages[:index]) if index else ""
    start = full.find(messages[index]["content"], len(prefix))
    if start < 0:
        raise DataError(f"message {index}'s content does not appear verbatim in the rendered chat")
    return start


def render_conversation(
    tokenizer: Any,
    messages: Sequence[Message],
    context: tuple[int, int, int] | None = None,
    evidence: Sequence[tuple[int, int, int]] = (),
) -> Rendered:
    """Render ``messages`` with the chat template; label exactly the assistant answers.

    ``context``: ``(message_index, char_start, char_end)`` inside that message's content, the part
    middle truncation may cut; default: the whole content of the longest user message.
    ``evidence``: ``(message_index, char_start, char_end)`` ranges located as token ranges (a token
    belongs to one when its characters overlap it).
    """
    if not any(m["role"] == "assistant" for m in messages):
        raise DataError("conversation has no assistant turn (nothing to train on)")
    full = _render(tokenizer, messages)
    answers = answer_char_ranges(tokenizer, messages, full)
    if context is None:
        users = [i for i, m in enumerate(messages) if m["role"] == "user"]
        index = max(users, key=lambda i: len(messages[i]["content"])) if users else 0
        content = messages[index]["content"]
        # A QA turn in the project's prompt: the context ends where the question template starts
        # (inference cuts the tokens there), else the whole turn counts as context.
        end = context_end(content)
        context = (index, 0, len(content) if end is None else end)
    base = content_char_start(tokenizer, messages, context[0], full)
    ctx_chars = (base + context[1], base + context[2])

    ids, starts, ends = tokenize_at(tokenizer, full, [ctx_chars[1], *(a for a, _ in answers)])
    labels = np.full_like(ids, IGNORE_INDEX)
    for a, b in answers:
        # A token belongs to the answer when it starts inside it.
        inside = (starts >= a) & (starts < b)
        labels[inside] = ids[inside]
    in_ctx = np.flatnonzero((starts >= ctx_chars[0]) & (ends <= ctx_chars[1]) & (ends > starts))
    ctx_tokens = (int(in_ctx[0]), int(in_ctx[-1]) + 1) if in_ctx.size else (0, 0)
    spans = []
    for index, a, b in evidence:
        at = content_char_start(tokenizer, messages, index, full)
        hit = np.flatnonzero((starts < at + b) & (ends > at + a))
        if hit.size:
            spans.append((int(hit[0]), int(hit[-1]) + 1))
    answers_after = np.flatnonzero((labels != IGNORE_INDEX) & (np.arange(len(ids)) >= ctx_tokens[1]))
    question = (ctx_tokens[1], int(answers_after[0]) if answers_after.size else ctx_tokens[1])
    return Rendered(ids, labels, ctx_tokens, full, tuple(spans), question)


def tokenize_at(tokenizer: Any, text: str, cuts: Sequence[int]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Token ids and character (start, end) offsets of ``text`` tokenized piece by piece between ``cuts``.

    No token spans a cut: inference tokenizes the cached context and the question separately, so
    training must not merge characters across that boundary either.
    """
    bounds = sorted({0, len(text), *(c for c in cuts if 0 < c < len(text))})
    ids: list[int] = []
    starts: list[int] = []
    ends: list[int] = []
    for a, b in zip(bounds, bounds[1:]):
        enc = tokenizer(text[a:b], add_special_tokens=False, return_offsets_mapping=True)
        ids.extend(enc["input_ids"])
        starts.extend(a + s for s, _ in enc["offset_mapping"])
        ends.extend(a + e for _, e in enc["offset_mapping"])
    as_array = lambda v: np.asarray(v, dtype=np.int64)  # noqa: E731
    return as_array(ids), as_array(starts), as_array(ends)


def truncate_middle(rendered: Rendered, max_length: int) -> Rendered | None:
    """Cut ``len - max_length`` tokens from the middle of the context; None if that cannot fit.

    Head and tail of the context survive (instructions usually lead, the question usually trails);
    everything outside the context (question, answer, template tokens) is kept whole.
    """
    excess = len(rendered.input_ids) - max_length
    if excess <= 0:
        return rendered
    start, end = rendered.context_tokens
    if end - start < excess:
        return None
    keep_head = (end - start - excess) // 2
    cut = slice(start + keep_head, start + keep_head + excess)
    keep = np.ones(len(rendered.input_ids), dtype=bool)
    keep[cut] = False
    before = np.concatenate([[0], np.cumsum(keep)])  # kept tokens before each old index
    moved = lambda a, b: (int(before[a]), int(before[b]))  # noqa: E731
    evidence = tuple(moved(a, b) for a, b in rendered.evidence_tokens if before[b] > before[a])
    return Rendered(rendered.input_ids[keep], rendered.labels[keep], (start, end - excess), rendered.text,
                    evidence, moved(*rendered.question_tokens))
