"""The study driver's bookkeeping: which steps run, and that replaced outputs are kept, not resumed."""

from __future__ import annotations

import pytest

from studies.mini.study import STEPS, Study, StudyConfig


@pytest.fixture
def study(tmp_path, monkeypatch):
    s = Study(tmp_path, StudyConfig.smoke(), log=lambda _: None)
    s.calls, s.finished = [], set()
    for name in STEPS:
        monkeypatch.setattr(s, "step_" + name.replace("-", "_"), lambda name=name: s.calls.append(name))
    monkeypatch.setattr(s, "done", lambda step: step in s.finished)
    return s


def test_finished_steps_are_skipped_in_study_order(study):
    study.finished = {"stage1", "stage2", "eval"}
    study.run(("eval", "stage2", "stage1"))
    assert study.calls == []
    study.finished = {"stage2", "eval"}
    study.run(("eval", "stage1"))  # given out of order: run in study order
    assert study.calls == ["stage1", "eval"]


def test_a_rerun_step_makes_later_finished_steps_rerun_and_keeps_their_old_outputs(study):
    old = study.run_dir("stage2") / "checkpoint-120"
    old.mkdir(parents=True)
    (study.root / "eval").mkdir()
    study.finished = {"stage2", "eval"}  # stage 1 (re)trains: stage 2 and eval were made from the old one
    study.run(("stage1", "stage2", "eval"))
    assert study.calls == ["stage1", "stage2", "eval"]
    assert not study.run_dir("stage2").exists() and not (study.root / "eval").exists()
    kept = list(study.run_dir("stage2").parent.glob("acre-stage2.replaced-*"))
    assert len(kept) == 1 and (kept[0] / "checkpoint-120").is_dir()
    assert "data.prepare.overwrite=true" in study._overrides("stage2")  # its stream may have changed

    study.calls.clear()
    study.run_dir("stage2").mkdir(parents=True)
    study.run(("stage2",), force=True)  # a second replacement in the same second gets its own name
    assert study.calls == ["stage2"] and len(list(study.run_dir("stage2").parent.glob("acre-stage2.replaced-*"))) == 2
    study.redo = False
    assert "data.prepare.overwrite=true" not in study._overrides("stage2")
