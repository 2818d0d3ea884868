"""Refill scorers (modeling/scorer_spec.py, scoring.py, span_choice.py, ranking.py) against per-token, per-head loops written from their definitions."""

from __future__ import annotations

import math

import pytest
import torch

from acre_train.data.prompt import PromptFormat
from acre_train.infer import AcreEngine, BiLayerCache, CacheSettings, RefillSettings, load_cache, save_cache
from acre_train.modeling.scorer_spec import ScorerSettings
from acre_train.modeling.scoring import sink_mask
from acre_train.modeling.span_choice import grow_tokens, select_spans
from acre_train.modeling import acre_forward, interleave
from acre_train.modeling.batch import pad_batch

from helpers import perturbed_acre_model as _model, random_ids as _ids

pytestmark = pytest.mark.usefixtures("one_thread")
SETTINGS = CacheSettings(first_chunk=16, stride=8, interval=4)


def _rope(x: torch.Tensor, positions, theta: float) -> torch.Tensor:
    """RoPE from the formula (rotate-half), ``x [..., P, D]`` at ``positions [P]`` (may be negative)."""
    dim = x.shape[-1]
    inv = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    angle = torch.as_tensor(list(positions), dtype=torch.float64)[:, None] * inv[None]
    angle = torch.cat([angle, angle], dim=-1).to(x.dtype)
    half = dim // 2
    return x * torch.cos(angle) + torch.cat([-x[..., half:], x[..., :half]], dim=-1) * torch.sin(angle)


def _reference(model, ctx, q, scorer: ScorerSettings, token_mass: list | None = None, own: list[bool] | None = None
               ) -> tuple[torch.Tensor, list[tuple[int, int]]]:
    """Scores from the plain plan of context + question, computed token by token, head by head
    (``token_mass``: filled with the ``l2`` scorer's per-token table ``[H, n, N]`` of every layer;
    ``own``: per question token, whether it is pooled, as ``query=question`` does)."""
    plan = interleave(ctx + q, first_chunk=16, stride=8, intervals=4)
    captured = {}
    with torch.no_grad():
        acre_forward(model, **pad_batch([plan.as_dict()]),
                     capture=lambda layer, qr, k, v: captured.__setitem__(layer, (qr[0], k[0])))
    theta = model.config.rope_parameters["rope_theta"]
    finished_chunks = 4  # 16 + 3 * 8 = 40 raw tokens; the other 2 and the question fill chunk 4
    rows = range(len(plan))
    l1_rows = [i for i in rows if plan.is_l1[i] and plan.chunk_ids[i] < finished_chunks]
    raw_rows = [i for i in rows if not plan.is_l1[i] and plan.chunk_ids[i] < finished_chunks]
    q_rows = [i for i in rows if plan.raw_index[i] >= len(ctx)]
    if own is not None:
        q_rows = [i for i in q_rows if own[int(plan.raw_index[i]) - len(ctx)]]
    # Span j: the raw tokens between L1 token j - 1 and L1 token j.
    spans, start = [], 0
    for i in l1_rows:
        end = sum(1 for r in raw_rows if r < i)
        spans.append((start, end))
        start = end
    heads, kv_heads = model.config.num_attention_heads, model.config.num_key_value_heads
    group = heads // kv_heads
    def first(n: int) -> set[int]:  # the first n tokens of the context and of every chunk
        return {t for t in range(len(raw_rows)) if t < n or (t >= 16 and (t - 16) % 8 < n)}

    sinks, unscored = first(scorer.sinks), first(scorer.unscored)
    per_layer = []
    for layer in scorer.resolved_layers(model.config.num_hidden_layers):
        query, key = captured[layer]
        table = torch.zeros(heads, len(q_rows), len(spans), dtype=torch.float64)
        tokens = torch.zeros(heads, len(q_rows), len(raw_rows), dtype=torch.float64)
        raw_keys = _rope(key[:, raw_rows], range(len(raw_rows)), theta)  # keys at their text positions
        l1_keys = _rope(key[:, l1_rows], range(len(l1_rows)), theta)  # keys at memory positions j
        for a, row in enumerate(q_rows):
            text_q = _rope(query[:, row : row + 1], [int(plan.raw_index[row]) - int(plan.positions[row])], theta)[:, 0]
            for h in range(heads):
                kv = h // group
                scale = math.sqrt(query.shape[-1])
                if scorer.kind == "l1":
                    logits = [float(query[h, row] @ l1_keys[kv, j]) / scale for j in range(len(spans))]
                elif scorer.kind == "l2":
                    logits = [float(text_q[h] @ raw_keys[kv, t]) / scale for t in range(len(raw_rows))]
                else:
                    logits = []
                    for s, e in spans:
                        box = [t for t in range(s, e) if t not in sinks]
                        lo = raw_keys[kv, box].min(dim=0).values
                        hi = raw_keys[kv, box].max(dim=0).values
                        logits.append(sum(max(float(text_q[h, c] * lo[c]), float(text_q[h, c] * hi[c]))
                                          for c in range(len(lo))) / scale)
                if scorer.kind == "l2":
                    keep = [t for t in range(len(logits)) if t not in sinks]
                    top = max(logits[t] for t in keep)
                    z = sum(math.exp(logits[t] - top) for t in keep)
                    prob = [0.0 if t in sinks else math.exp(logits[t] - top) / z for t in range(len(logits))]
                    prob = [0.0 if t in unscored else p for t, p in enumerate(prob)]  # in the softmax, not counted
                    table[h, a] = torch.tensor([sum(prob[s:e]) for s, e in spans], dtype=torch.float64)
                    tokens[h, a] = torch.tensor(prob, dtype=torch.float64)
                else:
                    top = max(logits)
                    z = sum(math.exp(x - top) for x in logits)
                    table[h, a] = torch.tensor([math.exp(x - top) / z for x in logits], dtype=torch.float64)
        if token_mass is not None:
            token_mass.append(tokens)
        pooled = table.max(dim=0).values if scorer.heads == "max" else table.mean(dim=0)
        per_layer.append(pooled.mean(dim=0))
    return torch.stack(per_layer).mean(dim=0).float(), spans


