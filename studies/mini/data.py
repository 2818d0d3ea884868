"""Data of the miniature study: a tokenizer trained here, and the text/QA streams of every stage.

Every stream is built from the evaluation harness's own task generators (``acre_train.eval.tasks``)
with *training* seeds (``SEEDS``), rendered into exactly the prompt the harness feeds the models
(``acre_train.eval.prompt``: instruction, blank line, context or ``Document [i]: ...`` list, blank
line, ``Question: ...``, ``Answer:``) followed by the gold answer. Evaluation uses ``EVAL_SEED``,
which no training stream uses; SQuAD training questions that also occur in an evaluation set are
dropped (both are drawn from the same SQuAD v2 dev file).

Streams:

* **base** (phase 1 of pretraining the base from scratch): key-value drills as ``messages``
  conversations (``drill_conversation``): 2..8 needles in the needle tasks' wording, then one question
  per key; trained with the stage-2 collator, so the loss sees only the answers.
* **base2** (phase 2): the needle tasks as conversations, contexts growing from 128 tokens to the
  window (a length curriculum, trained in order), mixed with phase-1 drills.
* **stage1** (ACRE stage 1): the same construction at ``long_window`` tokens (longer than the base
  window): one long retrieval example (context up to ``long_window - 200``), then padding text.
* **stage2** (ACRE stage 2 and the vanilla SFT ablation): ``messages`` JSONL, user = the harness
  prompt without ``Answer:``, assistant = the answer; the tokenizer's chat template writes
  ``\\nAnswer: `` and the EOS, so the rendered text equals the harness prompt + answer.
"""

from __future__ import annotations

import json
import random
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Iterator

from acre_train.eval.prompt import CONTEXT_INSTRUCTION, DOCS_INSTRUCTION
from acre_train.eval.examples import Example
from acre_train.eval.tasks import build_task

EOS = "<|endoftext|>"
PAD = "<|pad|>"

# Plain "chat" template: the user turn is the prompt itself, the assistant turn is "\nAnswer: <text><eos>".
# It renders a (prompt, answer) conversation as exactly the evaluation harness's prompt + answer,
# so stage 2 trains on the format every method is evaluated with.
PLAIN_QA_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] == 'assistant' %}{{ '\\nAnswer: ' + message['content'] + '" + EOS + "' }}"
    "{% else %}{{ message['content'] }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '\\nAnswer:' }}{% endif %}"
)

# Seeds: training streams draw from these ranges; evaluation uses EVAL_SEED (never used in training).
SEEDS = {"base": 1000, "stage1": 2000, "stage2": 3000, "tokenizer": 4000, "base2": 5000}
EVAL_SEED = 777_001
RETRIEVAL_KINDS = ("niah_single", "niah_multikey", "niah_multivalue", "vt")
_NEEDLE = re.compile(r"One of the special magic numbers for (\S+) is: (\d+)\.")


# ------------------------------------------------------------------------------------ tokenizer


def tokenizer_corpus(seed: int = SEEDS["tokenizer"]) -> list[str]:
    """Text the tokenizer is trained on: the built-in Python reference, SQuAD paragraphs and
    questions, and synthetic needle/variable lines of the retrieval streams."""
    from acre_train.data.builtin import builtin_text
    from acre_train.eval.tasks import WORDS, load_squad

    texts = [r["text"] for r in builtin_text()]
    squad = load_squad(None)  # the packaged sample (the product never reads a machine's data layout)
    for art in squad:
        for p in art["paragraphs"]:
            texts.append(p["context"])
            texts.extend(q["question"] for q in p["qas"])
    rng = random.Random(seed)
    lines = []
    for _ in range(3000):
        key = f"{rng.choice(WORDS)}-{rng.choice(WORDS)}"
        name = "".join(rng.choice("ABCDEFGHIJKLMNOPQRSTUVWXYZ") for _ in range(5))
        lines.append(f"One of the special magic numbers for {key} is: {rng.randint(10**6, 10**7 - 1)}. "
                     f"VAR {name} = VAR {name[::-1]}. What is the special magic number for {key} mentioned "
                     "in the provided text? What are all the special magic numbers for")
    texts.append(" ".join(lines))
    texts += [DOCS_INSTRUCTION, CONTEXT_INSTRUCTION, "Question: Answer: Document [1]: "]
    return texts


def train_tokenizer(out_dir: str | Path, vocab_size: int = 2048, texts: Iterable[str] | None = None):
    """Byte-level BPE (digits split one by one) trained with ``tokenizers``; saved as a HF tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=2, special_tokens=[EOS, PAD],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(list(texts if texts is not None else tokenizer_corpus()), trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS, pad_token=PAD, model_max_length=1 << 20)
    fast.chat_template = PLAIN_QA_TEMPLATE
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(str(out_dir))
    return fast


# ------------------------------------------------------------------------------------- rendering


def prompt_text(ex: Example) -> str:
    """The harness's prompt (``acre_train.eval.prompt.prepare_example``) as one string, without ``\\nAnswer:``."""
    if ex.documents is not None:
        body = "".join(f"Document [{i + 1}]: {d}\n\n" for i, d in enumerate(ex.documents))
        return f"{ex.instruction or DOCS_INSTRUCTION}\n\n{body}\n\nQuestion: {ex.question}"
    return f"{ex.instruction or CONTEXT_INSTRUCTION}\n\n{ex.context}\n\nQuestion: {ex.question}"


