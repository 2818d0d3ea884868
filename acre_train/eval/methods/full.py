"""``full`` and ``truncated``: the plain model on the (possibly shortened) concatenated prompt.

Both run the library's own forward, with a cache that grows in place (``infer.growing_cache``: the
keys and values of transformers' ``DynamicCache`` without its per-step copy of the whole cache): they
are the reference the cache-editing methods are compared against, at their floor.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ...infer.placement import execution_device
from ...infer.decode import decode
from ...infer.growing_cache import GrowingCache
from ...measure import Timer
from ...modeling.sdpa import grouped_kv_sdpa
from ..prompt import PreparedExample
from .base import CostRecord, EvalMethod, GenerationConfig, MethodResult, decode_text


def _doc_spans(example: PreparedExample) -> list[tuple[int, int]]:
    """Token range of every document in prompt coordinates."""
    spans, pos = [], len(example.prefix_ids)
    for d in example.doc_ids:
        spans.append((pos, pos + len(d)))
        pos += len(d)
    return spans


def _kept_docs(spans: list[tuple[int, int]], kept: list[tuple[int, int]]) -> list[int]:
    """Documents with at least one token inside a kept prompt range."""
    return [i for i, (a, b) in enumerate(spans) if any(a < kb and b > ka for ka, kb in kept)]


def middle_keep(n: int, budget: int) -> list[tuple[int, int]]:
    """Ranges kept by LongBench-style middle truncation of ``n`` tokens to ``budget``: head and tail halves."""
    if n <= budget:
        return [(0, n)]
    head = budget // 2
    return [(0, head), (n - (budget - head), n)]


@torch.no_grad()
def run_plain(model, tokenizer, ids: list[int], generation: GenerationConfig,
              cache: GrowingCache | None = None) -> tuple[str, list[int], torch.Tensor, float]:
    """Library forward + greedy decoding over a growing cache: (text, ids, first logits, ttft seconds).

    ``cache``: an already filled cache (a shared context) that ``ids`` continue; it grows by the
    question and the answer (the caller crops it back).
    """
    device = execution_device(model)
    timer = Timer(device)
    x = torch.tensor([ids], device=device)
    cache = GrowingCache(capacity=len(ids) + generation.max_new_tokens) if cache is None else cache
    with grouped_kv_sdpa(device):  # the question over a cached context is a masked pass: no KV-head copies
        out = model(input_ids=x, cache=cache, use_cache=True, logits_to_keep=1)
    logits = out.logits[0, -1]
    ttft = timer.elapsed()
    first = logits.clone()

    def step(token: int) -> torch.Tensor:
        return model(input_ids=torch.tensor([[token]], device=device), cache=cache, use_cache=True).logits[0, -1]

    gen = decode(logits, step, max_new_tokens=generation.max_new_tokens, stop_ids=generation.stop_ids)
    return decode_text(tokenizer, gen, generation.stop_ids), gen, first, ttft


def _result(model, tokenizer, example: PreparedExample, keep: list[tuple[int, int]],
            generation: GenerationConfig, context: tuple[GrowingCache, int] | None = None) -> MethodResult:
    prompt = example.prompt_ids()
    ids = [t for a, b in keep for t in prompt[a:b]]
    if context is not None:  # the whole context is cached already: only the question is new
        cache, n = context
        text, gen, first, ttft = run_plain(model, tokenizer, ids[n:], generation, cache=cache)
        if cache.get_seq_length() > n:
            cache.crop(n - cache.get_seq_length())  # transformers 5: a negative count of tokens to drop
    else:
        text, gen, first, ttft = run_plain(model, tokenizer, ids, generation)
    cfg = model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    kv_bytes = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * head_dim * len(ids) * model.lm_head.weight.element_size()
    cost = CostRecord(tokens_prefilled=len(ids), token_layers_computed=len(ids) * cfg.num_hidden_layers,
                      kv_attended=float(len(ids)), kv_bytes=kv_bytes, ttft_s=ttft)
    return MethodResult(text, gen, cost, kept_docs=_kept_docs(_doc_spans(example), keep), first_logits=first)


QUESTION_ROOM = 1024  # tokens a shared context's cache keeps free for a question and its answer (it grows past)


@dataclass
class Full(EvalMethod):
    """The whole prompt; a context beyond ``max_length`` (default: the model's ``max_position_embeddings``)
    less :data:`QUESTION_ROOM` loses its middle, LongBench style: what a user of the base gets."""

    name = "full"
    max_length: int = 0

    def limit(self, model) -> int:
        return self.max_length or model.config.max_position_embeddings

    def prepare(self, model, tokenizer, example):
        """The context's KV (prefix + documents) once, for every question asked of it. A context longer than
        the model's window less :data:`QUESTION_ROOM` keeps its head and tail halves (the middle cut once
        per context, LongBench style), so every question continues the same truncated cache."""
        n = len(example.prefix_ids) + example.context_len
        limit = self.limit(model)
        keep = middle_keep(n, limit - min(QUESTION_ROOM, limit // 4))  # a small model's window keeps 3/4 for context
        context = [*example.prefix_ids, *(t for d in example.doc_ids for t in d)]
        ids = [t for a, b in keep for t in context[a:b]]
        cache = GrowingCache(capacity=len(ids) + QUESTION_ROOM)
        if ids:
            model(input_ids=torch.tensor([ids], dtype=torch.long, device=execution_device(model)), cache=cache,
                  use_cache=True, logits_to_keep=1)
        return cache, len(ids), keep

    def answer(self, model, tokenizer, example, state, generation):
        cache, kept, keep = state if state is not None else self.prepare(model, tokenizer, example)
        n = len(example.prefix_ids) + example.context_len
        room = self.limit(model) - kept - generation.max_new_tokens
        if len(example) - n > room:
            raise ValueError(f"full: the question ({len(example) - n} tokens) and {generation.max_new_tokens} new "
                             f"tokens do not fit the {room + generation.max_new_tokens} positions left after the context")
        return _result(model, tokenizer, example, [*keep, (n, len(example))], generation, (cache, kept))


@dataclass
class Truncated(EvalMethod):
    """The prompt cut to ``budget`` attended KV entries (or ``ratio`` of the prompt when budget is 0).

    Instruction and question are kept whole; the context loses its middle (``side=middle``) or its
    beginning (``side=end`` keeps the most recent tokens).
    """

    name = "truncated"
    budget: int = -1  # -1: not given, use ratio
    ratio: float = 0.25
    side: str = "middle"

    def check(self) -> None:
        if self.side not in {"middle", "end"}:
            raise ValueError(f"side must be 'middle' or 'end', got {self.side!r}")
        if self.budget == 0 or self.budget < -1:
            raise ValueError(f"budget must be a positive number of KV entries, got {self.budget} "
                             "(leave it out to keep a ratio of the prompt)")
        if not 0 < self.ratio <= 1:
            raise ValueError(f"ratio must be in (0, 1], got {self.ratio}")

    def _budget(self, example) -> int:
        return self.budget if self.budget > 0 else int(round(self.ratio * len(example)))

    def check_example(self, example) -> None:
        fixed = len(example.prefix_ids) + len(example.suffix_ids)
        budget = self._budget(example)
        if budget < fixed:
            raise ValueError(f"truncated: budget {budget} is below the {fixed} instruction+question tokens "
                             f"of example {example.example.id!r}")
        if self.budget > len(example):
            raise ValueError(f"truncated: budget {self.budget} is larger than example {example.example.id!r}'s "
                             f"whole prompt ({len(example)} tokens): nothing would be cut")

    def answer(self, model, tokenizer, example, state, generation):
        self.check_example(example)
        n = len(example)
        budget = self._budget(example)
        fixed = len(example.prefix_ids) + len(example.suffix_ids)
        p, c = len(example.prefix_ids), example.context_len
        room = min(budget - fixed, c)
        if self.side == "middle":
            ctx = [(p + a, p + b) for a, b in middle_keep(c, room)] if room else []
        else:
            ctx = [(p + c - room, p + c)] if room else []
        keep = [(0, p), *ctx, (p + c, n)]
        return _result(model, tokenizer, example, keep, generation)
