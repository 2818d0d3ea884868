"""A resumed run's logs hold each step once: lines past the resumed checkpoint are dropped."""

from __future__ import annotations

import json

from acre_train.train.callbacks import StepLogger


def _steps(path) -> list[int]:
    return [json.loads(line)["step"] for line in path.read_text().splitlines()]


def test_resume_drops_log_lines_past_the_checkpoint_and_a_cut_line(tmp_path):
    # As a kill leaves them: steps 1-5 logged, the last checkpoint at step 3, a line cut mid-write.
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text("".join(json.dumps({"step": s, "loss": 1.0}) + "\n" for s in range(1, 6)) + '{"step": 6, "lo')
    samples = tmp_path / "samples_rank0.jsonl"
    samples.write_text("".join(json.dumps({"step": s, "rank": 0, "sample_index": [s]}) + "\n" for s in range(1, 6)))
    logger = StepLogger(tmp_path, rank=0, total_steps=8, start_step=3, tensorboard=False, progress_bar=False,
                        log_samples=True, every_steps=1)
    logger.log_samples(4, [40])
    logger.log_step(4, {"loss": 0.5, "tokens_per_s": 1.0})
    logger.close()
    assert _steps(metrics) == [1, 2, 3, 4]
    assert json.loads(metrics.read_text().splitlines()[-1])["loss"] == 0.5
    assert _steps(samples) == [1, 2, 3, 4]


def test_a_fresh_start_keeps_no_lines_of_a_dead_run(tmp_path):
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 1, "loss": 9.0}) + "\n")
    logger = StepLogger(tmp_path, rank=0, total_steps=2, start_step=0, tensorboard=False, progress_bar=False,
                        log_samples=False, every_steps=1)
    logger.log_step(1, {"loss": 2.0, "tokens_per_s": 1.0})
    logger.close()
    assert [json.loads(x)["loss"] for x in (tmp_path / "metrics.jsonl").read_text().splitlines()] == [2.0]
