"""The ACRE model adapter: L1 parameters on a frozen Hugging Face causal LM (DESIGN.md §3–4).

``attach_acre(model)`` adds, per decoder layer, L1 copies of ``q/k/v`` (and optionally ``o``)
projections next to the base ones (``self_attn.acre_q_proj`` ...), one L1 embedding row
(``model.acre_embed_tokens``), freezes every base weight, and gives each attention module an ACRE
forward. The modules, norms, rotary embedding, MLPs and attention backends all stay transformers'
own; without ACRE inputs the model behaves exactly like the base model.

``acre_forward(model, ...)`` runs an interleaved batch and returns the loss over labelled raw tokens.

This module must stay self-contained (torch/transformers only, relative imports): exports copy it.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Callable, Iterable

import torch
import torch.nn.functional as F
from torch import nn

from .interleave import IGNORE_INDEX
from .rope import Rope
from .visibility import AttentionKernel, MemoryIndex

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3", "mistral")
L1_PROJECTIONS = ("q_proj", "k_proj", "v_proj")
ACRE_PREFIX = "acre_"
EMBED_NAME = "acre_embed_tokens"


@dataclass
class AcreOutput:
    """What ``acre_forward`` returns. ``loss`` is ``loss_sum / num_items`` (token-weighted)."""

    loss: torch.Tensor | None
    loss_sum: torch.Tensor | None
    num_tokens: int
    logits: torch.Tensor | None = None
    hidden_states: torch.Tensor | None = None


def check_supported(config) -> None:
    """Raise a clear error for architectures the adapter does not know."""
    model_type = getattr(config, "model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(
            f"ACRE supports the Llama-family decoder models {', '.join(SUPPORTED_MODEL_TYPES)}; "
            f"got model_type={model_type!r}"
        )


def attach_acre(model: nn.Module, *, train_o_proj: bool = False, lora: dict | None = None) -> nn.Module:
    """Add L1 parameters to ``model`` (a ``*ForCausalLM``) in place, freeze the base, return it.

    L1 projections start as copies of the base projections; the L1 embedding row starts as the EOS
    embedding. Works on the meta device too (nothing is copied there).

    ``lora={"rank": r, "alpha": a, "dropout": p}``: each L1 projection is a frozen copy of the base
    projection plus a peft LoRA delta (``lora_B`` starts at zero, so the untrained model equals the
    full-copy one); only the LoRA matrices and the L1 embedding train. ``None``: full copies train.

    >>> from transformers import AutoModelForCausalLM, Qwen2Config  # doctest: +SKIP
    >>> model = attach_acre(AutoModelForCausalLM.from_config(Qwen2Config(...)))  # doctest: +SKIP
    """
    config = model.config
    check_supported(config)
    if is_acre_model(model):
        raise ValueError("this model already has ACRE parameters attached")
    for param in model.parameters():
        param.requires_grad_(False)

    decoder = model.model
    for layer in decoder.layers:
        attn = layer.self_attn
        names = L1_PROJECTIONS + (("o_proj",) if train_o_proj else ())
        for name in names:
            copy = _trainable_copy(getattr(attn, name))
            setattr(attn, ACRE_PREFIX + name, copy if lora is None else _lora_wrap(copy, lora))
        attn.__class__ = _acre_attention_class(type(attn))

    base_embed = decoder.embed_tokens.weight
    l1_embed = nn.Embedding(1, base_embed.shape[1], device=base_embed.device, dtype=base_embed.dtype)
    with torch.no_grad():
        if base_embed.device.type != "meta":
            l1_embed.weight.copy_(base_embed[_eos_id(config)][None])
    l1_embed.weight.requires_grad_(True)
    setattr(decoder, EMBED_NAME, l1_embed)
    config.acre = {"train_o_proj": bool(train_o_proj), "format_version": 1, "l1": "full" if lora is None else "lora"}
    if lora is not None:
        config.acre["lora"] = _lora_settings(lora)
    return model


def attach_from_section(model: nn.Module, section: dict | None) -> nn.Module:
    """``attach_acre`` with the options an ACRE config's ``acre`` section recorded (exports, checkpoints)."""
    section = section or {}
    lora = section.get("lora") if section.get("l1", "full") == "lora" else None
    return attach_acre(model, train_o_proj=bool(section.get("train_o_proj", False)), lora=lora)


LORA_ADAPTER = "acre"  # the peft adapter name inside every L1 projection


