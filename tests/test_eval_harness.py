"""Tasks (seeded, sized, evidence right), the JSONL format, and the `acre-train eval` CLI end to end."""

from __future__ import annotations

import json

import pytest
import torch
import transformers

from acre_train.eval import build_task, load_jsonl, prepare_example, save_jsonl
from acre_train.eval.examples import Example


def _tokenizer():
    try:
        from acre_train.data.tiny_tokenizer import tiny_tokenizer

        return tiny_tokenizer()
    except ImportError:  # fallback until the shared tiny tokenizer exists: a small BPE trained here
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
        from pydoc_data.topics import topics

        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        tok.train_from_iterator(list(topics.values())[:200], trainers.BpeTrainer(
            vocab_size=512, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False))
        return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>")


@pytest.fixture(scope="module")
def tok():
    return _tokenizer()


def test_squad_task_sized_seeded_gold_known(tok):
    a = build_task("squad", tok, 1200, 3, seed=4)
    assert [e.to_dict() for e in a] == [e.to_dict() for e in build_task("squad", tok, 1200, 3, seed=4)]
    for e in a:
        (g,) = e.gold_docs
        assert any(ans.lower() in e.documents[g].lower() for ans in e.answers)
        others = [d for i, d in enumerate(e.documents) if i != g]
        assert others and not any(ans.lower() in d.lower() for d in others for ans in e.answers)
        n = sum(len(tok(d, add_special_tokens=False)["input_ids"]) for d in e.documents)
        assert 600 < n <= 1200


@pytest.mark.parametrize("name", ["niah_single", "niah_multikey", "niah_multivalue", "vt"])
def test_needle_tasks(tok, name):
    (e,) = build_task(name, tok, 1000, 1, seed=1)
    n = len(tok(e.context, add_special_tokens=False)["input_ids"])
    assert 800 < n <= 1010
    needles = [e.context[a:b] for a, b in e.gold_spans]
    for ans in e.answers:  # every gold answer is stated inside a needle
        assert any(ans in s for s in needles)
    prep = prepare_example(tok, e, chunk_tokens=128)
    assert prep.gold_docs and all(0 <= d < prep.num_docs for d in prep.gold_docs)
    for d in prep.gold_docs[:1]:  # the chunk marked gold holds (part of) a needle's text
        text = tok.decode(prep.doc_ids[d])
        assert any(s[:12] in text or s[-12:] in text for s in needles)
    if name == "vt":  # the chain reads in order
        assert [s.split()[1] for s in needles] == e.answers


def test_jsonl_roundtrip_and_errors(tmp_path, tok):
    exs = build_task("niah_single", tok, 300, 2) + build_task("squad", tok, 400, 1)
    path = tmp_path / "t.jsonl"
    save_jsonl(exs, path)
    assert [e.to_dict() for e in load_jsonl(path)] == [e.to_dict() for e in exs]

    def interrupted():
        yield exs[0]
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):  # a write stopped halfway leaves the old file whole, and no other
        save_jsonl(interrupted(), path)
    assert [e.to_dict() for e in load_jsonl(path)] == [e.to_dict() for e in exs]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["t.jsonl"]
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"id": 1, "question": "q", "answers": ["a"], "context": "c", "documnets": []}) + "\n")
    with pytest.raises(ValueError, match=r"bad.jsonl:1: unknown field\(s\) \['documnets'\]"):
        load_jsonl(bad)
    broken = tmp_path / "broken.jsonl"
    broken.write_text(json.dumps(exs[0].to_dict()) + "\n\n{not json\n")
    with pytest.raises(ValueError, match=r"broken.jsonl:3: malformed JSON"):
        load_jsonl(broken)
    with pytest.raises(ValueError, match="exactly one of"):
        Example(id="x", question="q", answers=["a"], context="c", documents=["d"])
    with pytest.raises(ValueError, match="out of range"):
        Example(id="x", question="q", answers=["a"], documents=["d"], gold_docs=[3])


