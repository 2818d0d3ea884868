"""A layer-by-layer forward over an explicit KV store, built from the model's own modules.

The training-free methods (CacheFocus, InfoFlow, CacheBlend, EPIC) need what a plain forward does
not give: keys cached at one position and attended at another, caches that differ per layer,
token rows that stop being computed half-way up the stack. This module runs the library's own
decoder layers (``model.model.layers[i]``) one at a time; the only thing it replaces is the KV
cache, by a :class:`StoreCache` seeded with *given* past keys/values that the layer appends to in
place, and the mask, which is built from explicit positions.

Order of KV entries does not matter: every entry carries its position, and the mask lets a query
at position ``p`` attend an entry at ``q`` iff ``q <= p``. RoPE is already in the keys, so an entry
can sit anywhere in the tensor. This is what makes selective recompute (replace some entries) and
pruning (drop some entries) plain tensor indexing.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import nn
from transformers.cache_utils import Cache

from ..infer.growing_cache import GrowingLayer
from ..infer.placement import execution_device
from ..modeling.rope import Rope
from ..modeling.sdpa import grouped_kv_sdpa

# Owner ids tag KV entries with the segment they came from (>= 0: document / chunk index).
PREFIX_OWNER = -1
QUERY_OWNER = -2


@dataclass
class LayerKV:
    """KV entries of one layer: post-RoPE keys, values, their positions and owner segment ids.

    ``keys``/``values``: ``(1, num_kv_heads, n, head_dim)``; ``positions``/``owners``: ``(n,)`` long.
    """

    keys: torch.Tensor
    values: torch.Tensor
    positions: torch.Tensor
    owners: torch.Tensor

    def __len__(self) -> int:
        return int(self.positions.shape[0])

    def cat(self, other: "LayerKV") -> "LayerKV":
        return LayerKV(
            torch.cat([self.keys, other.keys], dim=2),
            torch.cat([self.values, other.values], dim=2),
            torch.cat([self.positions, other.positions]),
            torch.cat([self.owners, other.owners]),
        )

    def take(self, index: torch.Tensor) -> "LayerKV":
        """Entries at ``index`` (long indices or a boolean mask)."""
        if index.dtype == torch.bool:
            index = index.nonzero().flatten()
        return LayerKV(self.keys[:, :, index], self.values[:, :, index], self.positions[index], self.owners[index])

    def sorted(self) -> "LayerKV":
        """Entries in position order (for inspection and comparisons; attention does not need it)."""
        return self.take(torch.argsort(self.positions, stable=True))

    def nbytes(self) -> int:
        return self.keys.numel() * self.keys.element_size() + self.values.numel() * self.values.element_size()


KVStore = list[LayerKV]


def cat_stores(a: KVStore, b: KVStore) -> KVStore:
    """Layer-wise concatenation of two stores."""
    if len(a) != len(b):
        raise ValueError(f"stores have {len(a)} and {len(b)} layers")
    return [x.cat(y) for x, y in zip(a, b)]


def store_nbytes(store: KVStore) -> int:
    return sum(layer.nbytes() for layer in store)


@dataclass
class ModelParts:
    """The pieces of a decoder-only HF model this engine drives (Llama / Qwen2 / Qwen3 / Mistral layout)."""

    embed: nn.Module
    layers: nn.ModuleList
    norm: nn.Module
    lm_head: nn.Module
    rope: Rope  # the model's RoPE (acre_train.modeling.rope)
    num_heads: int
    num_kv_heads: int
    head_dim: int
    execution_device: torch.device  # where inputs go (weights may be offloaded: acre_train.infer.placement)

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def device(self) -> torch.device:
        return self.execution_device

    @property
    def dtype(self) -> torch.dtype:
        return self.lm_head.weight.dtype

    def empty_layer(self) -> LayerKV:
        shape = (1, self.num_kv_heads, 0, self.head_dim)
        z = torch.zeros(shape, dtype=self.dtype, device=self.device)
        e = torch.zeros(0, dtype=torch.long, device=self.device)
        return LayerKV(z, z.clone(), e, e.clone())

    def empty_store(self) -> KVStore:
        return [self.empty_layer() for _ in range(self.num_layers)]

    def logits(self, hidden_last: torch.Tensor) -> torch.Tensor:
        """Next-token logits ``(vocab,)`` from the last layer's hidden state of one row."""
        return self.lm_head(self.norm(hidden_last.reshape(1, 1, -1)))[0, 0]


