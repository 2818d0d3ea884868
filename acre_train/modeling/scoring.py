"""Scoring kernels: a question's queries and a cache's keys (L1 or raw) to one score per span, or a mass
per raw token. Each is checked against a per-token, per-head loop in ``tests/test_infer_scorers.py``;
every score is computed in fp32 whatever the model dtype."""

from __future__ import annotations

import math
from typing import Sequence

import torch


# ------------------------------------------------------------------------------------ geometry

def sink_mask(num_tokens: int, first_chunk: int, stride: int, sinks: int) -> torch.Tensor:
    """``[N]`` bool: the first ``sinks`` tokens of the context and of every chunk (text positions).

    >>> sink_mask(10, 4, 3, 1).nonzero().flatten().tolist()
    [0, 4, 7]
    """
    t = torch.arange(num_tokens)
    if sinks <= 0:
        return torch.zeros(num_tokens, dtype=torch.bool)
    later = (t >= first_chunk) & ((t - first_chunk) % stride < sinks)
    return (t < sinks) | later


def spans_with(mask: torch.Tensor, span_bounds: torch.Tensor) -> torch.Tensor:
    """``[m]`` bool: spans holding at least one ``True`` token of ``mask`` (on the L2 axis)."""
    counts = torch.cumsum(torch.cat([torch.zeros(1, dtype=torch.long), mask.long()]), 0)
    return counts[span_bounds[1:]] > counts[span_bounds[:-1]]


def pool_heads(probs: torch.Tensor, heads: str) -> torch.Tensor:
    """``[H, n, m]`` -> ``[m]``: pool heads, then mean over the question's tokens."""
    pooled = probs.amax(dim=0) if heads == "max" else probs.mean(dim=0)
    return pooled.mean(dim=0)


