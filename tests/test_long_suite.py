"""The long-context suite: its generators at every length, its texts disjoint from every training stream,
and its test split used once."""

from __future__ import annotations

import json
import os
import re
import sysconfig
from collections import defaultdict
from pathlib import Path

import pytest

from acre_train.data.squad import TRAIN_PARITY, squad_articles
from acre_train.eval import long_tasks
from acre_train.eval.ledger import Ledger, TestSplitReused, fingerprint
from acre_train.eval.long_tasks import JARGON, LENGTHS, LONG_TASKS, build_long_task, jargon_entries
from acre_train.eval.tasks import WORDS, build_task

SQUAD = Path(__file__).resolve().parents[2] / "shared" / "data" / "squad-v2-dev.json"

try:
    JARGON.locate()
    HAVE_HAYSTACK = True
except FileNotFoundError:
    HAVE_HAYSTACK = False
# CI installs the haystack (.ci/run); elsewhere the suite's tests say how to.
needs_haystack = pytest.mark.skipif(not HAVE_HAYSTACK and not os.environ.get("ACRE_TRAIN_REQUIRE_HAYSTACK"),
                                    reason=f"the long suite's haystack is not installed ({JARGON.install})")


@pytest.fixture(scope="module")
def tok():
    from acre_train.data.tiny_tokenizer import tiny_tokenizer

    return tiny_tokenizer()


def _by_context(examples):
    groups = defaultdict(list)
    for e in examples:
        groups[e.meta["context_id"]].append(e)
    return groups


@needs_haystack
@pytest.mark.parametrize("name", ["long_needles", "long_chain"])
@pytest.mark.parametrize("length", LENGTHS)
def test_needle_families_are_sized_in_tokens_mark_their_evidence_and_ask_eight_questions(tok, name, length):
    examples = build_long_task(name, tok, length, 1, "test")
    groups = _by_context(examples)
    assert len(groups) == 1 and len(examples) == 8
    context = examples[0].context
    n = len(tok(context, add_special_tokens=False)["input_ids"])
    assert 0.95 * length <= n <= length
    pieces = 1 if name == "long_needles" else 2
    for e in examples:
        assert e.context is context and len(e.gold_spans) == pieces
        facts = [context[a:b] for a, b in e.gold_spans]
        assert e.answers[0] in facts[-1] and all(f.endswith(".") for f in facts)
        archive = re.search(r"the (\w+ \w+) archive", e.question).group(1)
        assert archive in facts[0]
        if pieces == 2:  # the room named with the archive is the room whose code answers
            room = re.search(r"in the ([\w-]+) room", facts[0]).group(1)
            assert f"of the {room} room" in facts[1] and e.gold_spans[0][0] < e.gold_spans[1][0]
    assert len({e.answers[0] for e in examples}) == 8  # eight different questions, eight answers


@needs_haystack
@pytest.mark.skipif(not SQUAD.is_file(), reason="needs ../shared/data/squad-v2-dev.json")
@pytest.mark.parametrize("length", [4096, 32768])
def test_long_qa_puts_four_gold_paragraphs_of_its_split_among_distractors_without_the_answers(tok, length):
    data = squad_articles(SQUAD)
    paragraphs = {p["context"]: i for i, art in enumerate(data) for p in art["paragraphs"]}
    examples = build_long_task("long_qa", tok, length, 2, "dev", squad_path=SQUAD)
    groups = _by_context(examples)
    assert len(groups) == 2 and all(len(g) == 8 for g in groups.values())
    for group in groups.values():
        docs = group[0].documents
        golds = set(group[0].meta["gold_docs_in_context"])
        assert len(golds) == 4 and {e.gold_docs[0] for e in group} == golds
        n = sum(len(tok(d, add_special_tokens=False)["input_ids"]) for d in docs)
        assert 0.95 * length <= n <= length
        for e in group:
            gold = docs[e.gold_docs[0]]
            assert paragraphs[gold] % 4 == 1  # a dev article (held out from training: odd index)
            assert any(a.lower() in gold.lower() for a in e.answers)
            for i, d in enumerate(docs):
                if i not in golds:
                    assert not any(a.lower() in d.lower() for a in e.answers)


