"""Stage-1 preparation end to end on small local files and the built-in text."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import datasets
import numpy as np
import pytest

from acre_train.cli import main
from acre_train.data import DataError, Stage1Settings, load_prepared, prepare_stage1, tiny_tokenizer
from acre_train.modeling.interleave import IGNORE_INDEX, interleave, num_chunks, sample_intervals

datasets.disable_progress_bars()

PLAN = dict(first_chunk=64, stride=32, intervals=(4, 8, 16))


def _ascii_docs() -> list[str]:
    """ASCII prose (so any token span decodes to an exact substring of its document)."""
    from pydoc_data.topics import topics

    docs = ["".join(c for c in text if ord(c) < 128) for _, text in sorted(topics.items())]
    return [d for d in docs if len(d) > 200][:30]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("corpus") / "docs.jsonl"
    with open(path, "w") as f:
        for i, text in enumerate(_ascii_docs()):
            f.write(json.dumps({"text": text, "meta": {"doc": i}}) + "\n")
    return path


def _settings(tmp_path, inputs, name="out", **over) -> Stage1Settings:
    values = dict(inputs=(str(inputs),), output=tmp_path / name, cache_dir=tmp_path / "cache",
                  min_length=100, max_length=300, token_budget=20_000, seed=1, **PLAN)
    values.update(over)
    return Stage1Settings(**values)


def _arrow_bytes(path: Path) -> list[bytes]:
    return [p.read_bytes() for p in sorted(path.glob("*.arrow"))]


def test_spans_respect_bounds_and_budget(tmp_path, corpus):
    ds, manifest = load_prepared(prepare_stage1(_settings(tmp_path, corpus)))
    lengths = ds["num_raw_tokens"]
    assert len(ds) > 20
    assert all(100 <= n <= 300 for n in lengths)
    assert sum(lengths) <= 20_000
    assert manifest["counts"]["raw_tokens"] == sum(lengths)
    assert manifest["counts"]["total_tokens"] == sum(len(x) for x in ds["input_ids"])
    assert sum(manifest["histograms"]["raw_length"].values()) == len(ds)
    assert manifest["plan"]["l1_token_id"] == tiny_tokenizer().eos_token_id
    assert manifest["inputs"][0]["sha256"] and manifest["complete"] is True
    for column in ("input_ids", "is_l1", "chunk_ids", "positions", "memory_positions", "labels",
                   "raw_index", "num_raw_tokens", "intervals", "sample_index"):
        assert column in ds.column_names


def test_same_seed_is_byte_identical_and_other_seed_changes_intervals(tmp_path, corpus):
    a = prepare_stage1(_settings(tmp_path, corpus, "a"))
    b = prepare_stage1(_settings(tmp_path, corpus, "b", cache_dir=tmp_path / "other-cache"))
    c = prepare_stage1(_settings(tmp_path, corpus, "c", seed=2))
    assert _arrow_bytes(a) == _arrow_bytes(b) and _arrow_bytes(a)
    ma, mb = (json.loads((p / "manifest.json").read_text()) for p in (a, b))
    assert ma["counts"] == mb["counts"] and ma["fingerprint"] == mb["fingerprint"]
    ia, ic = load_prepared(a)[0]["intervals"], load_prepared(c)[0]["intervals"]
    assert ia != ic


def test_every_l1_slot_is_where_the_plan_puts_it(tmp_path, corpus):
    settings = _settings(tmp_path, corpus)
    ds, manifest = load_prepared(prepare_stage1(settings))
    l1_id = manifest["plan"]["l1_token_id"]
    for row in ds.with_format("numpy"):
        is_l1 = row["is_l1"].astype(bool)
        raw = row["input_ids"][~is_l1]
        expected_intervals = sample_intervals(num_chunks(len(raw), 64, 32), (4, 8, 16),
                                              seed=(1, int(row["sample_index"])))
        assert row["intervals"].tolist() == expected_intervals
        plan = interleave(raw, first_chunk=64, stride=32, intervals=expected_intervals, l1_token_id=l1_id)
        for key, value in plan.as_dict().items():
            np.testing.assert_array_equal(row[key], value, err_msg=key)
        assert (row["input_ids"][is_l1] == l1_id).all()
        assert (row["labels"][is_l1] == IGNORE_INDEX).all()


def test_decoding_raw_tokens_gives_back_the_source_span(tmp_path, corpus):
    tok = tiny_tokenizer()
    docs = _ascii_docs()
    ds, _ = load_prepared(prepare_stage1(_settings(tmp_path, corpus)))
    checked = 0
    for row in ds:
        segments = json.loads(row["meta"])
        raw = [t for t, l1 in zip(row["input_ids"], row["is_l1"]) if not l1]
        if len(segments) == 1:
            seg = segments[0]
            text = tok.decode(raw)
            source = docs[seg["meta"]["doc"]]
            assert text in source
            assert raw == tok(source, add_special_tokens=False)["input_ids"][seg["start"]:seg["end"]]
            checked += 1
        else:  # packed: the pieces are joined by exactly one EOS each
            assert raw.count(tok.eos_token_id) == len(segments) - 1
    assert checked > 10


def test_all_input_formats_give_the_same_samples(tmp_path, corpus):
    import pyarrow as pa
    import pyarrow.parquet as pq
    import zstandard

    lines = corpus.read_text()
    (tmp_path / "d.jsonl.gz").write_bytes(gzip.compress(lines.encode()))
    (tmp_path / "d.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(lines.encode()))
    records = [json.loads(line) for line in lines.splitlines()]
    pq.write_table(pa.table({"text": [r["text"] for r in records], "meta": [json.dumps(r["meta"]) for r in records]}),
                   tmp_path / "d.parquet")
    reference = load_prepared(prepare_stage1(_settings(tmp_path, corpus, "ref")))[0]["input_ids"]
    for name in ("d.jsonl.gz", "d.jsonl.zst", "d.parquet"):
        got = load_prepared(prepare_stage1(_settings(tmp_path, tmp_path / name, name + ".out")))[0]["input_ids"]
        assert got == reference, name


def test_bad_records_are_counted_reported_or_fatal(tmp_path, corpus, capsys):
    path = tmp_path / "mixed.jsonl"
    good = corpus.read_text().splitlines()
    path.write_text("\n".join([good[0], "{broken", json.dumps({"txt": "x"}), json.dumps({"text": 5}), *good[1:]]) + "\n")
    _, manifest = load_prepared(prepare_stage1(_settings(tmp_path, path)))
    skipped = manifest["skipped"]
    assert skipped["total"] == 3
    assert [(e["source"], e["line"]) for e in skipped["examples"]] == [(str(path), 2), (str(path), 3), (str(path), 4)]
    assert f"{path}:3: missing field 'text'" in capsys.readouterr().err
    with pytest.raises(DataError, match=rf"{path}:2: malformed JSON"):
        prepare_stage1(_settings(tmp_path, path, "strict", strict=True))  # same cache as the lenient run
    assert not (tmp_path / "strict").exists()


def test_input_without_any_sample_says_why(tmp_path):
    path = tmp_path / "short.jsonl"
    path.write_text(json.dumps({"text": "tiny"}) + "\n")
    with pytest.raises(DataError, match="below min_length=100"):
        prepare_stage1(_settings(tmp_path, path, pack=False))
    assert not (tmp_path / "out").exists()


def test_interrupted_run_leaves_nothing_that_looks_complete(tmp_path, corpus, monkeypatch):
    from acre_train.data import prepare as prepare_module

    original = prepare_module.save_rows

    def save_then_die(rows, path, *args, **kwargs):  # the rows are all written, the manifest is not
        original(rows, path, *args, **kwargs)
        assert Path(path).name.startswith(".out.partial-") and (Path(path) / "state.json").is_file()
        raise KeyboardInterrupt("simulated interruption")

    monkeypatch.setattr(prepare_module, "save_rows", save_then_die)
    with pytest.raises(KeyboardInterrupt):
        prepare_stage1(_settings(tmp_path, corpus))
    assert not (tmp_path / "out").exists()
    assert not list(tmp_path.glob(".out.*"))
    with pytest.raises(DataError, match="no such prepared dataset"):
        load_prepared(tmp_path / "out")
    monkeypatch.undo()
    # A directory without a complete manifest (e.g. a killed copy) is refused, not half-read.
    (tmp_path / "fake").mkdir()
    with pytest.raises(DataError, match="did not finish"):
        load_prepared(tmp_path / "fake")
    assert load_prepared(prepare_stage1(_settings(tmp_path, corpus)))[1]["complete"]


def test_rerun_reuses_and_changed_settings_need_overwrite(tmp_path, corpus):
    out = prepare_stage1(_settings(tmp_path, corpus))
    stamp = (out / "manifest.json").stat().st_mtime_ns
    messages = []
    prepare_stage1(_settings(tmp_path, corpus, num_proc=1), log=messages.append)
    assert "reusing" in messages[0] and (out / "manifest.json").stat().st_mtime_ns == stamp
    with pytest.raises(DataError, match="--overwrite"):
        prepare_stage1(_settings(tmp_path, corpus, min_length=120))
    prepare_stage1(_settings(tmp_path, corpus, min_length=120, overwrite=True))
    assert min(load_prepared(out)[0]["num_raw_tokens"]) >= 120


@pytest.mark.slow
def test_two_processes_give_the_same_rows(tmp_path, corpus, monkeypatch):
    # A fast tokenizer encodes while the records are read, in one process (it uses every core itself);
    # a slow one, or a fast one told to use one core, is tokenized in worker processes. Every way
    # gives the same rows and manifest.
    from acre_train.data import stage1

    class SlowEncoder(stage1.BatchEncoder):
        def __init__(self, tokenizer):
            super().__init__(tokenizer)
            self.rust, self.tokenizer = None, tokenizer  # as for a tokenizer without a Rust backend

    workers = []
    real = stage1._tokenize

    def spy(settings, *args):
        if args[-1] > 1:  # the number of worker processes
            workers.append(settings.output.name)
        return real(settings, *args)

    monkeypatch.setattr(stage1, "_tokenize", spy)

    def prep(name, **over):
        return load_prepared(prepare_stage1(_settings(tmp_path, corpus, name, cache_dir=tmp_path / name / "c", **over)))

    runs = {"one": prep("one"), "two": prep("two", num_proc=2)}
    monkeypatch.setenv("TOKENIZERS_PARALLELISM", "false")
    runs["serial"] = prep("serial", num_proc=2)
    monkeypatch.setattr(stage1, "BatchEncoder", SlowEncoder)
    runs["slow"] = prep("slow", num_proc=2)
    assert workers == ["serial", "slow"]
    rows = {name: ds.to_dict() for name, (ds, _) in runs.items()}
    assert all(r == rows["one"] for r in rows.values())
    for key in ("counts", "histograms", "plan", "skipped", "inputs"):
        assert all(m[key] == runs["one"][1][key] for _, m in runs.values()), key


def test_unknown_settings_key_is_named():
    with pytest.raises(DataError, match="min_lenght: unknown key; did you mean 'min_length'"):
        Stage1Settings.from_dict({"builtin": True, "min_lenght": 5})


def test_settings_are_typed_like_the_recipe_and_every_problem_is_one_line():
    from acre_train.data import Stage2Settings

    with pytest.raises(DataError) as bad:
        Stage2Settings.from_dict({"builtin": True, "overlong": "cut", "context_tokens": "many"})
    text = str(bad.value)
    assert "\n" not in text and "overlong: Input should be 'truncate' or 'drop' (got 'cut')" in text
    assert "context_tokens: " in text
    with pytest.raises(DataError, match="^Stage1Settings: need 1 <= min_length <= max_length"):
        Stage1Settings(builtin=True, min_length=50, max_length=10)
    s = Stage1Settings(builtin=True, intervals=16, first_chunk="64", stride=32, min_length=8, max_length=64)
    assert s.intervals == (16,) and s.first_chunk == 64 and s.to_dict()["intervals"] == [16]


def test_cli_run_and_debug_on_builtin_text(tmp_path, capsys):
    args = ["preprocess", "stage1", "--builtin", "--min-length", "64", "--max-length", "128", "--first-chunk", "48",
            "--stride", "32", "--intervals", "8,16", "--budget", "3000", "--cache-dir", str(tmp_path / "c")]
    assert main([*args, "--debug", "2", "--color", "never", "--output", str(tmp_path / "o")]) == 0
    shown = capsys.readouterr().out
    assert shown.count("sample ") == 2 and "[L1]" in shown and "{{" in shown and "\033[" not in shown
    assert not (tmp_path / "o").exists()  # --debug writes nothing
    assert main([*args, "--output", str(tmp_path / "o")]) == 0
    ds, manifest = load_prepared(tmp_path / "o")
    assert manifest["settings"]["builtin"] and sum(ds["num_raw_tokens"]) <= 3000
    assert main([*args]) == 2 and "--output is required" in capsys.readouterr().err


def test_overwrite_replaces_only_a_prepared_dataset_and_cleans_stale_partials(tmp_path, corpus):
    mine = tmp_path / "notes"
    mine.mkdir()
    (mine / "thesis.txt").write_text("years of work")
    with pytest.raises(DataError, match="not a prepared dataset"):
        prepare_stage1(_settings(tmp_path, corpus, "notes", overwrite=True))
    assert (mine / "thesis.txt").read_text() == "years of work"
    stale = tmp_path / ".out.partial-killed"
    stale.mkdir()
    (stale / "half.arrow").write_bytes(b"\0" * 10)
    first = prepare_stage1(_settings(tmp_path, corpus))
    assert not stale.exists()
    again = prepare_stage1(_settings(tmp_path, corpus, seed=5, overwrite=True))  # a dataset: replaced
    assert again == first and load_prepared(again)[1]["settings"]["seed"] == 5


def test_the_batch_encoder_gives_the_tokenizers_own_ids_whatever_its_backend_was_left_with():
    """Dataset workers get the Rust backend alone (fast to pickle); its ids must be the wrapper's, even
    when an earlier call left truncation or padding switched on in the shared backend."""
    import pickle

    from acre_train.data.tokenizer import BatchEncoder

    tok = tiny_tokenizer()
    texts = ["a longer sentence with several words in it, and punctuation.", "short", "", "  two  spaces\n\nand lines"]
    want = tok(texts, add_special_tokens=False)["input_ids"]
    tok._tokenizer.enable_truncation(3)
    tok._tokenizer.enable_padding(length=40)
    encode = pickle.loads(pickle.dumps(BatchEncoder(tok)))
    assert encode.rust is not None and encode(texts) == want
    assert max(len(ids) for ids in want) > 3