def _expand(keys: torch.Tensor, num_heads: int) -> torch.Tensor:
    """GQA: query head ``h`` reads KV head ``h // group``."""
    return keys.repeat_interleave(num_heads // keys.shape[0], dim=0).float()


def _grouped_logits(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """``q [H, n, D]`` · ``k [H_kv, N, D]`` / sqrt(D) -> ``[H, n, N]`` without copying the keys per head
    (query heads of one KV head are stacked along the token axis: one matmul per KV head)."""
    heads, n, dim = q.shape
    kv = k.shape[0]
    stacked = q.reshape(kv, (heads // kv) * n, dim)
    logits = torch.matmul(stacked, k.float().transpose(1, 2)).reshape(heads, n, -1)
    # In place where no gradient flows (ranking): the same division, without a second [H, n, N] tensor.
    return logits / math.sqrt(dim) if logits.requires_grad else logits.div_(math.sqrt(dim))


# --------------------------------------------------------------------------------------- scores

def score_l1(queries: Sequence[torch.Tensor], l1_keys_rot: Sequence[torch.Tensor], heads: str = "mean",
             temperature: float = 1.0) -> torch.Tensor:
    """``queries[i] [H, n, D]`` (rotated at memory positions), ``l1_keys_rot[i] [H_kv, m, D]`` -> ``[m]``.

    ``temperature`` divides the logits (the refill-aware training loss may sharpen; inference uses 1).
    """
    per_layer = []
    for q, k in zip(queries, l1_keys_rot, strict=True):
        logits = _grouped_logits(q.float(), k)
        if temperature != 1.0:
            logits = logits / temperature
        per_layer.append(pool_heads(torch.softmax(logits, dim=-1), heads))
    return torch.stack(per_layer).mean(dim=0)


def score_entries(queries: list[torch.Tensor], keys: list[torch.Tensor], temperature: float = 1.0) -> torch.Tensor:
    """The paper's score, one per L1 entry: :func:`score_l1` with the mean over heads.

    ``queries[i]``: rotated query states ``[H, n, D]`` of the question tokens at scoring layer ``i``;
    ``keys[i]``: that layer's L1 keys ``[H_kv, m, D]``, rotated at the positions the queries saw
    them. Softmax over the ``m`` entries, mean over heads and query tokens, then over layers (fp32).
    """
    return score_l1(queries, keys, "mean", temperature)


def l2_mass(queries: Sequence[torch.Tensor], l2_keys_rot: Sequence[torch.Tensor],
            ignore: torch.Tensor | None = None) -> list[torch.Tensor]:
    """Per scoring layer, the question's attention over the raw keys: ``[H, n, N2]`` (fp32).

    ``queries[i] [H, n, D]`` rotated at their text positions (after the context); ``l2_keys_rot[i]
    [H_kv, N2, D]`` rotated at ``0..N2-1``; ``ignore [N2]`` bool: tokens left out of the softmax.
    """
    out = []
    for q, k in zip(queries, l2_keys_rot, strict=True):
        logits = _grouped_logits(q.float(), k.to(q.device))
        if ignore is not None and bool(ignore.any()):
            # Only the ignored columns are written (sinks are ~1 % of the tokens): the same values as a
            # masked_fill over the whole [H, n, N2] tensor, which at 128K tokens cost more than the softmax.
            columns = torch.nonzero(ignore[: logits.shape[-1]].cpu()).flatten().to(logits.device)
            logits = logits.index_fill_(-1, columns, float("-inf"))
        out.append(torch.softmax(logits, dim=-1))
    return out


def prefix_mass(mass: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Per layer, the prefix sum of the mass over the L2 axis: what :func:`segment_scores` and
    :func:`window_scores` read (``prefix=``). Made once where several segment sets of one mass are
    scored (sentence runs after windows), each call would otherwise sum the whole context again."""
    return [probs.cumsum(-1) for probs in mass]


def _prefixes(mass: Sequence[torch.Tensor], prefix: Sequence[torch.Tensor] | None):
    """The given prefix sums, or each layer's made as it is read (one [H, n, N2] sum alive at a time)."""
    return prefix if prefix is not None else (probs.cumsum(-1) for probs in mass)


def segment_scores(mass: Sequence[torch.Tensor], starts: torch.Tensor, ends: torch.Tensor,
                   heads: str = "mean", prefix: Sequence[torch.Tensor] | None = None) -> torch.Tensor:
    """The mass of each token segment ``[starts[i], ends[i])``, pooled like every scorer: per layer,
    per question token, pool the heads; then the mean over question tokens and over layers.

    Spans, windows and single tokens are all segments, so a window that is a span scores as that span.
    ``prefix``: :func:`prefix_mass` of ``mass``, when the caller has it.
    """
    per_layer = []
    for csum in _prefixes(mass, prefix):
        # Sum per segment through a prefix sum over the L2 axis (segments are contiguous).
        a, b = starts.to(csum.device, torch.long), ends.to(csum.device, torch.long)
        per_layer.append(pool_heads(_before(csum, b) - _before(csum, a), heads))
    return torch.stack(per_layer).mean(dim=0)


def _before(csum: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """The mass before token ``index`` (``csum[..., index - 1]``, 0 at index 0): a prefix sum read without
    first copying it behind a column of zeros (the same values; at 128K tokens the copy cost more than
    the sum)."""
    return csum[..., (index - 1).clamp(min=0)].masked_fill_(index == 0, 0.0)


def window_scores(mass: Sequence[torch.Tensor], width: int, count: int, heads: str = "mean",
                  prefix: Sequence[torch.Tensor] | None = None) -> torch.Tensor:
    """:func:`segment_scores` of the ``count`` windows ``[s, s + width)``, ``s = 0..count-1``: the same
    arithmetic read through slices of the prefix sum (no gathered copies: at 128K tokens those were most
    of a question's selection time). ``prefix``: :func:`prefix_mass` of ``mass``, when the caller has it."""
    per_layer = []
    for csum in _prefixes(mass, prefix):
        sums = csum[..., width - 1 : width - 1 + count].clone()  # window s ends at token s + width - 1
        sums[..., 1:] -= csum[..., : count - 1]  # ... and starts after token s - 1 (window 0: nothing before)
        per_layer.append(pool_heads(sums, heads))
    return torch.stack(per_layer).mean(dim=0)


def score_l2(queries: Sequence[torch.Tensor], l2_keys_rot: Sequence[torch.Tensor], span_bounds: torch.Tensor,
             heads: str = "mean", ignore: torch.Tensor | None = None) -> torch.Tensor:
    """Raw-key attention mass per span (see :func:`l2_mass` for the arguments)."""
    bounds = span_bounds.to(torch.long)
    return segment_scores(l2_mass(queries, l2_keys_rot, ignore), bounds[:-1], bounds[1:], heads)


def key_bounds(l2_keys_rot: torch.Tensor, span_bounds: torch.Tensor, ignore: torch.Tensor | None = None
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """Per span, KV head and channel: ``(min, max)`` of the rotated raw keys, each ``[H_kv, m, D]``.

    Tokens in ``ignore`` are left out; a span with no token left gets an empty box (min = +inf,
    max = -inf), which :func:`score_bounds` ranks last.
    """
    keys = l2_keys_rot.float()
    h, _, d = keys.shape
    m = len(span_bounds) - 1
    owner = torch.repeat_interleave(torch.arange(m), torch.diff(span_bounds))  # span of every token
    n = len(owner)
    keys = keys[:, :n]
    if ignore is not None:
        keep = ~ignore[:n]
        keys, owner = keys[:, keep], owner[keep]
    index = owner[None, :, None].expand(h, -1, d).to(keys.device)
    low = keys.new_full((h, m, d), float("inf")).scatter_reduce(1, index, keys, "amin")
    high = keys.new_full((h, m, d), float("-inf")).scatter_reduce(1, index, keys, "amax")
    return low, high


def score_bounds(queries: Sequence[torch.Tensor], boxes: Sequence[tuple[torch.Tensor, torch.Tensor]],
                 heads: str = "mean") -> torch.Tensor:
    """Quest's upper bound per span: ``queries[i] [H, n, D]`` at text positions, ``boxes[i]`` from
    :func:`key_bounds`; softmax of the bound logits over spans, pooled like the other scorers."""
    per_layer = []
    for q, (low, high) in zip(queries, boxes, strict=True):
        q = q.float()
        low, high = _expand(low.to(q.device), q.shape[0]), _expand(high.to(q.device), q.shape[0])
        empty = torch.isinf(low[..., 0])  # [H, m]: spans with no token in their box
        low, high = low.masked_fill(torch.isinf(low), 0.0), high.masked_fill(torch.isinf(high), 0.0)
        # max(q_c * lo_c, q_c * hi_c) = hi_c when q_c >= 0, else lo_c: two matmuls on split queries.
        pos, neg = q.clamp(min=0), q.clamp(max=0)
        bound = torch.matmul(pos, high.transpose(1, 2)) + torch.matmul(neg, low.transpose(1, 2))
        logits = (bound / math.sqrt(q.shape[-1])).masked_fill(empty[:, None, :], float("-inf"))
        per_layer.append(pool_heads(torch.softmax(logits, dim=-1), heads))
    return torch.stack(per_layer).mean(dim=0)
