"""Tiny Llama-family models built in-process (tests, quickstart, benchmarks; nothing downloaded).

They go through exactly the code paths real checkpoints use; only the sizes differ.
"""

from __future__ import annotations

import torch
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig, PreTrainedModel

TINY_SIZES = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  head_dim=16)  # explicit: Qwen3 would default to 128


def tiny_config(
    model_type: str = "qwen2",
    *,
    vocab_size: int = 512,
    max_position_embeddings: int = 32768,
    eos_token_id: int = 1,
    attn_implementation: str = "sdpa",
    **overrides,
) -> PretrainedConfig:
    """A small config of a supported architecture, GQA on (4 query heads, 2 KV heads) by default."""
    sizes = {**TINY_SIZES, **overrides}
    if "head_dim" not in overrides:  # keep head_dim consistent with an overridden width
        sizes["head_dim"] = sizes["hidden_size"] // sizes["num_attention_heads"]
    config = AutoConfig.for_model(
        model_type,
        vocab_size=vocab_size,
        max_position_embeddings=max_position_embeddings,
        eos_token_id=eos_token_id,
        bos_token_id=None,
        pad_token_id=None,
        tie_word_embeddings=False,
        **sizes,
    )
    config._attn_implementation = attn_implementation
    return config


def tiny_model(model_type: str = "qwen2", *, seed: int = 0, **config_overrides) -> PreTrainedModel:
    """A randomly initialised fp32 tiny model in eval mode (dropout off), reproducible by ``seed``."""
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(model_type, **config_overrides), dtype=torch.float32)
    return model.eval()
