"""The ``acre``/``acre-l1`` evaluation rows: equal to ``full`` where ACRE reduces to it, and wired end to end."""

from __future__ import annotations

import json

import pytest
import torch

from acre_train.eval.methods import GenerationConfig, parse_method
from acre_train.eval.prompt import PreparedExample
from acre_train.eval.examples import Example, save_jsonl
from acre_train.eval.tasks import build_task
from acre_train.infer.settings import selection_suffix
from acre_train.modeling import acre_parameters, attach_acre
from acre_train.tiny import tiny_model
from helpers import perturbed_acre_model

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


def test_eval_with_a_device_map_that_offloads_to_disk_predicts_as_without(tmp_path, capsys):
    """Every method drives the layers itself: each must find its weights brought in from disk."""
    from acre_train.cli import main
    from acre_train.data.tiny_tokenizer import tiny_tokenizer
    from acre_train.export.writer import export_model

    tok = tiny_tokenizer()
    model = perturbed_acre_model("qwen2", vocab_size=len(tok), eos_token_id=tok.eos_token_id)
    export = export_model(model, tmp_path / "export", tokenizer=tok, base_model=None,
                          inference={"first_chunk": 128, "stride": 64, "interval": 16, "working_window": 512,
                                     "max_refill": 64})
    tasks = tmp_path / "tasks.jsonl"
    save_jsonl(build_task("niah_single", tok, 400, 1), tasks)
    predictions = []
    for extra in ([], ["--device-map", "auto", "--max-memory", "cpu=60000", "--offload-folder", str(tmp_path / "off")]):
        out = tmp_path / f"out{len(extra)}"
        assert main(["eval", "--model", str(export), "--tasks", str(tasks), "--methods", "full,acre,infoflow",
                     "--out", str(out), "--max-new-tokens", "3", "--no-progress", *extra]) == 0
        rows = [json.loads(line) for line in (out / "predictions.jsonl").read_text().splitlines()]
        predictions.append({r["method"]: (r["prediction"], r.get("acre_k")) for r in rows})
    assert "disk: " in capsys.readouterr().out.split("placed by the device map: ")[1].splitlines()[0]
    assert predictions[0] == predictions[1] and len(predictions[0]) == 3


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


class _CharTokenizer:
    """One token per character, with offsets: a context's token ranges are its character ranges."""

    def __call__(self, text, add_special_tokens=False, return_offsets_mapping=False):
        return {"input_ids": [ord(c) for c in text], "offset_mapping": [(i, i + 1) for i in range(len(text))]}


def test_refill_visible_gold_names_the_look_alikes_a_question_saw():
    from types import SimpleNamespace

    from acre_train.eval.methods.acre import gold_token_ranges, refill_recall

    # Three needles of 4 characters after a 6-token prefix; the answer is the second one's.
    # Spans of the cache (prompt coordinates): [6,14) holds needle 0, [22,30) needle 1, [30,38) needle 2.
    context = "xxxxAAAAxxxxxxxxBBBBxxxxxxxxCCCC"
    ex = Example(id="t", question="q?", answers=["BBBB"], context=context, gold_spans=[[4, 8], [16, 20], [28, 32]])
    prepared = PreparedExample(ex, [1] * 6, [[1] * len(context)], [1] * 3, [])
    cache = SimpleNamespace(span_bounds=torch.tensor([6, 14, 22, 30, 38]), num_context_tokens=38, tail_ids=[])
    tok = _CharTokenizer()
    assert gold_token_ranges(tok, prepared) == [(10, 14), (22, 26), (34, 38)]
    got = refill_recall(tok, prepared, cache, selected=[2])
    assert got["refill_coverage"] == 1.0 and got["refill_visible_gold"] == [1]
    got = refill_recall(tok, prepared, cache, selected=[0, 2])
    assert got["refill_visible_gold"] == [0, 1]
    got = refill_recall(tok, prepared, cache, selected=[1, 3])  # the asked needle missed, a look-alike back
    assert got["refill_coverage"] == 0.0 and got["refill_visible_gold"] == [2]
    half = torch.zeros(38, dtype=torch.bool)
    half[22:26] = True
    half[34:36] = True  # half of needle 2 is not "visible whole"
    assert refill_recall(tok, prepared, cache, selected=half)["refill_visible_gold"] == [1]


