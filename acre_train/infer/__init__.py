"""Inference over a bi-layer cache: build once per context, answer many questions with refilling."""

from ..data.prompt import QUESTION_TEMPLATE, PromptFormat
from ..modeling.bilayer import BiLayerCache, CacheSettings, num_selected
from ..modeling.scoring import score_entries
from ..modeling.span_choice import select_spans
from .cache import CacheMismatchError, ContextTooLongError, build_cache, fingerprint, load_cache, save_cache
from .engine import AcreEngine, Answer
from .refill import assemble
from .settings import RefillSettings

__all__ = [
    "AcreEngine", "Answer", "BiLayerCache", "CacheMismatchError", "CacheSettings", "ContextTooLongError",
    "PromptFormat", "QUESTION_TEMPLATE", "RefillSettings", "assemble", "build_cache", "fingerprint",
    "load_cache", "num_selected", "save_cache", "score_entries", "select_spans",
]
