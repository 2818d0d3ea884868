"""Inference (DESIGN.md §5) against plainly written references: refilling, scores, selection, caches."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from acre_train.infer import (
    AcreEngine,
    BiLayerCache,
    CacheMismatchError,
    CacheSettings,
    ContextTooLongError,
    RefillSettings,
    assemble,
    load_cache,
    num_selected,
    save_cache,
    select_spans,
)
from acre_train.modeling import acre_forward, acre_parameters, attach_acre, interleave
from acre_train.modeling.batch import pad_batch
from acre_train.modeling.span_choice import span_tokens
from acre_train.tiny import tiny_model

from helpers import perturbed_acre_model as _model, random_ids as _ids

ATOL = 1e-5


pytestmark = pytest.mark.usefixtures("one_thread")
BIG = RefillSettings(working_window=10**6, max_refill=10**6, max_new_tokens=4)


# ----------------------------------------------------------------------------- helpers / references





def _rope(x: torch.Tensor, positions, theta: float) -> torch.Tensor:
    """RoPE from the formula (rotate-half convention), ``x [..., P, D]`` at ``positions [P]``."""
    dim = x.shape[-1]
    inv = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    angle = torch.as_tensor(positions, dtype=torch.float64)[:, None] * inv[None]
    angle = torch.cat([angle, angle], dim=-1).to(x.dtype)
    half = dim // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * torch.cos(angle) + rotated * torch.sin(angle)


def _theta(model) -> float:
    return model.config.rope_parameters["rope_theta"]


def _full_run(model, plan, capture=None):
    """One plain ``acre_forward`` over a whole plan (the training-time computation)."""
    with torch.no_grad():
        return acre_forward(model, **pad_batch([plan.as_dict()]), return_logits=True, capture=capture)


def _last_raw(plan) -> int:
    return int(np.nonzero(~plan.is_l1)[0][-1])


def _captured_kv(model, plan):
    """Pre-RoPE keys and values of every token of ``plan``, per layer, from one full run."""
    kv = {}
    _full_run(model, plan, capture=lambda layer, q, k, v: kv.__setitem__(layer, (k[0], v[0])))
    return kv


def _expected_order(plan, finished: int, selected: set[int]) -> list[int]:
    """Plan indices of the refilled cache, written out plainly: span j (if selected), then L1 j; pending last."""
    order, span = [], []
    j = 0
    for i in range(finished):
        if plan.is_l1[i]:
            if j in selected:
                order.extend(span)
            order.append(i)
            span, j = [], j + 1
        else:
            span.append(i)
    return order + span  # the raw tokens after the last L1 token of the finished chunks


# ----------------------------------------------------------------------------- refilling

@pytest.mark.parametrize("arch,n", [("qwen2", 27), ("qwen2", 32), ("llama", 30)])
def test_one_chunk_context_refill_all_equals_single_chunk_forward(arch, n):
    """k = m over a one-chunk context (open: n < W0; finished: n == W0) is the single-chunk forward."""
    model = _model(arch)
    settings = CacheSettings(first_chunk=32 if n != 30 else 30, stride=16, interval=4)
    engine = AcreEngine(model, cache_settings=settings, refill=BIG)
    ctx, q = _ids(n, 1), _ids(9, 2)
    cache = engine.build(ctx)
    answer = engine.answer(cache, q)
    assert answer.k == cache.num_l1 and len(answer.selected) == cache.num_l1
    if n == settings.first_chunk:
        assert cache.num_l1 > 0 and not cache.tail_ids
    plan = interleave(ctx + q, first_chunk=1000, stride=1000, intervals=4)
    ref = _full_run(model, plan).logits[0, _last_raw(plan)]
    torch.testing.assert_close(answer.first_logits, ref, atol=ATOL, rtol=0)
    # Greedy decoding (with L1 tokens inserted every l generated tokens) = the same single chunk, grown.
    tokens = []
    for _ in range(len(answer.token_ids)):
        plan = interleave(ctx + q + tokens, first_chunk=1000, stride=1000, intervals=4)
        tokens.append(int(_full_run(model, plan).logits[0, _last_raw(plan)].argmax()))
    assert answer.token_ids == tokens


@pytest.mark.parametrize("positions", ["compact", "text"])
@pytest.mark.parametrize("selected", ["all", "some", "none"])
def test_refill_rebuilds_the_nested_cache_in_order(selected, positions):
    """Spans go right before their L1 entry, pending tokens last; rotated at positions contiguous from 0,
    or (``text``) at each token's index in the interleaved context, the open chunk after all of it."""
    model = _model("qwen2")
    # 16 and 11 are not multiples of 5: spans cross chunk boundaries and 3 tokens stay pending.
    settings = CacheSettings(first_chunk=16, stride=11, interval=5)
    ctx = _ids(47, 3)
    cache = AcreEngine(model, cache_settings=settings).build(ctx)
    plan = interleave(ctx, first_chunk=16, stride=11, intervals=5)
    finished = int((plan.chunk_ids < 3).sum())  # chunks [0,16) [16,27) [27,38); [38,47) is open
    assert cache.tail_ids == ctx[38:] and cache.num_pending == 3 and cache.num_l1 == 7
    m = cache.num_l1
    chosen = {"all": set(range(m)), "some": {1, 4, m - 1}, "none": set()}[selected]
    refilled = assemble(model, cache, torch.tensor(sorted(chosen), dtype=torch.long), positions)
    order = _expected_order(plan, finished, chosen)
    rotation = range(len(order)) if positions == "compact" else order
    assert refilled.next_position == (len(order) if positions == "compact" else finished)
    kv = _captured_kv(model, plan)
    for layer, (key, value) in kv.items():
        expected_k = _rope(key[:, order], rotation, _theta(model))
        torch.testing.assert_close(refilled.keys[layer], expected_k, atol=ATOL, rtol=0)
        torch.testing.assert_close(refilled.values[layer], value[:, order], atol=ATOL, rtol=0)