def test_coverage_counts_evidence_tokens_and_the_split_reads_rows_as_recall_times_answered():
    from types import SimpleNamespace

    from acre_train.eval.metrics import refill_split
    from acre_train.eval.methods.acre import evidence_visibility

    cache = SimpleNamespace(span_bounds=torch.tensor([0, 8, 16, 24, 32]), num_context_tokens=36, tail_ids=[0] * 4)
    straddling = [(12, 20)]  # half in span 1, half in span 2
    half = evidence_visibility(straddling, cache, selected=[1])
    assert half["refill_recall"] == 1.0 and half["refill_coverage"] == 0.5  # overlap says found; half came back
    assert evidence_visibility(straddling, cache, selected=[1, 2])["refill_coverage"] == 1.0
    assert evidence_visibility([(33, 35)], cache, selected=[])["refill_coverage"] == 1.0  # the raw tail is seen
    rows = [{"score": 1.0, "refill_coverage": 1.0}, {"score": 0.5, "refill_coverage": 1.0},
            {"score": 0.0, "refill_coverage": 0.5}, {"score": 1.0, "refill_coverage": None}]
    split = refill_split(rows)
    assert split["score_when_refilled"] == 75.0 and split["score_when_refilled_n"] == 2
    assert split["score_when_missed"] == 0.0 and split["score_when_missed_n"] == 1
    assert split["refill_covered"] == pytest.approx(200 / 3) and split["refill_coverage"] == pytest.approx(250 / 3)
    low, high = split["score_when_refilled_ci"]
    assert 50.0 <= low <= 75.0 <= high <= 100.0


def _tiny_export(tmp_path, **inference):
    from acre_train.data.tiny_tokenizer import tiny_tokenizer
    from acre_train.export.writer import export_model

    tok = tiny_tokenizer()
    model = attach_acre(tiny_model("qwen2", vocab_size=len(tok), eos_token_id=tok.eos_token_id))
    torch.manual_seed(1)
    with torch.no_grad():
        for _, p in acre_parameters(model):
            p.add_(0.05 * torch.randn_like(p))
    geometry = {"first_chunk": 128, "stride": 64, "interval": 16, "working_window": 512, "max_refill": 64, **inference}
    return export_model(model, tmp_path / "export", tokenizer=tok, base_model=None, inference=geometry), tok


def test_calibrate_sweeps_unscored_only_where_the_sinks_are_kept(tmp_path, capsys):
    from acre_train.cli import main

    export, tok = _tiny_export(tmp_path)
    dev = tmp_path / "dev.jsonl"
    save_jsonl(build_task("niah_multikey", tok, 400, 2, seed=5), dev)
    assert main(["calibrate", str(export), "--data", str(dev), "--scorers", "l2", "--layers", "1", "--heads", "max",
                 "--sinks", "2", "--keep-sinks", "spans,tokens", "--unscored", "0,8", "--neighbors", "0", "--grow", "1",
                 "--grow-shapes", "sentences", "--queries", "all", "--dry-run", "--no-progress"]) == 0
    printed = capsys.readouterr().out
    assert "calibrating 8 settings" in printed and "unscored=8" in printed
    assert not (export / "calibration.json").is_file()  # --dry-run changes nothing
    from acre_train.eval.calibrate import sweep

    grid = {(c.scorer.keep_sinks, c.scorer.unscored, c.grow) for c in
            sweep(2, kinds=("l2",), layers=(1,), heads=("max",), sinks=(2,), neighbors=(False,), grow=(1,),
                  grow_shapes=("sentences",), keep_sinks=("spans", "tokens"), unscored=(0, 8))}
    # no kept sinks: never unscored (the sinks would never come back); tokens: grown refills only
    assert grid == {("", 0, 0), ("", 0, 1), ("spans", 0, 0), ("spans", 0, 1), ("spans", 8, 0), ("spans", 8, 1),
                    ("tokens", 0, 1), ("tokens", 8, 1)}
    row = parse_method("acre:unscored=8:sinks=2:keep_sinks=tokens:scorer=l2")
    assert row.scorer_settings(None).describe() == "l2:layers=-1,sinks=2,keep_sinks=tokens,unscored=8"


