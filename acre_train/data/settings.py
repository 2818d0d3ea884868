"""Settings of the two preparation stages: pydantic models, as the recipe's sections are (the recipe's
``data.prepare`` is validated by these same classes). Unknown keys, wrong types and bad values are a
``DataError`` naming the key, with a did-you-mean."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, ValidationError, field_validator, model_validator

from ..errors import explain_validation
from ..modeling.geometry import PAPER_INTERVALS, WindowGeometry
from .errors import DataError

_PAPER = WindowGeometry()  # W0 = 4096, S = 2048, l from {8..128}: the one place these defaults live

# Settings that do not change the output, so they stay out of the cache fingerprint.
# ``strict`` stays in: it decides which records survive, so a lenient run's cache must not answer a strict one.
NON_OUTPUT_FIELDS = frozenset({"output", "num_proc", "overwrite", "cache_dir"})


class _Settings(BaseModel):
    model_config = ConfigDict(extra="forbid")

    def __init__(self, **values: Any):
        try:
            super().__init__(**values)
        except ValidationError as exc:
            raise DataError(f"{type(self).__name__}: " + "; ".join(explain_validation(exc, type(self)))) from None

    @classmethod
    def from_dict(cls, values: dict[str, Any]):
        """Build from a mapping (e.g. a recipe's YAML section); an unknown key is an error."""
        return cls(**values)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict of every field (paths as strings, tuples as lists)."""
        return self.model_dump(mode="json")

    def output_dict(self) -> dict[str, Any]:
        """The settings that determine the output (the cache fingerprint's share)."""
        return {k: v for k, v in self.to_dict().items() if k not in NON_OUTPUT_FIELDS}


class PlanSettings(_Settings):
    """Where the L1 tokens go (recorded in the manifest; the trainer and inference must agree)."""

    first_chunk: int = _PAPER.first_chunk
    stride: int = _PAPER.stride
    intervals: tuple[int, ...] = PAPER_INTERVALS
    seed: int = 0
    l1_token_id: int | None = None  # None: the tokenizer's EOS id (DESIGN §4: no vocab change)

    @field_validator("intervals", mode="before")
    @classmethod
    def _one_or_many(cls, value: Any) -> Any:
        return [value] if isinstance(value, int) else value

    @model_validator(mode="after")
    def _check_plan(self):
        self.geometry  # noqa: B018  (validates)
        return self

    @property
    def geometry(self) -> WindowGeometry:
        """The window geometry this plan trains with (what an export's inference defaults derive from)."""
        try:
            return WindowGeometry(first_chunk=self.first_chunk, stride=self.stride, intervals=self.intervals)
        except ValueError as exc:
            raise DataError(str(exc)) from None


class _Common(PlanSettings):
    output: Path | None = None
    inputs: tuple[str, ...] = ()
    dataset_name: str | None = None  # a `datasets` name instead of files
    dataset_config: str | None = None
    dataset_split: str = "train"
    builtin: bool = False  # the built-in sample (pydoc text for stage 1, SQuAD subset for stage 2)
    tokenizer: str = "tiny"  # a path or hub name for AutoTokenizer, or "tiny" (tiny_tokenizer())
    num_proc: int = 1
    strict: bool = False
    overwrite: bool = False
    cache_dir: Path | None = None  # default: $ACRE_TRAIN_CACHE or ~/.cache/acre-train

    @field_validator("inputs", mode="before")
    @classmethod
    def _paths_as_text(cls, value: Any) -> Any:
        return [str(p) for p in ([value] if isinstance(value, (str, Path)) else value)]

    @model_validator(mode="after")
    def _check_common(self):
        sources = bool(self.inputs) + bool(self.dataset_name) + bool(self.builtin)
        if sources != 1:
            raise ValueError("give exactly one input: files (inputs), a dataset_name, or builtin")
        if self.num_proc < 1:
            raise ValueError(f"num_proc must be >= 1, got {self.num_proc}")
        return self


class Stage1Settings(_Common):
    """Stage 1: spans of plain text with L1 tokens (``acre-train preprocess stage1``).

    ``min_length``/``max_length`` bound every span in raw tokens; documents longer than a span are
    cut into consecutive spans whose lengths are drawn uniformly from that range; with ``pack``,
    shorter documents (and leftovers) are joined, EOS-separated, into spans. Preparation stops once
    ``token_budget`` raw tokens are emitted (None: no limit).
    """

    text_field: str = "text"
    meta_field: str = "meta"
    min_length: int = 4096
    max_length: int = 65536
    token_budget: int | None = 2_000_000_000
    pack: bool = True

    @model_validator(mode="after")
    def _check_lengths(self):
        if not 1 <= self.min_length <= self.max_length:
            raise ValueError(f"need 1 <= min_length <= max_length, got {self.min_length} and {self.max_length}")
        if self.token_budget is not None and self.token_budget < self.min_length:
            raise ValueError(f"token_budget ({self.token_budget}) is below min_length ({self.min_length}): no span fits")
        return self


class Stage2Settings(_Common):
    """Stage 2: chat-formatted SFT samples with L1 tokens (``acre-train preprocess stage2``).

    ``format``: ``auto`` (per record: ``messages``, ShareGPT ``conversations``, alpaca
    ``instruction``/``output``), one of those explicitly, or ``squad`` (SQuAD JSON files built into
    long-context QA: the gold paragraph at a random depth among other paragraphs until the context
    holds ``context_tokens`` tokens). Samples over ``max_length`` raw tokens are truncated from the
    middle of their context (``overlong="truncate"``) or dropped (``"drop"``).
    """

    format: Literal["auto", "messages", "sharegpt", "alpaca", "squad"] = "auto"
    max_length: int = 32768
    min_length: int = 1
    overlong: Literal["truncate", "drop"] = "truncate"
    system_prompt: str | None = None
    context_tokens: int = 4096
    questions_per_paragraph: int = 1
    # > 1: consecutive conversations with the same context become one sample of up to this many
    # question/answer segments after one context (train with train.refill_sim: each question answers
    # over the context alone). SQuAD input then gives a paragraph's questions one shared context.
    pack_questions: int = 1
    max_samples: int | None = None

    @model_validator(mode="after")
    def _check_stage2(self):
        if self.pack_questions < 1:
            raise ValueError(f"pack_questions must be >= 1, got {self.pack_questions}")
        if not 1 <= self.min_length <= self.max_length:
            raise ValueError(f"need 1 <= min_length <= max_length, got {self.min_length} and {self.max_length}")
        if self.context_tokens < 1 or self.questions_per_paragraph < 1:
            raise ValueError("context_tokens and questions_per_paragraph must be >= 1")
        if self.builtin and self.format == "auto":
            self.format = "squad"  # the built-in stage-2 sample is the SQuAD subset
        return self