def _lora_settings(lora: dict) -> dict:
    unknown = set(lora) - {"rank", "alpha", "dropout"}
    if unknown:
        raise ValueError(f"unknown LoRA setting(s) {sorted(unknown)}; known: rank, alpha, dropout")
    rank = int(lora.get("rank", 16))
    if rank < 1:
        raise ValueError(f"LoRA rank must be >= 1, got {rank}")
    return {"rank": rank, "alpha": float(lora.get("alpha", 2 * rank)), "dropout": float(lora.get("dropout", 0.0))}


def _lora_wrap(copy: nn.Linear, lora: dict) -> nn.Module:
    """A frozen copy + peft LoRA delta (peft's own ``lora.Linear``: its init, scaling and dropout)."""
    from peft import LoraConfig
    from peft.tuners.lora import Linear as LoraLinear

    settings = _lora_settings(lora)
    limit = min(copy.in_features, copy.out_features)
    if settings["rank"] > limit:  # checked before peft allocates rank x width matrices
        raise ValueError(f"LoRA rank {settings['rank']} exceeds the L1 projection's size ({copy.in_features} -> "
                         f"{copy.out_features}): a delta of rank > {limit} is not low-rank; lower model.lora.rank "
                         "or train full copies (model.l1=full)")
    copy.requires_grad_(False)
    config = LoraConfig(r=settings["rank"], lora_alpha=settings["alpha"], lora_dropout=settings["dropout"])
    layer = LoraLinear(copy, LORA_ADAPTER, config=config, r=settings["rank"], lora_alpha=settings["alpha"],
                       lora_dropout=settings["dropout"])
    layer.to(device=copy.weight.device, dtype=copy.weight.dtype)
    copy.requires_grad_(False)  # peft may flip requires_grad on the base layer; it stays frozen
    return layer


def is_acre_model(model: nn.Module) -> bool:
    return hasattr(getattr(model, "model", None), EMBED_NAME)


def _trainable_copy(linear: nn.Linear) -> nn.Linear:
    copy = nn.Linear(linear.in_features, linear.out_features, bias=linear.bias is not None,
                     device=linear.weight.device, dtype=linear.weight.dtype)
    with torch.no_grad():
        if linear.weight.device.type != "meta":
            copy.weight.copy_(linear.weight)
            if linear.bias is not None:
                copy.bias.copy_(linear.bias)
    copy.requires_grad_(True)
    return copy


def _eos_id(config) -> int:
    eos = getattr(config, "eos_token_id", None)
    if isinstance(eos, (list, tuple)):
        eos = eos[0] if eos else None
    if eos is None:
        raise ValueError("the model config has no eos_token_id to initialise the L1 embedding from")
    return int(eos)


# --------------------------------------------------------------------------------------- attention

_ACRE_CLASSES: dict[type, type] = {}


def _acre_attention_class(base_cls: type) -> type:
    """A subclass of the library's attention class with the ACRE forward (one per base class)."""
    if base_cls not in _ACRE_CLASSES:
        module = inspect.getmodule(base_cls)
        _ACRE_CLASSES[base_cls] = type(
            f"Acre{base_cls.__name__}",
            (AcreAttentionMixin, base_cls),
            {"_rotate_half": staticmethod(module.rotate_half),
             "_apply_rope": staticmethod(module.apply_rotary_pos_emb)},
        )
    return _ACRE_CLASSES[base_cls]


class AcreAttentionMixin:
    """Selective windowed attention with L1 projections; falls back to the base forward otherwise.

    The ACRE layout reaches every layer as the ``acre_layout`` keyword: transformers forwards extra
    model keywords down to the attention modules, so no model code is copied or patched.
    """

    def forward(self, hidden_states, position_embeddings, attention_mask, cache=None, **kwargs):
        layout = kwargs.get("acre_layout")
        if layout is None:
            return super().forward(hidden_states, position_embeddings, attention_mask, cache=cache, **kwargs)
        bsz, n, _ = hidden_states.shape
        shape = (bsz, n, -1, self.head_dim)
        rows = layout.l1_rows
        query = _mixed_linear(self.q_proj, self.acre_q_proj, hidden_states, rows).view(shape)
        key = _mixed_linear(self.k_proj, self.acre_k_proj, hidden_states, rows).view(shape)
        value = _mixed_linear(self.v_proj, self.acre_v_proj, hidden_states, rows).view(shape).transpose(1, 2)
        if getattr(self, "q_norm", None) is not None:  # Qwen3: per-head norms before RoPE
            query, key = self.q_norm(query), self.k_norm(key)
        query, key = query.transpose(1, 2), key.transpose(1, 2)

        cos, sin = position_embeddings
        query_rot, key_rot = self._apply_rope(query, key, cos, sin)
        if layout.kernel.capture is not None:
            layout.kernel.capture(self.layer_idx, query_rot, key, value)
        memory_key, memory_value = layout.memory_kv(key, value)
        out = layout.kernel.attend(self, query_rot, key_rot, value, memory_key, memory_value, hidden_states.dtype)
        out = out.reshape(bsz, n, -1)
        out = _mixed_linear(self.o_proj, getattr(self, "acre_o_proj", None), out, rows)
        return out, None