def answer_text(ex: Example) -> str:
    """The target answer: the gold answer, or every gold joined by ', ' where all are asked for."""
    return ", ".join(ex.answers) if ex.substring_mode in ("all", "fraction") else ex.answers[0]


def qa_text(ex: Example, dense: bool = False) -> str:
    """Prompt + ``\nAnswer: <answer>`` (no end-of-turn tokens); ``dense``: see ``qa_conversation``."""
    return "".join(m["content"] if m["role"] == "user" else f"\nAnswer: {m['content']}"
                   for m in qa_conversation(ex, dense))


@dataclass
class StreamSettings:
    window: int = 1024  # tokens per base-pretraining span (the base model's native window)
    long_window: int = 3072  # tokens per stage-1 span (longer than the base window)
    base_docs: int = 24000  # phase-1 key-value drills (conversations)
    base2_docs: int = 12800  # phase-2 needle-task conversations (contexts growing to the window)
    drill_max_facts: int = 8  # facts per drill: 2..this
    drill_share: float = 0.3  # share of phase-2 records that are phase-1 drills
    stage1_docs: int = 160
    stage2_samples: int = 320
    stage2_max_context: int = 2600  # stage-2 context lengths are drawn up to this (tokens)
    squad_share: float = 0.2  # share of stage-2 samples (and base retrieval examples) that are SQuAD


def _filler(rng: random.Random, min_chars: int) -> str:
    """Random Python-reference topics joined until ``min_chars`` characters."""
    from acre_train.data.builtin import builtin_text

    docs = builtin_text()
    parts, n = [], 0
    while n < min_chars:
        parts.append(docs[rng.randrange(len(docs))]["text"])
        n += len(parts[-1])
    return " ".join(parts)


def _fit(tokenizer, text: str, tokens: int) -> str:
    """``text`` cut to about ``tokens + 32`` tokens (it must already be longer than ``tokens``)."""
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    return tokenizer.decode(ids[: tokens + 32]) if len(ids) > tokens + 32 else text


def _examples(kind: str, tokenizer, length: int, n: int, seed: int) -> list[Example]:
    return build_task(kind, tokenizer, length, n, seed)


class _Pool:
    """Retrieval examples of one kind and context length, generated in batches with fresh seeds."""

    def __init__(self, tokenizer, seed0: int, exclude_questions: set[str] | None = None):
        self.tokenizer, self.seed, self.pool = tokenizer, seed0, {}
        self.exclude = exclude_questions or set()

    def take(self, kind: str, length: int) -> Example:
        key = (kind, length)
        while not self.pool.get(key):
            self.seed += 1
            batch = _examples(kind, self.tokenizer, length, 8, self.seed)
            self.pool[key] = [e for e in batch if e.question not in self.exclude or kind != "squad"]
        return self.pool[key].pop()


MIXED_KINDS = ("niah_single", "niah_multikey", "niah_multikey", "niah_multivalue", "vt")


def _pick_kind(rng: random.Random, squad_share: float, kinds: tuple[str, ...] = MIXED_KINDS) -> str:
    if rng.random() < squad_share:
        return "squad"
    return rng.choice(kinds)


def drill_conversation(rng: random.Random, facts: int, filler: float = 0.0) -> list[dict[str, str]]:
    """A key-value drill as a conversation: ``facts`` needles in the needle tasks' own wording (after
    each, with probability ``filler``, one sentence of reference text), then one harness-format
    question per key in random order, each answered by the assistant (the loss sees only the answers).
    """
    from acre_train.eval.tasks import NEEDLE_INSTRUCTION, WORDS, filler_sentences, needle_question

    sentences = filler_sentences()
    keys = list(dict.fromkeys(f"{rng.choice(WORDS)}-{rng.choice(WORDS)}" for _ in range(3 * facts)))[:facts]
    values = [str(rng.randint(10**6, 10**7 - 1)) for _ in keys]
    parts = []
    for k, v in zip(keys, values):
        parts.append(f"One of the special magic numbers for {k} is: {v}.")
        if rng.random() < filler:
            parts.append(sentences[rng.randrange(len(sentences))])
    order = rng.sample(range(len(keys)), len(keys))
    messages = []
    for n, i in enumerate(order):
        head = f"{NEEDLE_INSTRUCTION}\n\n{' '.join(parts)}" if n == 0 else ""
        messages += [{"role": "user", "content": f"{head}\n\nQuestion: {needle_question(keys[i])}"},
                     {"role": "assistant", "content": values[i]}]
    return messages


