"""One prompt for every method: prefix, documents (or context chunks), question suffix.

The prefix and suffix come from the project's one question prompt (``acre_train.data.prompt``):
the model's chat template, the task's instruction before the context, ``QUESTION_TEMPLATE`` and the
generation prompt after it -- what stage 2 trains on and what ``chat``/``generate`` send. Pieces are
tokenized separately and concatenated, so every method sees the very same token ids: ``full`` feeds
``prefix + doc_0 + ... + doc_n + suffix``; the cache-editing methods encode the same pieces
separately. A ``context`` example is tokenized once (with offsets) and cut into chunks of
``chunk_tokens``; its ``gold_spans`` become the ids of the chunks they overlap.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..data.prompt import PromptFormat
from .examples import Example

DOCS_INSTRUCTION = ("Answer the question based on the given documents. Only give me the answer and do not "
                    "output any other words.")
CONTEXT_INSTRUCTION = "Read the text below and answer the question. Only give me the answer."


@dataclass
class PreparedExample:
    """Token ids of one example's prompt, split into prefix / documents / suffix."""

    example: Example
    prefix_ids: list[int]
    doc_ids: list[list[int]]
    suffix_ids: list[int]
    gold_docs: list[int]

    @property
    def num_docs(self) -> int:
        return len(self.doc_ids)

    @property
    def context_len(self) -> int:
        return sum(map(len, self.doc_ids))

    def prompt_ids(self) -> list[int]:
        return [*self.prefix_ids, *(t for d in self.doc_ids for t in d), *self.suffix_ids]

    def __len__(self) -> int:
        return len(self.prefix_ids) + self.context_len + len(self.suffix_ids)


def document_text(index: int, text: str) -> str:
    """How document ``index`` (0-based) of a documents task reads in the prompt."""
    return f"Document [{index + 1}]: {text}\n\n"


def example_instruction(example: Example) -> str:
    """The instruction before the context: the example's own, else the default of its kind."""
    return example.instruction or (DOCS_INSTRUCTION if example.documents is not None else CONTEXT_INSTRUCTION)


def example_context(example: Example) -> str:
    """The context as one text (documents rendered and joined), e.g. for a training conversation."""
    if example.documents is None:
        return example.context or ""
    return "".join(document_text(i, d) for i, d in enumerate(example.documents))


def evidence_char_ranges(example: Example) -> list[tuple[int, int]]:
    """Where the answer's support lies in :func:`example_context`'s text: inside every gold span (context
    tasks) or gold document (document tasks) that holds an answer, the first occurrence of each answer
    it holds -- a SQuAD answer in its paragraph, a needle's value. Empty when nothing is marked gold.

    >>> evidence_char_ranges(Example(id="x", question="q?", answers=["42"], context="a b 42 c", gold_spans=[[2, 8]]))
    [(4, 6)]
    """
    if example.documents is not None:
        gold, spans, at = set(example.gold_docs or []), [], 0
        for i, doc in enumerate(example.documents):
            text = document_text(i, doc)
            if i in gold:
                spans.append((at, at + len(text)))
            at += len(text)
    else:
        spans = [tuple(s) for s in example.gold_spans or []]
    context = example_context(example)
    out = set()
    for a, b in spans:
        for answer in example.answers:
            found = context.find(answer, a, b)
            if found >= 0:
                out.add((found, found + len(answer)))
    return sorted(out)


def _ids(tokenizer, text: str, special: bool = False) -> list[int]:
    return list(tokenizer(text, add_special_tokens=special)["input_ids"])


def prepare_example(tokenizer, example: Example, chunk_tokens: int = 512) -> PreparedExample:
    """Tokenize ``example`` into the shared prompt layout (BOS, if the tokenizer adds one, in the prefix)."""
    if chunk_tokens <= 0:
        raise ValueError(f"chunk_tokens must be positive, got {chunk_tokens}")
    instruction = example_instruction(example)
    if example.documents is not None:
        docs = [_ids(tokenizer, document_text(i, d)) for i, d in enumerate(example.documents)]
        gold = list(example.gold_docs or [])
    else:
        docs, gold = _chunk_context(tokenizer, example, chunk_tokens)
    prompt = PromptFormat(tokenizer)
    prefix = prompt.prefix_ids(instruction)
    suffix = prompt.question_ids(example.question)
    if any(len(d) == 0 for d in docs):
        raise ValueError(f"example {example.id!r}: a document tokenizes to nothing")
    return PreparedExample(example, prefix, docs, suffix, gold)


def _chunk_context(tokenizer, example: Example, chunk_tokens: int) -> tuple[list[list[int]], list[int]]:
    text = example.context or ""
    if not text:
        raise ValueError(f"example {example.id!r}: empty context")
    if getattr(tokenizer, "is_fast", False):
        enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        ids, offsets = list(enc["input_ids"]), list(enc["offset_mapping"])
    else:  # slow tokenizers give no offsets: gold spans cannot be mapped to chunks
        ids, offsets = _ids(tokenizer, text), None
    chunks = [ids[i:i + chunk_tokens] for i in range(0, len(ids), chunk_tokens)]
    gold: list[int] = []
    if example.gold_spans and offsets is not None:
        for start, end in example.gold_spans:
            hit = {i // chunk_tokens for i, (a, b) in enumerate(offsets) if a < end and b > start}
            gold.extend(sorted(hit - set(gold)))
    return chunks, sorted(gold)
