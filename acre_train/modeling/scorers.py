"""Refill scorers: how a question ranks the spans of a bi-layer cache (``refill.scorer``).

Three scorers, one score per L1 entry (per span), higher = refill first:

* ``l1`` (the paper's): the question's attention over the **L1 keys** (softmax over the ``m``
  entries), at the queries' memory positions.
* ``l2``: the question's attention over the **raw keys** of the context (softmax over every L2
  token, the query placed after the context and each key at its text position), summed per span.
  It reads one layer's L2 keys per scoring layer (CPU memory; on a GPU node they are gathered to
  the device per question: ``layers × N2 × H_kv × D`` elements).
* ``bounds`` (Quest-style): per span, per KV head and channel, the min and max of the raw keys
  rotated at their text positions; the span's logit is the upper bound ``Σ_c max(q_c·min_c,
  q_c·max_c) / sqrt(D)`` and the softmax runs over spans. Two vectors per span per layer, built
  once per cache (and saved in it); nothing else is read per question.

Each scorer pools the query heads (``heads: mean | max``), averages over the question's tokens and
then over the scoring layers. Raw-key attention is pulled to *attention sinks*, the first tokens of
the context and of every chunk; ``sinks: N`` leaves the first ``N`` tokens of each out of the
ranking (out of the softmax for ``l2``, out of the box for ``bounds``), and ``keep_sinks`` refills
the spans holding them anyway (they then count against ``k``). ``keep_sinks=tokens`` (token-granular
refill only) keeps the context's first span whole, where the prompt's instruction lies, but only the
sink tokens themselves of every later chunk: a chunk's first tokens matter as sinks, not as text, and
whole spans spend much of a small budget on them (at 2K, three spans of a 6-span budget). The
tokens after the first few still draw mass, so calibrate it with ``sinks`` (docs/real-base.md).
``spans`` and ``tokens`` cost budget with every chunk: with ``S = 512`` a 15K context has ~30 chunks,
and their sink spans alone spend a 12-span budget before the question places anything.
``keep_sinks=first`` keeps only the context's first span (the prompt's start, the global sink): one
span at every length, so the rest of the budget always goes where the question points.
``unscored: N`` (``l2`` only) is the gentler rule for them: the first ``N`` tokens of the context and
of every chunk stay in the softmax, as they are in the model's own attention, but the mass they draw
counts for no span or region, so they never place a refill (they are still refilled when a chosen
region covers them). A chunk's first tokens were encoded with almost no local context and draw mass
whatever is asked; taking them out of the softmax instead (``sinks``) renormalises the heads that
park nearly all their mass there, and with ``heads=max`` those heads' leftovers can then decide the
ranking (dev 2K SQuAD, replayed: the whole evidence back for 93 % with 16 tokens out of the softmax
but 69 % with 24; with ``sinks=4`` and ``unscored`` 8 to 32, 91–93 %; docs/real-base.md). Since no
region is ever placed on them, ``unscored`` needs ``sinks`` and ``keep_sinks``: a refill without the
context's first tokens (the attention sinks, the prompt's start) answers almost nothing even when the
evidence is back.

``query=question`` pools over the question's own words only. By default (``all``) every token
after the context counts: the template's lead-in ("Answer the question using the context above"),
the end of turn and the generation prompt too. Those tokens are the same for every question and
attend mostly to the context's last sentences, so with a mean over tokens they pull a refill toward
the context's end whatever was asked (dev 2K SQuAD: a densest window touched the context's last
40 tokens for 24 of 100 questions with ``all``, 19 with ``question``; docs/real-base.md). The engine
finds the question's words in the ids :class:`~acre_train.data.prompt.PromptFormat` writes.

``learned=1`` ranks with the export's learned scorer (``modeling/learned_scorer.py``, trained with
``train.refill_loss.params: scorer``): the question's queries pass through its low-rank map before
any of the three scorers; nothing else changes, decoding never sees it.

Every score is computed in fp32 whatever the model dtype. The tests keep a per-token, per-head
loop as the reference for each scorer.

>>> ScorerSettings.parse("l2:layers=7+9,heads=max,sinks=4").describe()
'l2:layers=7+9,heads=max,sinks=4'
"""

