"""The real-base study driver end to end on a tiny base: streams, both stages, exports, eval cells, report."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from acre_train.cli import main as cli_main

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
@pytest.mark.skipif(os.environ.get("ACRE_TRAIN_LONG_TESTS") != "1",
                    reason="100 s (nine training processes); ACRE_TRAIN_LONG_TESTS=1 runs it (kept out of CI's 15 minutes)")
def test_reproduce_real_smoke_runs_every_step_and_resumes(tmp_path, monkeypatch, capsys):
    from acre_train.data.builtin import builtin_qa
    from acre_train.data.tiny_tokenizer import tiny_tokenizer
    from acre_train.tiny import tiny_model

    tok = tiny_tokenizer()
    base = tmp_path / "tiny-base"
    tiny_model("qwen2", vocab_size=len(tok), eos_token_id=tok.eos_token_id).save_pretrained(base)
    tok.save_pretrained(base)
    squad = tmp_path / "squad.json"
    squad.write_text(json.dumps(builtin_qa()))
    monkeypatch.chdir(REPO)  # the recipes are the checkout's
    args = ["reproduce", "real", "--smoke", "--smoke-base", str(base), "--squad", str(squad), "--root", str(tmp_path / "study")]
    assert cli_main(args) == 0
    root = tmp_path / "study"
    manifest = json.loads((root / "streams" / "manifest.json").read_text())
    assert not set(manifest["train_articles"]) & set(manifest["heldout_articles"])
    report = (root / "report.md").read_text()
    from studies.real.study import MODELS

    for row in {name for rows in MODELS.values() for name in rows.values()}:  # every row of every model group
        assert row in report
    from safetensors import safe_open

    def l1_keys(model: str) -> list[str]:
        with safe_open(str(root / "exports" / model / "acre_adapter.safetensors"), "pt") as f:
            return list(f.keys())

    assert any("lora" in k for k in l1_keys("stage1"))
    assert l1_keys("stage2-full") and not any("lora" in k for k in l1_keys("stage2-full"))  # full copies, end to end
    assert manifest["with_evidence"] == manifest["stage2_conversations"]  # every training question knows its evidence
    corpus = json.loads((root / "streams" / "corpus-manifest.json").read_text())
    assert corpus["stage1"]["tokens"] >= 2000 and corpus["stage2"]["conversations"] == 4
    metrics = [json.loads(x) for x in (root / "runs" / "qwen2.5-0.5b-stage2-refill-lora" / "metrics.jsonl").read_text().splitlines()]
    assert any("refill_loss" in m for m in metrics)
    records = json.loads((root / "report.json").read_text())
    assert {r["task"] for r in records} == {"squad", "niah_multikey"}
    assert all(r["n"] == 2 for r in records)
    # Second run: every step finds its output and skips it.
    capsys.readouterr()
    assert cli_main(args) == 0
    out = capsys.readouterr().out
    assert "streams: " in out and "skipped" in out and "eval " not in out


def test_reproduce_help_names_every_step_of_both_studies(capsys):
    """The --steps help is written out by hand (the CLI does not import torch to print help)."""
    from studies.mini.study import STEPS as MINI
    from studies.real.study import STEPS as REAL

    with pytest.raises(SystemExit):
        cli_main(["reproduce", "--help"])
    text = "".join(capsys.readouterr().out.split())  # argparse wraps lines, even inside a hyphenated name
    assert "real:" + ",".join(REAL) + ";" in text
    assert "mini:" + ",".join(MINI) in text


@pytest.mark.parametrize("flag", [["--force"], ["--nice", "5"]])
def test_reproduce_real_refuses_the_mini_studys_flags_instead_of_ignoring_them(flag, capsys):
    from acre_train.cli import main

    assert main(["reproduce", "real", "--squad", "missing.json", *flag]) == 2
    err = capsys.readouterr().err
    assert f"does not take {flag[0]}" in err and "Traceback" not in err