def _expected_order_tokens(plan, finished: int, tokens: set[int]) -> list[int]:
    """As :func:`_expected_order`, token by token: a raw token (by its text index) is kept when chosen."""
    order, span = [], []
    for i in range(finished):
        if plan.is_l1[i]:
            order.extend(t for t in span if int(plan.raw_index[t]) in tokens)
            order.append(i)
            span = []
        else:
            span.append(i)
    return order + span


def test_token_refill_puts_each_chosen_token_before_its_own_l1_entry():
    """Grown refills cut spans: the chosen tokens of span j go right before L1 j, in text order; the
    answer equals the engine's over the same tokens, and whole spans as a mask equal spans as indices."""
    model = _model("qwen2")
    settings = CacheSettings(first_chunk=16, stride=11, interval=5)
    ctx = _ids(47, 3)
    engine = AcreEngine(model, cache_settings=settings, refill=BIG.replace(max_new_tokens=2))
    cache = engine.build(ctx)
    plan = interleave(ctx, first_chunk=16, stride=11, intervals=5)
    finished = int((plan.chunk_ids < 3).sum())
    chosen = {2, 3, 4, 9, 14, 15, 16, 17, 30}  # a tail of span 0, a head of span 3, across the chunk border at 16
    mask = torch.zeros(int(cache.span_bounds[-1]), dtype=torch.bool)
    mask[sorted(chosen)] = True
    refilled = assemble(model, cache, mask)
    order = _expected_order_tokens(plan, finished, chosen)
    for layer, (key, value) in _captured_kv(model, plan).items():
        torch.testing.assert_close(refilled.keys[layer], _rope(key[:, order], range(len(order)), _theta(model)), atol=ATOL, rtol=0)
        torch.testing.assert_close(refilled.values[layer], value[:, order], atol=ATOL, rtol=0)
    q = _ids(4, 9)
    spans = engine.answer(cache, q, selected=[1, 4])
    as_mask = engine.answer(cache, q, selected=span_tokens(cache.span_bounds, [1, 4]))
    assert torch.equal(as_mask.first_logits, spans.first_logits) and as_mask.selected == [1, 4]
    partial = engine.answer(cache, q, selected=mask)
    assert torch.equal(partial.refilled, mask) and partial.selected == [0, 1, 2, 3, 6]
    assert partial.cache_length == cache.num_l1 + len(chosen) + cache.num_pending


def test_no_refill_equals_the_plain_acre_plan():
    """k = 0: the question continues the open chunk over the L1 cache, exactly the training plan."""
    model = _model("qwen2")
    settings = CacheSettings(first_chunk=16, stride=8, interval=4)
    engine = AcreEngine(model, cache_settings=settings, refill=BIG.replace(max_refill=0))
    ctx, q = _ids(44, 4), _ids(3, 5)  # open chunk [40, 44) + 3 question tokens stay one chunk
    answer = engine.answer(engine.build(ctx), q)
    assert answer.k == 0 and answer.selected == []
    plan = interleave(ctx + q, first_chunk=16, stride=8, intervals=4)
    ref = _full_run(model, plan).logits[0, _last_raw(plan)]
    torch.testing.assert_close(answer.first_logits, ref, atol=ATOL, rtol=0)