def test_calibrate_writes_a_setting_that_chat_and_eval_then_use(tmp_path, capsys):
    from acre_train.cli import main
    from acre_train.modeling.scorer_spec import ScorerSettings

    export, tok = _tiny_export(tmp_path)
    dev = tmp_path / "dev.jsonl"
    save_jsonl(build_task("niah_multikey", tok, 400, 4, seed=5), dev)
    rc = main(["calibrate", str(export), "--data", str(dev), "--layers", "0,1,0+1", "--sinks", "0,2", "--no-progress"])
    assert rc == 0
    table = json.loads((export / "calibration.json").read_text())
    best = table["rows"][0]
    # 3 layer sets (0, 1, and both averaged as one setting). l1: layers x heads x nb; l2/bounds: x sinks
    # (0, 2, 2+keep); l2 without neighbours: grown from 1-4 seeds too, by attention, centred, densest or sentences;
    # every one pooling all question tokens or the question's own words
    assert len(table["rows"]) == 2 * (3 * 2 * 2 + 2 * 3 * 2 * 2 * 3 + 3 * 2 * 3 * 4 * 4)
    assert {r["scorer"]["query"] for r in table["rows"]} == {"all", "question"}
    assert {tuple(r["scorer"]["layers"]) for r in table["rows"]} == {(0,), (1,), (0, 1)}
    assert {r["grow"] for r in table["rows"] if r["scorer"]["kind"] == "l2"} == {0, 1, 2, 3, 4}
    assert {r["grow_shape"] for r in table["rows"] if r["grow"]} == {"attention", "centered", "densest", "sentences"}
    assert all(best["covered"] >= r["covered"] for r in table["rows"]) and best["n"] == 4
    stored = json.loads((export / "config.json").read_text())["acre"]["inference"]
    assert ScorerSettings.parse(stored["scorer"]) == ScorerSettings.parse(best["scorer"])
    assert (stored["neighbors"], stored["grow"], stored["grow_shape"]) == \
        (best["neighbors"], best["grow"], best["grow_shape"])
    assert "`" + best["setting"] + "`" in (export / "calibration.md").read_text()

    chosen = ScorerSettings.parse(best["scorer"]).describe()
    context = tmp_path / "ctx.txt"
    context.write_text(build_task("niah_single", tok, 400, 1)[0].context)
    capsys.readouterr()
    import io

    # chat reads stdin: feed one question through the function the verb runs.
    from acre_train.cli import build_parser_for
    from acre_train.infer.cli import run_chat

    argv = ["chat", str(export), "--context", str(context), "--device", "cpu", "--max-new-tokens", "2"]
    assert run_chat(build_parser_for(argv).parse_args(argv), stdin=io.StringIO("What is the key?\n")) == 0
    assert f"scorer {chosen}" in capsys.readouterr().out

    # An eval row takes the stored scorer, and its own options replace it.
    out = tmp_path / "out"
    assert main(["eval", "--model", str(export), "--tasks", str(dev), "--methods",
                 "acre,acre:scorer=l2:layers=1:heads=max:sinks=2:neighbors=1", "--out", str(out),
                 "--max-new-tokens", "2", "--no-progress"]) == 0
    rows = [json.loads(line) for line in (out / "predictions.jsonl").read_text().splitlines()]
    assert {r["acre_scorer"] for r in rows} == {chosen + selection_suffix(best["neighbors"], best["grow"], best["grow_shape"]),
                                                "l2:layers=1,heads=max,sinks=2 +neighbors"}
    summary = json.loads((out / "summary.json").read_text())["overall"]
    for label in ("acre", "acre:scorer=l2:layers=1,heads=max,sinks=2:neighbors=1"):  # --scorer's spelling
        e = summary[label]
        assert e["score_when_refilled_n"] + e["score_when_missed_n"] == 4
        assert e["refill_coverage"] is not None
    assert "score when refilled" in (out / "results.md").read_text()