SCORERS = ["l1:layers=-1", "l1:layers=0+1,heads=max", "l2:layers=1", "l2:layers=0+1,heads=max,sinks=2",
           "l2:layers=0+1,heads=max,sinks=1,keep_sinks=tokens,unscored=3",
           "bounds:layers=0", "bounds:layers=0+1,heads=max,sinks=1"]


@pytest.mark.parametrize("spec", SCORERS)
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_each_scorer_equals_its_reference(spec, arch):
    model = _model(arch)
    scorer = ScorerSettings.parse(spec)
    engine = AcreEngine(model, cache_settings=SETTINGS, refill=RefillSettings(scorer=scorer))
    ctx, q = _ids(42, 6), _ids(6, 7)
    cache = engine.build(ctx)
    q_plan = interleave(cache.tail_ids + q, first_chunk=100, stride=100, intervals=4, carry_in=cache.carry)
    got = engine.scores(cache, q_plan, num_tail=len(cache.tail_ids), scorer=scorer)
    want, spans = _reference(model, ctx, q, scorer)
    assert cache.span_bounds.tolist() == [s for s, _ in spans] + [spans[-1][1]]
    torch.testing.assert_close(got, want, atol=2e-6, rtol=1e-5)


class _Words(PromptFormat):
    """A prompt without a tokenizer that knows which tokens of one question are its own words."""

    def __init__(self, q: list[int], own: list[bool]):
        super().__init__(None)
        self.q, self.own = q, own

    def question_words(self, q_ids):
        return self.own if list(q_ids) == self.q else None


@pytest.mark.parametrize("spec", ["l1:layers=0+1,heads=max", "l2:layers=0+1,heads=max,sinks=2", "bounds:layers=1"])
def test_query_question_pools_only_the_question_s_own_words(spec):
    model = _model("qwen2")
    ctx, q = _ids(42, 6), _ids(6, 7)
    own = [False, True, True, True, False, False]  # template lead-in, the question's words, end of turn
    scorer = ScorerSettings.parse(spec + ",query=question")
    engine = AcreEngine(model, cache_settings=SETTINGS, refill=RefillSettings(scorer=scorer), prompt=_Words(q, own))
    cache = engine.build(ctx)
    q_plan = interleave(cache.tail_ids + q, first_chunk=100, stride=100, intervals=4, carry_in=cache.carry)
    got = engine.scores(cache, q_plan, num_tail=len(cache.tail_ids), scorer=scorer)
    want, _ = _reference(model, ctx, q, scorer, own=own)
    torch.testing.assert_close(got, want, atol=2e-6, rtol=1e-5)
    every, _ = _reference(model, ctx, q, ScorerSettings.parse(spec))
    assert not torch.allclose(want, every, atol=1e-4)  # the template's tokens did count before
    with pytest.raises(ValueError, match="own words"):  # not known: an error, not a silent fallback
        AcreEngine(model, cache_settings=SETTINGS, refill=RefillSettings(working_window=18, scorer=scorer)).answer(cache, q)


