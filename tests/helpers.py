"""Helpers shared by several test modules (import as ``from helpers import ...``; pytest puts tests/ on the path)."""

from __future__ import annotations

import torch

from acre_train.modeling import acre_parameters, attach_acre
from acre_train.tiny import tiny_model

# A small slice of the built-in text: ~100 spans of 96-160 tokens, chunks of 32 then 16 tokens.
SMALL_DATA = ["data.prepare.token_budget=14000", "data.prepare.min_length=96", "data.prepare.max_length=160",
              "data.prepare.first_chunk=32", "data.prepare.stride=16", "data.prepare.intervals=[4, 8]"]


def perturbed_acre_model(arch: str = "qwen2", seed: int = 0, **kw):
    """A tiny ACRE model whose L1 weights differ from the base copies, so a mix-up cannot pass."""
    model = attach_acre(tiny_model(arch, seed=seed, **kw))
    torch.manual_seed(seed + 1)
    with torch.no_grad():
        for _, p in acre_parameters(model):
            p.add_(0.05 * torch.randn_like(p))
    return model


def random_ids(n: int, seed: int) -> list[int]:
    return torch.randint(2, 512, (n,), generator=torch.Generator().manual_seed(seed)).tolist()
