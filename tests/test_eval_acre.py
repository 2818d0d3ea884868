"""The ``acre``/``acre-l1`` evaluation rows: equal to ``full`` where ACRE reduces to it, and wired end to end."""

from __future__ import annotations

import json

import pytest
import torch

from acre_train.eval.methods import GenerationConfig, parse_method
from acre_train.eval.prompt import PreparedExample
from acre_train.eval.tasks import Example, build_task, save_jsonl
from acre_train.modeling import acre_parameters, attach_acre
from acre_train.tiny import tiny_model

VOCAB = 211


def _acre_model():
    model = attach_acre(tiny_model("qwen2", vocab_size=VOCAB, eos_token_id=1))
    torch.manual_seed(5)
    with torch.no_grad():
        for _, p in acre_parameters(model):
            p.add_(0.05 * torch.randn_like(p))
    return model.eval()


def _example(doc_lens: list[int], prefix: int = 6, suffix: int = 9) -> PreparedExample:
    g = torch.Generator().manual_seed(0)
    ids = lambda n: torch.randint(2, VOCAB, (n,), generator=g).tolist()  # noqa: E731
    ex = Example(id="t", question="q?", answers=["a"], documents=["d"] * len(doc_lens))
    return PreparedExample(ex, ids(prefix), [ids(n) for n in doc_lens], ids(suffix), [])


class _IdsTokenizer:
    """Methods only see ids; decoding is the one thing they ask of a tokenizer."""

    def decode(self, ids, skip_special_tokens=True):
        return " ".join(map(str, ids))


def _run(method, model, example):
    with torch.no_grad():
        state = method.prepare(model, _IdsTokenizer(), example)
        return method.answer(model, _IdsTokenizer(), example, state, GenerationConfig(max_new_tokens=3))


def test_acre_without_l1_tokens_in_one_chunk_equals_full():
    """Interval beyond the context and a chunk that holds it all: ACRE is the base model's attention."""
    model, example = _acre_model(), _example([40, 30])
    full = _run(parse_method("full"), model, example)
    acre = _run(parse_method("acre:first_chunk=4096:stride=4096:interval=4096"), model, example)
    torch.testing.assert_close(acre.first_logits, full.first_logits, atol=1e-5, rtol=0)
    assert acre.output_ids == full.output_ids
    assert acre.cost.kv_attended == full.cost.kv_attended


def test_acre_attends_less_than_full_and_l1_less_than_acre():
    model, example = _acre_model(), _example([120, 120, 120])
    common = "first_chunk=64:stride=32:interval=8:working_window=200"
    full = _run(parse_method("full"), model, example)
    acre = _run(parse_method(f"acre:{common}:max_refill=64"), model, example)
    l1 = _run(parse_method(f"acre-l1:{common}"), model, example)
    assert acre.extra["acre_k"] == 64 // 8 and l1.extra["acre_k"] == 0
    assert l1.cost.kv_attended < acre.cost.kv_attended < full.cost.kv_attended


def test_acre_row_needs_an_acre_model():
    with pytest.raises(ValueError, match="needs an ACRE model"):
        _run(parse_method("acre"), tiny_model("qwen2", vocab_size=VOCAB), _example([20]))


def test_eval_cli_runs_acre_rows_on_an_export(tmp_path):
    from acre_train.cli import main
    from acre_train.data.tiny_tokenizer import tiny_tokenizer
    from acre_train.export.writer import export_model

    tok = tiny_tokenizer()
    model = attach_acre(tiny_model("qwen2", vocab_size=len(tok), eos_token_id=tok.eos_token_id))
    export = export_model(model, tmp_path / "export", tokenizer=tok, base_model=None,
                          inference={"first_chunk": 128, "stride": 64, "interval": 16, "working_window": 512,
                                     "max_refill": 64})
    tasks = tmp_path / "tasks.jsonl"
    save_jsonl(build_task("niah_single", tok, 400, 1), tasks)
    out = tmp_path / "out"
    rc = main(["eval", "--model", str(export), "--tasks", str(tasks), "--methods", "full,acre,acre-l1",
               "--out", str(out), "--max-new-tokens", "3", "--no-progress"])
    assert rc == 0
    rows = [json.loads(line) for line in (out / "predictions.jsonl").read_text().splitlines()]
    by_method = {r["method"]: r for r in rows}
    assert set(by_method) == {"full", "acre", "acre-l1"}
    # The export's stored settings were used: k = floor(min(W - m, eta) / l) with eta=64, l=16.
    assert by_method["acre"]["acre_k"] == 4 and by_method["acre-l1"]["acre_k"] == 0


def test_a_shared_context_is_prepared_once_and_answers_as_if_alone():
    """Three questions on one context: every method's answers and first logits equal answering each
    question on its own (the reused state is not changed by answering), and prepare runs once."""
    from acre_train.eval.harness import group_by_context, run_context, run_one

    model, first = _acre_model(), _example([50, 40, 30])
    g = torch.Generator().manual_seed(3)
    group = [PreparedExample(Example(id=f"q{i}", question="q?", answers=["a"], documents=["d"] * 3),
                             first.prefix_ids, first.doc_ids, torch.randint(2, VOCAB, (5 + i,), generator=g).tolist(), [])
             for i in range(3)]
    assert len(group_by_context(group)) == 1
    generation = GenerationConfig(max_new_tokens=3)
    for spec in ("full", "acre:first_chunk=64:stride=32:interval=8:working_window=100", "cachefocus:n=1", "infoflow"):
        method = parse_method(spec)
        calls = []
        real_prepare = method.prepare
        method.prepare = lambda *a, **k: calls.append(1) or real_prepare(*a, **k)  # noqa: B023
        shared = run_context(model, _IdsTokenizer(), method, group, generation, recall_k=1)
        assert len(calls) == 1
        for row, prepared in zip(shared, group):
            alone = run_one(model, _IdsTokenizer(), parse_method(spec), prepared, generation, recall_k=1)
            assert row["prediction"] == alone["prediction"], spec
            assert row["questions_on_context"] == 3 and row["prepare_s"] == shared[0]["prepare_s"]


def test_refill_recall_and_rank_of_the_evidence_span():
    from types import SimpleNamespace

    from acre_train.eval.methods.acre import refill_recall

    # Four documents of 8 tokens after a 6-token prefix: spans (prompt coordinates) of 8 tokens each;
    # the gold document (index 2) is tokens 22..30, i.e. span 2 (22..30) of the cache below.
    example = _example([8, 8, 8, 8])
    example.gold_docs = [2]
    example.example.gold_docs = [2]
    cache = SimpleNamespace(span_bounds=torch.tensor([6, 14, 22, 30, 38]), num_context_tokens=38, tail_ids=[])
    scores = torch.tensor([0.4, 0.3, 0.2, 0.1])  # the evidence span ranks third
    got = refill_recall(None, example, cache, selected=[0, 1], scores=scores)
    assert got["refill_recall"] == 0.0 and got["refill_rank"] == 3
    got = refill_recall(None, example, cache, selected=[2], scores=torch.tensor([0.1, 0.2, 0.6, 0.1]))
    assert got["refill_recall"] == 1.0 and got["refill_rank"] == 1
    assert refill_recall(None, example, cache, selected=[0, 1, 2, 3], scores=None)["refill_rank"] is None
