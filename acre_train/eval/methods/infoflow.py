"""InfoFlow KV and the baselines that share its engine: no-recompute, CacheBlend, EPIC (DESIGN §6).

1. ``prepare``: chunk-wise prefill. The instruction prefix is prefilled at positions ``0..P-1``;
   every document/chunk alone at *chunk-local* positions ``0..len-1`` (no prefix, no other chunk).
2. Re-rotation: chunks are laid out after the prefix (original order, or reordered, see 4) and
   their keys moved to global positions with ``Rope.reposition``.
3. Selection of context tokens to recompute, ``num_recomputed(ratio, N)`` of the ``N`` context tokens:
   - ``attention`` (InfoFlow): the question runs over the re-rotated cache up to the last layer of
     the band; at each band layer the softmax attention of every question token and head to every
     key is taken (columns over prefix + context + question, masked causally); a context token's
     score is the L2 norm of its column over (band layers, heads, question tokens). Top-r scores.
   - ``none``: nothing (``no-recompute``).
   - ``cacheblend``: all context tokens are recomputed up to ``blend_layer``; there the value
     deviation ``||v_fresh - v_cached||`` (over kv heads and dims) picks the top-r tokens, and only
     those continue up the stack (the others fall back to their cached entries).
   - ``epic``: the first ``ceil(ratio * len)`` tokens of every chunk.
4. ``reorder`` (attention selector only): chunks are re-laid out by ascending mean token score, so
   the most relevant chunk sits next to the question, before selection and recompute.
5. Recompute: the selected tokens and the question run through *all* layers under the global causal
   mask, each layer using fresh entries for the selected tokens and the re-rotated cached entries
   for the rest (``engine.layer_pass(override=True)``). With every token selected this is exactly
   a full prefill. Decoding then starts from the question's last row.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from .. import engine
from ...measure import Timer
from ..prompt import PreparedExample
from .base import (CostRecord, EvalMethod, GenerationConfig, MethodResult, encode_documents, finish_from_store, owners,
                   segment_positions, store_cost, tensor)

SELECTORS = ("attention", "none", "cacheblend", "epic")


def default_band(num_layers: int) -> list[int]:
    """Layers 22–25 of 32 (the paper's band) scaled to ``num_layers``."""
    lo = min(num_layers - 1, (22 * num_layers) // 32)
    hi = min(num_layers - 1, max(lo, (25 * num_layers) // 32))
    return list(range(lo, hi + 1))


def num_recomputed(ratio: float, n: int) -> int:
    """Tokens recomputed for a ratio: ``round(ratio * n)`` (half up), within ``[0, n]``."""
    if not 0.0 <= ratio <= 1.0:
        raise ValueError(f"ratio must be in [0, 1], got {ratio}")
    return max(0, min(n, int(math.floor(ratio * n + 0.5))))


@dataclass
class ChunkState:
    prefix: engine.KVStore  # positions 0..P-1
    chunks: list[engine.KVStore]  # chunk-local positions 0..len-1
    tokens_prefilled: int
    token_layers: int


@torch.no_grad()
def chunkwise_prepare(parts: engine.ModelParts, example: PreparedExample) -> ChunkState:
    """Prefix at its positions; every chunk alone at chunk-local positions."""
    prefix, chunks, token_layers = encode_documents(parts, example, after_prefix=False)
    return ChunkState(prefix, chunks, len(example.prefix_ids) + example.context_len, token_layers)


def layout(parts: engine.ModelParts, state: ChunkState, order: list[int]) -> tuple[engine.KVStore, int]:
    """Prefix + chunks in ``order``, re-rotated to contiguous global positions (entries in position order)."""
    store, pos = state.prefix, len(state.prefix[0])
    for d in order:
        n = len(state.chunks[d][0])
        new_pos = segment_positions(pos, n, parts.device)
        moved = [engine.LayerKV(parts.rope.reposition(l.keys, l.positions, new_pos), l.values, new_pos,
                                l.owners) for l in state.chunks[d]]
        store = engine.cat_stores(store, moved)
        pos += n
    return store, pos


@dataclass
class InfoFlowResult:
    store: engine.KVStore
    first_logits: torch.Tensor
    next_position: int
    order: list[int]  # chunk layout order
    selected: list[int]  # global positions of recomputed context tokens
    token_scores: torch.Tensor | None  # per context token in *original-order* layout (attention selector)
    chunk_scores: dict[int, float] | None
    costs: dict[str, int] = field(default_factory=dict)


def attention_scores(parts: engine.ModelParts, store: engine.KVStore, example: PreparedExample, q_start: int,
                     band: list[int]) -> tuple[torch.Tensor, int, int]:
    """Per context token: L2 norm of the question's attention over (band layers, heads, question tokens).

    Returns (scores of the ``N`` context tokens in layout order, rows run, token-layers spent).
    """
    dev, p, n = parts.device, len(example.prefix_ids), example.context_len
    s = len(example.suffix_ids)
    acc = torch.zeros(n, dtype=torch.float64, device=dev)

    def on_layer(ev: engine.LayerEvent) -> None:
        if ev.index in band:
            probs = ev.attention_probs()  # (heads, question, past + new)
            cols = torch.cat([ev.past.positions, ev.new.positions])
            ctx = (cols >= p) & (cols < p + n)
            acc.index_add_(0, cols[ctx] - p, probs[:, :, ctx].double().pow(2).sum(dim=(0, 1)))

    res = engine.layer_pass(parts, tensor(example.suffix_ids, dev), segment_positions(q_start, s, dev),
                            owners(engine.QUERY_OWNER, s, dev), store, num_layers=max(band) + 1, on_layer=on_layer)
    return acc.sqrt(), s, res.token_layers


def _checked(selector: str, reorder: bool, band: list[int] | None, blend_layer: int, num_layers: int) -> list[int]:
    """The options of one InfoFlow-family answer, checked; returns the scoring band."""
    if selector not in SELECTORS:
        raise ValueError(f"selector must be one of {SELECTORS}, got {selector!r}")
    if reorder and selector != "attention":
        raise ValueError("reorder needs the attention selector (it orders chunks by attention score)")
    band = default_band(num_layers) if band is None else list(band)
    if not band or any(not 0 <= b < num_layers for b in band):
        raise ValueError(f"band {band} must be non-empty layer indices in [0, {num_layers})")
    if selector == "cacheblend" and not 0 <= blend_layer < num_layers:
        raise ValueError(f"blend_layer {blend_layer} outside [0, {num_layers})")
    return band


def _chosen_rows(selector: str, token_scores: torch.Tensor | None, order: list[int], lens: list[int], ratio: float,
                 m: int, n: int, dev: torch.device) -> torch.Tensor:
    """Context rows (in layout order) each selector recomputes, sorted: ``attention`` the top ``m`` by
    score, ``epic`` the first ``ceil(ratio * len)`` of each chunk, ``cacheblend`` all of them up to its
    blend layer (where it keeps the ``m`` that deviate most), ``none`` nothing."""
    if selector == "attention":
        assert token_scores is not None
        in_layout = torch.cat([token_scores[sum(lens[:d]): sum(lens[:d]) + lens[d]] for d in order])
        chosen = torch.topk(in_layout, m).indices if m else torch.zeros(0, dtype=torch.long, device=dev)
    elif selector == "epic":
        rows, off = [], 0
        for d in order:
            rows.extend(range(off, off + min(lens[d], math.ceil(ratio * lens[d]))))
            off += lens[d]
        chosen = torch.tensor(rows, dtype=torch.long, device=dev)
    elif selector == "cacheblend":
        chosen = torch.arange(n, device=dev)
    else:
        chosen = torch.zeros(0, dtype=torch.long, device=dev)
    return torch.sort(chosen).values


@torch.no_grad()
def infoflow_answer(parts: engine.ModelParts, example: PreparedExample, state: ChunkState, *,
                    selector: str = "attention", ratio: float = 0.15, band: list[int] | None = None,
                    reorder: bool = False, blend_layer: int = 1) -> InfoFlowResult:
    """Steps 2–5 of the module docstring for one question."""
    L, dev = parts.num_layers, parts.device
    band = _checked(selector, reorder, band, blend_layer, L)
    p, n, s, k = len(example.prefix_ids), example.context_len, len(example.suffix_ids), example.num_docs
    order = list(range(k))
    store, q_start = layout(parts, state, order)
    costs = {"tokens": 0, "token_layers": 0, "recomputed": 0}
    token_scores = chunk_scores = None
    lens = [len(d) for d in example.doc_ids]
    if selector == "attention":
        token_scores, rows, tl = attention_scores(parts, store, example, q_start, band)
        costs["tokens"] += rows
        costs["token_layers"] += tl
        starts = [p + sum(lens[:d]) for d in range(k)]
        chunk_scores = {d: float(token_scores[starts[d] - p: starts[d] - p + lens[d]].mean()) for d in range(k)}
        if reorder:
            order = sorted(range(k), key=lambda d: (chunk_scores[d], d))
            store, q_start = layout(parts, state, order)
    # ids / owners of the context in layout order; index i <-> global position p + i
    layout_ids = tensor([t for d in order for t in example.doc_ids[d]], dev)
    layout_own = torch.cat([owners(d, lens[d], dev) for d in order])
    m = num_recomputed(ratio, n)
    chosen = _chosen_rows(selector, token_scores, order, lens, ratio, m, n, dev)
    blend: dict[str, torch.Tensor] = {}

    def on_layer(ev: engine.LayerEvent) -> engine.LayerControl | None:
        if selector != "cacheblend" or ev.index != blend_layer:
            return None
        is_ctx = ev.owners >= 0
        ctx_pos = ev.positions[is_ctx]
        fresh = ev.new.values[:, :, is_ctx]
        cached = store[ev.index].values[:, :, ctx_pos]  # layout store: entry index == position
        dev_norm = (fresh - cached).double().pow(2).sum(dim=(0, 1, 3)).sqrt()
        blend["deviation"] = torch.zeros(n, dtype=torch.float64, device=dev).index_copy_(0, ctx_pos - p, dev_norm)
        top = torch.topk(dev_norm, m).indices if m else torch.zeros(0, dtype=torch.long, device=dev)
        ctx_rows = is_ctx.nonzero().flatten()
        keep = torch.cat([ctx_rows[top], (~is_ctx).nonzero().flatten()])
        return engine.LayerControl(keep_rows=torch.sort(keep).values)

    rows_ids = torch.cat([layout_ids[chosen], tensor(example.suffix_ids, dev)])
    rows_pos = torch.cat([p + chosen, segment_positions(q_start, s, dev)])
    rows_own = torch.cat([layout_own[chosen], owners(engine.QUERY_OWNER, s, dev)])
    res = engine.layer_pass(parts, rows_ids, rows_pos, rows_own, store, override=True, on_layer=on_layer)
    costs["tokens"] += len(rows_ids)
    costs["token_layers"] += res.token_layers
    costs["recomputed"] = res.token_layers - s * L
    if selector == "cacheblend":
        dev_all = blend["deviation"]
        top = torch.topk(dev_all, m).indices if m else dev_all.new_zeros(0, dtype=torch.long)
        selected = sorted(int(x) + p for x in top)
        off, chunk_scores = 0, {}
        for d in order:
            chunk_scores[d] = float(dev_all[off: off + lens[d]].mean())
            off += lens[d]
    else:
        selected = [int(x) + p for x in chosen]
    return InfoFlowResult(res.store, parts.logits(res.hidden[:, -1]), q_start + s, order, selected, token_scores,
                          chunk_scores, costs)


@dataclass
class InfoFlow(EvalMethod):
    """InfoFlow KV: chunk-local prefill, re-rotation, attention-norm top-``ratio`` recompute.

    ``band``: layers as ``a-b`` or ``a,b,c`` (default: the paper's 22–25 of 32, scaled).
    """

    name = "infoflow"
    ratio: float = 0.15
    band: str = "auto"
    reorder: bool = False
    selector: str = "attention"
    blend_layer: int = 1

    def check(self) -> None:
        if not 0 < self.ratio <= 1:
            raise ValueError(f"ratio must be in (0, 1], got {self.ratio}")

    def _band(self, num_layers: int) -> list[int] | None:
        if self.band == "auto":
            return None
        if "-" in self.band:
            a, b = self.band.split("-")
            return list(range(int(a), int(b) + 1))
        return [int(x) for x in self.band.split(",")]

    def prepare(self, model, tokenizer, example):
        return chunkwise_prepare(engine.model_parts(model), example)

    def answer(self, model, tokenizer, example, state, generation: GenerationConfig) -> MethodResult:
        parts = engine.model_parts(model)
        timer = Timer(parts.device)
        r = infoflow_answer(parts, example, state, selector=self.selector, ratio=self.ratio,
                            band=self._band(parts.num_layers), reorder=self.reorder, blend_layer=self.blend_layer)
        ttft = timer.elapsed()
        kv, kv_bytes = store_cost(r.store)
        text, ids = finish_from_store(parts, tokenizer, r.store, r.first_logits, r.next_position, generation)
        cost = CostRecord(tokens_prefilled=state.tokens_prefilled + r.costs["tokens"],
                          token_layers_computed=state.token_layers + r.costs["token_layers"],
                          token_layers_recomputed=r.costs["recomputed"], kv_attended=kv, kv_bytes=kv_bytes,
                          ttft_s=ttft)
        ranking = None
        if r.chunk_scores is not None:
            ranking = sorted(r.chunk_scores, key=lambda d: (-r.chunk_scores[d], d))
        return MethodResult(text, ids, cost, kept_docs=None, doc_ranking=ranking, first_logits=r.first_logits,
                            extra={"recomputed_tokens": len(r.selected), "order": r.order})


@dataclass
class NoRecompute(InfoFlow):
    """Chunk-local caches re-rotated to global positions, nothing recomputed."""

    name = "no-recompute"
    selector: str = "none"


@dataclass
class CacheBlend(InfoFlow):
    """CacheBlend: top-``ratio`` tokens by value deviation at ``blend_layer`` are recomputed."""

    name = "cacheblend"
    selector: str = "cacheblend"


@dataclass
class Epic(InfoFlow):
    """EPIC: the first ``ceil(ratio * len)`` tokens of every chunk are recomputed."""

    name = "epic"
    selector: str = "epic"