def test_text_positions_answer_as_the_context_read_at_its_own_positions():
    """positions=text: the question and the decoded tokens run at their indices in the whole context, over the
    refilled tokens rotated at theirs (written out here from a full run of the plan), and differ from compact."""
    model = _model("qwen2")
    settings = CacheSettings(first_chunk=16, stride=12, interval=4)
    ctx, q = _ids(44, 31), _ids(3, 32)  # chunks 16 + 12 + 12; the open chunk (4 tail + 3 + 3 new) stays one chunk
    refill = BIG.replace(max_new_tokens=3, positions="text")
    engine = AcreEngine(model, cache_settings=settings, refill=refill)
    cache = engine.build(ctx)
    chosen = {1, 4, 7}
    answer = engine.answer(cache, q, selected=sorted(chosen))
    compact = engine.answer(cache, q, selected=sorted(chosen), positions="compact")
    assert not torch.allclose(answer.first_logits, compact.first_logits, atol=1e-3)

    def reference(raw: list[int]) -> torch.Tensor:
        plan = interleave(raw, first_chunk=16, stride=12, intervals=4)
        finished = int((plan.chunk_ids < 3).sum())
        assert int(plan.chunk_ids[-1]) == 3  # the question and the new tokens stay in the open chunk
        order = _expected_order(plan, finished, chosen)
        kv = _captured_kv(model, plan)
        prefix = {layer: (_rope(k[:, order], order, _theta(model))[None], v[:, order][None]) for layer, (k, v) in kv.items()}
        rows = slice(finished, len(plan))
        positions = torch.arange(finished, len(plan))[None]
        is_l1 = torch.as_tensor(plan.is_l1[rows])[None]
        with torch.no_grad():
            out = acre_forward(model, input_ids=torch.as_tensor(plan.input_ids[rows])[None], is_l1=is_l1,
                               chunk_ids=torch.zeros_like(positions), positions=positions,
                               memory_positions=torch.where(is_l1, positions, -1), kernel="chunked",
                               prefix=prefix.__getitem__, return_logits=True)
        return out.logits[0, int(np.nonzero(~plan.is_l1[rows])[0][-1])]

    torch.testing.assert_close(answer.first_logits, reference(ctx + q), atol=ATOL, rtol=0)
    tokens: list[int] = []
    for _ in range(len(answer.token_ids)):
        tokens.append(int(reference(ctx + q + tokens).argmax()))
    assert answer.token_ids == tokens


def test_attention_backends_give_the_same_answer():
    """Short queries over a long cache take SDPA's masked form, building takes its causal form; every
    backend must agree."""
    model = _model("qwen2")
    ctx, q = _ids(146, 22), _ids(3, 23)  # open chunk: 2 tail + 3 question tokens (+1 L1) over a 60-token cache
    answers = []
    for backend in (None, "sdpa", "eager"):
        engine = AcreEngine(model, cache_settings=CacheSettings(16, 8, 4), backend=backend,
                            refill=RefillSettings(working_window=60, max_new_tokens=4))
        answers.append(engine.answer(engine.build(ctx), q))
    for other in answers[1:]:
        torch.testing.assert_close(other.first_logits, answers[0].first_logits, atol=ATOL, rtol=0)
        assert other.token_ids == answers[0].token_ids and other.selected == answers[0].selected


# ----------------------------------------------------------------------------- scoring / selection