def _mixed_linear(base: nn.Linear, l1: nn.Linear | None, x: torch.Tensor, l1_rows: torch.Tensor) -> torch.Tensor:
    """``base(x)`` with the L1 rows (flat indices into ``x``'s tokens) replaced by ``l1(x)``."""
    out = base(x)
    if l1 is None or l1_rows.numel() == 0:
        return out
    flat_x = x.reshape(-1, x.shape[-1])
    flat = out.reshape(-1, out.shape[-1])
    return flat.index_copy(0, l1_rows, l1(flat_x.index_select(0, l1_rows))).view(out.shape)


class AcreLayout:
    """Everything a layer needs about an interleaved batch, computed once per forward."""

    def __init__(self, kernel: AttentionKernel, l1_rows: torch.Tensor, memory_cos: torch.Tensor, memory_sin: torch.Tensor,
                 rope: Rope):
        self.kernel = kernel
        self.rope = rope
        self.l1_rows = l1_rows
        self.memory = kernel.memory
        self.memory_cos = memory_cos[:, None]  # [B, 1, m, D], broadcast over heads
        self.memory_sin = memory_sin[:, None]

    def memory_kv(self, key: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """L1 tokens' keys rotated at memory positions ``j`` (from pre-RoPE keys) and their values."""
        index = self.memory.token_index[:, None, :, None].expand(-1, key.shape[1], -1, key.shape[-1])
        mem_key = key.gather(2, index)
        mem_value = value.gather(2, index)
        mem_key = self.rope.apply(mem_key, self.memory_cos.to(key.dtype), self.memory_sin.to(key.dtype))
        return mem_key, mem_value


# ----------------------------------------------------------------------------------------- forward

def default_kernel(device: torch.device | str) -> str:
    """``chunked`` everywhere: memory grows with the chunk only and SDPA's causal (flash) kernels
    apply on every device. ``flex`` is opt-in and CUDA-only (see :func:`check_kernel`)."""
    del device
    return "chunked"


FLEX_ON_CPU = ("kernel 'flex' is refused on CPU: compiled flex attention on CPU returns NaN or wrong values at "
               "some shapes and cannot compile a second sequence length in one process (a torch limitation, "
               "not the mask's); use 'chunked' (the default) or 'dense'")


def check_kernel(kind: str, device: torch.device | str) -> None:
    """Refuse kernel/device pairs known to give wrong results."""
    if kind == "flex" and torch.device(device).type == "cpu":
        raise ValueError(FLEX_ON_CPU)


def build_layout(
    model: nn.Module,
    *,
    is_l1: torch.Tensor,
    chunk_ids: torch.Tensor,
    positions: torch.Tensor,
    memory_positions: torch.Tensor,
    hidden_like: torch.Tensor,
    kernel: str | None = None,
    backend: str | None = None,
    prefix: Callable[[int], tuple[torch.Tensor, torch.Tensor]] | None = None,
    capture: Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], None] | None = None,
) -> AcreLayout:
    """The per-forward ACRE layout, with bounds checked against the model's position range."""
    check_positions(model.config, positions, memory_positions)
    memory = MemoryIndex.from_batch(is_l1, chunk_ids, memory_positions)
    kernel = kernel or default_kernel(is_l1.device)
    check_kernel(kernel, is_l1.device)
    attention = AttentionKernel(
        kind=kernel,
        backend=backend or _default_backend(model.config),
        chunk_ids=chunk_ids,
        positions=positions,
        is_l1=is_l1,
        memory=memory,
        prefix=prefix,
        capture=capture,
    )
    l1_rows = torch.nonzero(is_l1.reshape(-1), as_tuple=False).reshape(-1)
    mem_cos, mem_sin = model.model.rotary_emb(hidden_like, memory.positions)
    return AcreLayout(attention, l1_rows, mem_cos, mem_sin, Rope.of(model))


def _default_backend(config) -> str:
    return "eager" if getattr(config, "_attn_implementation", "sdpa") == "eager" else "sdpa"