from __future__ import annotations

import bisect
import math
from dataclasses import asdict, dataclass, field, fields
from typing import Any, Callable, ClassVar, Mapping, Protocol, Sequence

import torch

from ..errors import key_hint

from .selection_words import GROW_SHAPES, KEEP_SINKS, POOLS, QUERIES  # noqa: F401  (the choices, torch-free)


@dataclass(frozen=True)
class ScorerSettings:
    """Which scorer ranks the spans, at which layers, pooled how (see the module docstring)."""

    kind: str = "l1"
    layers: tuple[int, ...] = (-1,)
    heads: str = "mean"
    sinks: int = 0
    keep_sinks: str = ""  # "": off; "spans": the spans holding the sinks; "tokens": see the module docstring
    learned: bool = False  # rank with the learned query map (modeling/learned_scorer.py) of the export
    query: str = "all"  # "all": every token after the context; "question": the question's own words
    unscored: int = 0  # l2: the first N tokens of the context and of every chunk win no refill (see the docstring)

    def __post_init__(self) -> None:
        object.__setattr__(self, "layers", tuple(int(x) for x in self.layers))
        object.__setattr__(self, "keep_sinks", _keep(self.keep_sinks))
        if self.kind not in SCORER_KINDS:
            raise ValueError(f"unknown scorer {self.kind!r}; choose one of {', '.join(SCORER_KINDS)}")
        if self.heads not in POOLS:
            raise ValueError(f"scorer heads must be one of {', '.join(POOLS)}, got {self.heads!r}")
        if not self.layers:
            raise ValueError("a scorer needs at least one layer")
        if self.sinks < 0:
            raise ValueError(f"scorer sinks must be >= 0, got {self.sinks}")
        if self.query not in QUERIES:
            raise ValueError(f"scorer query must be one of {', '.join(QUERIES)}, got {self.query!r}")
        if not self.spec.reads_raw_keys and (self.sinks or self.keep_sinks):
            raise ValueError(f"sinks/keep_sinks apply to the raw-key scorers, not to {self.kind}")
        if self.unscored < 0:
            raise ValueError(f"scorer unscored must be >= 0, got {self.unscored}")
        if self.unscored and not self.spec.ranks_tokens:
            raise ValueError(f"unscored applies to the l2 scorer's per-token mass (a kind that ranks tokens), "
                             f"not to {self.kind}")
        if self.unscored and not (self.keep_sinks and self.sinks):
            # Held out at 2K SQuAD, unscored=32 alone refilled the whole evidence for 96 % of the questions
            # and answered 17.9 F1 where it did (56.3 with the sink tokens kept): no region ever covered them.
            raise ValueError("unscored=N stops the context's first tokens from placing a refill, so the attention "
                             "sinks decoding needs would never come back: add sinks=N and keep_sinks=tokens (or 1)")

    @property
    def spec(self) -> "ScorerKind":
        """What this scorer's kind computes and reads (:data:`SCORER_KINDS`)."""
        return SCORER_KINDS[self.kind]

    # ------------------------------------------------------------------------------ spellings

    def as_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["layers"] = list(self.layers)
        return out

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any]) -> "ScorerSettings":
        """From an export's ``inference.scorer`` section (unknown keys fail with a suggestion)."""
        known = [f.name for f in fields(cls)]
        picked = {}
        for key, value in values.items():
            if key not in known:
                raise ValueError(f"unknown scorer setting {key!r}{key_hint(key, known)}")
            picked[key] = value
        if "layers" in picked:
            picked["layers"] = _layers(picked["layers"])
        if "learned" in picked:
            picked["learned"] = _flag(picked["learned"])
        for key in ("sinks", "unscored"):
            if key in picked:
                picked[key] = int(picked[key])
        return cls(**picked)

    @classmethod
    def parse(cls, spec: str | Mapping[str, Any] | "ScorerSettings") -> "ScorerSettings":
        """``"l2:layers=7+9,heads=max,sinks=4"`` (kind, then comma-separated options) -> settings."""
        if isinstance(spec, ScorerSettings):
            return spec
        if isinstance(spec, Mapping):
            return cls.from_mapping(spec)
        kind, _, rest = str(spec).strip().partition(":")
        values: dict[str, Any] = {"kind": kind.strip()}
        for part in filter(None, (p.strip() for p in rest.split(","))):
            key, eq, value = part.partition("=")
            if not eq:
                raise ValueError(f"scorer option {part!r} is not key=value (in {spec!r})")
            values[key.strip()] = value.strip()
        return cls.from_mapping(values)

    def describe(self) -> str:
        """The spec string ``parse`` reads back (defaults left out)."""
        opts = [f"layers={'+'.join(str(x) for x in self.layers)}"]
        if self.heads != "mean":
            opts.append(f"heads={self.heads}")
        if self.sinks:
            opts.append(f"sinks={self.sinks}")
        if self.keep_sinks:
            opts.append("keep_sinks=" + ("1" if self.keep_sinks == "spans" else self.keep_sinks))
        if self.unscored:
            opts.append(f"unscored={self.unscored}")
        if self.learned:
            opts.append("learned=1")
        if self.query != "all":
            opts.append(f"query={self.query}")
        return f"{self.kind}:{','.join(opts)}"

    def resolved_layers(self, num_layers: int) -> list[int]:
        """The scoring layers as indices ``0..L-1`` (sorted, unique); out of range is an error."""
        if any(not -num_layers <= x < num_layers for x in self.layers):
            raise ValueError(f"scoring layers {self.layers} out of range for a {num_layers}-layer model")
        return sorted({x % num_layers for x in self.layers})


