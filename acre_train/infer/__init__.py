"""Inference over a bi-layer cache: build once per context, answer many questions with refilling."""

from .cache import BiLayerCache, CacheMismatchError, ContextTooLongError, build_cache, fingerprint
from .engine import AcreEngine, Answer
from ..data.prompt import QUESTION_TEMPLATE, PromptFormat
from .refill import assemble, num_selected
from ..modeling.scoring import score_entries
from ..modeling.span_choice import select_spans
from .settings import CacheSettings, RefillSettings

__all__ = [
    "AcreEngine", "Answer", "BiLayerCache", "CacheMismatchError", "CacheSettings", "ContextTooLongError",
    "PromptFormat", "QUESTION_TEMPLATE", "RefillSettings", "assemble", "build_cache", "fingerprint",
    "num_selected", "score_entries", "select_spans",
]