def check_positions(config, positions: torch.Tensor, memory_positions: torch.Tensor) -> None:
    """Compressed positions must stay inside the model's trained position range."""
    limit = getattr(config, "max_position_embeddings", None)
    if limit is None or positions.numel() == 0:
        return
    highest = int(torch.maximum(positions.max(), memory_positions.max()))
    if highest >= limit:
        raise ValueError(
            f"the interleaved sequence reaches RoPE position {highest}, but the model's "
            f"max_position_embeddings is {limit}: use a larger L1 interval, a smaller first chunk / "
            f"stride, or a shorter sequence"
        )


def embed_interleaved(model: nn.Module, input_ids: torch.Tensor, is_l1: torch.Tensor) -> torch.Tensor:
    """Token embeddings with L1 slots replaced by the L1 embedding row."""
    decoder = model.model
    embeds = decoder.embed_tokens(input_ids)
    l1 = getattr(decoder, EMBED_NAME).weight[0].to(embeds.dtype)
    return torch.where(is_l1[..., None], l1, embeds)


def acre_forward(
    model: nn.Module,
    *,
    input_ids: torch.Tensor,
    is_l1: torch.Tensor,
    chunk_ids: torch.Tensor,
    positions: torch.Tensor,
    memory_positions: torch.Tensor,
    labels: torch.Tensor | None = None,
    num_items_in_batch: int | torch.Tensor | None = None,
    kernel: str | None = None,
    backend: str | None = None,
    return_logits: bool = False,
    prefix: Callable[[int], tuple[torch.Tensor, torch.Tensor]] | None = None,
    capture: Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], None] | None = None,
) -> AcreOutput:
    """Run an interleaved batch (tensors ``[B, n]`` as produced by the interleave plan + padding).

    Padding: ``chunk_ids = -1``, ``labels = IGNORE_INDEX``, ``is_l1 = False``. The loss is the sum of
    cross-entropies over labelled tokens divided by ``num_items_in_batch`` (when given, so gradient
    accumulation weights tokens, not micro-batches) or by the batch's own labelled-token count.
    Logits are computed only where labels are set unless ``return_logits``.

    Inference hooks: ``prefix(layer_idx) -> (keys, values)`` adds already-rotated keys ``[B, H_kv, P, D]``
    that every query sees (the bi-layer cache; chunked kernel); ``capture(layer_idx, query_rot,
    key_pre_rope, value)`` is called in every layer with ``[B, H*, n, D]`` tensors.
    """
    is_l1 = is_l1.bool()
    embeds = embed_interleaved(model, input_ids, is_l1)
    layout = build_layout(
        model, is_l1=is_l1, chunk_ids=chunk_ids, positions=positions, memory_positions=memory_positions,
        hidden_like=embeds, kernel=kernel, backend=backend, prefix=prefix, capture=capture,
    )
    # A ready 4-D mask makes transformers skip building its own causal mask (O(n^2) for eager);
    # the ACRE kernels build theirs from the layout.
    no_mask = embeds.new_zeros(embeds.shape[0], 1, 0, 0, dtype=torch.bool)
    hidden = model.model(
        inputs_embeds=embeds, position_ids=positions, attention_mask=no_mask, use_cache=False, acre_layout=layout,
    ).last_hidden_state

    logits = model.lm_head(hidden) if return_logits else None
    if labels is None:
        return AcreOutput(loss=None, loss_sum=None, num_tokens=0, logits=logits, hidden_states=hidden)
    selected = labels != IGNORE_INDEX
    count = int(selected.sum())
    if logits is not None:
        loss_sum = F.cross_entropy(logits[selected].float(), labels[selected], reduction="sum")
    else:
        loss_sum = chunked_lm_loss(model.lm_head, hidden[selected], labels[selected])
    denominator = num_items_in_batch if num_items_in_batch is not None else max(count, 1)
    if isinstance(denominator, torch.Tensor):
        denominator = denominator.to(loss_sum.device)
    return AcreOutput(loss=loss_sum / denominator, loss_sum=loss_sum, num_tokens=count, logits=logits, hidden_states=hidden)


