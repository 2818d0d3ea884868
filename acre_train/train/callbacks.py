"""What a step reports: tensorboard scalars, a progress bar, metrics.jsonl and per-rank sample logs."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ..files import write_text_atomic


def _open_from(path: Path, start_step: int, resumed_line: dict[str, Any] | None = None):
    """``path`` opened for appending after dropping its lines of steps past ``start_step``.

    A run killed between logging a step and checkpointing it logs that step again when it resumes;
    without the trim the log would hold both lines (and a fresh start would keep a dead run's lines).
    A line cut short by the kill is dropped too. A run killed between checkpointing a step and logging
    it would leave a gap: ``resumed_line`` (the checkpoint's record of that step) fills it in.
    """
    def kept_line(line: str) -> bool:
        try:
            return json.loads(line).get("step", 0) <= start_step
        except json.JSONDecodeError:
            return False

    lines = path.read_text(encoding="utf-8").splitlines(keepends=True) if path.is_file() else []
    kept = [line for line in lines if line.endswith("\n") and kept_line(line)]
    if resumed_line and not any(
            json.loads(line).get("step") == start_step for line in kept):
        kept.append(json.dumps({"step": start_step, **resumed_line}) + "\n")
    if kept != lines:
        write_text_atomic(path, "".join(kept))
    return open(path, "a", encoding="utf-8")


class StepLogger:
    """Rank 0 writes tensorboard + ``metrics.jsonl`` + progress bar; every rank may log its samples."""

    def __init__(self, run_dir: Path, *, rank: int, total_steps: int, start_step: int, tensorboard: bool,
                 progress_bar: bool, log_samples: bool, every_steps: int, resumed_line: dict[str, Any] | None = None):
        self.rank = rank
        self.every = every_steps
        self.main = rank == 0
        self.writer = None
        self.bar = None
        self.metrics = None
        self.samples = None
        if log_samples:
            self.samples = _open_from(run_dir / f"samples_rank{rank}.jsonl", start_step)
        if not self.main:
            return
        if resumed_line and start_step % every_steps and not resumed_line.get("final"):
            resumed_line = None  # (a step the cadence does not log)
        self.metrics = _open_from(run_dir / "metrics.jsonl", start_step, resumed_line)
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            # purge_step hides the events of steps that the resumed checkpoint did not keep
            self.writer = SummaryWriter(str(run_dir / "tensorboard"), purge_step=start_step + 1 if start_step else None)
        if progress_bar:
            from tqdm.auto import tqdm

            self.bar = tqdm(total=total_steps, initial=start_step, desc="train", unit="step", dynamic_ncols=True)

    def log_samples(self, step: int, sample_indices: list[int]) -> None:
        if self.samples:
            self.samples.write(json.dumps({"step": step, "rank": self.rank, "sample_index": sample_indices}) + "\n")
            self.samples.flush()

    def log_step(self, step: int, metrics: dict[str, Any]) -> None:
        if not self.main:
            return
        if self.bar is not None:
            self.bar.update(1)
            self.bar.set_postfix(loss=f"{metrics['loss']:.4f}", tok_s=f"{metrics['tokens_per_s']:.0f}",
                                 gflops=f"{metrics.get('rank_gflops_per_s', 0):.0f}")
        if step % self.every and not metrics.get("final"):
            return
        self.metrics.write(json.dumps({"step": step, **metrics}) + "\n")
        self.metrics.flush()
        if self.writer is not None:
            for key, value in metrics.items():
                if isinstance(value, (int, float)) and not isinstance(value, bool):
                    self.writer.add_scalar(f"train/{key}", value, step)
            self.writer.flush()

    def message(self, text: str) -> None:
        if self.main:
            (self.bar.write if self.bar is not None else print)(text)

    def close(self) -> None:
        for handle in (self.samples, self.metrics):
            if handle:
                handle.close()
        if self.writer is not None:
            self.writer.close()
        if self.bar is not None:
            self.bar.close()
