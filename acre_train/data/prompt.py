"""The one question prompt: stage-2 training, ``chat``/``generate`` and ``eval`` all render through it.

A question about a long context is one user turn -- an optional instruction, the context, then
``QUESTION_TEMPLATE`` -- rendered with the tokenizer's own chat template and followed by the
generation prompt (the assistant's answer is what stage 2 labels). The rendering is cut at the two
ends of the context: the part before it (template start + instruction) and the context itself are
cacheable, the part after it (question + end of turn + generation prompt) is per question. Pieces are
tokenized separately (``add_special_tokens=False``: the template writes any BOS itself), and stage-2
training tokenizes at the very same cuts, so a trained model sees at inference exactly the token ids
it was trained on (``tests/test_prompt.py`` checks this token for token).
"""

from __future__ import annotations

from typing import Any, Sequence

QUESTION_TEMPLATE = "\n\nAnswer the question using the context above.\nQuestion: {question}"
_SENTINEL = "\u2063ACRE-CONTEXT\u2063"


def user_content(context: str, question: str, instruction: str | None = None) -> str:
    """The user turn's text: ``[instruction + blank line] + context + QUESTION_TEMPLATE``."""
    head = f"{instruction}\n\n" if instruction else ""
    return head + context + QUESTION_TEMPLATE.format(question=question)


def context_end(content: str) -> int | None:
    """Where the context ends in a user turn written by :func:`user_content` (None: not such a turn)."""
    marker = QUESTION_TEMPLATE.split("{question}")[0]
    at = content.rfind(marker)
    return at if at >= 0 else None


def context_span(context: str, instruction: str | None = None) -> tuple[int, int]:
    """Character range of the context inside :func:`user_content`'s text."""
    start = len(f"{instruction}\n\n") if instruction else 0
    return start, start + len(context)


def qa_messages(context: str, question: str, answer: str | None = None, instruction: str | None = None,
                system_prompt: str | None = None) -> list[dict[str, str]]:
    """The conversation of one QA example (with the answer as the assistant turn when given)."""
    messages = [{"role": "system", "content": system_prompt}] if system_prompt else []
    messages.append({"role": "user", "content": user_content(context, question, instruction)})
    if answer is not None:
        messages.append({"role": "assistant", "content": answer})
    return messages


class PromptFormat:
    """Context/question rendering for one tokenizer; text without a chat template stays plain."""

    def __init__(self, tokenizer: Any, system_prompt: str | None = None):
        self.tokenizer = tokenizer
        self.system_prompt = system_prompt
        self._template: tuple[list[int], list[int]] | None = None  # question_words' lead-in and end ids

    def split(self, question: str, instruction: str | None = None) -> tuple[str, str]:
        """(text before the context, text after it) of the rendered prompt, generation prompt included."""
        messages = qa_messages(_SENTINEL, question, instruction=instruction, system_prompt=self.system_prompt)
        if getattr(self.tokenizer, "chat_template", None):
            text = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        else:  # no template: plain text, led by BOS when the tokenizer would add one itself
            text = self._bos() + "".join(m["content"] for m in messages)
        before, after = text.split(_SENTINEL)
        return before, after

    def _bos(self) -> str:
        bos = getattr(self.tokenizer, "bos_token", None)
        if not bos:
            return ""
        ids = self.tokenizer("a", add_special_tokens=True)["input_ids"]
        return bos if ids[:1] == [self.tokenizer.bos_token_id] else ""

    def encode(self, text: str) -> list[int]:
        if self.tokenizer is None:
            raise ValueError("text input needs a tokenizer; pass token ids instead")
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def prefix_ids(self, instruction: str | None = None) -> list[int]:
        """Tokens before the context (template start, system prompt, instruction)."""
        return self.encode(self.split("", instruction)[0])

    def context_ids(self, context: str, instruction: str | None = None) -> list[int]:
        """Tokens of everything up to the end of the context (what a cache holds)."""
        return self.encode(self.split("", instruction)[0] + context)

    def question_ids(self, question: str) -> list[int]:
        """Tokens after the context: the question, the end of the user turn, the generation prompt."""
        return self.encode(self.split(question)[1])

    def question_words(self, q_ids: Sequence[int]) -> list[bool] | None:
        """Which of ``q_ids`` (as :meth:`question_ids` writes them) are the question's own words, not the
        template around them (``QUESTION_TEMPLATE``'s lead-in, the end of turn, the generation prompt).
        None when ``q_ids`` does not sit in this template, or there is no tokenizer.

        The template's tokens are found once, as what two different questions' ids share at either
        end: a tokenizer that merges across the question's edge shifts the boundary by a token, and
        the check below then still holds.
        """
        if self.tokenizer is None:
            return None
        if self._template is None:
            a, b = self.question_ids("What is it?"), self.question_ids("Zebra count 1990")  # no end in common
            head = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), 0)
            tail = next((i for i, (x, y) in enumerate(zip(reversed(a), reversed(b))) if x != y), 0)
            self._template = (a[:head], a[len(a) - tail:])
        head, tail = self._template
        ids = list(q_ids)
        if len(ids) <= len(head) + len(tail) or ids[: len(head)] != head or ids[len(ids) - len(tail):] != tail:
            return None
        return [False] * len(head) + [True] * (len(ids) - len(head) - len(tail)) + [False] * len(tail)

    def stop_ids(self, config: Any) -> set[int]:
        """Where an answer ends: :func:`stop_token_ids` of this tokenizer and ``config``."""
        return stop_token_ids(self.tokenizer, config)


END_OF_TURN = ("<|im_end|>", "<|eot_id|>")  # ChatML (Qwen) and Llama 3 chat templates


def stop_token_ids(tokenizer: Any, *configs: Any) -> set[int]:
    """The token ids a generated answer stops at, the one definition every decoder uses (chat, generate,
    eval): the EOS ids of the tokenizer and of each config given (a model config, a generation config),
    plus the chat template's end-of-turn token when the vocabulary has one."""
    ids: set[int] = set()
    for config in configs:
        eos = getattr(config, "eos_token_id", None)
        ids.update(int(x) for x in (eos if isinstance(eos, (list, tuple)) else [eos] if eos is not None else []))
    if tokenizer is not None:
        if getattr(tokenizer, "eos_token_id", None) is not None:
            ids.add(int(tokenizer.eos_token_id))
        for token in END_OF_TURN:
            tid = tokenizer.convert_tokens_to_ids(token) if hasattr(tokenizer, "convert_tokens_to_ids") else None
            if isinstance(tid, int) and tid != getattr(tokenizer, "unk_token_id", None) and tid >= 0:
                ids.add(tid)
    return ids