def acre_layers_from(
    model: nn.Module,
    hidden: torch.Tensor,
    *,
    first_layer: int,
    is_l1: torch.Tensor,
    chunk_ids: torch.Tensor,
    positions: torch.Tensor,
    memory_positions: torch.Tensor,
    kernel: str | None = None,
    backend: str | None = None,
    prefix: Callable[[int], tuple[torch.Tensor, torch.Tensor]] | None = None,
    capture: Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], None] | None = None,
) -> torch.Tensor:
    """:func:`acre_forward`'s decoder layers from ``first_layer`` on, and the final norm, given the
    hidden states ``[B, n, d]`` entering that layer (the layers below ran in an earlier forward).

    The loop is the base model's own (each decoder layer with the rotary embeddings of ``positions``);
    the ACRE layout reaches the attention as in :func:`acre_forward`.
    """
    inner = model.model
    n_layers = model.config.num_hidden_layers
    if not 0 < first_layer < n_layers:
        raise ValueError(f"first_layer must lie in 1..{n_layers - 1}, got {first_layer}")
    layout = build_layout(
        model, is_l1=is_l1.bool(), chunk_ids=chunk_ids, positions=positions, memory_positions=memory_positions,
        hidden_like=hidden, kernel=kernel, backend=backend, prefix=prefix, capture=capture,
    )
    no_mask = hidden.new_zeros(hidden.shape[0], 1, 0, 0, dtype=torch.bool)
    position_embeddings = inner.rotary_emb(hidden, positions)
    for layer in inner.layers[first_layer:n_layers]:
        hidden = layer(hidden, attention_mask=no_mask, position_embeddings=position_embeddings, position_ids=positions,
                       use_cache=False, acre_layout=layout)
        hidden = hidden[0] if isinstance(hidden, tuple) else hidden
    return inner.norm(hidden)


LM_HEAD_ROWS = 512  # rows of logits alive at once: 512 x 152K vocab x 4 B = 0.3 GB instead of 1.2 GB at 2K


def chunked_lm_loss(lm_head: nn.Module, hidden: torch.Tensor, labels: torch.Tensor, rows: int | None = None) -> torch.Tensor:
    """Summed cross-entropy of ``lm_head(hidden)`` against ``labels``, ``rows`` tokens at a time.

    Each slice's logits are recomputed in the backward pass (non-reentrant checkpoint), so full
    logits (tokens x vocabulary, fp32) never exist in forward or backward; the result and its
    gradients equal the one-shot computation.
    """
    from torch.utils.checkpoint import checkpoint

    rows = rows or LM_HEAD_ROWS

    def piece(h: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(lm_head(h).float(), y, reduction="sum")

    if hidden.shape[0] <= rows:
        return piece(hidden, labels)
    run = piece if not torch.is_grad_enabled() else (
        lambda h, y: checkpoint(piece, h, y, use_reentrant=False))
    return sum(run(hidden[s:s + rows], labels[s:s + rows]) for s in range(0, hidden.shape[0], rows))


# -------------------------------------------------------------------------------------- parameters

def acre_parameters(model: nn.Module) -> Iterable[tuple[str, nn.Parameter]]:
    """The L1 parameters (the only trainable ones), by name."""
    return ((name, p) for name, p in model.named_parameters() if _is_acre_name(name))


def _is_acre_name(name: str) -> bool:
    # ``base_layer``: the frozen copy inside a LoRA L1 projection (rebuilt from the base, never stored).
    parts = name.split(".")
    return any(part.startswith(ACRE_PREFIX) for part in parts) and "base_layer" not in parts


def acre_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The L1 weights only (what checkpoints and adapter-only exports hold)."""
    return {name: p.detach() for name, p in acre_parameters(model)}


def load_acre_state_dict(model: nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Load L1 weights; every L1 parameter must be present and nothing else may be."""
    own = dict(acre_parameters(model))
    missing = sorted(set(own) - set(state))
    unexpected = sorted(set(state) - set(own))
    if missing or unexpected:
        raise ValueError(f"L1 weights do not match this model: missing {missing[:4]}, unexpected {unexpected[:4]}")
    with torch.no_grad():
        for name, tensor in state.items():
            if own[name].shape != tensor.shape:
                raise ValueError(f"L1 weight {name} has shape {tuple(tensor.shape)}, the model expects {tuple(own[name].shape)}")
            own[name].copy_(tensor)


def count_parameters(model: nn.Module) -> dict[str, int]:
    """Parameter counts by group: each L1 projection kind, the L1 embedding, the frozen base, totals.

    >>> count_parameters(model)["trainable"]  # Qwen2.5-3B shape, q/k/v + embedding: 188,837,888  # doctest: +SKIP
    """
    groups: dict[str, int] = {}
    trainable = frozen = 0
    for name, p in model.named_parameters():
        n = p.numel()
        if p.requires_grad:
            trainable += n
            group = next((part for part in name.split(".") if part.startswith(ACRE_PREFIX)), "other trainable")
            groups[group] = groups.get(group, 0) + n
        else:
            frozen += n
    return {**dict(sorted(groups.items())), "trainable": trainable, "frozen": frozen, "total": trainable + frozen}
