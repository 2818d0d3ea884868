"""CacheFocus (training-free; DESIGN §6).

1. ``prepare``: the instruction prefix is prefilled once; every document is prefilled alone after
   it (attending the prefix only) at positions ``P .. P+len-1``. Query-independent, reusable.
2. Re-positioning: documents are laid out one after another (doc ``i`` starts at ``P + sum of
   earlier lengths``) by un-rotating and re-rotating their cached keys (``Rope.reposition``).
3. Layer-adaptive pruning (query pass 1): the question runs up the stack; after every ``n``-th layer
   (layers ``n-1, 2n-1, ...``) the question's attention mass per document — softmax over all
   entries, summed over the document's entries, mean over heads and question tokens — ranks the
   documents still kept, and the lowest are dropped from all later layers. ``pruning_schedule``
   gives how many remain after each pruning layer: ``k - k_finish`` documents in ``L // n`` equal
   steps (``k_prune = (k - k_finish) / (L / n)``, the remainder going to the earliest steps), ending
   at exactly ``k_finish``.
4. Allocation: the surviving documents are re-positioned contiguously after the prefix, in their
   original order (``align``) or by ascending final attention mass so the most relevant one sits
   next to the question (``sort``).
5. Query pass 2: the question runs again over the re-allocated cache (its pass-1 entries were
   computed at the old positions and against a different cache) and decoding starts.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .. import engine
from ...measure import Timer
from ..prompt import PreparedExample
from .base import (CostRecord, EvalMethod, GenerationConfig, MethodResult, encode_documents, finish_from_store, owners,
                   segment_positions, store_cost, tensor)


def pruning_schedule(num_docs: int, num_layers: int, every: int, k_finish: int) -> dict[int, int]:
    """``{layer index: documents kept after that layer}`` for the pruning layers ``every-1, 2*every-1, ...``."""
    if every <= 0 or k_finish <= 0:
        raise ValueError(f"n and k_finish must be positive, got n={every}, k_finish={k_finish}")
    steps = num_layers // every
    if steps == 0:
        raise ValueError(f"cachefocus: n={every} exceeds the model's {num_layers} layers; no layer would prune")
    to_prune = max(0, num_docs - k_finish)
    base, extra = divmod(to_prune, steps)
    schedule, kept = {}, num_docs
    for s in range(steps):
        kept -= base + (1 if s < extra else 0)
        schedule[(s + 1) * every - 1] = kept
    return schedule


@dataclass
class CacheFocusState:
    prefix: engine.KVStore
    docs: list[engine.KVStore]  # each at positions P .. P+len-1
    tokens_prefilled: int
    token_layers: int


@dataclass
class CacheFocusTrace:
    masses: dict[int, dict[int, float]] = field(default_factory=dict)  # layer -> doc -> mass
    kept: dict[int, list[int]] = field(default_factory=dict)  # layer -> docs kept after it


@torch.no_grad()
def cachefocus_prepare(parts: engine.ModelParts, example: PreparedExample) -> CacheFocusState:
    """Prefix once, then every document after the prefix, independently."""
    prefix, docs, token_layers = encode_documents(parts, example, after_prefix=True)
    return CacheFocusState(prefix, docs, len(example.prefix_ids) + example.context_len, token_layers)


def _layout(parts: engine.ModelParts, state: CacheFocusState, order: list[int]) -> tuple[engine.KVStore, int]:
    """Prefix + documents in ``order``, re-positioned contiguously; returns (store, next position)."""
    store = state.prefix
    pos = len(state.prefix[0])
    for d in order:
        doc = state.docs[d]
        n = len(doc[0])
        new_pos = segment_positions(pos, n, parts.device)
        moved = [engine.LayerKV(parts.rope.reposition(l.keys, l.positions, new_pos), l.values, new_pos,
                                l.owners) for l in doc]
        store = engine.cat_stores(store, moved)
        pos += n
    return store, pos


@torch.no_grad()
def cachefocus_answer(parts: engine.ModelParts, example: PreparedExample, state: CacheFocusState, *,
                      every: int = 4, k_finish: int = 5, allocation: str = "align"):
    """Passes 1–2 of the module docstring; returns (final store, first logits, next position, kept, trace, costs)."""
    if allocation not in {"align", "sort"}:
        raise ValueError(f"cachefocus: allocation must be 'align' or 'sort', got {allocation!r}")
    dev = parts.device
    k = example.num_docs
    schedule = pruning_schedule(k, parts.num_layers, every, k_finish)
    store, q_start = _layout(parts, state, list(range(k)))
    s = len(example.suffix_ids)
    q_ids, q_pos, q_own = tensor(example.suffix_ids, dev), segment_positions(q_start, s, dev), owners(
        engine.QUERY_OWNER, s, dev)
    trace = CacheFocusTrace()
    alive = list(range(k))
    last_mass: dict[int, float] = {d: 0.0 for d in alive}
    drop_rank: list[int] = []  # dropped documents, earliest first

    def on_layer(ev: engine.LayerEvent) -> engine.LayerControl | None:
        if ev.index not in schedule:
            return None
        probs = ev.attention_probs().mean(dim=(0, 1))  # mean over heads and question tokens -> (keys,)
        col_owner = torch.cat([ev.past.owners, ev.new.owners])
        mass = {d: float(probs[col_owner == d].sum()) for d in alive}
        trace.masses[ev.index] = mass
        last_mass.update(mass)
        ranked = sorted(alive, key=lambda d: (-mass[d], d))  # ties: earlier document first
        keep, drop = ranked[: schedule[ev.index]], ranked[schedule[ev.index]:]
        drop_rank.extend(sorted(drop, key=lambda d: (mass[d], -d)))
        alive[:] = sorted(keep)
        trace.kept[ev.index] = list(alive)
        return engine.LayerControl(drop_owners=drop)

    pass1 = engine.layer_pass(parts, q_ids, q_pos, q_own, store, on_layer=on_layer)
    order = sorted(alive) if allocation == "align" else sorted(alive, key=lambda d: (last_mass[d], -d))
    final, q_start2 = _layout(parts, state, order)
    pass2 = engine.layer_pass(parts, q_ids, segment_positions(q_start2, s, dev), q_own, final)
    ranking = sorted(alive, key=lambda d: (-last_mass[d], d)) + drop_rank[::-1]
    costs = {"tokens": 2 * s, "token_layers": pass1.token_layers + pass2.token_layers,
             "recomputed": pass2.token_layers}
    return pass2.store, parts.logits(pass2.hidden[:, -1]), q_start2 + s, sorted(alive), ranking, trace, costs


@dataclass
class CacheFocus(EvalMethod):
    """Per-document caches after a shared prefix, layer-adaptive pruning every ``n`` layers to
    ``k_finish`` documents, then ``align``/``sort`` re-allocation."""

    name = "cachefocus"
    n: int = 4
    k_finish: int = 5
    allocation: str = "align"

    def check(self) -> None:
        if self.n < 1 or self.k_finish < 1:
            raise ValueError(f"n and k_finish must be >= 1, got n={self.n}, k_finish={self.k_finish}")
        if self.allocation not in ("align", "sort"):
            raise ValueError(f"allocation must be 'align' or 'sort', got {self.allocation!r}")

    def prepare(self, model, tokenizer, example):
        return cachefocus_prepare(engine.model_parts(model), example)

    def answer(self, model, tokenizer, example, state, generation: GenerationConfig) -> MethodResult:
        parts = engine.model_parts(model)
        timer = Timer(parts.device)
        store, logits, next_pos, kept, ranking, trace, c = cachefocus_answer(
            parts, example, state, every=self.n, k_finish=self.k_finish, allocation=self.allocation)
        ttft = timer.elapsed()
        kv, kv_bytes = store_cost(store)
        text, ids = finish_from_store(parts, tokenizer, store, logits, next_pos, generation)
        cost = CostRecord(tokens_prefilled=state.tokens_prefilled + c["tokens"],
                          token_layers_computed=state.token_layers + c["token_layers"],
                          token_layers_recomputed=c["recomputed"], kv_attended=kv, kv_bytes=kv_bytes, ttft_s=ttft)
        return MethodResult(text, ids, cost, kept_docs=kept, doc_ranking=ranking, first_logits=logits,
                            extra={"kept_per_layer": {str(k): v for k, v in trace.kept.items()}})