def test_document_evidence_is_the_answer_sentence_of_the_gold_document():
    from acre_train.data.tiny_tokenizer import tiny_tokenizer
    from acre_train.eval.methods.acre import evidence_token_ranges
    from acre_train.eval.prompt import prepare_example

    tok = tiny_tokenizer()
    docs = ["Rivers run to the sea. Lakes are still.", "The Rhine is long. It flows through Basel to the sea. The end."]
    ex = Example(id="d", question="Which city?", answers=["Basel"], documents=docs, gold_docs=[1])
    prepared = prepare_example(tok, ex)
    (start, end), = evidence_token_ranges(tok, prepared)
    text = tok.decode(prepared.prompt_ids()[start:end])
    assert text.strip() == "It flows through Basel to the sea."
    ex.answers = ["Zurich"]  # no answer string in the gold document: the whole document is the evidence
    (start, end), = evidence_token_ranges(tok, prepare_example(tok, ex))
    assert end - start == len(prepared.doc_ids[1])


def test_calibrate_at_several_lengths_stores_a_band_per_length_that_the_engine_picks(tmp_path):
    from acre_train.cli import main
    from acre_train.infer import AcreEngine
    from acre_train.infer.settings import inference_settings
    from acre_train.modeling.scorer_spec import ScorerSettings
    from acre_train.modeling.selection import Selection

    export, tok = _tiny_export(tmp_path, positions="text")
    assert main(["calibrate", str(export), "--data", "niah_multikey", "--context-tokens", "600", "300",
                 "--num-examples", "4", "--questions-per-context", "2", "--scorers", "l2", "--layers", "0,1",
                 "--heads", "max", "--sinks", "2", "--keep-sinks", "first", "--neighbors", "0", "--grow", "1,2",
                 "--grow-shapes", "densest", "--queries", "all", "--max-refill", "32", "64", "--no-progress"]) == 0
    table = json.loads((export / "calibration.json").read_text())
    assert [x["context_tokens"] for x in table["lengths"]] == [300, 600]
    assert [x["rows"][0]["k"] for x in table["lengths"]] == [2, 4]  # eta 32 and 64 over 16-token spans
    firsts = [Selection(scorer=ScorerSettings.parse(r["scorer"]), neighbors=r["neighbors"], grow=r["grow"],
                        grow_shape=r["grow_shape"], positions="text", max_refill=eta)
              for r, eta in zip((x["rows"][0] for x in table["lengths"]), (32, 64))]
    config = json.loads((export / "config.json").read_text())
    stored = config["acre"]["inference"]
    assert stored["bands"] == [f"424: {firsts[0].describe()}", firsts[1].describe()]  # sqrt(300 * 600) = 424
    assert table["chosen"] == stored["bands"] and "## Length bands stored" in (export / "calibration.md").read_text()
    cache_settings, refill = inference_settings(config)
    assert [refill.bands.pick(n) for n in (300, 424, 425, 600)] == [firsts[0], firsts[0], firsts[1], firsts[1]]
    engine = AcreEngine.__new__(AcreEngine)
    engine.refill = refill

    class _Cache:
        context_tokens = 500
    picked = engine.settings_for(_Cache())
    assert picked.with_selection(firsts[1]) == picked and picked.max_refill == 64