def _layers(value: Any) -> tuple[int, ...]:
    if isinstance(value, str):
        return tuple(int(x) for x in value.replace("+", " ").replace(",", " ").split())
    if isinstance(value, int):
        return (value,)
    return tuple(int(x) for x in value)


def _keep(value: Any) -> str:
    """``keep_sinks``: yes/no (yes = ``spans``, the old boolean) or ``spans`` / ``tokens`` / ``first``."""
    if isinstance(value, str) and value.strip().lower() in KEEP_SINKS:
        return value.strip().lower()
    if value == "":
        return ""
    try:
        return "spans" if _flag(value) else ""
    except ValueError:
        raise ValueError(f"keep_sinks must be yes/no, spans, tokens or first, got {value!r}") from None


def _flag(value: Any) -> bool:
    if isinstance(value, str):
        if value.lower() in ("1", "true", "yes", "on"):
            return True
        if value.lower() in ("0", "false", "no", "off"):
            return False
        raise ValueError(f"expected a yes/no value, got {value!r}")
    return bool(value)


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


def _pool(probs: torch.Tensor, heads: str) -> torch.Tensor:
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
        per_layer.append(_pool(torch.softmax(logits, dim=-1), heads))
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
            logits = logits.masked_fill_(ignore.to(logits.device), float("-inf"))
        out.append(torch.softmax(logits, dim=-1))
    return out


def segment_scores(mass: Sequence[torch.Tensor], starts: torch.Tensor, ends: torch.Tensor,
                   heads: str = "mean") -> torch.Tensor:
    """The mass of each token segment ``[starts[i], ends[i])``, pooled like every scorer: per layer,
    per question token, pool the heads; then the mean over question tokens and over layers.

    Spans, windows and single tokens are all segments, so a window that is a span scores as that span.
    """
    per_layer = []
    for probs in mass:
        # Sum per segment through a prefix sum over the L2 axis (segments are contiguous).
        csum = probs.cumsum(-1)
        a, b = starts.to(probs.device, torch.long), ends.to(probs.device, torch.long)
        per_layer.append(_pool(_before(csum, b) - _before(csum, a), heads))
    return torch.stack(per_layer).mean(dim=0)


