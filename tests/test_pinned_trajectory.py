"""A pinned loss trajectory (torchtune/TRL style): the tiny stage-1 recipe's first 20 losses.

A silent change of the training math (loss normalisation, masking, the interleave plan, the
optimizer step) moves these numbers; an intended change regenerates the file:

    python tests/test_pinned_trajectory.py
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
PINNED = ROOT / "tests" / "data" / "tiny_stage1_losses.json"
ATOL = 2e-4  # losses are ~6.9; steps differ by ~1e-2, float noise across machines by ~1e-6


def trajectory(workdir: Path, *extra: str) -> list[float]:
    from acre_train.train import load_recipe
    from acre_train.train.distributed import setup
    from acre_train.train.trainer import Trainer

    recipe = load_recipe(ROOT / "recipes/tiny_stage1.yaml", [
        f"output_root={workdir}", f"data.path={workdir / 'data'}", "logging.progress_bar=false",
        "logging.tensorboard=false", "checkpoint.every_steps=null", *extra])
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return Trainer(recipe, setup(use_deepspeed=False), log=lambda *_: None).run().losses
    finally:
        torch.set_num_threads(threads)


def test_tiny_stage1_reproduces_its_pinned_losses(tmp_path):
    pinned = json.loads(PINNED.read_text())
    got = trajectory(tmp_path)
    assert len(got) == pinned["steps"] == 20
    np.testing.assert_allclose(got, pinned["losses"], rtol=0, atol=ATOL)


def test_held_out_loss_is_logged_and_its_samples_never_train(tmp_path):
    trajectory(tmp_path, "data.eval_split=0.1", "train.eval_every=5", "train.max_steps=10", "logging.log_samples=true",
               "run_name=heldout")
    run = tmp_path / "heldout"
    logged = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    evals = {m["step"]: m["eval_loss"] for m in logged if "eval_loss" in m}
    assert sorted(evals) == [5, 10] and all(4.0 < v < 8.0 for v in evals.values())
    from acre_train.data import load_prepared
    from acre_train.train.batching import split_held_out

    _, held = split_held_out(load_prepared(tmp_path / "data")[0], 0.1, 0)
    trained = {i for line in (run / "samples_rank0.jsonl").read_text().splitlines() for i in json.loads(line)["sample_index"]}
    assert trained and not trained & set(held["sample_index"])


if __name__ == "__main__":
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        losses = trajectory(Path(tmp))
    PINNED.parent.mkdir(exist_ok=True)
    PINNED.write_text(json.dumps({"recipe": "recipes/tiny_stage1.yaml", "steps": len(losses),
                                  "losses": [round(x, 6) for x in losses], "torch": torch.__version__}, indent=1) + "\n")
    print(f"wrote {PINNED}: {losses[:3]} ... {losses[-3:]}", file=sys.stderr)
