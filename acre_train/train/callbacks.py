"""What a step reports: tensorboard scalars, a progress bar, metrics.jsonl and per-rank sample logs."""

from __future__ import annotations

import json
import resource
import sys
from pathlib import Path
from typing import Any

import torch


class StepLogger:
    """Rank 0 writes tensorboard + ``metrics.jsonl`` + progress bar; every rank may log its samples."""

    def __init__(self, run_dir: Path, *, rank: int, total_steps: int, start_step: int, tensorboard: bool,
                 progress_bar: bool, log_samples: bool, every_steps: int):
        self.rank = rank
        self.every = every_steps
        self.main = rank == 0
        self.writer = None
        self.bar = None
        self.metrics = None
        self.samples = open(run_dir / f"samples_rank{rank}.jsonl", "a", encoding="utf-8") if log_samples else None
        if not self.main:
            return
        self.metrics = open(run_dir / "metrics.jsonl", "a", encoding="utf-8")
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(str(run_dir / "tensorboard"))
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