def test_the_engine_refills_the_reference_top_k_and_bounds_travel_with_a_saved_cache(tmp_path):
    model = _model("qwen2")
    scorer = ScorerSettings.parse("bounds:layers=1,sinks=1")
    engine = AcreEngine(model, cache_settings=SETTINGS,
                        refill=RefillSettings(working_window=18, scorer=scorer, max_new_tokens=3))
    ctx, q = _ids(42, 6), _ids(6, 7)
    cache = engine.build(ctx)
    assert set(cache.boxes) == {"1:1"}  # built with the cache, for the engine's scorer
    answer = engine.answer(cache, q)
    want, _ = _reference(model, ctx, q, scorer)
    assert answer.k == 2 and answer.selected == sorted(torch.topk(want, 2).indices.tolist())
    loaded = load_cache(save_cache(cache, tmp_path / "c.safetensors"), model, SETTINGS)
    torch.testing.assert_close(loaded.boxes["1:1"][0], cache.boxes["1:1"][0], atol=0, rtol=0)
    torch.testing.assert_close(loaded.boxes["1:1"][1], cache.boxes["1:1"][1], atol=0, rtol=0)
    again = engine.answer(loaded, q)
    assert again.selected == answer.selected and again.token_ids == answer.token_ids


def _neighbors_reference(scores: list[float], k: int) -> list[int]:
    taken: list[int] = []
    for j in sorted(range(len(scores)), key=lambda i: (-scores[i], i)):
        if len(taken) >= k:
            break
        if j in taken:
            continue
        taken.append(j)
        near = [i for i in (j - 1, j + 1) if 0 <= i < len(scores) and i not in taken]
        if near and len(taken) < k:
            taken.append(max(near, key=lambda i: (scores[i], -i)))
    return sorted(taken)


@pytest.mark.parametrize("seed", range(6))
def test_neighbor_selection_follows_its_definition(seed):
    gen = torch.Generator().manual_seed(seed)
    scores = torch.rand(13, generator=gen)
    for k in range(0, 14):
        got = select_spans(scores, k, neighbors=True).tolist()
        assert got == _neighbors_reference(scores.tolist(), k)
        assert len(got) == k  # the same budget as plain top-k
    assert select_spans(scores, 4).tolist() == sorted(torch.topk(scores, 4).indices.tolist())


def test_kept_sink_spans_count_against_k():
    scores = torch.tensor([0.0, 0.9, 0.1, 0.8, 0.2])
    forced = torch.tensor([True, False, True, False, False])
    assert select_spans(scores, 3, forced=forced).tolist() == [0, 1, 2]
    assert select_spans(scores, 1, forced=forced).tolist() == [0]


def test_keep_sinks_refills_the_chunk_start_spans():
    model = _model("llama")
    scorer = ScorerSettings.parse("l2:layers=1,sinks=1,keep_sinks=1")
    engine = AcreEngine(model, cache_settings=SETTINGS,
                        refill=RefillSettings(working_window=10 + 4 * 6, scorer=scorer, max_new_tokens=2))
    cache = engine.build(_ids(46, 6))
    answer = engine.answer(cache, _ids(6, 7))
    # Sinks at text positions 0, 16, 24, 32: spans 0, 4, 6, 8 (4 raw tokens each) hold them.
    assert {0, 4, 6, 8} <= set(answer.selected) and len(answer.selected) == answer.k == 6


def test_sink_mask_marks_the_first_tokens_of_the_context_and_of_every_chunk():
    assert sink_mask(40, 16, 8, 2).nonzero().flatten().tolist() == [0, 1, 16, 17, 24, 25, 32, 33]
    assert not sink_mask(40, 16, 8, 0).any()