@needs_haystack
@pytest.mark.skipif(not SQUAD.is_file(), reason="needs ../shared/data/squad-v2-dev.json")
def test_no_long_suite_text_is_in_any_training_stream():
    """Document level: no long-suite document is a training document, and none shares a 12-word passage
    with the stage-1 text mix, the 1M-token corpus (Python Language Reference, the standard library's
    modules, training SQuAD articles), the stage-2 and calibration sets (the same SQuAD articles and
    needles over the Language Reference)."""
    from pydoc_data.topics import topics

    data = squad_articles(SQUAD)
    training = [t for t in topics.values()]
    training += [p["context"] for i, art in enumerate(data) if i % 2 == TRAIN_PARITY for p in art["paragraphs"]]
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    training += [p.read_text(encoding="utf-8", errors="replace") for p in sorted(stdlib.glob("*.py"))]

    def shingles(text: str, n: int = 12) -> set[int]:
        words = re.findall(r"\w+", text.lower())
        return {hash(" ".join(words[i:i + n])) for i in range(len(words) - n + 1)}

    seen: set[int] = set()
    for text in training:
        seen |= shingles(text)
    suite = [text for _, text in jargon_entries()]
    suite += [p["context"] for i, art in enumerate(data) if i % 2 != TRAIN_PARITY for p in art["paragraphs"]]
    # Wikipedia's census sentences ("... someone living alone who was 65 years of age or older ...") recur in
    # many city articles: a template's few shared windows are not a shared document; a copied one shares most.
    shared = [(round(len(shingles(text) & seen) / max(1, len(shingles(text))), 3), text[:60]) for text in suite]
    copied = [x for x in shared if x[0] >= 0.05]
    assert not copied, f"{len(copied)} long-suite documents share >= 5 % of their 12-word passages with training text"
    assert sum(x[0] > 0 for x in shared) <= 2  # the census template above, and nothing else
    # and the needles' own words are none of the training needles' key words
    words = set(WORDS) | {w.lower() for w in WORDS}
    assert not {w.lower() for w in long_tasks._NAMES + long_tasks._STONES} & words
    assert sum(len(t) for t in suite) > 1_000_000


@needs_haystack
def test_dev_and_test_share_no_haystack_entry_and_no_key(tok):
    dev_docs, test_docs = (set(long_tasks.haystack_documents(s)) for s in ("dev", "test"))
    assert dev_docs and test_docs and not dev_docs & test_docs
    dev, test = (build_long_task("long_needles", tok, 4096, 2, s) for s in ("dev", "test"))
    assert not {e.question for e in dev} & {e.question for e in test}
    assert build_task("long_needles", tok, 4096, 9, split="test")[0].question == test[0].question  # 9 -> 2 contexts
    assert len(build_task("long_needles", tok, 4096, 9, split="test")) == 16
    with pytest.raises(ValueError, match="--split applies to the long suite"):
        build_task("niah_single", tok, 512, 1, split="test")


def test_a_missing_haystack_names_the_package_to_install(monkeypatch, tmp_path):
    gone = long_tasks.TextSource(**{**JARGON.__dict__, "paths": (str(tmp_path / "none.txt.gz"),)})
    monkeypatch.delenv("ACRE_TRAIN_HAYSTACK", raising=False)
    with pytest.raises(FileNotFoundError, match="apt-get install jargon-text"):
        gone.locate()


def test_the_ledger_refuses_a_repeat_and_a_rerun_reports_the_first(tmp_path):
    ledger = Ledger(tmp_path / "ledger.jsonl")
    key = fingerprint({"model": "abc", "tasks": "long_needles", "context_tokens": 16384})
    assert key != fingerprint({"model": "abd", "tasks": "long_needles", "context_tokens": 16384})
    assert ledger.check(key, rerun=False) == []
    ledger.record(key, {"out": "run1", "scores": {"acre": 50.0}})
    with pytest.raises(TestSplitReused, match="ran already.*--rerun"):
        ledger.check(key, rerun=False)
    before = ledger.check(key, rerun=True)
    assert [r["scores"] for r in before] == [{"acre": 50.0}]
    ledger.record(key, {"out": "run2", "scores": {"acre": 55.0}, "rerun": True})
    assert [r["out"] for r in ledger.previous(key)] == ["run1", "run2"]
    assert [json.loads(x)["out"] for x in (tmp_path / "ledger.jsonl").read_text().splitlines()] == ["run1", "run2"]


@needs_haystack
def test_eval_on_the_test_split_runs_once_and_a_rerun_names_the_first(tmp_path, capsys):
    """The CLI path: a tiny model answers a 1K long_needles test cell, is refused the second time, and with
    --rerun answers again and writes both runs beside each other."""
    from acre_train.cli import main
    from acre_train.data.tiny_tokenizer import tiny_tokenizer
    from acre_train.tiny import tiny_model

    tok = tiny_tokenizer()
    model = tiny_model("qwen2", vocab_size=len(tok), eos_token_id=tok.eos_token_id)
    folder = tmp_path / "model"
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    ledger = tmp_path / "ledger.jsonl"
    argv = ["eval", "--model", str(folder), "--tasks", "long_needles", "--split", "test", "--context-tokens", "1024",
            "--num-examples", "8", "--methods", "full", "--max-new-tokens", "2", "--device", "cpu", "--no-progress",
            "--ledger", str(ledger), "--out", str(tmp_path / "run1")]
    assert main(argv) == 0
    assert main(argv[:-1] + [str(tmp_path / "run2")]) == 2  # refused: one line, exit code 2
    assert "ran already" in capsys.readouterr().err
    assert not (tmp_path / "run2").exists()
    assert main(argv[:-1] + [str(tmp_path / "run2"), "--rerun"]) == 0
    runs = json.loads((tmp_path / "run2" / "test_runs.json").read_text())
    assert [r["out"] for r in runs["earlier_runs"]] == [str(tmp_path / "run1")]
    assert len(ledger.read_text().splitlines()) == 2