def _before(csum: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """The mass before token ``index`` (``csum[..., index - 1]``, 0 at index 0): a prefix sum read without
    first copying it behind a column of zeros (the same values; at 128K tokens the copy cost more than
    the sum)."""
    return csum[..., (index - 1).clamp(min=0)].masked_fill_(index == 0, 0.0)


def window_scores(mass: Sequence[torch.Tensor], width: int, count: int, heads: str = "mean") -> torch.Tensor:
    """:func:`segment_scores` of the ``count`` windows ``[s, s + width)``, ``s = 0..count-1``: the same
    arithmetic read through slices of the prefix sum (no gathered copies: at 128K tokens those were most
    of a question's selection time)."""
    per_layer = []
    for probs in mass:
        csum = probs.cumsum(-1)
        sums = csum[..., width - 1 : width - 1 + count].clone()  # window s ends at token s + width - 1
        sums[..., 1:] -= csum[..., : count - 1]  # ... and starts after token s - 1 (window 0: nothing before)
        del csum
        per_layer.append(_pool(sums, heads))
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
        per_layer.append(_pool(torch.softmax(logits, dim=-1), heads))
    return torch.stack(per_layer).mean(dim=0)


# ------------------------------------------------------------------------------------ selection

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
    window = window_scores(mass, size, num_tokens - size + 1, heads).cpu()
    regions = torch.zeros(num_tokens, dtype=torch.bool)
    placed = 0
    for s in torch.argsort(window, descending=True, stable=True).tolist():
        if placed >= seeds or used >= budget:
            break
        if regions[s : s + size].any():
            continue
        a, b = (s, s + size) if ends is None else _on_sentences(mass, ends, s, size, heads)
        free = torch.arange(a, b)[~taken[a:b]][: budget - used]
        taken[free] = True
        regions[s : s + size] = True
        used += len(free)
        placed += 1
    return taken


def _on_sentences(mass: Sequence[torch.Tensor], ends: torch.Tensor, start: int, size: int, heads: str
                  ) -> tuple[int, int]:
    """The window ``[start, start + size)`` moved onto whole sentences (``grow_tokens(shape="sentences")``)."""
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
    best = int(torch.argmax(segment_scores(mass, torch.tensor(starts), torch.tensor(stops), heads).cpu()))
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


# ------------------------------------------------------------------------------- on a cache

@dataclass
class QuestionQueries:
    """The question's rotated query states from the engine's scoring pass, per captured layer.

    ``memory_positions``: where the scoring pass rotated them (after the L1 entries);
    ``text_positions``: where the question sits in the text (after the whole context).
    """

    by_layer: dict[int, torch.Tensor]  # layer -> [H, n, D]
    memory_positions: torch.Tensor  # [n]
    text_positions: torch.Tensor  # [n]
    # ``[n]`` bool: the question's own words among the n tokens (PromptFormat.question_words); None:
    # not known (ids outside the project's prompt, or no tokenizer). ``find_own`` finds them when first
    # asked (most scorers pool every token and never ask).
    own: torch.Tensor | None = None
    find_own: Callable[[], list[bool] | None] | None = field(default=None, repr=False)
    # What several scorers of one question share (calibrate runs hundreds): queries moved to their
    # text positions, per layer, and (``keys``, shared with the own-words view) the rotated L2 keys;
    # freed with the question.
    derived: dict[tuple[str, int], torch.Tensor] = field(default_factory=dict)
    keys: dict[int, torch.Tensor] = field(default_factory=dict)
    words: "QuestionQueries | None" = field(default=None, repr=False)  # the own-words view, made once

    def for_scorer(self, scorer: ScorerSettings) -> "QuestionQueries":
        """The queries ``scorer`` pools over: all of them, or (``query=question``) the question's own words.

        The template around a question ("Answer the question using the context above", the end of
        turn, the generation prompt) is the same for every question; its tokens attend mostly to the
        context's last sentences, and with the mean over tokens they pull a refill there whatever
        was asked (docs/real-base.md).
        """
        if scorer.query == "all":
            return self
        if self.own is None and self.find_own is not None:
            found, self.find_own = self.find_own(), None
            self.own = None if found is None else torch.tensor(found, dtype=torch.bool)
        if self.own is not None and bool(self.own.all()):
            return self
        if self.own is None or not bool(self.own.any()):
            raise ValueError(f"scorer {scorer.describe()} pools the question's own words, but they are not known "
                             "here: give the engine its tokenizer and the question as text, or as the ids "
                             "PromptFormat.question_ids writes")
        if self.words is None:
            rows = torch.nonzero(self.own.cpu()).flatten()
            self.words = QuestionQueries(
                by_layer={x: q.index_select(1, rows.to(q.device)) for x, q in self.by_layer.items()},
                memory_positions=self.memory_positions[rows], text_positions=self.text_positions[rows],
                own=torch.ones(len(rows), dtype=torch.bool), keys=self.keys)
        return self.words

    def at_text(self, model, layer: int) -> torch.Tensor:
        from .rope import Rope

        key = ("query", layer)
        if key not in self.derived:
            q = self.by_layer[layer].float()
            self.derived[key] = Rope.of(model).reposition(q, self.memory_positions, self.text_positions)
        return self.derived[key]

    def learned(self, model, qmap, layer: int, frame: str) -> torch.Tensor:
        """The learned scorer's queries (``qmap`` on the pre-RoPE query), rotated at the ``frame``'s
        positions: ``"memory"`` (for L1 keys) or ``"text"`` (for raw keys)."""
        from .rope import Rope

        key = ("learned-" + frame, layer)
        if key not in self.derived:
            rope = Rope.of(model)
            with torch.no_grad():  # ranking only: the map trains in train/refill_loss.py, never here
                mapped = qmap(layer, rope.unrotate(self.by_layer[layer].float(), self.memory_positions))
            self.derived[key] = rope.rotate(mapped, self.memory_positions if frame == "memory" else self.text_positions)
        return self.derived[key]

    def l2_keys(self, model, cache, layer: int) -> torch.Tensor:
        if layer not in self.keys:
            self.keys[layer] = cache.l2_keys_rotated(model, layer)
        return self.keys[layer]


def rank_spans(model, cache, queries: QuestionQueries, scorer: ScorerSettings) -> torch.Tensor:
    """One score per span of ``cache`` (``[m]``) with ``scorer``; ``queries`` must hold its layers."""
    layers = scorer.resolved_layers(model.config.num_hidden_layers)
    queries = queries.for_scorer(scorer)
    missing = [x for x in layers if x not in queries.by_layer]
    if missing:
        raise ValueError(f"the scoring pass captured no queries at layers {missing}")
    qmap = _query_map(model, scorer, layers) if scorer.learned else None
    return scorer.spec.rank(model, cache, queries, scorer, layers, qmap)


def question_mass(model, cache, queries: QuestionQueries, scorer: ScorerSettings) -> list[torch.Tensor]:
    """The ``l2`` scorer's per-token mass of the question (:func:`l2_mass`, one per scoring layer)."""
    layers = scorer.resolved_layers(model.config.num_hidden_layers)
    queries = queries.for_scorer(scorer)
    qmap = _query_map(model, scorer, layers) if scorer.learned else None
    qs = [queries.learned(model, qmap, x, "text") if qmap else queries.at_text(model, x) for x in layers]
    ignore = cache.sink_tokens(scorer.sinks) if scorer.sinks else None
    mass = l2_mass(qs, [queries.l2_keys(model, cache, x) for x in layers], ignore)
    if not scorer.unscored:
        return mass
    # Out of the ranking, not out of the softmax: the mass they draw is simply not counted.
    counted = (~cache.sink_tokens(scorer.unscored)).to(mass[0])
    return [m * counted.to(m.device) for m in mass]


def choose_refill(model, cache, queries: QuestionQueries, scorer: ScorerSettings, k: int, *, neighbors: bool = False,
                  grow: int = 0, grow_shape: str = "attention", forced: torch.Tensor | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(scores [m], refilled [N_closed] bool)``: rank the spans of ``cache`` and pick what to refill.

    The budget is ``k`` spans of ``l`` tokens. ``grow = 0``: whole spans (:func:`select_spans`, with
    ``neighbors``); ``grow = N``: tokens (:func:`grow_tokens` from ``N`` seeds, ``grow_shape``; ``l2`` scorers only).
    ``forced [m]`` bool: spans refilled first (with ``keep_sinks``, the sink spans are added to them).
    """
    sinks = forced_spans(cache, scorer)
    # keep_sinks=tokens keeps whole spans where a span is the unit refilled (no grow).
    if sinks is not None and (not grow or scorer.keep_sinks in ("spans", "first")):
        forced = sinks if forced is None else (forced | sinks)
    if not grow:
        scores = rank_spans(model, cache, queries, scorer)
        return scores, span_tokens(cache.span_bounds, select_spans(scores, k, neighbors=neighbors, forced=forced))
    if not scorer.spec.ranks_tokens:
        raise ValueError(f"refill grow needs a per-token mass (the l2 scorer's); {scorer.describe()} ranks whole spans")
    mass = question_mass(model, cache, queries, scorer)
    bounds = cache.span_bounds.to(torch.long)
    scores = segment_scores(mass, bounds[:-1], bounds[1:], scorer.heads)
    taken = span_tokens(bounds, torch.nonzero(forced).flatten()[:k]) if forced is not None else None
    ends = cache.sentence_ends if grow_shape == "sentences" else None
    if sinks is not None and scorer.keep_sinks == "tokens":
        kept = cache.sink_tokens(scorer.sinks)[: int(bounds[-1])].cpu()
        kept[: int(bounds[1]) if len(bounds) > 1 else 0] = True  # the first span whole: the prompt's instruction
        taken = kept if taken is None else (taken | kept)
    interval = int(torch.diff(bounds).max()) if len(bounds) > 1 else 1
    return scores, grow_tokens(mass, num_tokens=int(bounds[-1]), budget=k * interval, width=interval, seeds=grow,
                               heads=scorer.heads, taken=taken, shape=grow_shape, sentence_ends=ends, spend=True)


def _query_map(model, scorer: ScorerSettings, layers: list[int]):
    from .learned_scorer import query_map_of

    qmap = query_map_of(model)
    if qmap is None:
        raise ValueError(f"scorer {scorer.describe()} is learned, but this model has no learned scorer (an export "
                         "trained with train.refill_loss.params=scorer carries one in acre_scorer.safetensors)")
    missing = [x for x in layers if x not in qmap.layers]
    if missing:
        raise ValueError(f"the learned scorer was trained at layers {qmap.layers}; {scorer.describe()} asks for {missing}")
    return qmap


def forced_spans(cache, scorer: ScorerSettings) -> torch.Tensor | None:
    """``[m]`` bool: the spans ``keep_sinks`` refills whatever their score (None: none)."""
    if not (scorer.keep_sinks and scorer.sinks):
        return None
    if scorer.keep_sinks == "first":  # one span whatever the context's length
        first = torch.zeros(cache.num_l1, dtype=torch.bool)
        first[:1] = True
        return first
    return spans_with(cache.sink_tokens(scorer.sinks), cache.span_bounds)


# ------------------------------------------------------------------------------ the scorer kinds

class ScoringCache(Protocol):
    """What a scorer may read from a cache (``infer/cache.py:BiLayerCache`` is one)."""

    span_bounds: torch.Tensor  # [m + 1] token offsets of the spans
    l1_keys_rot: Sequence[torch.Tensor]  # per layer [H_kv, m, D], rotated at their memory positions
    num_l1: int
    sentence_ends: torch.Tensor | None

    def sink_tokens(self, sinks: int) -> torch.Tensor: ...  # [N] bool: the first tokens of the context and chunks

    def l2_keys_rotated(self, model, layer: int) -> torch.Tensor: ...  # [H_kv, N, D] at text positions

    def key_box(self, model, layer: int, sinks: int) -> tuple[torch.Tensor, torch.Tensor]: ...  # per span min, max


class ScorerKind:
    """One kind of scorer (``ScorerSettings.kind``). A new one is a subclass with a ``name`` and
    :meth:`rank` (inference, over a cache) and :meth:`score` (training, over the captured keys), and one
    ``@scorer_kind`` line; the reference it must equal goes in ``tests/test_infer_scorers.py``.

    ``frame``: where the question's queries are rotated for it (``memory``: after the L1 entries, for L1
    keys; ``text``: after the whole context, for raw keys). ``reads_raw_keys``: its score reads the raw
    (L2) keys, so attention sinks (``sinks``, ``keep_sinks``) apply. ``ranks_tokens``: it has a per-token
    mass (:func:`question_mass`), so it can refill grown token regions and leave tokens ``unscored``.
    """

    name: ClassVar[str] = ""
    frame: ClassVar[str] = "text"
    reads_raw_keys: ClassVar[bool] = True
    ranks_tokens: ClassVar[bool] = False

    def rank(self, model, cache: ScoringCache, queries: QuestionQueries, scorer: ScorerSettings,
             layers: list[int], qmap) -> torch.Tensor:
        """One score per span of ``cache`` (``[m]``)."""
        raise NotImplementedError

    def score(self, queries: list[torch.Tensor], keys: list[torch.Tensor], bounds: torch.Tensor, heads: str,
              ignore: torch.Tensor | None) -> torch.Tensor:
        """Training's score per span (``train/refill_loss.py``): ``queries``/``keys`` per layer in the
        kind's frame (L1 keys for ``memory``, the context's raw keys for ``text``, ``bounds`` their spans)."""
        raise NotImplementedError

    def prepare_cache(self, model, cache: ScoringCache, scorer: ScorerSettings) -> None:
        """What the cache keeps for this scorer, made once at build time (and saved with it)."""

    def _text_queries(self, model, queries: QuestionQueries, layers: list[int], qmap) -> list[torch.Tensor]:
        return [queries.learned(model, qmap, x, "text") if qmap else queries.at_text(model, x) for x in layers]


SCORER_KINDS: dict[str, ScorerKind] = {}


def scorer_kind(cls: type[ScorerKind]) -> type[ScorerKind]:
    """Register a :class:`ScorerKind` under its ``name``."""
    SCORER_KINDS[cls.name] = cls()
    return cls


@scorer_kind
class L1Keys(ScorerKind):
    """The paper's: the question's attention over the L1 keys."""

    name, frame, reads_raw_keys = "l1", "memory", False

    def rank(self, model, cache, queries, scorer, layers, qmap):
        qs = [queries.learned(model, qmap, x, "memory") if qmap else queries.by_layer[x].float() for x in layers]
        return score_l1(qs, [cache.l1_keys_rot[x] for x in layers], scorer.heads)

    def score(self, queries, keys, bounds, heads, ignore):
        return score_l1(queries, keys, heads)


@scorer_kind
class RawKeys(ScorerKind):
    """The question's attention over the raw keys, summed per span."""

    name, ranks_tokens = "l2", True

    def rank(self, model, cache, queries, scorer, layers, qmap):
        bounds = cache.span_bounds.to(torch.long)
        return segment_scores(question_mass(model, cache, queries, scorer), bounds[:-1], bounds[1:], scorer.heads)

    def score(self, queries, keys, bounds, heads, ignore):
        return score_l2(queries, keys, bounds, heads, ignore)


@scorer_kind
class KeyBoxes(ScorerKind):
    """Quest-style: the upper bound of the question's logit over each span's min/max key box."""

    name = "bounds"

    def rank(self, model, cache, queries, scorer, layers, qmap):
        qs = self._text_queries(model, queries, layers, qmap)
        return score_bounds(qs, [cache.key_box(model, x, scorer.sinks) for x in layers], scorer.heads)

    def score(self, queries, keys, bounds, heads, ignore):
        return score_bounds(queries, [key_bounds(k, bounds, ignore) for k in keys], heads)

    def prepare_cache(self, model, cache, scorer):
        for layer in scorer.resolved_layers(model.config.num_hidden_layers):
            cache.key_box(model, layer, scorer.sinks)
