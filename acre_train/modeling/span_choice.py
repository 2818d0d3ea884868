"""From scores to what is refilled: whole spans (with neighbours, forced spans first) or grown token
regions of a shape (``attention``, ``centered``, ``densest``, ``sentences``) within the same budget."""

from __future__ import annotations

import bisect
from typing import Sequence

import torch

from .scoring import segment_scores, window_scores
from .selection_words import GROW_SHAPES


def select_spans(scores: torch.Tensor, k: int, *, neighbors: bool = False,
                 forced: torch.Tensor | None = None) -> torch.Tensor:
    """The ``k`` spans to refill, in text order.

    Plain: the ``k`` best scores. ``neighbors``: walk the spans best first; each one taken brings the
    better-scored of its two neighbours (while the budget lasts), so evidence that straddles a span
    boundary comes back whole. ``forced`` ``[m]`` bool: spans taken first, whatever their score.

    >>> select_spans(torch.tensor([0.1, 0.5, 0.3, 0.0, 0.2]), 2).tolist()
    [1, 2]
    >>> select_spans(torch.tensor([0.1, 0.5, 0.0, 0.3, 0.2]), 4, neighbors=True).tolist()
    [0, 1, 3, 4]
    """
    scores = scores.float().cpu()
    m = scores.numel()
    k = max(0, min(k, m))
    taken = torch.zeros(m, dtype=torch.bool)
    if forced is not None:
        for j in torch.nonzero(forced.cpu()).flatten().tolist()[:k]:
            taken[j] = True
    budget = k - int(taken.sum())
    if budget > 0 and not neighbors:
        rest = scores.masked_fill(taken, float("-inf"))
        taken[torch.topk(rest, budget).indices] = True
    elif budget > 0:
        for j in torch.argsort(scores, descending=True, stable=True).tolist():
            if budget == 0:
                break
            if taken[j]:
                continue
            taken[j] = True
            budget -= 1
            near = [i for i in (j - 1, j + 1) if 0 <= i < m and not taken[i]]
            if near and budget > 0:
                best = max(near, key=lambda i: (float(scores[i]), -i))
                taken[best] = True
                budget -= 1
    return torch.nonzero(taken).flatten()