@pytest.mark.parametrize("layers", [(-1,), (0, 1)])
def test_scores_equal_a_brute_force_computation(layers):
    model = _model("llama")
    settings = CacheSettings(first_chunk=16, stride=8, interval=4)
    engine = AcreEngine(model, cache_settings=settings)
    ctx, q = _ids(42, 6), _ids(6, 7)
    cache = engine.build(ctx)
    q_plan = interleave(cache.tail_ids + q, first_chunk=100, stride=100, intervals=4, carry_in=cache.carry)
    got = engine.scores(cache, q_plan, num_tail=len(cache.tail_ids), layers=layers)

    # Brute force over the plain plan of context + question: question queries vs L1 keys at j.
    plan = interleave(ctx + q, first_chunk=16, stride=8, intervals=4)
    captured = {}
    _full_run(model, plan, capture=lambda layer, qr, k, v: captured.__setitem__(layer, (qr[0], k[0])))
    finished_l1 = [i for i in range(len(plan)) if plan.is_l1[i] and plan.chunk_ids[i] < 4]
    question_rows = [i for i in range(len(plan)) if plan.raw_index[i] >= len(ctx)]
    heads, kv_heads = model.config.num_attention_heads, model.config.num_key_value_heads
    total = [0.0] * len(finished_l1)
    for layer in [x % 2 for x in layers]:
        query, key = captured[layer]
        keys = _rope(key[:, finished_l1], range(len(finished_l1)), _theta(model))
        for h in range(heads):
            for row in question_rows:
                logits = [float(query[h, row] @ keys[h // (heads // kv_heads), j]) / math.sqrt(query.shape[-1])
                          for j in range(len(finished_l1))]
                top = max(logits)
                exps = [math.exp(x - top) for x in logits]
                for j, e in enumerate(exps):
                    total[j] += e / sum(exps) / (heads * len(question_rows) * len(layers))
    assert cache.num_l1 == len(finished_l1)
    torch.testing.assert_close(got, torch.tensor(total), atol=1e-6, rtol=0)


@pytest.mark.parametrize("m,l,W,eta,k", [
    (0, 4, 100, 100, 0),     # m = 0: nothing to select
    (10, 16, 1000, 8, 0),    # eta < l: not one span fits
    (10, 4, 5, 4096, 0),     # W < m: the L1 cache alone overflows the window
    (10, 4, 30, 4096, 5),    # floor((30 - 10) / 4)
    (10, 4, 31, 4096, 5),    # floor((31 - 10) / 4) = 5
    (10, 4, 10_000, 12, 3),  # eta binds: floor(12 / 4)
    (10, 4, 10_000, 4096, 10),  # clamped to m
])
def test_k_follows_the_formula_at_its_edges(m, l, W, eta, k):
    assert num_selected(m, l, W, eta) == k


def test_selection_takes_top_scores_then_sorts_by_position():
    scores = torch.tensor([0.1, 0.5, 0.2, 0.9, 0.3])
    assert select_spans(scores, 2).tolist() == [1, 3]
    assert select_spans(scores, 0).tolist() == []


def test_answer_refills_the_top_scored_spans():
    model = _model("qwen2")
    engine = AcreEngine(model, cache_settings=CacheSettings(16, 8, 4),
                        refill=RefillSettings(working_window=20, max_refill=10**6, max_new_tokens=1))
    cache = engine.build(_ids(48, 8))
    answer = engine.answer(cache, _ids(5, 9))
    assert answer.k == (20 - cache.num_l1) // 4 and 0 < answer.k < cache.num_l1
    expected = torch.sort(torch.topk(answer.scores, answer.k).indices).values.tolist()
    assert answer.selected == expected
    assert answer.cache_length == cache.num_l1 + 4 * answer.k


# ----------------------------------------------------------------------------- cache reuse / save / load

def _small_engine(model, **refill):
    base = dict(working_window=16, max_refill=10**6, max_new_tokens=5)
    return AcreEngine(model, cache_settings=CacheSettings(16, 8, 4), refill=RefillSettings(**{**base, **refill}))


def test_two_questions_on_one_cache_equal_two_separate_runs():
    model = _model("qwen2")
    engine = _small_engine(model)
    ctx, q1, q2 = _ids(52, 10), _ids(6, 11), _ids(8, 12)
    shared = engine.build(ctx)
    first, second = engine.answer(shared, q1), engine.answer(shared, q2)
    alone1 = engine.answer(engine.build(ctx), q1)
    alone2 = engine.answer(engine.build(ctx), q2)
    assert first.selected != second.selected or first.token_ids != second.token_ids  # the test can tell them apart
    for a, b in ((first, alone1), (second, alone2)):
        torch.testing.assert_close(a.first_logits, b.first_logits, atol=ATOL, rtol=0)
        assert a.token_ids == b.token_ids and a.selected == b.selected


def test_saved_and_reloaded_cache_gives_identical_answers(tmp_path):
    model = _model("qwen2")
    engine = _small_engine(model)
    ctx, q = _ids(50, 13), _ids(7, 14)
    cache = engine.build(ctx)
    assert cache.l2_keys.device.type == "cpu" and cache.l2_values.device.type == "cpu"
    assert cache.l1_keys.device == next(model.parameters()).device
    before = engine.answer(cache, q)
    loaded = engine.load_cache(save_cache(cache, tmp_path / "ctx.safetensors"))
    assert loaded.l2_keys.device.type == "cpu" and loaded.l2_values.device.type == "cpu"
    after = engine.answer(loaded, q)
    assert torch.equal(before.first_logits, after.first_logits) and before.token_ids == after.token_ids
    assert before.selected == after.selected



def test_sampling_is_reproducible_by_seed():
    model = _model("qwen2")
    engine = _small_engine(model, temperature=1.0, top_p=0.9, max_new_tokens=6)
    cache = engine.build(_ids(40, 15))
    a, b = engine.answer(cache, _ids(5, 16), seed=3), engine.answer(cache, _ids(5, 16), seed=3)
    assert a.token_ids == b.token_ids
    # ... and the seed is used: other seeds draw other answers.
    assert len({tuple(engine.answer(cache, _ids(5, 16), seed=s).token_ids) for s in range(4, 10)} | {tuple(a.token_ids)}) > 1


def test_text_in_text_out_with_the_tiny_tokenizer():
    tiny_tokenizer = pytest.importorskip("acre_train.data.tiny_tokenizer").tiny_tokenizer
    tok = tiny_tokenizer()
    model = _model("qwen2", vocab_size=len(tok), eos_token_id=tok.eos_token_id)
    engine = AcreEngine(model, tok, cache_settings=CacheSettings(32, 16, 4),
                        refill=RefillSettings(working_window=100, max_new_tokens=3))
    cache = engine.build("The quick brown fox jumps over the lazy dog. " * 8)
    answer = engine.answer(cache, "What does the fox do?")
    assert isinstance(answer.text, str) and len(answer.token_ids) <= 3
    rendered = tok.decode(engine.prompt.context_ids("CTX") + engine.prompt.question_ids("Q?"))
    assert rendered.startswith("<|im_start|>user\nCTX") and rendered.endswith("<|im_start|>assistant\n")


# ----------------------------------------------------------------------------- bad input

def test_a_cache_from_another_model_or_other_settings_is_an_error(tmp_path):
    model = _model("qwen2")
    path = save_cache(_small_engine(model).build(_ids(40, 17)), tmp_path / "c.safetensors")
    with pytest.raises(CacheMismatchError, match="built by another model"):
        load_cache(path, _model("qwen2", seed=5), CacheSettings(16, 8, 4))
    with pytest.raises(CacheMismatchError, match="built by another model"):
        load_cache(path, _model("qwen2").to(torch.float64), CacheSettings(16, 8, 4))
    with pytest.raises(CacheMismatchError, match="built with settings"):
        load_cache(path, model, CacheSettings(16, 8, 8))
    in_memory = _small_engine(model).build(_ids(40, 17))
    with pytest.raises(CacheMismatchError, match="built by another model"):
        _small_engine(_model("qwen2", seed=5)).answer(in_memory, _ids(4, 1))
    other = tmp_path / "other.safetensors"
    from safetensors.torch import save_file
    save_file({"x": torch.zeros(1)}, str(other))
    with pytest.raises(CacheMismatchError, match="not an ACRE bi-layer cache"):
        load_cache(other, model, CacheSettings(16, 8, 4))


def test_contexts_beyond_the_settings_are_clear_errors():
    model = _model("qwen2", max_position_embeddings=64)
    engine = AcreEngine(model, cache_settings=CacheSettings(16, 8, 4), refill=RefillSettings(working_window=8))
    with pytest.raises(ContextTooLongError, match="more than the working window W = 8"):
        engine.build(_ids(80, 18))  # 18 L1 entries > W
    wide = AcreEngine(model, cache_settings=CacheSettings(80, 80, 100))
    with pytest.raises(ContextTooLongError, match="max_position_embeddings 64"):
        wide.build(_ids(70, 19))
    ok = AcreEngine(model, cache_settings=CacheSettings(16, 8, 4),
                    refill=RefillSettings(working_window=64, max_new_tokens=40))
    cache = ok.build(_ids(40, 20))
    with pytest.raises(ContextTooLongError, match="the model has 64"):
        ok.answer(cache, _ids(10, 21))
    with pytest.raises(ValueError, match="question is empty"):
        ok.answer(cache, [])


def test_one_decode_loop_greedy_and_sampled():
    from acre_train.infer.decode import decode

    table = {0: torch.tensor([0.0, 2.0, 1.0]), 1: torch.tensor([3.0, 0.0, 0.0]), 2: torch.tensor([0.0, 0.0, 5.0])}
    step = lambda token: table[token]  # noqa: E731
    assert decode(table[2], step, max_new_tokens=5, stop_ids={0}) == [2, 2, 2, 2, 2]
    assert decode(table[0], step, max_new_tokens=5, stop_ids={0}) == [1, 0]  # the stop token is kept, then stop
    # top-p that keeps only the best token is greedy; sampling follows softmax(logits / T), by seed
    assert decode(table[0], step, max_new_tokens=4, temperature=1.0, top_p=1e-6) == [1, 0, 1, 0]
    two = torch.tensor([0.0, float(torch.log(torch.tensor(3.0)))])
    draws = [decode(two, lambda t: two, max_new_tokens=1, temperature=1.0, seed=s)[0] for s in range(2000)]
    assert abs(sum(draws) / len(draws) - 0.75) < 0.03
    assert decode(two, lambda t: two, max_new_tokens=8, temperature=1.0, seed=5) == \
        decode(two, lambda t: two, max_new_tokens=8, temperature=1.0, seed=5)


@pytest.mark.parametrize("scorer", ["l1:layers=-1", "l2:layers=0+1,heads=max"])
def test_a_closed_tail_scores_alike_and_answers_alike_when_nothing_is_refilled(scorer, tmp_path):
    """close_tail runs the raw tail once at build time. Its KV then attends to the L1 memory only, as the
    scoring pass always did: the scores are the open tail's for every question, and with no span refilled
    (k = 0) the answer is the open tail's exactly. A saved cache keeps the closed tail."""
    model = _model("qwen2")
    settings = CacheSettings(first_chunk=16, stride=12, interval=4)
    ctx, q = _ids(47, 21), _ids(6, 22)  # chunks 16 + 12 + 12, a raw tail of 7
    for refill in (RefillSettings(working_window=200, max_refill=8, scorer=scorer, max_new_tokens=5),
                   RefillSettings(working_window=200, max_refill=0, scorer=scorer, max_new_tokens=5)):
        open_engine = AcreEngine(model, cache_settings=settings, refill=refill)
        closed_engine = AcreEngine(model, cache_settings=settings, refill=refill, close_tail=True)
        cache, closed = open_engine.build(ctx), closed_engine.build(ctx)
        assert len(closed.tail_ids) == 7 and torch.equal(cache.tail_keys, closed.tail_keys)  # the same build
        a, b = open_engine.answer(cache, q), closed_engine.answer(closed, q)
        if refill.max_refill:
            torch.testing.assert_close(a.scores, b.scores, atol=1e-6, rtol=1e-5)
            assert a.selected == b.selected and len(a.selected) == 2
        else:
            torch.testing.assert_close(a.first_logits, b.first_logits, atol=ATOL, rtol=0)
            assert a.token_ids == b.token_ids and a.selected == b.selected == []
    loaded = closed_engine.load_cache(save_cache(closed, tmp_path / "closed.safetensors"))
    assert torch.equal(loaded.tail_keys, closed.tail_keys)
    assert closed_engine.answer(loaded, q).token_ids == closed_engine.answer(closed, q).token_ids


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_reusing_the_scoring_pass_starts_the_prefill_above_it_over_the_refilled_cache(arch):
    """reuse_score_pass: the question's layers up to the last scoring layer are its scoring pass's (over
    the L1 memory and the closed tail, without the refill), the layers above run over the refilled cache.
    Checked against a plain whole-model run over the KV written out by hand whose entry to the next layer
    is replaced by the scoring pass's hidden states (a pre-hook), and its KV against the pass's keys
    rotated at the question's final positions (RoPE from its formula)."""
    from acre_train.modeling.scoring_pass import open_chunk_plan, run_open_chunk, slice_plan

    model = _model(arch)
    last = 0  # the scoring layer: layer 0 is reused, layers 1.. run again
    settings = CacheSettings(first_chunk=16, stride=12, interval=4)
    ctx, q = _ids(47, 31), _ids(6, 32)
    refill = RefillSettings(working_window=200, max_refill=8, scorer=f"l2:layers={last},heads=max", grow=1,
                            max_new_tokens=3, close_tail=True, refill_after_tail=True, reuse_score_pass=True)
    engine = AcreEngine(model, cache_settings=settings, refill=refill)
    cache = engine.build(ctx)
    got = engine.answer(cache, q)
    idx = torch.nonzero(got.refilled).flatten()
    assert len(idx) > 0

    # the scoring pass, written out: the question over the L1 memory and the closed tail
    m, tail = cache.num_l1, cache.tail_keys.shape[2]
    theta = _theta(model)
    plan = slice_plan(open_chunk_plan(cache, q), tail)
    pass_kv = {x: (torch.cat([cache.l1_keys_rot[x], _rope(cache.tail_keys[x], range(m, m + tail), theta)], 1),
                   torch.cat([cache.l1_values[x], cache.tail_values[x]], 1)) for x in range(cache.tail_keys.shape[0])}
    seen: dict = {}
    entry = model.model.layers[last].register_forward_hook(lambda _m, _a, out: seen.setdefault("hidden", out))
    pass_keys = {}
    run_open_chunk(model, plan, offset=m + tail, prefix=lambda x: (pass_kv[x][0][None], pass_kv[x][1][None]),
                   capture=lambda x, _q, k, v: pass_keys.setdefault(x, (k[0], v[0])), device=torch.device("cpu"))
    entry.remove()

    # the final cache, written out: L1 memory, closed tail, refilled tokens, then the question above layer `last`
    base = assemble(model, cache, torch.zeros(int(cache.span_bounds[-1]), dtype=torch.bool))
    start = base.length
    keys = torch.cat([base.keys, _rope(cache.tail_keys, range(start, start + tail), theta),
                      _rope(cache.l2_keys[:, :, idx], range(start + tail, start + tail + len(idx)), theta)], dim=2)
    values = torch.cat([base.values, cache.tail_values, cache.l2_values[:, :, idx]], dim=2)
    swap = model.model.layers[last + 1].register_forward_pre_hook(lambda _m, args: (seen["hidden"], *args[1:]))
    final_keys = {}
    try:
        hidden = run_open_chunk(model, plan, offset=keys.shape[2], prefix=lambda x: (keys[x][None], values[x][None]),
                                capture=lambda x, _q, k, v: final_keys.setdefault(x, k[0]), device=torch.device("cpu"),
                                want_hidden=True)
    finally:
        swap.remove()
    last_raw = int(np.nonzero(~plan.is_l1)[0][-1])
    torch.testing.assert_close(got.first_logits, model.lm_head(hidden[0, last_raw]).float(), atol=ATOL, rtol=0)

    # the KV the answer decodes over: the pass's keys for the reused layer, the new run's above, all rotated
    # at the question's positions after the refilled tokens
    from acre_train.infer.engine import _KV

    kv = _KV(keys, values, capacity=keys.shape[2] + len(plan))
    queries = engine.question_queries(cache, open_chunk_plan(cache, q), num_tail=len(cache.tail_ids), layers=[last],
                                      keep_states=True)
    engine._run_and_extend(kv, plan, queries.states)
    where = torch.as_tensor(plan.positions) + keys.shape[2]
    written = kv.filled(last)[0][:, keys.shape[2]:]
    torch.testing.assert_close(written, _rope(pass_keys[last][0], where, theta), atol=ATOL, rtol=0)
    torch.testing.assert_close(kv.filled(last + 1)[0][:, keys.shape[2]:], _rope(final_keys[last + 1], where, theta),
                               atol=ATOL, rtol=0)


def test_reusing_the_scoring_pass_changes_nothing_when_nothing_is_refilled(monkeypatch):
    """With nothing refilled the scoring pass's layout is the final one, so reusing it is exact: the same
    first logits and tokens as running every layer again."""
    import acre_train.infer.engine as engine_module

    model = _model("qwen2")
    settings = CacheSettings(first_chunk=16, stride=12, interval=4)
    refill = RefillSettings(working_window=200, max_refill=8, scorer="l2:layers=0,heads=max", grow=1,
                            max_new_tokens=6, close_tail=True, refill_after_tail=True)
    engine = AcreEngine(model, cache_settings=settings, refill=refill)
    cache = engine.build(_ids(47, 41))
    real = engine_module.choose_refill

    def nothing(*args, **kwargs):
        scores, tokens = real(*args, **kwargs)
        return scores, torch.zeros_like(tokens)

    monkeypatch.setattr(engine_module, "choose_refill", nothing)
    q = _ids(6, 42)
    plain, reused = engine.answer(cache, q), engine.answer(cache, q, reuse_score_pass=True)
    torch.testing.assert_close(reused.first_logits, plain.first_logits, atol=ATOL, rtol=0)
    assert reused.token_ids == plain.token_ids and reused.cache_length == plain.cache_length
    assert reused.timings["prefill_s"] > 0


def test_a_stored_closed_tail_reopens_for_a_question_that_asks():
    """An export that stores the closed path answers with it, and a question asking for the tail re-run
    (close_tail off) gets exactly what an engine storing nothing answers."""
    model = _model("qwen2")
    settings = CacheSettings(first_chunk=16, stride=12, interval=4)
    plain = AcreEngine(model, cache_settings=settings,
                       refill=RefillSettings(working_window=200, max_refill=8, scorer="l2:layers=0,heads=max", grow=1,
                                             max_new_tokens=3))
    stored = AcreEngine(model, cache_settings=settings, refill=plain.refill.replace(close_tail=True, refill_after_tail=True))
    ctx, q = _ids(47, 61), _ids(6, 62)
    cache = stored.build(ctx)
    reopened = stored.answer(cache, q, close_tail=False, refill_after_tail=False)
    expected = plain.answer(plain.build(ctx), q)
    torch.testing.assert_close(reopened.first_logits, expected.first_logits, atol=ATOL, rtol=0)
    assert reopened.token_ids == expected.token_ids and reopened.open_chunk == expected.open_chunk
    assert stored.answer(cache, q).open_chunk < expected.open_chunk  # as stored: the question alone runs


def test_reusing_the_scoring_pass_needs_a_closed_tail_and_a_scoring_layer_below_the_last():
    model = _model("qwen2")
    with pytest.raises(ValueError, match="needs close_tail"):
        RefillSettings(reuse_score_pass=True)
    engine = AcreEngine(model, cache_settings=CacheSettings(first_chunk=16, stride=12, interval=4),
                        refill=RefillSettings(working_window=200, max_refill=8, scorer="l2:layers=-1,heads=max",
                                              close_tail=True, reuse_score_pass=True, max_new_tokens=2))
    cache = engine.build(_ids(47, 51))
    with pytest.raises(ValueError, match="model's last layer"):
        engine.answer(cache, _ids(6, 52))
    assert engine.answer(cache, _ids(6, 52), scorer="l2:layers=0,heads=max").token_ids  # a lower layer: it runs


def test_a_refill_after_the_closed_tail_is_the_tail_then_the_refilled_tokens_then_the_question():
    """refill_after_tail keeps the L1 memory (and the pending raw tokens) at the front, then the closed
    tail, then the refilled raw tokens in text order, each rotated at the next compact positions, then the
    question. Checked against that KV written out by hand (RoPE from its formula); with nothing refilled
    it is the closed tail's answer exactly."""
    from acre_train.modeling.scoring_pass import open_chunk_plan, run_open_chunk, slice_plan

    model = _model("qwen2")
    settings = CacheSettings(first_chunk=16, stride=12, interval=4)
    ctx, q = _ids(47, 21), _ids(6, 22)  # chunks 16 + 12 + 12, a raw tail of 7
    refill = RefillSettings(working_window=200, max_refill=8, scorer="l1:layers=-1", max_new_tokens=3,
                            close_tail=True, refill_after_tail=True)
    engine = AcreEngine(model, cache_settings=settings, refill=refill)
    cache = engine.build(ctx)
    finished = int(cache.span_bounds[-1])

    empty_before = engine.answer(cache, q, selected=[], refill_after_tail=False)
    empty_after = engine.answer(cache, q, selected=[])
    torch.testing.assert_close(empty_after.first_logits, empty_before.first_logits, atol=0, rtol=0)
    assert empty_after.token_ids == empty_before.token_ids

    chosen = [0, 2]
    got = engine.answer(cache, q, selected=chosen)
    base = assemble(model, cache, torch.zeros(finished, dtype=torch.bool))  # L1 entries + pending tokens
    idx = torch.nonzero(span_tokens(cache.span_bounds, torch.tensor(chosen))).flatten()
    start, tail = base.length, cache.tail_keys.shape[2]
    theta = _theta(model)
    keys = torch.cat([base.keys, _rope(cache.tail_keys, range(start, start + tail), theta),
                      _rope(cache.l2_keys[:, :, idx], range(start + tail, start + tail + len(idx)), theta)], dim=2)
    values = torch.cat([base.values, cache.tail_values, cache.l2_values[:, :, idx]], dim=2)
    plan = slice_plan(open_chunk_plan(cache, q), tail)
    hidden = run_open_chunk(model, plan, offset=keys.shape[2], prefix=lambda x: (keys[x][None], values[x][None]),
                            capture=lambda *a: None, device=torch.device("cpu"), want_hidden=True)
    last_raw = int(np.nonzero(~plan.is_l1)[0][-1])
    torch.testing.assert_close(got.first_logits, model.lm_head(hidden[0, last_raw]).float(), atol=ATOL, rtol=0)
    assert got.selected == chosen and got.cache_length == base.length + len(idx)  # L1, pending and refilled tokens
    with pytest.raises(ValueError, match="needs close_tail"):
        RefillSettings(refill_after_tail=True)
