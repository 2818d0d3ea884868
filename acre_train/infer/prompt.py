"""Turning (context, question) text into the two token streams inference needs.

The whole prompt is the one stage-2 training renders: a user turn holding the context followed by
the question (``QUESTION_TEMPLATE``, the same as ``acre_train/data/squad.py``), then the generation
prompt, rendered with the tokenizer's own chat template. The rendering is cut at the end of the
context: everything before (template start + context) is the cacheable part, everything after is the
question part. The two parts are tokenized separately (with ``add_special_tokens=False``: the template
writes any BOS itself), which is what lets one cache serve many questions.
"""

from __future__ import annotations

from typing import Any

# Kept equal to acre_train.data.squad.QUESTION_TEMPLATE (stage-2 training prompt).
QUESTION_TEMPLATE = "\n\nAnswer the question using the context above.\nQuestion: {question}"
_SENTINEL = "\u2063ACRE-CONTEXT\u2063"


class PromptFormat:
    """Context/question rendering for one tokenizer (``None``: token ids only)."""

    def __init__(self, tokenizer: Any, question_template: str = QUESTION_TEMPLATE, system_prompt: str | None = None):
        self.tokenizer = tokenizer
        self.question_template = question_template
        self.system_prompt = system_prompt

    def _split(self, question: str) -> tuple[str, str]:
        """(text before the context, text after it) of the rendered prompt."""
        body = _SENTINEL + self.question_template.format(question=question)
        if getattr(self.tokenizer, "chat_template", None):
            messages = ([{"role": "system", "content": self.system_prompt}] if self.system_prompt else [])
            messages.append({"role": "user", "content": body})
            text = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        else:
            text = body
        before, after = text.split(_SENTINEL)
        return before, after

    def _encode(self, text: str) -> list[int]:
        if self.tokenizer is None:
            raise ValueError("text input needs a tokenizer; pass token ids instead")
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def context_ids(self, context: str) -> list[int]:
        before, _ = self._split("")
        return self._encode(before + context)

    def question_ids(self, question: str) -> list[int]:
        _, after = self._split(question)
        return self._encode(after)

    def stop_ids(self, config: Any) -> set[int]:
        """EOS ids of the model and tokenizer, plus the chat template's end-of-turn token if known."""
        ids: set[int] = set()
        eos = getattr(config, "eos_token_id", None)
        ids.update(eos if isinstance(eos, (list, tuple)) else [eos] if eos is not None else [])
        if self.tokenizer is not None:
            if self.tokenizer.eos_token_id is not None:
                ids.add(int(self.tokenizer.eos_token_id))
            for token in ("<|im_end|>", "<|eot_id|>"):
                tid = self.tokenizer.convert_tokens_to_ids(token)
                if isinstance(tid, int) and tid != self.tokenizer.unk_token_id and tid >= 0:
                    ids.add(tid)
        return ids
