"""Data preparation: corpus readers, span packing, QA/SFT builders (``acre-train preprocess``).

Public API (what the trainer calls)::

    prepare_stage1(Stage1Settings(...)) -> Path     # spans of plain text + L1 tokens
    prepare_stage2(Stage2Settings(...)) -> Path     # chat SFT samples + L1 tokens
    load_prepared(path) -> (datasets.Dataset, manifest dict)

Every row holds ``InterleavePlan.as_dict()`` (``input_ids, is_l1, chunk_ids, positions,
memory_positions, labels, raw_index``) plus ``num_raw_tokens``, ``intervals``, ``sample_index``,
``meta`` (JSON) and, for stage 2, ``num_answer_tokens``.
"""

from __future__ import annotations

from .builtin import builtin_qa, builtin_text
from .errors import DataError, InputProblems
from .inspector import format_sample, print_samples
from .output import load_prepared
from .settings import PlanSettings, Stage1Settings, Stage2Settings
from .stage1 import prepare_stage1, preview_stage1
from .stage2 import prepare_stage2, preview_stage2
from .tiny_tokenizer import tiny_tokenizer

__all__ = [
    "DataError", "InputProblems", "PlanSettings", "Stage1Settings", "Stage2Settings",
    "builtin_qa", "builtin_text", "format_sample", "load_prepared", "prepare_stage1", "prepare_stage2",
    "preview_stage1", "preview_stage2", "print_samples", "tiny_tokenizer",
]