def model_parts(model: nn.Module) -> ModelParts:
    """Locate embed / layers / norm / lm_head / rotary module; refuse layouts this engine cannot drive."""
    inner = getattr(model, "model", None)
    needed = ("embed_tokens", "layers", "norm", "rotary_emb")
    if inner is None or not all(hasattr(inner, n) for n in needed) or not hasattr(model, "lm_head"):
        raise ValueError(
            f"{type(model).__name__} is not a Llama/Qwen2-style causal LM (needs model.model.{{{', '.join(needed)}}} "
            "and model.lm_head)"
        )
    cfg = model.config
    if "sliding_attention" in (getattr(cfg, "layer_types", None) or []):
        raise ValueError("models with sliding-window layers are not supported by the cache-editing methods")
    if getattr(cfg, "model_type", "") in {"gemma", "gemma2", "gemma3"}:
        raise ValueError("Gemma scales embeddings and soft-caps logits; this engine does not model that")
    heads = cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    return ModelParts(
        inner.embed_tokens, inner.layers, inner.norm, model.lm_head, Rope.of(model),
        heads, getattr(cfg, "num_key_value_heads", None) or heads, head_dim, execution_device(model),
    )


class StoreCache(Cache):
    """The transformers ``Cache`` a layer-by-layer pass hands the library's decoder layers.

    Layer ``i`` is seeded with the past entries it may attend (:meth:`seed`, one copy into a buffer with
    ``room`` spare slots); the layer's own ``update`` then writes its new keys and values in place and
    attends the filled part. So neither a pass over blocks nor a decoding step copies the past again,
    which a concatenating cache does on every call (the baselines' decoding at its floor).
    """

    def __init__(self, num_layers: int):
        super().__init__(layers=[GrowingLayer() for _ in range(num_layers)])

    def seed(self, index: int, past: LayerKV, room: int) -> None:
        layer = GrowingLayer(capacity=len(past) + room)
        layer.lazy_initialization(past.keys, past.values)
        layer.update(past.keys, past.values)
        self.layers[index] = layer

    def entries(self, index: int, start: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer ``index``'s keys and values from entry ``start`` on (views, no copy)."""
        layer = self.layers[index]
        return layer.keys[:, :, start:], layer.values[:, :, start:]


def position_mask(query_pos: torch.Tensor, key_pos: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Additive mask ``(1, 1, q, k)``: 0 where ``key_pos <= query_pos``, the dtype's min elsewhere.

    Float (not bool) so that both the eager and the SDPA attention functions read it the same way.
    """
    allowed = key_pos[None, :] <= query_pos[:, None]
    mask = torch.zeros(allowed.shape, dtype=dtype, device=query_pos.device)
    return mask.masked_fill_(~allowed, torch.finfo(dtype).min)[None, None]


@dataclass
class LayerEvent:
    """What an ``on_layer`` callback sees after layer ``index`` ran on the current rows."""

    index: int
    layer: nn.Module
    hidden_in: torch.Tensor  # (1, rows, hidden): input of this layer for the current rows
    positions: torch.Tensor  # (rows,)
    owners: torch.Tensor  # (rows,)
    cos: torch.Tensor  # (rows, head_dim)
    sin: torch.Tensor
    past: LayerKV  # entries the rows attended besides themselves
    new: LayerKV  # entries the rows just produced
    parts: ModelParts

    def attention_probs(self, rows: torch.Tensor | None = None) -> torch.Tensor:
        """Softmax attention ``(heads, q, past+new)`` of the given rows, recomputed plainly.

        Columns are ``past`` entries then ``new`` entries, masked by position as in the pass.
        """
        rows = torch.arange(self.hidden_in.shape[1], device=self.positions.device) if rows is None else rows
        q = query_states(self.layer, self.hidden_in[:, rows], self.cos[rows], self.sin[rows], self.parts)
        keys = torch.cat([self.past.keys, self.new.keys], dim=2)
        keys = keys.repeat_interleave(self.parts.num_heads // self.parts.num_kv_heads, dim=1)
        key_pos = torch.cat([self.past.positions, self.new.positions])
        scores = (q @ keys.transpose(-1, -2)) * self.layer.self_attn.scaling
        scores = scores + position_mask(self.positions[rows], key_pos, scores.dtype)
        return torch.softmax(scores.float(), dim=-1)[0]


def query_states(layer: nn.Module, hidden_in: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 parts: ModelParts) -> torch.Tensor:
    """Post-RoPE query states ``(1, heads, rows, head_dim)`` of a decoder layer for given inputs."""
    attn = layer.self_attn
    h = layer.input_layernorm(hidden_in)
    q = attn.q_proj(h).view(1, h.shape[1], -1, parts.head_dim)
    if hasattr(attn, "q_norm"):  # Qwen3-style per-head query norm, applied before RoPE
        q = attn.q_norm(q)
    q = q.transpose(1, 2)
    return parts.rope.apply(q, cos, sin)


@dataclass
class LayerControl:
    """A callback's answer: which rows go on to the next layer, which owners later layers drop."""

    keep_rows: torch.Tensor | None = None
    drop_owners: list[int] = field(default_factory=list)


@dataclass
class PassResult:
    hidden: torch.Tensor  # (1, rows_left, hidden) output of the last layer run
    positions: torch.Tensor  # positions of those rows
    store: KVStore  # per layer: past entries kept for that layer + entries produced there
    token_layers: int  # sum over layers of rows computed (the compute actually spent)


OnLayer = Callable[[LayerEvent], "LayerControl | None"]


@torch.no_grad()
def layer_pass(
    parts: ModelParts,
    ids: torch.Tensor,
    positions: torch.Tensor,
    owners: torch.Tensor,
    past: KVStore | None,
    *,
    num_layers: int | None = None,
    on_layer: OnLayer | None = None,
    override: bool = False,
    block_rows: int = 1024,
) -> PassResult:
    """Run token rows ``ids`` at ``positions`` through the first ``num_layers`` layers over ``past``.

    Each layer's rows attend that layer's past entries and themselves, by position. After each
    layer ``on_layer`` may shrink the rows (``keep_rows``, indices into the current rows) or drop
    owners from all later layers' past (``drop_owners``).

    ``override=True``: ``past`` holds cached entries for (some of) the rows' own positions; each
    layer ignores those and uses the rows' fresh ones instead (selective recompute). Rows dropped by
    ``keep_rows`` fall back to their cached entries in later layers.

    Rows are processed in position order, ``block_rows`` at a time; a block attends the blocks
    before it through their fresh entries. That is exact (causal attention never looks ahead) and
    keeps the explicit mask at ``block_rows x keys``.
    """
    num_layers = parts.num_layers if num_layers is None else num_layers
    past = parts.empty_store() if past is None else past
    if len(past) != parts.num_layers:
        raise ValueError(f"past store has {len(past)} layers, model has {parts.num_layers}")
    if ids.dim() != 1 or ids.shape != positions.shape or ids.shape != owners.shape:
        raise ValueError("ids, positions and owners must be 1-D tensors of one length")
    device = parts.device
    order = torch.argsort(positions.to(device), stable=True)
    ids, positions, owners = ids.to(device)[order], positions.to(device)[order], owners.to(device)[order]
    h = parts.embed(ids[None])
    cos, sin = parts.rope.cos_sin(positions, h.dtype)
    dropped: list[int] = []
    out_store: KVStore = []
    token_layers = 0
    for i in range(parts.num_layers):
        layer_past = past[i]
        if dropped:
            layer_past = layer_past.take(~torch.isin(layer_past.owners, torch.tensor(dropped, device=device)))
        if override and len(layer_past):
            layer_past = layer_past.take(~torch.isin(layer_past.positions, positions))
        if i >= num_layers or h.shape[1] == 0:
            out_store.append(layer_past)
            continue
        h_in = h
        h, new, whole = _run_layer(parts, i, h_in, positions, owners, cos, sin, layer_past, block_rows)
        token_layers += h.shape[1]
        out_store.append(whole)
        if on_layer is not None:
            control = on_layer(LayerEvent(i, parts.layers[i], h_in, positions, owners, cos, sin, layer_past, new, parts))
            if control is not None:
                dropped.extend(control.drop_owners)
                if control.keep_rows is not None:
                    keep = control.keep_rows.to(device)
                    h, positions, owners, cos, sin = h[:, keep], positions[keep], owners[keep], cos[keep], sin[keep]
    return PassResult(h, positions, out_store, token_layers)


def _run_layer(parts: ModelParts, i: int, h: torch.Tensor, positions: torch.Tensor, owners: torch.Tensor,
               cos: torch.Tensor, sin: torch.Tensor, past: LayerKV,
               block_rows: int) -> tuple[torch.Tensor, LayerKV, LayerKV]:
    """One library decoder layer over sorted rows, in blocks; returns its output, the new entries and
    past + new (views of one :class:`StoreCache` buffer, in which each block attends the past and the
    blocks before it)."""
    cache = StoreCache(parts.num_layers)
    cache.seed(i, past, room=h.shape[1])
    key_pos = past.positions
    outs: list[torch.Tensor] = []
    for a in range(0, h.shape[1], block_rows):
        sl = slice(a, a + block_rows)
        key_pos = torch.cat([key_pos, positions[sl]])
        with grouped_kv_sdpa(parts.device):  # masked attention over the store without KV-head copies
            outs.append(parts.layers[i](
                h[:, sl], attention_mask=position_mask(positions[sl], key_pos, h.dtype), position_ids=positions[None, sl],
                cache=cache, use_cache=True, position_embeddings=(cos[None, sl], sin[None, sl]),
            ))
    new = LayerKV(*cache.entries(i, len(past)), positions, owners)
    whole = LayerKV(*cache.entries(i), key_pos, torch.cat([past.owners, owners]))
    return torch.cat(outs, dim=1), new, whole


@torch.no_grad()
def greedy_decode(
    parts: ModelParts,
    store: KVStore,
    first_logits: torch.Tensor,
    next_position: int,
    max_new_tokens: int,
    stop_ids: set[int],
) -> list[int]:
    """Greedy decoding over an explicit store; the first token comes from ``first_logits``.

    Each step runs one token through every layer over a :class:`StoreCache` seeded once with the
    store: the step writes its key and value in place and reads the rest, copying nothing. Every entry
    of the store must sit before ``next_position`` (so a step attends all of them, with no mask)."""
    from ..infer.decode import decode

    device = parts.device
    cache = StoreCache(parts.num_layers)
    for i, layer_kv in enumerate(store):
        cache.seed(i, layer_kv, room=max_new_tokens)
    if any(len(layer_kv) and int(layer_kv.positions.max()) >= next_position for layer_kv in store):
        raise ValueError(f"the store holds entries at or after the first answer position {next_position}")
    pos = next_position

    def step(token: int) -> torch.Tensor:
        nonlocal pos
        p = torch.tensor([pos], device=device)
        h = parts.embed(torch.tensor([[token]], device=device))
        cos, sin = parts.rope.cos_sin(p, h.dtype)
        for layer in parts.layers:  # every entry is before the token: no mask
            h = layer(h, attention_mask=None, position_ids=p[None], cache=cache, use_cache=True,
                      position_embeddings=(cos[None], sin[None]))
        pos += 1
        return parts.logits(h[:, -1])

    return decode(first_logits, step, max_new_tokens=max_new_tokens, stop_ids=stop_ids)
