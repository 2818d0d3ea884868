"""Grouped key/value heads in SDPA on the CPU, for inference calls.

Two costs of transformers' ``sdpa`` attention on the CPU, both avoided inside :func:`grouped_kv_sdpa`:

* **Masked calls copy the KV heads.** transformers copies the key/value heads up to the query heads
  (``repeat_kv``) whenever a mask is passed, because CUDA's fused kernels take a mask or grouped heads,
  not both. PyTorch's CPU kernel takes both. For a question over a long cache that copy is most of the
  work: with Qwen2.5-0.5B's 2 KV heads and 14 query heads, 32 queries over 16K keys took 2.7x longer with
  the copy than with ``enable_gqa`` (same output to the last bit). transformers reads
  ``TRANSFORMERS_SDPA_FORCE_GQA`` at every attention call; the block sets it.
* **One query token runs per head.** A decoding step's single query row goes through SDPA's grouped
  path one head at a time. Folding the query heads that share a KV head into rows of that head
  (``[B, H, 1, D]`` -> ``[B, H_kv, H / H_kv, D]``, one softmax per row over the same keys) is the same
  arithmetic in about half the time on CPU (``benchmarks/inference_cost.py --compare-fold``).
  transformers folds the same way only when a mask is passed and the switch above is off; the block
  routes every single-query call there (the ACRE kernels' decoding steps and the baselines' alike).

Training is left alone: its kernels and their gradients stay exactly as pinned.
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from typing import Iterator

import torch
import torch.nn.functional as F

FORCE_GQA = "TRANSFORMERS_SDPA_FORCE_GQA"


def single_query_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                           mask: torch.Tensor | None = None, scaling: float | None = None) -> torch.Tensor:
    """Attention of one query token ``[B, H, 1, D]`` over grouped heads ``[B, H_kv, K, D]``, in SDPA's layout
    ``[B, H, 1, D]``: each KV head's query heads become rows, so no head is copied or run alone.

    ``mask``: ``None`` or one shared by every head (``[B or 1, 1, 1, K]``, boolean or additive).
    """
    bsz, heads, _, dim = query.shape
    groups = heads // key.shape[1]
    folded = query.reshape(bsz, key.shape[1], groups, dim)
    out = F.scaled_dot_product_attention(folded, key, value, attn_mask=mask, scale=scaling)
    return out.reshape(out.shape[0], heads, 1, value.shape[-1])


def _single_query_sdpa(fallback):
    """transformers' attention-function signature: single-query calls folded, everything else to ``fallback``."""

    def attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None, **kwargs):
        simple = (query.shape[2] == 1 and key.shape[1] < query.shape[1] and not dropout
                  and kwargs.get("position_bias") is None and kwargs.get("softcap") is None
                  and not kwargs.get("output_attentions") and (attention_mask is None or attention_mask.shape[1] == 1))
        if not simple:
            return fallback(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                            is_causal=is_causal, **kwargs)
        out = single_query_attention(query, key, value, attention_mask, scaling)
        return out.transpose(1, 2).contiguous(), None

    attention.acre_single_query = True
    return attention


@contextmanager
def grouped_kv_sdpa(device: torch.device | str) -> Iterator[None]:
    """Within the block, SDPA on ``device`` attends grouped KV heads without copying them, and folds a single
    query token's heads into rows (CPU only; elsewhere, and when the switch is already on, nothing changes).

    >>> with grouped_kv_sdpa(model.lm_head.weight.device):
    ...     logits = model(input_ids=question, cache=cache, use_cache=True).logits
    """
    if torch.device(device).type != "cpu" or os.environ.get(FORCE_GQA) is not None:
        yield
        return
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    os.environ[FORCE_GQA] = "1"
    # the instance's own (local) entry, put back as it was after: library-wide registrations stay untouched
    had_local = "sdpa" in getattr(ALL_ATTENTION_FUNCTIONS, "_local_mapping", {})
    previous = ALL_ATTENTION_FUNCTIONS["sdpa"]
    ALL_ATTENTION_FUNCTIONS["sdpa"] = _single_query_sdpa(previous)
    try:
        yield
    finally:
        os.environ.pop(FORCE_GQA, None)
        if had_local:
            ALL_ATTENTION_FUNCTIONS["sdpa"] = previous
        else:
            del ALL_ATTENTION_FUNCTIONS["sdpa"]
