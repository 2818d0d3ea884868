"""The method interface every evaluation row implements, and the helpers they share."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from .. import engine
from ..prompt import PreparedExample


@dataclass
class GenerationConfig:
    """Greedy decoding settings shared by all methods."""

    max_new_tokens: int = 32
    stop_ids: set[int] = field(default_factory=set)


@dataclass
class CostRecord:
    """What answering one example cost.

    tokens_prefilled: token rows that entered the model before the first generated token (every
        pass counted, also passes that stop below the last layer).
    token_layers_computed: sum over layers of token rows computed before the first generated token.
    token_layers_recomputed: the part of that spent again on tokens already prefilled once
        (InfoFlow/CacheBlend/EPIC recompute; CacheFocus's second query pass).
    kv_attended: KV entries the first generated token attends to, mean over layers (the query and
        instruction included; the token itself not).
    kv_bytes: bytes of that KV cache (all layers).
    prepare_s / ttft_s / wall_s: query-independent preparation; answer() start to first-token
        logits; everything including decoding. memory_added_bytes: peak memory the method added over the
        loaded model while preparing and answering (``acre_train.measure.PeakMemory.added_bytes``).
    """

    tokens_prefilled: int = 0
    token_layers_computed: int = 0
    token_layers_recomputed: int = 0
    kv_attended: float = 0.0
    kv_bytes: int = 0
    prepare_s: float = 0.0
    ttft_s: float = 0.0
    wall_s: float = 0.0
    memory_added_bytes: int | None = None

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass
class MethodResult:
    """A method's answer to one example."""

    prediction: str
    output_ids: list[int]
    cost: CostRecord
    kept_docs: list[int] | None = None  # documents/chunks left in the cache (None: all, nothing dropped)
    doc_ranking: list[int] | None = None  # documents/chunks by the method's relevance, best first
    first_logits: torch.Tensor | None = None  # logits of the first generated token (tests, not saved)
    extra: dict[str, Any] = field(default_factory=dict)


class EvalMethod:
    """Base class. Options are dataclass fields of the subclass (parsed from ``name:key=value``).

    ``prepare`` does the query-independent work (e.g. caching documents) and returns a state that
    ``answer`` consumes; both run under ``torch.no_grad`` in the harness.
    """

    name: ClassVar[str] = ""
    needs_acre: ClassVar[bool] = False  # answers only with an ACRE model (an 'acre-train export' folder)

    @classmethod
    def join_options(cls, opts: list[str]) -> list[str]:
        """The spec's ``key=value`` pieces (split at ``:``), regrouped where an option's value itself holds
        ``:`` (a row whose options take a spelling of their own overrides this)."""
        return opts

    def check(self) -> None:
        """Raise ``ValueError`` for option values that cannot work (called when the row is parsed)."""

    def check_example(self, example: PreparedExample) -> None:
        """Raise ``ValueError`` if this row cannot answer ``example`` (called before any answer)."""
        del example

    def prepare(self, model, tokenizer, example: PreparedExample) -> Any:
        del model, tokenizer, example
        return None

    def answer(self, model, tokenizer, example: PreparedExample, state: Any,
               generation: GenerationConfig) -> MethodResult:
        raise NotImplementedError

    def label(self) -> str:
        """Name plus the options that differ from their defaults (used as the row label)."""
        parts = [self.name]
        for f in dataclasses.fields(self):  # type: ignore[arg-type]
            value = getattr(self, f.name)
            if f.default is not dataclasses.MISSING and value != f.default:
                parts.append(f"{f.name}={value}")
        return ":".join(parts)


def decode_text(tokenizer, ids: list[int], stop_ids: set[int]) -> str:
    """Text of generated ids, cut at the first stop token and first non-empty line."""
    kept = []
    for t in ids:
        if t in stop_ids:
            break
        kept.append(t)
    text = tokenizer.decode(kept, skip_special_tokens=True).strip()
    return text.split("\n", 1)[0].strip()


def finish_from_store(parts: engine.ModelParts, tokenizer, store: engine.KVStore, first_logits: torch.Tensor,
                      next_position: int, generation: GenerationConfig) -> tuple[str, list[int]]:
    """Greedy-decode from an explicit store and return (text, ids)."""
    ids = engine.greedy_decode(parts, store, first_logits, next_position, generation.max_new_tokens,
                               generation.stop_ids)
    return decode_text(tokenizer, ids, generation.stop_ids), ids


def store_cost(store: engine.KVStore) -> tuple[float, int]:
    """(mean entries per layer, bytes) of a store."""
    return sum(len(layer) for layer in store) / len(store), engine.store_nbytes(store)


def tensor(ids: list[int], device: torch.device) -> torch.Tensor:
    return torch.tensor(ids, dtype=torch.long, device=device)


def segment_positions(start: int, n: int, device: torch.device) -> torch.Tensor:
    return torch.arange(start, start + n, device=device)


def owners(value: int, n: int, device: torch.device) -> torch.Tensor:
    return torch.full((n,), value, dtype=torch.long, device=device)


def prefix_pass(parts: engine.ModelParts, example: PreparedExample) -> engine.PassResult:
    """The shared prompt prefix through every layer at positions ``0..p-1`` (cached once per example)."""
    dev, p = parts.device, len(example.prefix_ids)
    return engine.layer_pass(parts, tensor(example.prefix_ids, dev), segment_positions(0, p, dev),
                             owners(engine.PREFIX_OWNER, p, dev), None)


def encode_documents(parts: engine.ModelParts, example: PreparedExample, *, after_prefix: bool
                     ) -> tuple[engine.KVStore, list[engine.KVStore], int]:
    """The prefix once, then every document on its own: ``(prefix store, per-document stores, token-layers)``.

    ``after_prefix``: each document sits right after the prefix and attends to it (CacheFocus);
    otherwise it is encoded alone at local positions ``0..n-1`` (InfoFlow's chunk-wise prefill).
    """
    dev, p = parts.device, len(example.prefix_ids)
    pre = prefix_pass(parts, example)
    docs, token_layers = [], pre.token_layers
    for d, ids in enumerate(example.doc_ids):
        res = engine.layer_pass(parts, tensor(ids, dev), segment_positions(p if after_prefix else 0, len(ids), dev),
                                owners(d, len(ids), dev), pre.store if after_prefix else None)
        docs.append([layer.take(layer.owners == d) for layer in res.store])
        token_layers += res.token_layers
    return pre.store, docs, token_layers