def test_the_published_long_tables_are_what_the_script_writes():
    """docs/long/README.md and the README's long-context block come from the committed predictions through
    studies/long/cells.py; a hand edit or a stale table fails here."""
    from studies.long.cells import write_report

    assert write_report(check=True) == 0


def test_a_row_added_to_a_finished_cell_is_reported_inside_it_and_marked(tmp_path, monkeypatch):
    """``CELL+row`` runs (a baseline added after the cell's first run) join the cell's tables, marked."""
    from studies.long import cells

    def rows(method, score):
        return [{"method": method, "score": score, "substring": score, "qa_f1": score, "prediction": "KX-1",
                 "answers": ["KX-1"], "kv_attended": 10, "prompt_tokens": 100, "context_index": 0, "prepare_s": 1.0,
                 "answer_s": 1.0, "memory_added_bytes": 0, "refill_coverage": 1.0, "refill_rank": 1}] * 4

    monkeypatch.setattr(cells, "DOCS", tmp_path)
    monkeypatch.setattr(cells, "CELLS", {"n": ("long_needles", 16, 4, "full,acre", 8),
                                         "n+cachefocus": ("long_needles", 16, 4, "cachefocus", 8)})
    for run, lines in (("n", rows("full", 1.0) + rows("acre", 0.5)), ("n+cachefocus", rows("cachefocus", 0.25))):
        (tmp_path / "cells" / run).mkdir(parents=True)
        (tmp_path / "cells" / run / "predictions.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    table = cells.table()
    assert "| n | `cachefocus` (added later) | answer contained 25.0" in table and "n+cachefocus" not in table
    assert "| n | `acre` | answer contained 50.0" in table
    compact = cells.compact_table()
    assert "25.0 (25–25) †" in compact and "† a row added after the cell's first run" in compact


def test_a_control_row_answers_with_its_own_model_and_is_reported_under_its_own_name(tmp_path, monkeypatch):
    """The SFT-vanilla control runs the ``full`` row on another model folder; the cell reports it as
    ``sft-vanilla``, beside (not merged with) the base's full attention."""
    from studies.long import cells

    def rows(method, score):
        return [{"method": method, "score": score, "substring": score, "qa_f1": score, "prediction": "a b",
                 "answers": ["a b"], "kv_attended": 10, "prompt_tokens": 100, "context_index": 0, "prepare_s": 1.0,
                 "answer_s": 1.0, "memory_added_bytes": 0, "refill_coverage": 1.0, "refill_rank": 1}] * 4

    vanilla = cells.REPO / "checkpoints" / "vanilla-export"
    monkeypatch.setattr(cells, "CELLS", {"q": ("long_qa", 16, 4, "full,acre", 8),
                                         "q+sft-vanilla": ("long_qa", 16, 4, "full", 8)})
    monkeypatch.setattr(cells, "MODELS", {"q+sft-vanilla": (vanilla, tmp_path / "run")})
    monkeypatch.setattr(cells, "LABELS", {"q+sft-vanilla": {"full": "sft-vanilla"}})
    argv = cells.command("q+sft-vanilla")
    assert argv[argv.index("--model") + 1] == "checkpoints/vanilla-export" and argv[argv.index("--methods") + 1] == "full"
    assert cells.command("q")[cells.command("q").index("--model") + 1] == str(cells.EXPORT.relative_to(cells.REPO))
    assert "SFT-vanilla" not in cells.compact_table()  # no column before the control has run
    monkeypatch.setattr(cells, "DOCS", tmp_path)
    for run, lines in (("q", rows("full", 1.0) + rows("acre", 0.5)), ("q+sft-vanilla", rows("full", 0.75))):
        (tmp_path / "cells" / run).mkdir(parents=True)
        (tmp_path / "cells" / run / "predictions.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    table = cells.table()
    assert "| q | `sft-vanilla` (added later) | F1 75.0" in table and "| q | `full` | F1 100.0" in table
    assert "| SFT-vanilla |" in cells.compact_table() and "75.0 (75–75) †" in cells.compact_table()
