"""What a training step computes, in FLOPs, so the log can say how close a step runs to the machine's peak.

The estimate counts matrix multiplies only (they are >95 % of the work): the decoder's linear layers
on every token, the LM head on labelled tokens, and attention's two products over the keys each
token sees. Frozen base weights need no weight gradient, so the backward pass costs one forward's
matmuls (gradients with respect to the inputs) plus, for attention, two; trainable L1 weights are a
rounding error and are ignored. Under ACRE a token at RoPE position ``p`` sees exactly ``p + 1``
keys (its chunk up to itself and every earlier L1 token), so attention's work is read off the
positions.
"""

from __future__ import annotations

import torch
from torch import nn


def linear_params(model: nn.Module) -> tuple[int, int]:
    """(weights of the decoder layers' linear maps, weights of the LM head), L1 copies and LoRA deltas excluded."""
    model = model.get_base_model() if hasattr(model, "get_base_model") else model  # a peft LoRA (SFT-vanilla)
    decoder = 0
    for name, module in model.model.layers.named_modules():
        if isinstance(module, nn.Linear) and ".acre_" not in f".{name}" and ".lora_" not in f".{name}":
            decoder += module.weight.numel()
    return decoder, model.lm_head.weight.numel()


def step_flops(model: nn.Module, batches: list[dict[str, torch.Tensor]], trains_base: bool = False) -> float:
    """Forward + backward FLOPs of one optimizer step over ``batches`` (its micro-batches)."""
    decoder, head = linear_params(model)
    config = (model.get_base_model() if hasattr(model, "get_base_model") else model).config
    width = config.num_attention_heads * (getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads)
    backward_linear = 2 if trains_base else 1  # input grads (+ weight grads when the base trains)
    total = 0.0
    for b in batches:
        if "sim_scalars" in b:  # refilled layout: the context's plan, then the open chunk (its prefix not counted)
            real = b["sim_ctx_chunk_ids"] >= 0
            open_real = torch.arange(b["sim_open_positions"].shape[1])[None] < b["sim_open_positions_len"][:, None]
            keys = float((b["sim_ctx_positions"][real] + 1).sum() + (b["sim_open_positions"][open_real] + 1).sum())
            tokens = int(real.sum() + open_real.sum())
            labelled = int((b["labels"] != -100).sum())
            forward = 2.0 * decoder * tokens + 2.0 * head * labelled
            total += forward * (1 + backward_linear) + 4.0 * keys * width * config.num_hidden_layers * 3
            continue
        if "chunk_ids" in b:  # ACRE: padding has chunk id -1
            real = b["chunk_ids"] >= 0
            keys = float((b["positions"][real] + 1).sum())
        else:  # plain causal attention per row
            real = b["attention_mask"].bool()
            lengths = real.sum(-1).double()
            keys = float((lengths * (lengths + 1) / 2).sum())
        tokens = int(real.sum())
        labelled = int((b["labels"] != -100).sum())
        forward = 2.0 * decoder * tokens + 2.0 * head * labelled
        attention = 4.0 * keys * width * config.num_hidden_layers  # QK^T and AV
        total += forward * (1 + backward_linear) + attention * 3
    return total