def phase1_drill(rng: random.Random, s: StreamSettings) -> dict[str, Any]:
    """One phase-1 record: a key-value drill without filler; a quarter have a single fact (copying
    the one value needs no key matching: those teach the copy itself), the rest 2..``drill_max_facts``."""
    facts = 1 if rng.random() < 0.25 else rng.randint(2, s.drill_max_facts)
    return {"messages": drill_conversation(rng, facts), "meta": {"kind": "drill", "facts": facts}}


def drill_conversations(s: StreamSettings, seed: int = SEEDS["base"]) -> Iterator[dict[str, Any]]:
    """Phase-1 base records (``phase1_drill``)."""
    rng = random.Random(seed)
    for _ in range(s.base_docs):
        yield phase1_drill(rng, s)


def qa_conversation(ex: Example, dense: bool = False) -> list[dict[str, str]]:
    """An example as the harness's prompt + answer; ``dense``: every other multi-key needle asked too."""
    messages = [{"role": "user", "content": prompt_text(ex)}, {"role": "assistant", "content": answer_text(ex)}]
    if dense and ex.task == "niah_multikey" and ex.context:
        from acre_train.eval.tasks import needle_question

        for k, v in _NEEDLE.findall(ex.context):
            if v not in ex.answers:
                messages += [{"role": "user", "content": f"\n\nQuestion: {needle_question(k)}"},
                             {"role": "assistant", "content": v}]
    return messages


def task_conversations(tokenizer, s: StreamSettings, seed: int = SEEDS["base2"], log=print) -> Iterator[dict[str, Any]]:
    """Phase-2 base records, in curriculum order (the recipe trains them unshuffled): the needle tasks
    (``niah_single``, and ``niah_multikey`` with every needle asked) in the harness's own prompt, with
    context lengths from 128 tokens growing to the window over the first 70 % of the stream; a
    ``drill_share`` of phase-1 drills (no text between the facts) keeps the copy phase 1 learned.

    Why a curriculum: the phase-1 base copies a lone needle from 128 tokens of reference text (40 %
    exact) but not from 256 (5 %), and a uniform 128..640 mix did not move it in 430 steps."""
    rng = random.Random(seed)
    pool = _Pool(tokenizer, seed * 100)
    low, top = 128, s.window - 160  # room for the instruction, the question and the answer
    for i in range(s.base2_docs):
        if rng.random() < s.drill_share:
            yield phase1_drill(rng, s)
            continue
        reach = low + (top - low) * min(1.0, i / (0.7 * s.base2_docs))
        length = rng.randrange(low, int(reach) + 1, 32) if reach >= low + 32 else low
        kind = "niah_single" if rng.random() < 0.6 else "niah_multikey"
        ex = pool.take(kind, length)
        yield {"messages": qa_conversation(ex, dense=True), "meta": {"kind": ex.task, "context_tokens": length}}
        if log and (i + 1) % 2000 == 0:
            log(f"  phase-2 records: {i + 1}")


def stage1_documents(tokenizer, s: StreamSettings, exclude_questions: set[str], seed: int = SEEDS["stage1"],
                     ) -> Iterator[dict[str, Any]]:
    """Stage-1 documents: one long retrieval example (context beyond the base window) + reference text."""
    rng = random.Random(seed)
    pool = _Pool(tokenizer, seed * 100, exclude_questions)
    for i in range(s.stage1_docs):
        if rng.random() < 0.2:
            yield {"text": _fit(tokenizer, _filler(rng, 6 * s.long_window), s.long_window), "meta": {"kind": "text"}}
            continue
        length = rng.randrange(s.window, s.long_window - 200, 64)
        ex = pool.take(_pick_kind(rng, s.squad_share), length)
        text = qa_text(ex) + EOS + _filler(rng, 6 * (s.long_window - length) + 400)
        yield {"text": _fit(tokenizer, text, s.long_window), "meta": {"kind": ex.task}}


def stage2_conversations(tokenizer, s: StreamSettings, exclude_questions: set[str], seed: int = SEEDS["stage2"],
                         ) -> Iterator[dict[str, Any]]:
    """Stage-2 ``messages`` records: contexts from 256 tokens to ``stage2_max_context``."""
    rng = random.Random(seed)
    pool = _Pool(tokenizer, seed * 100, exclude_questions)
    for _ in range(s.stage2_samples):
        length = rng.randrange(256, s.stage2_max_context, 64)
        ex = pool.take(_pick_kind(rng, s.squad_share), length)
        yield {"messages": [{"role": "user", "content": prompt_text(ex)},
                            {"role": "assistant", "content": answer_text(ex)}],
               "meta": {"kind": ex.task, "context_tokens": length}}


def write_jsonl(records: Iterable[dict[str, Any]], path: str | Path) -> int:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    n = 0
    with open(path, "w", encoding="utf-8") as f:
        for r in records:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")
            n += 1
    return n
