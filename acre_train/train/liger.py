"""Liger kernels as per-kernel toggles: applied only with CUDA, never replacing the ACRE forward.

``apply_liger_kernel_to_<arch>(model=m, ...)`` would swap ``m.forward`` for its own fused-loss
forward if ``fused_linear_cross_entropy`` were on (CONVENTIONS.md). We therefore always pass
``fused_linear_cross_entropy=False`` and ``cross_entropy=False`` to the patcher and, when the recipe
asks for the fused loss, compute it ourselves from the ACRE hidden states (``LossModule``).
"""

from __future__ import annotations

import importlib
from typing import Callable

import torch
from torch import nn

from .recipe_schema import LigerSection

PATCHERS = {"llama": "apply_liger_kernel_to_llama", "qwen2": "apply_liger_kernel_to_qwen2",
            "qwen3": "apply_liger_kernel_to_qwen3", "mistral": "apply_liger_kernel_to_mistral"}


def apply_liger(model: nn.Module, toggles: LigerSection, log: Callable[[str], None] = print) -> dict[str, bool]:
    """Apply the enabled norm/SwiGLU/RoPE kernels; returns what is active (``fused_ce`` included)."""
    wanted = toggles.model_dump()
    if not any(wanted.values()):
        return {k: False for k in wanted}
    if not torch.cuda.is_available():
        log(f"liger kernels {sorted(k for k, v in wanted.items() if v)} requested but CUDA is not available: "
            "running without them (their Triton kernels only run on GPUs)")
        return {k: False for k in wanted}
    try:
        liger = importlib.import_module("liger_kernel.transformers")
    except ImportError:
        log("liger kernels requested but liger-kernel is not installed (pip install 'acre-train[gpu]'): running without them")
        return {k: False for k in wanted}
    patcher = getattr(liger, PATCHERS[model.config.model_type])
    patcher(model=model, rope=toggles.rope, rms_norm=toggles.rms_norm, swiglu=toggles.swiglu,
            cross_entropy=False, fused_linear_cross_entropy=False)
    log(f"liger kernels on: {sorted(k for k, v in wanted.items() if v)}")
    return wanted