def test_scorer_settings_spellings_and_errors():
    s = ScorerSettings.parse("l2:layers=7+9,heads=max,sinks=4,keep_sinks=yes")
    assert s == ScorerSettings("l2", (7, 9), "max", 4, True) and s.keep_sinks == "spans"
    assert ScorerSettings.parse(s.describe()) == s == ScorerSettings.parse(s.as_dict())
    assert RefillSettings(scorer="bounds:layers=3").scorer.kind == "bounds"
    with pytest.raises(ValueError, match="did you mean 'heads'"):
        ScorerSettings.parse("l2:head=max")
    with pytest.raises(ValueError, match="unknown scorer 'l3'"):
        ScorerSettings.parse("l3")
    with pytest.raises(ValueError, match="not to l1"):
        ScorerSettings.parse("l1:sinks=4")
    quiet = ScorerSettings.parse("l2:layers=7+9,heads=max,sinks=4,keep_sinks=tokens,unscored=16,query=question")
    assert quiet.unscored == 16 and ScorerSettings.parse(quiet.describe()) == quiet == ScorerSettings.parse(quiet.as_dict())
    with pytest.raises(ValueError, match="unscored applies to the l2"):
        ScorerSettings.parse("bounds:layers=1,unscored=4")
    with pytest.raises(ValueError, match="keep_sinks=tokens"):  # the sinks would never be refilled
        ScorerSettings.parse("l2:layers=1,unscored=16")
    with pytest.raises(ValueError, match="out of range"):
        ScorerSettings(layers=(5,)).resolved_layers(2)


# ------------------------------------------------------------------------------ grown refills

