"""Cache-editing methods against plain references on tiny fp32 models.

References are computed without the engine: the library's own forward (logits, DynamicCache), or
attention written out by hand from the weights at layer 0 (whose inputs are just embeddings).
"""

from __future__ import annotations

import math

import pytest
import torch
import transformers
from transformers import DynamicCache

from acre_train.eval import engine
from acre_train.eval.methods import GenerationConfig, parse_method
from acre_train.eval.methods.cachefocus import cachefocus_answer, cachefocus_prepare, pruning_schedule
from acre_train.eval.methods.infoflow import chunkwise_prepare, infoflow_answer, num_recomputed
from acre_train.eval.prompt import PreparedExample
from acre_train.eval.examples import Example

VOCAB = 211
TOL = 1e-5


def _model(layers: int = 4, arch: str = "qwen2", seed: int = 0):
    torch.manual_seed(seed)
    kw = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048)
    cfg = transformers.Qwen2Config(**kw) if arch == "qwen2" else transformers.LlamaConfig(**kw)
    return transformers.AutoModelForCausalLM.from_config(cfg).eval()


def _example(doc_lens: list[int], prefix: int = 6, suffix: int = 9, seed: int = 0) -> PreparedExample:
    """Random token pieces (no tokenizer needed: methods only see ids)."""
    g = torch.Generator().manual_seed(seed)
    ids = lambda n: torch.randint(0, VOCAB, (n,), generator=g).tolist()  # noqa: E731
    ex = Example(id="t", question="q?", answers=["a"], documents=["d"] * len(doc_lens))
    return PreparedExample(ex, ids(prefix), [ids(n) for n in doc_lens], ids(suffix), [])


@torch.no_grad()
def _full_logits(model, prep: PreparedExample) -> torch.Tensor:
    return model(torch.tensor([prep.prompt_ids()])).logits[0, -1]


@pytest.fixture(scope="module")
def model4():
    return _model(4)


class _NoTok:
    def decode(self, ids, skip_special_tokens=True):
        return " ".join(map(str, ids))


@pytest.mark.parametrize("spec", ["cachefocus", "cachefocus:allocation=sort", "infoflow:ratio=1.0",
                                  "infoflow:ratio=1.0:reorder=true", "cacheblend:ratio=1.0", "epic:ratio=1.0"])
@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_single_document_full_budget_reproduces_full_logits(spec, arch, model4):
    model = model4 if arch == "qwen2" else _model(4, "llama")
    prep = _example([40])
    method = parse_method(spec)
    ref = _full_logits(model, prep)
    with torch.no_grad():
        res = method.answer(model, _NoTok(), prep, method.prepare(model, _NoTok(), prep), GenerationConfig(3))
    assert (res.first_logits - ref).abs().max() < TOL
    full = parse_method("full").answer(model, _NoTok(), prep, None, GenerationConfig(3))
    assert res.output_ids == full.output_ids  # greedy continuation over the edited cache agrees too


def _library_cache(model, ids: list[int]) -> DynamicCache:
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(torch.tensor([ids]), cache=cache, use_cache=True)
    return cache


@pytest.mark.parametrize("reorder", [False, True])
def test_chunkwise_prefill_reposition_full_recompute_equals_full_prefill_every_layer(reorder, model4):
    prep = _example([23, 31, 17, 26], seed=3)
    parts = engine.model_parts(model4)
    state = chunkwise_prepare(parts, prep)
    # sanity: without recompute the chunk-local caches really differ from a full prefill
    raw = infoflow_answer(parts, prep, state, selector="none")
    r = infoflow_answer(parts, prep, state, ratio=1.0, reorder=reorder, band=[2, 3])
    order = r.order
    ordered = PreparedExample(prep.example, prep.prefix_ids, [prep.doc_ids[d] for d in order], prep.suffix_ids, [])
    cache = _library_cache(model4, ordered.prompt_ids())
    for layer, mine in enumerate(r.store):
        mine = mine.sorted()
        assert torch.equal(mine.positions, torch.arange(len(ordered)))
        assert (mine.keys - cache.layers[layer].keys).abs().max() < TOL, layer
        assert (mine.values - cache.layers[layer].values).abs().max() < TOL, layer
    assert (r.first_logits - _full_logits(model4, ordered)).abs().max() < TOL
    assert (raw.first_logits - _full_logits(model4, prep)).abs().max() > 1e-3
    # layer-0 keys do not depend on context: re-rotated chunk-local keys must equal full-prefill ones
    plain0 = _library_cache(model4, prep.prompt_ids()).layers[0].keys
    assert (raw.store[0].sorted().keys - plain0).abs().max() < TOL
    assert len(r.selected) == prep.context_len


