"""A tiny byte-level BPE tokenizer trained in-process on the built-in text (for tests and demos).

Trained with the ``tokenizers`` package in about a second, cached on disk (keyed by the settings,
the ``tokenizers`` version and the training text) and in memory, and wrapped as a
``transformers.PreTrainedTokenizerFast`` with EOS, a *distinct* pad token (pad == eos silently
masks every EOS label) and a ChatML chat template, like Qwen2.5's.
"""

from __future__ import annotations

import hashlib
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING

from ..files import cache_root  # noqa: F401 (also re-exported: older imports)

if TYPE_CHECKING:  # transformers is heavy; import it only when a tokenizer is built
    from transformers import PreTrainedTokenizerFast

EOS_TOKEN = "<|endoftext|>"
PAD_TOKEN = "<|pad|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = (EOS_TOKEN, PAD_TOKEN, IM_START, IM_END)

# ChatML, as Qwen2.5 renders it (without the default system prompt): every turn is
# "<|im_start|>{role}\n{content}<|im_end|>\n"; the generation prompt opens an assistant turn.
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def _training_text() -> list[str]:
    from .builtin import builtin_qa, builtin_text

    texts = [r["text"] for r in builtin_text()]
    # Add the QA sample so English prose tokenizes sensibly too.
    for article in builtin_qa()["data"]:
        for para in article["paragraphs"]:
            texts.append(para["context"])
            texts.extend(q["question"] for q in para["qas"])
    return texts


def _train(vocab_size: int, texts: list[str], path: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # every byte encodable: no <unk>
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    from ..files import atomic_path

    with atomic_path(path) as tmp:  # concurrent test workers never read a half-written file
        tok.save(str(tmp))


@lru_cache(maxsize=8)
def _tokenizer_file(vocab_size: int) -> str:
    import tokenizers

    texts = _training_text()
    digest = hashlib.sha256()
    for part in (str(vocab_size), tokenizers.__version__, *SPECIAL_TOKENS, *texts):
        digest.update(part.encode("utf-8"))
        digest.update(b"\0")
    path = cache_root() / "tiny-tokenizer" / f"bpe-{vocab_size}-{digest.hexdigest()[:16]}.json"
    if not path.exists():
        _train(vocab_size, texts, path)
    return str(path)


def tiny_tokenizer(vocab_size: int = 1024) -> "PreTrainedTokenizerFast":
    """A small byte-level BPE tokenizer with ``<|endoftext|>`` EOS, ``<|pad|>`` pad and ChatML.

    Deterministic for a given ``vocab_size`` (and ``tokenizers`` version); the first call trains it
    (about a second), later calls load it from the cache. Returns a fresh object each call, so
    callers may modify it.
    """
    if vocab_size < 256 + len(SPECIAL_TOKENS):
        raise ValueError(f"vocab_size must be >= {256 + len(SPECIAL_TOKENS)} (bytes + specials), got {vocab_size}")
    from transformers import PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast(
        tokenizer_file=_tokenizer_file(vocab_size),
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        additional_special_tokens=[IM_START, IM_END],
        model_max_length=1 << 20,
    )
    tok.chat_template = CHATML_TEMPLATE
    tok.name_or_path = f"acre-train/tiny-bpe-{vocab_size}"
    return tok