def _grow_reference(mass: list[torch.Tensor], num_tokens: int, budget: int, width: int, seeds: int, heads: str,
                    taken: set[int] | None = None, shape: str = "attention", ends: list[bool] | None = None) -> set[int]:
    """Written from grow_tokens' docstring: seeds best first, each ``width`` clear of what is taken, then
    the untaken token next to a taken one with the most mass, one at a time (ties: the earlier token).
    ``centered``: each seed instead takes the free budget's even share, centred on it, kept inside the
    context, and nothing grows. ``densest``: each region is the window of that share with the most mass
    on untaken tokens (best first, ties: the earlier), not overlapping an earlier region; its untaken
    tokens come back. ``sentences``: each densest window is replaced by the run of whole sentences (at
    most the window's size, overlapping it) with the most mass on untaken tokens (ties: the earlier), or, in a
    sentence longer than the window, the window of that size inside it overlapping it; then widened by
    half the share left over on each side (the odd token after it), clipped to the context."""
    def score(a: int, b: int) -> float:
        per_layer = []
        for table in mass:
            sums = table[:, :, a:b].double().sum(-1)  # [H, n]
            pooled = sums.max(0).values if heads == "max" else sums.mean(0)
            per_layer.append(float(pooled.mean()))
        return sum(per_layer) / len(per_layer)

    taken = set(taken or ())
    share = max(width, (budget - len(taken)) // seeds) if shape != "attention" else width
    if shape in ("densest", "sentences"):
        untaken = torch.ones(mass[0].shape[-1])
        untaken[list(taken)] = 0.0
        mass = [table * untaken for table in mass]  # taken tokens add nothing to a window
        share, regions = min(share, num_tokens), set()
        for s in sorted(range(num_tokens - share + 1), key=lambda s: (-score(s, s + share), s)):
            if seeds == 0 or len(taken) >= budget:
                break
            if regions & set(range(s, s + share)):
                continue
            a, b = (s, s + share) if shape == "densest" else _on_sentences_reference(score, ends[:num_tokens], s, share)
            taken |= set([t for t in range(a, b) if t not in taken][: budget - len(taken)])
            regions |= set(range(s, s + share))
            seeds -= 1
        return taken
    placed = 0
    for s in sorted(range(num_tokens - width + 1), key=lambda s: (-score(s, s + width), s)):
        if placed >= seeds or len(taken) + width > budget:
            break
        if any(t in taken for t in range(max(0, s - width), s + 2 * width)):
            continue
        start = s - (share - width) // 2  # centred on the seed window, then slid back inside the context
        start = max(0, min(start, num_tokens - share))
        region = [t for t in range(start, start + share) if t not in taken][: budget - len(taken)]
        taken |= set(region)
        placed += 1
    if shape == "centered":
        return taken
    while len(taken) < budget:
        free = [t for t in range(num_tokens) if t not in taken]
        frontier = [t for t in free if t - 1 in taken or t + 1 in taken] or free
        if not frontier:
            break
        taken.add(max(frontier, key=lambda t: (score(t, t + 1), -t)))
    return taken


def _on_sentences_reference(score, ends: list[bool], start: int, size: int) -> tuple[int, int]:
    n = len(ends)
    sentences, a = [], 0
    for t in range(n):
        if ends[t] or t == n - 1:
            sentences.append((a, t + 1))
            a = t + 1
    runs = set()
    for i in range(len(sentences)):
        for j in range(i, len(sentences)):
            a, b = sentences[i][0], sentences[j][1]
            if b - a <= size:
                runs.add((a, b))
            elif i == j:  # one sentence longer than the window: the windows of that size inside it
                runs |= {(x, x + size) for x in range(a, b - size + 1)}
    near = [(a, b) for a, b in runs if a < start + size and b > start]
    a, b = max(near, key=lambda r: (score(*r), -r[0]))
    left = size - (b - a)
    return max(0, a - left // 2), min(n, b + left - left // 2)


class _EveryThird:
    """A tokenizer's decode under which the ids 2, 5, 8, ... end a sentence (their text ends in a full stop)."""

    def decode(self, ids, **_):
        return "".join(" w." if t % 3 == 2 else " w" for t in ids)


def _sentence_ends_of(num_tokens: int, seed: int) -> list[bool]:
    gen = torch.Generator().manual_seed(100 + seed)
    return (torch.rand(num_tokens, generator=gen) < 0.15).tolist()  # sentences of ~7 tokens, some longer


@pytest.mark.parametrize("shape", ["attention", "centered", "densest", "sentences"])
@pytest.mark.parametrize("seeds,heads,forced", [(1, "max", ()), (2, "mean", ()), (3, "max", (5, 6, 7)), (2, "max", tuple(range(40)))])
def test_grown_refill_equals_its_reference(seeds, heads, forced, shape):
    gen = torch.Generator().manual_seed(seeds)
    mass = [torch.softmax(torch.randn(4, 3, 60, generator=gen) * 3, -1) for _ in range(2)]
    taken = torch.zeros(56, dtype=torch.bool)
    taken[list(forced)] = True
    ends = _sentence_ends_of(60, seeds)
    got = grow_tokens(mass, num_tokens=56, budget=24, width=4, seeds=seeds, heads=heads, taken=taken if forced else None,
                      shape=shape, sentence_ends=torch.tensor(ends))
    want = _grow_reference(mass, 56, 24, 4, seeds, heads, set(forced), shape, ends)
    assert set(torch.nonzero(got).flatten().tolist()) == want
    if shape == "attention" or forced == tuple(range(40)):
        assert int(got.sum()) == max(24, len(forced))
    elif shape == "centered":  # regions of 24 // seeds tokens, one per seed (none overlap here)
        assert int(got.sum()) == len(forced) + seeds * ((24 - len(forced)) // seeds)
    elif shape == "densest":  # disjoint regions of that share; a region over a forced token brings back fewer new ones
        assert len(forced) < int(got.sum()) <= len(forced) + seeds * ((24 - len(forced)) // seeds)
    else:  # moved onto sentences, regions may meet: never more than the budget
        assert len(forced) < int(got.sum()) <= 24


def test_a_centered_region_lies_around_its_seed_and_inside_the_context():
    mass = [torch.zeros(1, 1, 40)]
    mass[0][0, 0, 20:22] = 1.0  # the best 2-token window is 20..21; a 10-token share puts 4 on each side
    got = grow_tokens(mass, num_tokens=40, budget=10, width=2, seeds=1, shape="centered")
    assert torch.nonzero(got).flatten().tolist() == list(range(16, 26))
    mass[0].zero_()
    mass[0][0, 0, 38:40] = 1.0  # at the end: slid back to stay inside
    got = grow_tokens(mass, num_tokens=40, budget=10, width=2, seeds=1, shape="centered")
    assert torch.nonzero(got).flatten().tolist() == list(range(30, 40))


def test_a_densest_region_adds_up_the_question_s_matches_where_a_narrow_seed_would_not():
    mass = [torch.zeros(1, 1, 60)]
    mass[0][0, 0, 5] = 1.0  # one strong match: the best 2-token window
    mass[0][0, 0, 40:50] = 0.3  # a sentence of weaker matches: 3.0 in all
    centered = grow_tokens(mass, num_tokens=60, budget=10, width=2, seeds=1, shape="centered")
    densest = grow_tokens(mass, num_tokens=60, budget=10, width=2, seeds=1, shape="densest")
    assert torch.nonzero(centered).flatten().tolist() == list(range(0, 10))
    assert torch.nonzero(densest).flatten().tolist() == list(range(40, 50))
    mass[0][0, 0, 0:4] = 5.0  # a kept sink the question attends to most: taken already, it wins no region
    taken = torch.zeros(60, dtype=torch.bool)
    taken[0:4] = True
    densest = grow_tokens(mass, num_tokens=60, budget=14, width=2, seeds=1, taken=taken, shape="densest")
    assert torch.nonzero(densest).flatten().tolist() == [0, 1, 2, 3, *range(40, 50)]


def test_a_sentence_region_takes_the_whole_sentence_a_densest_window_would_cut():
    mass = [torch.zeros(1, 1, 60)]
    mass[0][0, 0, 18:30] = 0.2  # the question's words: the end of one sentence and the start of the next
    mass[0][0, 0, 30:40] = 0.05  # ... which answers
    ends = torch.zeros(60, dtype=torch.bool)
    ends[[9, 23, 39, 49]] = True  # sentences 0-9, 10-23, 24-39, 40-49, 50-59
    densest = grow_tokens(mass, num_tokens=60, budget=16, width=2, seeds=1, shape="densest")
    assert torch.nonzero(densest).flatten().tolist() == list(range(18, 34))  # cuts 24-39 at 34
    got = grow_tokens(mass, num_tokens=60, budget=16, width=2, seeds=1, shape="sentences", sentence_ends=ends)
    assert torch.nonzero(got).flatten().tolist() == list(range(24, 40))
    with pytest.raises(ValueError, match="sentence ends"):
        grow_tokens(mass, num_tokens=60, budget=16, width=2, seeds=1, shape="sentences")


def test_sentence_ends_come_from_the_tokens_text_and_travel_with_a_saved_cache(tmp_path):
    from acre_train.infer.sentences import sentence_ends

    class Words:  # a tokenizer's decode: every id is a word; 7 ends a sentence, 11 starts with no space
        def decode(self, ids):
            return {7: " end.", 11: ".5", 13: "\n"}.get(ids[0] % 20, " w")

    ids = [1, 7, 2, 3, 7, 11, 4, 13, 5, 27]
    assert sentence_ends(Words(), ids).tolist() == [False, True, False, False, False, False, False, True, False, True]
    model = _model("qwen2")
    engine = AcreEngine(model, Words(), cache_settings=SETTINGS, refill=RefillSettings(working_window=18))
    ctx = _ids(42, 6)
    cache = engine.build(ctx)
    assert torch.equal(cache.sentence_ends, sentence_ends(Words(), ctx)[: cache.num_l2])
    loaded = engine.load_cache(save_cache(cache, tmp_path / "c.safetensors"))
    assert torch.equal(loaded.sentence_ends, cache.sentence_ends)
    assert AcreEngine(model, cache_settings=SETTINGS).build(ctx).sentence_ends is None  # ids alone: not known


def test_the_cli_offers_every_grow_shape():
    from acre_train.cli import build_parser_for
    from acre_train.modeling.selection_words import GROW_SHAPES

    for shape in GROW_SHAPES:
        argv = ["chat", "export", "--context", "c.txt", "--grow-shape", shape]
        assert build_parser_for(argv).parse_args(argv).grow_shape == shape


@pytest.mark.parametrize("shape", ["attention", "centered", "densest", "sentences"])
def test_the_engine_grows_the_reference_tokens_and_reports_them(shape):
    model = _model("qwen2")
    scorer = ScorerSettings.parse("l2:layers=0+1,heads=max,sinks=1")
    # W = 18 with m = 10 L1 entries: k = 2 spans of 4 -> 8 tokens grown from one seed.
    engine = AcreEngine(model, _EveryThird(), cache_settings=SETTINGS,
                        refill=RefillSettings(working_window=18, scorer=scorer, grow=1, grow_shape=shape, max_new_tokens=2))
    ctx, q = _ids(42, 6), _ids(6, 7)
    cache = engine.build(ctx)
    answer = engine.answer(cache, q)
    mass: list = []
    _reference(model, ctx, q, scorer, mass)
    want = _grow_reference(mass, int(cache.span_bounds[-1]), 8, 4, 1, "max", shape=shape,
                           ends=[t % 3 == 2 for t in ctx])
    assert answer.k == 2 and set(torch.nonzero(answer.refilled).flatten().tolist()) == want
    again = engine.answer(cache, q, selected=answer.refilled)
    assert torch.equal(again.first_logits, answer.first_logits)


def test_keep_sinks_tokens_keeps_the_first_span_and_only_the_sink_tokens_of_later_chunks():
    from acre_train.modeling.ranking import question_mass

    model = _model("llama")
    scorer = ScorerSettings.parse("l2:layers=1,heads=max,sinks=1,keep_sinks=tokens")
    engine = AcreEngine(model, cache_settings=SETTINGS, refill=RefillSettings(
        working_window=10 + 4 * 6, scorer=scorer, grow=1, grow_shape="densest", max_new_tokens=2))
    ctx, q = _ids(46, 6), _ids(6, 7)
    cache = engine.build(ctx)
    answer = engine.answer(cache, q)
    plan, k = engine.open_chunk(cache, q)
    mass = question_mass(model, cache, engine.question_queries(cache, plan, num_tail=len(cache.tail_ids), layers=[1]),
                         scorer)  # the fast mass, checked against its reference above; here: what is kept
    # Span 0 (tokens 0-3) whole, then only the sink token of each later chunk (text positions 16, 24, 32);
    # the rest of the k = 6 spans' 24 tokens goes to one densest region.
    kept = torch.zeros(40, dtype=torch.bool)
    kept[[0, 1, 2, 3, 16, 24, 32]] = True
    want = grow_tokens(mass, num_tokens=40, budget=24, width=4, seeds=1, heads="max", taken=kept, shape="densest")
    assert k == 6 and torch.equal(answer.refilled, want) and bool(want[kept].all())
    spans = grow_tokens(mass, num_tokens=40, budget=24, width=4, seeds=1, heads="max", shape="densest",
                        taken=(torch.arange(40) < 4) | ((torch.arange(40) >= 16) & (torch.arange(40) % 8 < 4)))
    assert not torch.equal(want, spans)  # keep_sinks=1 (whole spans) would refill other tokens
    assert scorer.describe() == "l2:layers=1,heads=max,sinks=1,keep_sinks=tokens"
    assert ScorerSettings.parse(scorer.as_dict()) == scorer
    with pytest.raises(ValueError, match="keep_sinks must be"):
        ScorerSettings.parse("l2:sinks=4,keep_sinks=all")


@pytest.mark.parametrize("kw,message", [({"scorer": "l1:layers=-1", "grow": 2}, "l2 scorer"),
                                        ({"scorer": "l2:layers=1", "grow": 1, "neighbors": True}, "not both"),
                                        ({"scorer": "l2:layers=1", "grow": -1}, ">= 0"),
                                        ({"scorer": "l2:layers=1", "grow": 2, "grow_shape": "round"}, "grow_shape"),
                                        ({"positions": "gapped"}, "positions must be one of compact, text")])
def test_a_selection_that_cannot_be_made_is_refused_in_one_line(kw, message):
    with pytest.raises(ValueError, match=message):
        RefillSettings(**kw)


def test_a_new_scorer_is_one_class_and_one_line(monkeypatch):
    """The registry is the one place a scorer kind lives: a kind registered here parses, validates its
    options, and the engine refills with it (this one ranks the latest spans first)."""
    from acre_train.modeling import scorer_spec

    monkeypatch.setattr(scorer_spec, "SCORER_KINDS", dict(scorer_spec.scorer_kinds()))

    @scorer_spec.scorer_kind
    class Latest(scorer_spec.ScorerKind):
        name, frame, reads_raw_keys = "latest", "memory", False

        def rank(self, model, cache, queries, scorer, layers, qmap):
            return torch.arange(cache.num_l1, dtype=torch.float32)

    assert ScorerSettings.parse("latest:layers=0").describe() == "latest:layers=0"
    with pytest.raises(ValueError, match="sinks/keep_sinks apply to the raw-key scorers, not to latest"):
        ScorerSettings.parse("latest:layers=0,sinks=4")
    engine = AcreEngine(_model("llama"), cache_settings=SETTINGS,
                        refill=RefillSettings(working_window=1000, max_refill=3 * 4, scorer="latest:layers=0",
                                              max_new_tokens=2))
    answer = engine.answer(engine.build(_ids(70, 3)), _ids(5, 4))
    m = answer.num_l1
    assert answer.k == 3 and answer.selected == list(range(m - 3, m))