def test_pruning_schedule_formula():
    # k_prune = (k - k_finish) / (L / n) per pruning layer, remainder to the earliest ones
    assert pruning_schedule(13, 32, 4, 5) == {3: 12, 7: 11, 11: 10, 15: 9, 19: 8, 23: 7, 27: 6, 31: 5}
    assert pruning_schedule(29, 32, 4, 5) == {3: 26, 7: 23, 11: 20, 15: 17, 19: 14, 23: 11, 27: 8, 31: 5}
    assert pruning_schedule(6, 4, 1, 2) == {0: 5, 1: 4, 2: 3, 3: 2}
    assert pruning_schedule(3, 4, 2, 5) == {1: 3, 3: 3}  # fewer documents than k_finish: nothing pruned
    with pytest.raises(ValueError, match="exceeds"):
        pruning_schedule(6, 2, 4, 5)


def _plain_layer0(model, ids: list[int], pos: list[int]):
    """Layer-0 post-RoPE queries (heads, n, d) and keys (kv_heads, n, d), written out by hand."""
    m = model.model
    layer = m.layers[0]
    h = layer.input_layernorm(m.embed_tokens(torch.tensor(ids)))
    d = model.config.hidden_size // model.config.num_attention_heads
    q = layer.self_attn.q_proj(h).view(len(ids), -1, d).transpose(0, 1)
    k = layer.self_attn.k_proj(h).view(len(ids), -1, d).transpose(0, 1)
    ang = torch.tensor(pos, dtype=torch.float32)[:, None] * m.rotary_emb.inv_freq[None, :]
    cos, sin = torch.cat([ang.cos()] * 2, -1), torch.cat([ang.sin()] * 2, -1)

    def rot(x):
        a, b = x[..., : d // 2], x[..., d // 2:]
        return x * cos + torch.cat([-b, a], -1) * sin

    return rot(q), rot(k)


def _plain_question_attention(model, prep: PreparedExample, doc_order: list[int]) -> torch.Tensor:
    """Layer-0 softmax attention (heads, question, all keys) of the question over prefix+docs+question."""
    ids = [*prep.prefix_ids, *(t for d in doc_order for t in prep.doc_ids[d]), *prep.suffix_ids]
    n, s = len(ids), len(prep.suffix_ids)
    q, k = _plain_layer0(model, ids, list(range(n)))
    heads = q.shape[0]
    k = k.repeat_interleave(heads // k.shape[0], dim=0)
    scores = q[:, n - s:] @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    causal = torch.arange(n)[None, :] <= torch.arange(n - s, n)[:, None]
    return torch.softmax(scores.masked_fill(~causal, float("-inf")), dim=-1)


@torch.no_grad()
def test_cachefocus_prunes_exactly_per_schedule(model4):
    prep = _example([12, 15, 9, 14, 11, 13], seed=5)
    parts = engine.model_parts(model4)
    state = cachefocus_prepare(parts, prep)
    store, _, _, kept, ranking, trace, _ = cachefocus_answer(parts, prep, state, every=1, k_finish=2)
    schedule = pruning_schedule(6, 4, 1, 2)
    alive = set(range(6))
    for layer in sorted(schedule):
        mass = trace.masses[layer]
        assert set(mass) == alive  # only documents still alive are scored
        top = sorted(alive, key=lambda d: -mass[d])[: schedule[layer]]
        assert set(trace.kept[layer]) == set(top) and len(top) == schedule[layer]
        alive = set(top)
    assert kept == sorted(alive) and len(kept) == 2 and set(ranking[:2]) == alive
    # final cache: exactly prefix + kept documents + question, contiguous positions, in every layer
    want = len(prep.prefix_ids) + sum(len(prep.doc_ids[d]) for d in kept) + len(prep.suffix_ids)
    for layer in store:
        assert set(layer.owners.tolist()) == {engine.PREFIX_OWNER, engine.QUERY_OWNER, *kept}
        assert torch.equal(layer.sorted().positions, torch.arange(want))
    # layer-0 masses by hand: documents laid out in order, question attends everything causally
    probs = _plain_question_attention(model4, prep, list(range(6))).mean(dim=(0, 1))
    start = len(prep.prefix_ids)
    for d, doc in enumerate(prep.doc_ids):
        assert trace.masses[0][d] == pytest.approx(float(probs[start:start + len(doc)].sum()), abs=1e-6)
        start += len(doc)


@torch.no_grad()
def test_cachefocus_pass1_layers_drop_pruned_documents(model4):
    """In pass 1 the question at layer l attends only documents alive before l (checked via attention columns)."""
    prep = _example([10, 12, 8, 11], seed=6)
    parts = engine.model_parts(model4)
    state = cachefocus_prepare(parts, prep)
    seen: dict[int, set[int]] = {}
    orig = engine.layer_pass

    def spy(*args, **kwargs):
        cb = kwargs.get("on_layer")
        if cb is not None:
            def wrapped(ev):
                seen[ev.index] = set(ev.past.owners.tolist()) - {engine.PREFIX_OWNER}
                return cb(ev)
            kwargs["on_layer"] = wrapped
        return orig(*args, **kwargs)

    engine.layer_pass = spy
    try:
        _, _, _, kept, _, trace, _ = cachefocus_answer(parts, prep, state, every=2, k_finish=1)
    finally:
        engine.layer_pass = orig
    assert seen[0] == seen[1] == {0, 1, 2, 3}
    assert seen[2] == seen[3] == set(trace.kept[1]) and len(trace.kept[1]) == pruning_schedule(4, 4, 2, 1)[1]
    assert set(kept) == set(trace.kept[3]) and len(kept) == 1


@torch.no_grad()
def test_infoflow_selects_top_r_of_brute_force_attention_norm(model4):
    prep = _example([21, 17, 25, 19], seed=7)
    parts = engine.model_parts(model4)
    state = chunkwise_prepare(parts, prep)
    ratio = 0.3
    r = infoflow_answer(parts, prep, state, ratio=ratio, band=[0])
    probs = _plain_question_attention(model4, prep, [0, 1, 2, 3])  # (heads, question, keys)
    p, n = len(prep.prefix_ids), prep.context_len
    brute = probs[:, :, p:p + n].pow(2).sum(dim=(0, 1)).sqrt()  # L2 over heads x question tokens
    assert torch.allclose(r.token_scores.float(), brute, atol=1e-6)
    m = num_recomputed(ratio, n)
    want = sorted((torch.argsort(brute, descending=True)[:m] + p).tolist())
    assert r.selected == want and len(want) == round(ratio * n)


@torch.no_grad()
def test_epic_selects_first_tokens_of_each_chunk(model4):
    prep = _example([10, 7, 13], seed=8)
    parts = engine.model_parts(model4)
    r = infoflow_answer(parts, prep, chunkwise_prepare(parts, prep), selector="epic", ratio=0.25)
    p, want, start = len(prep.prefix_ids), [], len(prep.prefix_ids)
    for d in prep.doc_ids:
        want += list(range(start, start + math.ceil(0.25 * len(d))))
        start += len(d)
    assert r.selected == want


@torch.no_grad()
def test_cacheblend_partial_recompute_costs(model4):
    prep = _example([20, 20], seed=9)
    parts = engine.model_parts(model4)
    r = infoflow_answer(parts, prep, chunkwise_prepare(parts, prep), selector="cacheblend", ratio=0.25,
                        blend_layer=1)
    m = num_recomputed(0.25, 40)
    assert len(r.selected) == m
    # all 40 context rows in layers 0-1, then m rows in layers 2-3
    assert r.costs["recomputed"] == 40 * 2 + m * 2


def test_full_beyond_its_window_keeps_the_context_s_head_and_tail_once_for_every_question(model4):
    prep = _example([600, 700], seed=11)
    other = PreparedExample(prep.example, prep.prefix_ids, prep.doc_ids, _example([1], suffix=5, seed=12).suffix_ids, [])
    method = parse_method("full:max_length=800")  # a quarter kept for questions: 600 context tokens
    state = method.prepare(model4, _NoTok(), prep)  # one truncated cache, two questions
    n = len(prep.prefix_ids) + prep.context_len
    for p in (prep, other):
        res = method.answer(model4, _NoTok(), p, state, GenerationConfig(2))
        ids = p.prompt_ids()
        ref = _full_logits(model4, PreparedExample(p.example, ids[:300] + ids[n - 300:n], [], ids[n:], []))
        assert (res.first_logits - ref).abs().max() < TOL and res.cost.kv_attended == 600 + len(ids) - n
        assert state[0].get_seq_length() == 600  # the question and answer are cropped off again


def test_truncated_attends_exactly_the_budget(model4):
    prep = _example([50, 60], seed=10)
    res = parse_method("truncated:budget=70").answer(model4, _NoTok(), prep, None, GenerationConfig(2))
    assert res.cost.kv_attended == 70
    with pytest.raises(ValueError, match="below"):
        parse_method("truncated:budget=5").answer(model4, _NoTok(), prep, None, GenerationConfig(2))


def test_bad_options_are_named():
    with pytest.raises(ValueError, match="no option 'k'"):
        parse_method("cachefocus:k=3")
    with pytest.raises(ValueError, match="unknown method"):
        parse_method("cachefokus")
    with pytest.raises(ValueError, match="expected true/false"):
        parse_method("infoflow:reorder=maybe")


@pytest.mark.parametrize("spec, message", [
    ("truncated:budget=0", "budget must be a positive"), ("truncated:budget=-5", "budget must be a positive"),
    ("truncated:ratio=1.5", "ratio must be in"), ("infoflow:ratio=0", "ratio must be in"),
    ("infoflow:ratio=1.2", "ratio must be in"), ("cachefocus:n=0", "n and k_finish must be >= 1"),
    ("cachefocus:allocation=random", "allocation must be"), ("acre:interval=-1", "interval must be >= 0"),
])
def test_impossible_options_are_refused_when_parsed(spec, message):
    from acre_train.eval.methods import parse_method

    with pytest.raises(ValueError, match=message):
        parse_method(spec)


def test_eval_refuses_bad_rows_before_loading_any_model(tmp_path, capsys):
    """A plain model folder with acre rows, or an impossible option: one-line errors, no model load."""
    from acre_train.cli import main

    folder = tmp_path / "plain"
    folder.mkdir()
    (folder / "config.json").write_text('{"model_type": "qwen2"}')  # would not even load as a model
    assert main(["eval", "--model", str(folder), "--tasks", "squad", "--methods", "full,acre"]) == 2
    assert "rows ['acre'] need an ACRE model" in capsys.readouterr().err
    assert main(["eval", "--model", str(folder), "--tasks", "squad", "--methods", "truncated:budget=0"]) == 2
    assert "budget must be a positive" in capsys.readouterr().err


@torch.no_grad()
def test_greedy_decode_over_a_store_equals_the_librarys_greedy_generate(model4):
    """The in-place StoreCache decode gives the tokens transformers' own generate gives (DynamicCache)."""
    parts = engine.model_parts(model4)
    ids = torch.randint(0, VOCAB, (37,), generator=torch.Generator().manual_seed(3))
    pos = torch.arange(len(ids))
    res = engine.layer_pass(parts, ids, pos, torch.zeros_like(ids), None, block_rows=8)  # blocks on purpose
    before = [layer.keys.clone() for layer in res.store]
    got = engine.greedy_decode(parts, res.store, parts.logits(res.hidden[:, -1]), len(ids), 12, stop_ids=set())
    want = model4.generate(ids[None], max_new_tokens=12, do_sample=False, min_new_tokens=12,
                           pad_token_id=0)[0, len(ids):].tolist()
    assert got == want
    # the store the decode started from is unchanged (the cache copied it once, then wrote its own buffer)
    assert all(torch.equal(layer.keys, kept) for layer, kept in zip(res.store, before))


def test_greedy_decode_refuses_a_store_with_entries_after_the_answer(model4):
    parts = engine.model_parts(model4)
    ids = torch.arange(5)
    res = engine.layer_pass(parts, ids, ids.clone(), torch.zeros_like(ids), None)
    with pytest.raises(ValueError, match="first answer position 3"):
        engine.greedy_decode(parts, res.store, parts.logits(res.hidden[:, -1]), 3, 2, stop_ids=set())
