"""Grouped key/value heads in masked SDPA on the CPU, through transformers' own switch.

transformers' ``sdpa`` attention copies the key/value heads up to the query heads (``repeat_kv``)
whenever a mask is passed, because CUDA's fused kernels take a mask or grouped heads, not both.
PyTorch's CPU kernel takes both. For a question over a long cache that copy is most of the work:
with Qwen2.5-0.5B's 2 KV heads and 14 query heads, 32 queries over 16K keys took 2.7x longer with the
copy than with ``enable_gqa`` (same output to the last bit; ``benchmarks/inference_cost.py``).

transformers reads ``TRANSFORMERS_SDPA_FORCE_GQA`` at every attention call; :func:`grouped_kv_sdpa`
sets it for the duration of an inference call on the CPU and restores it after. Training is left
alone: its kernels and their gradients stay exactly as pinned.
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from typing import Iterator

import torch

FORCE_GQA = "TRANSFORMERS_SDPA_FORCE_GQA"


@contextmanager
def grouped_kv_sdpa(device: torch.device | str) -> Iterator[None]:
    """Within the block, masked SDPA on ``device`` attends grouped KV heads without copying them
    (CPU only; elsewhere, and when the switch is already on, nothing changes).

    >>> with grouped_kv_sdpa(model.lm_head.weight.device):
    ...     logits = model(input_ids=question, cache=cache, use_cache=True).logits
    """
    if torch.device(device).type != "cpu" or os.environ.get(FORCE_GQA) is not None:
        yield
        return
    os.environ[FORCE_GQA] = "1"
    try:
        yield
    finally:
        os.environ.pop(FORCE_GQA, None)