def grow_tokens(mass: Sequence[torch.Tensor], *, num_tokens: int, budget: int, width: int, seeds: int,
                heads: str = "mean", taken: torch.Tensor | None = None, shape: str = "attention",
                sentence_ends: torch.Tensor | None = None,
                spend: bool = False) -> torch.Tensor:
    """Token-granular refill: ``[num_tokens]`` bool, at most ``budget`` tokens taken.

    Evidence rarely sits on span boundaries: a needle cut in two comes back by half, a sentence longer
    than a span not at all. So: the ``seeds`` best windows of ``width`` tokens are taken first (each at
    least ``width`` tokens clear of what is taken), then the rest of the budget grows the taken regions
    one token at a time, always by the untaken neighbouring token with the most mass. ``mass``: per
    layer ``[H, n, N2]`` (:func:`l2_mass`), pooled as every scorer is; ``taken``: tokens refilled
    whatever their score (kept sinks, forced evidence), counted in the budget. ``spend``: the caller
    needs ``mass`` no more, so it may be overwritten (no second copy at long contexts).

    The greedy growth follows the attention: a seed grows into the sentence around it while it
    is attended, and stops growing where another region's edge is attended more.

    ``shape="centered"``: no growth by attention; each seed's region is the free budget split evenly
    (``budget // seeds`` tokens) and centred on the seed window. The question attends to the words it
    shares with the evidence (a needle's key) more than to what it asks for (the value after it), so
    attention-led growth can stop short of the answer or wander into a look-alike neighbour; a fixed
    window around the match does neither.

    ``shape="densest"``: each region is again the free budget's even share, but placed where that many
    tokens hold the most mass (the best window of the region's own size, regions apart), not around the
    best ``width``-token window. One token the question matches strongly (a name, a number) can win a
    narrow window far from the sentence that answers; a wide window adds up every match of the
    question. Tokens already taken count for no window and are not taken twice.

    ``shape="sentences"``: each densest window, moved onto whole sentences. Of the runs of whole
    sentences no longer than the window that overlap it, the one with the most mass is taken, and
    what is left of the share widens it evenly on both sides (a sentence longer than the window: its
    densest window). ``sentence_ends`` ``[num_tokens]`` bool marks each sentence's last token
    (:func:`acre_train.infer.sentences.sentence_ends`). A densest window cuts the sentence it
    answers from at its edge about a quarter of the time at 2K SQuAD: the question's words are
    often in the sentence next to the answer (docs/real-base.md).
    """
    import heapq

    if shape not in GROW_SHAPES:
        raise ValueError(f"grow shape must be one of {GROW_SHAPES}, got {shape!r}")

    taken = torch.zeros(num_tokens, dtype=torch.bool) if taken is None else taken[:num_tokens].clone().cpu()
    width = max(1, min(width, num_tokens))
    if num_tokens == 0 or budget <= 0:
        return taken
    if shape in ("densest", "sentences"):
        if shape == "sentences" and sentence_ends is None:
            raise ValueError("grow shape 'sentences' needs the context's sentence ends (a cache built by an engine "
                             "with the tokenizer)")
        ends = sentence_ends[:num_tokens].cpu().bool() if shape == "sentences" else None
        return _densest_regions(mass, taken, budget=budget, width=width, seeds=seeds, heads=heads, ends=ends,
                                spend=spend)
    window = window_scores(mass, width, num_tokens - width + 1, heads).cpu()
    used, placed = int(taken.sum()), 0
    size = max(width, (budget - used) // max(1, seeds)) if shape == "centered" else width
    for s in torch.argsort(window, descending=True, stable=True).tolist():
        if placed >= seeds or used + width > budget:
            break
        if taken[max(0, s - width) : s + 2 * width].any():
            continue
        end = min(num_tokens, s - (size - width) // 2 + size)  # centred (attention: size = width, end = s + width)
        start = max(0, end - size)
        end = start + min(size, budget - used, num_tokens - start)
        used += int((~taken[start:end]).sum())
        taken[start:end] = True
        placed += 1
    if shape == "centered":
        return taken
    token = window_scores(mass, 1, num_tokens, heads).cpu().tolist()  # growth only
    frontier: list[tuple[float, int]] = []

    def push(t: int) -> None:
        if 0 <= t < num_tokens and not taken[t]:
            heapq.heappush(frontier, (-token[t], t))

    for t in torch.nonzero(taken).flatten().tolist():
        push(t - 1)
        push(t + 1)
    while used < budget:
        if not frontier:  # nothing taken yet, or all of it bordered: start again at the best free token
            free = [t for t in range(num_tokens) if not taken[t]]
            if not free:
                break
            push(max(free, key=lambda t: (token[t], -t)))
        _, t = heapq.heappop(frontier)
        if taken[t]:
            continue
        taken[t] = True
        used += 1
        push(t - 1)
        push(t + 1)
    return taken


def _densest_regions(mass: Sequence[torch.Tensor], taken: torch.Tensor, *, budget: int, width: int, seeds: int,
                     heads: str, ends: torch.Tensor | None = None, spend: bool = False) -> torch.Tensor:
    """``grow_tokens(shape="densest")``: ``seeds`` disjoint windows of the budget's share, most mass first
    (``ends``: each moved onto whole sentences, ``shape="sentences"``)."""
    num_tokens, used = len(taken), int(taken.sum())
    size = min(num_tokens, max(width, (budget - used) // max(1, seeds)))
    # What is taken already (kept sinks: the instruction the question attends to) wins no region.
    free = torch.ones(mass[0].shape[-1], dtype=mass[0].dtype, device=mass[0].device)
    free[:num_tokens] = (~taken).to(free)
    mass = [m.mul_(free) for m in mass] if spend else [m * free for m in mass]
    # One prefix sum serves the windows and every seed's sentence runs (in place: the masked mass is ours).
    prefix = [m.cumsum_(-1) for m in mass]
    window = window_scores(mass, size, num_tokens - size + 1, heads, prefix=prefix).cpu()
    regions = torch.zeros(num_tokens, dtype=torch.bool)
    placed = 0
    for s in torch.argsort(window, descending=True, stable=True).tolist():
        if placed >= seeds or used >= budget:
            break
        if regions[s : s + size].any():
            continue
        a, b = (s, s + size) if ends is None else _on_sentences(prefix, ends, s, size, heads)
        free = torch.arange(a, b)[~taken[a:b]][: budget - used]
        taken[free] = True
        regions[s : s + size] = True
        used += len(free)
        placed += 1
    return taken


def _on_sentences(prefix: Sequence[torch.Tensor], ends: torch.Tensor, start: int, size: int, heads: str
                  ) -> tuple[int, int]:
    """The window ``[start, start + size)`` moved onto whole sentences (``grow_tokens(shape="sentences")``);
    ``prefix``: the mass's :func:`~acre_train.modeling.scoring.prefix_mass`."""
    n = len(ends)
    cuts = torch.unique(torch.cat([torch.tensor([0, n]), torch.nonzero(ends).flatten() + 1])).tolist()
    first = max(0, bisect.bisect_right(cuts, start - size) - 1)  # no run from further back can reach the window
    starts, stops = [], []
    j = first
    for i in range(first, len(cuts) - 1):
        if cuts[i] >= start + size:
            break
        j = max(j, i + 1)
        while j + 1 < len(cuts) and cuts[j + 1] - cuts[i] <= size:
            j += 1
        a, b = cuts[i], cuts[j]
        if b - a > size:  # one sentence longer than the window: its windows of that size
            xs = range(max(a, start - size + 1), min(b - size, start + size - 1) + 1)
            starts.extend(xs)
            stops.extend(x + size for x in xs)
        elif b > start:
            starts.append(a)
            stops.append(b)
    best = int(torch.argmax(segment_scores([], torch.tensor(starts), torch.tensor(stops), heads, prefix=prefix).cpu()))
    a, b = starts[best], stops[best]
    left = size - (b - a)  # what the share has left widens the run evenly
    return max(0, a - left // 2), min(n, b + left - left // 2)


def span_tokens(span_bounds: torch.Tensor, spans: torch.Tensor | Sequence[int]) -> torch.Tensor:
    """``[span_bounds[-1]]`` bool: the tokens of ``spans`` (L1 entry indices).

    >>> span_tokens(torch.tensor([0, 2, 5, 6]), [1]).tolist()
    [False, False, True, True, True, False]
    """
    bounds = span_bounds.to(torch.long).cpu()
    out = torch.zeros(int(bounds[-1]) if len(bounds) else 0, dtype=torch.bool)
    for j in torch.as_tensor(spans, dtype=torch.long).flatten().tolist():
        out[int(bounds[j]) : int(bounds[j + 1])] = True
    return out
