"""Settings of the two preparation stages (dataclasses; unknown keys are errors that name the key)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from ..errors import key_hint
from ..modeling.geometry import PAPER_INTERVALS, WindowGeometry
from .errors import DataError

_PAPER = WindowGeometry()  # W0 = 4096, S = 2048, l from {8..128}: the one place these defaults live

# Settings that do not change the output, so they stay out of the cache fingerprint.
# ``strict`` stays in: it decides which records survive, so a lenient run's cache must not answer a strict one.
NON_OUTPUT_FIELDS = frozenset({"output", "num_proc", "overwrite", "cache_dir"})


@dataclass
class PlanSettings:
    """Where the L1 tokens go (recorded in the manifest; the trainer and inference must agree)."""

    first_chunk: int = _PAPER.first_chunk
    stride: int = _PAPER.stride
    intervals: tuple[int, ...] = PAPER_INTERVALS
    seed: int = 0
    l1_token_id: int | None = None  # None: the tokenizer's EOS id (DESIGN §4: no vocab change)

    def _check_plan(self) -> None:
        self.intervals = tuple(int(v) for v in ([self.intervals] if isinstance(self.intervals, int) else self.intervals))
        self.geometry  # noqa: B018  (validates)

    @property
    def geometry(self) -> WindowGeometry:
        """The window geometry this plan trains with (what an export's inference defaults derive from)."""
        try:
            return WindowGeometry(first_chunk=self.first_chunk, stride=self.stride, intervals=self.intervals)
        except ValueError as exc:
            raise DataError(str(exc)) from None


@dataclass
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

    def _check_common(self) -> None:
        self._check_plan()
        self.inputs = tuple(str(p) for p in self.inputs)
        if self.output is not None:
            self.output = Path(self.output)
        if self.cache_dir is not None:
            self.cache_dir = Path(self.cache_dir)
        sources = bool(self.inputs) + bool(self.dataset_name) + bool(self.builtin)
        if sources != 1:
            raise DataError("give exactly one input: files (inputs), a dataset_name, or builtin")
        if self.num_proc < 1:
            raise DataError(f"num_proc must be >= 1, got {self.num_proc}")

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> "_Common":
        """Build from a mapping (e.g. a recipe's YAML section); an unknown key is an error."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise DataError(f"unknown {cls.__name__} key {unknown[0]!r}{key_hint(unknown[0], known)}"
                            + (f" (and {len(unknown) - 1} more: {', '.join(map(repr, unknown[1:]))})" if unknown[1:] else ""))
        return cls(**values)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict of every field (paths as strings, tuples as lists)."""
        out = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            out[f.name] = str(value) if isinstance(value, Path) else list(value) if isinstance(value, tuple) else value
        return out

    def output_dict(self) -> dict[str, Any]:
        """The settings that determine the output (the cache fingerprint's share)."""
        return {k: v for k, v in self.to_dict().items() if k not in NON_OUTPUT_FIELDS}


@dataclass
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

    def __post_init__(self) -> None:
        self._check_common()
        if not 1 <= self.min_length <= self.max_length:
            raise DataError(f"need 1 <= min_length <= max_length, got {self.min_length} and {self.max_length}")
        if self.token_budget is not None and self.token_budget < self.min_length:
            raise DataError(f"token_budget ({self.token_budget}) is below min_length ({self.min_length}): no span fits")


@dataclass
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

    def __post_init__(self) -> None:
        self._check_common()
        if self.pack_questions < 1:
            raise DataError(f"pack_questions must be >= 1, got {self.pack_questions}")
        if self.format not in ("auto", "messages", "sharegpt", "alpaca", "squad"):
            raise DataError(f"unknown format {self.format!r}; choose auto, messages, sharegpt, alpaca or squad")
        if self.overlong not in ("truncate", "drop"):
            raise DataError(f"overlong must be 'truncate' or 'drop', got {self.overlong!r}")
        if not 1 <= self.min_length <= self.max_length:
            raise DataError(f"need 1 <= min_length <= max_length, got {self.min_length} and {self.max_length}")
        if self.context_tokens < 1 or self.questions_per_paragraph < 1:
            raise DataError("context_tokens and questions_per_paragraph must be >= 1")
        if self.builtin and self.format == "auto":
            self.format = "squad"  # the built-in stage-2 sample is the SQuAD subset