def test_cost_slack_stores_the_shallowest_scorer_within_the_slack_and_evidence_decides_without_it(tmp_path):
    from acre_train.cli import main
    from acre_train.modeling.scorer_spec import ScorerSettings

    export, tok = _tiny_export(tmp_path)
    dev = tmp_path / "dev.jsonl"
    save_jsonl(build_task("niah_multikey", tok, 400, 4, seed=5), dev)
    args = ["calibrate", str(export), "--data", str(dev), "--scorers", "l2", "--layers", "0,1", "--heads", "max",
            "--sinks", "0", "--neighbors", "0", "--grow", "0,1", "--grow-shapes", "sentences", "--queries", "all",
            "--no-progress"]
    assert main(args) == 0
    plain = json.loads((export / "calibration.json").read_text())["rows"]
    assert {r["score_layers"] for r in plain} == {1, 2}  # layer 0 runs one layer, layer 1 two
    assert main([*args, "--cost-slack", "100"]) == 0  # every setting is within 100 points: cost decides
    table = json.loads((export / "calibration.json").read_text())
    assert table["cost_slack"] == 100.0
    best = table["rows"][0]
    assert best["score_layers"] == 1 and [r["setting"] for r in table["rows"] if r["score_layers"] == 1] == \
        [r["setting"] for r in plain if r["score_layers"] == 1]  # ties keep the evidence order
    stored = json.loads((export / "config.json").read_text())["acre"]["inference"]
    assert ScorerSettings.parse(stored["scorer"]).layers == (0,)
    assert "layers scored" in (export / "calibration.md").read_text()
    assert main([*args, "--cost-slack", "-1"]) == 2


def test_the_acre_row_answers_with_the_stored_band_of_its_context_and_its_own_options_hold_everywhere(tmp_path):
    from acre_train.eval.harness import EvalConfig, evaluate
    from acre_train.eval.methods import parse_methods
    from acre_train.infer.load import load_export

    bands = ["500: l2:layers=1,heads=max +grow=1", "l2:layers=0,heads=max +grow=2,densest eta=32"]
    export, tok = _tiny_export(tmp_path, scorer="l2:layers=1", bands=bands)
    model, tok, _ = load_export(export, dtype=torch.float32)
    examples = [e for n in (300, 900) for e in build_task("niah_multikey", tok, n, 1, seed=3)]
    rows = evaluate(model, tok, examples, parse_methods("acre,acre:grow=3"),
                    config=EvalConfig(max_new_tokens=2, progress=False)).rows
    stored = [r for r in rows if r["method"] == "acre"]
    assert [r["acre_scorer"] for r in stored] == ["l2:layers=1,heads=max +grow=1", "l2:layers=0,heads=max +grow=2,densest"]
    assert stored[1]["acre_k"] == 32 // 16  # the long band's eta over 16-token spans
    own = [r for r in rows if r["method"] != "acre"]
    assert [r["acre_scorer"] for r in own] == ["l2:layers=1 +grow=3"] * 2 and own[1]["acre_k"] == 64 // 16


def test_a_second_calibration_of_one_export_is_refused_while_the_first_runs(tmp_path, capsys):
    from acre_train.cli import main
    from acre_train.files import FolderLock

    export, tok = _tiny_export(tmp_path)
    dev = tmp_path / "dev.jsonl"
    save_jsonl(build_task("niah_multikey", tok, 400, 2, seed=5), dev)
    before = (export / "config.json").read_text()
    with FolderLock(export, "calibration"):  # what a first calibrate holds while it runs
        assert main(["calibrate", str(export), "--data", str(dev), "--scorers", "l1", "--no-progress"]) == 2
    assert "in use by another calibration" in capsys.readouterr().err
    assert (export / "config.json").read_text() == before