def test_cli_end_to_end(tmp_path, tok):
    from acre_train.cli import main

    torch.manual_seed(0)
    cfg = transformers.Qwen2Config(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024)
    model_dir = tmp_path / "model"
    transformers.AutoModelForCausalLM.from_config(cfg).save_pretrained(model_dir)
    tok.save_pretrained(model_dir)
    tasks = tmp_path / "tasks.jsonl"
    save_jsonl(build_task("squad", tok, 500, 1) + build_task("niah_multivalue", tok, 400, 1), tasks)
    out = tmp_path / "out"
    methods = "full,truncated:budget=200,cachefocus:k_finish=2,infoflow,no-recompute,cacheblend,epic"
    rc = main(["eval", "--model", str(model_dir), "--tasks", str(tasks), "--methods", methods, "--out", str(out),
               "--max-new-tokens", "4", "--chunk-tokens", "128", "--no-progress"])
    assert rc == 0
    rows = [json.loads(line) for line in (out / "predictions.jsonl").read_text().splitlines()]
    assert len(rows) == 2 * 7
    summary = json.loads((out / "summary.json").read_text())
    assert set(summary["overall"]) == {m if ":" not in m else m for m in methods.split(",")}
    assert summary["overall"]["truncated:budget=200"]["kv_attended"] == 200
    assert summary["overall"]["full"]["ttft_s_vs_full"] == 1.0
    assert "| cachefocus:k_finish=2 |" in (out / "results.md").read_text()
    assert (out / "quality_vs_kv.png").read_bytes()[:4] == b"\x89PNG"
    assert main(["eval", "--model", str(model_dir), "--tasks", str(tasks), "--methods", "nope"]) == 2


def test_a_failing_row_keeps_the_finished_answers_and_the_same_command_resumes(tmp_path, tok):
    """A row that cannot answer one context (here: made to raise there) stops the eval with an error
    naming the row and context; every (context, row) that finished is kept in --out and a rerun answers
    only what is missing (a line a kill cut short is dropped and redone); the result equals a fresh run's."""
    from dataclasses import dataclass
    from typing import ClassVar

    from acre_train.eval.harness import PARTIAL, EvalConfig, evaluate
    from acre_train.eval.methods.full import Full

    calls: list[tuple[str, str]] = []

    @dataclass
    class Counting(Full):
        name: ClassVar[str] = "counting"
        broken: ClassVar[str | None] = None  # (not a field: the row's label stays the same when fixed)

        def answer(self, model, tokenizer, example, state, generation):
            calls.append((self.name, example.example.id))
            if example.example.id == Counting.broken:
                raise ValueError("this context needs a larger working window")
            return super().answer(model, tokenizer, example, state, generation)

    torch.manual_seed(0)
    cfg = transformers.Qwen2Config(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024)
    model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    examples = build_task("niah_single", tok, 200, 3, seed=3)
    config = EvalConfig(max_new_tokens=3, progress=False)
    fresh = evaluate(model, tok, examples, [Full(), Counting()], config=config)

    out = tmp_path / "out"
    Counting.broken = examples[2].id
    with pytest.raises(ValueError, match=r"row 'counting' on context 2 .*larger working window.*finished answers are kept"):
        evaluate(model, tok, examples, [Full(), Counting()], config=config, out_dir=out)
    lines = (out / PARTIAL).read_text().splitlines()
    assert len(lines) == 1 + 5  # the plan, then full/counting on contexts 0 and 1, full on context 2
    (out / PARTIAL).write_text("\n".join(lines[:-1]) + "\n" + lines[-1][: len(lines[-1]) // 2])  # a kill mid-line
    Counting.broken, calls[:] = None, []
    resumed = evaluate(model, tok, examples, [Full(), Counting()], config=config, out_dir=out)
    assert calls == [("counting", examples[2].id)]  # full on context 2 ran again (its line was torn), counting too
    strip = lambda rows: [{k: v for k, v in r.items() if not k.endswith(("_s", "_bytes"))} for r in rows]  # noqa: E731
    assert strip(resumed.rows) == strip(fresh.rows)
    assert not (out / PARTIAL).exists() and (out / "predictions.jsonl").is_file()
