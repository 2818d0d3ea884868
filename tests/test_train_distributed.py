"""2 CPU ranks through the real launchers: torchrun (DDP) and deepspeed (ZeRO-1, ZeRO-2 + resume).

One fixture runs every launch once (each costs ~20 s on two cores; the first DeepSpeed run also
compiles a small op, cached in ~/.cache/torch_extensions); the tests compare what they wrote.
All runs share the global batch (4) but split it differently, so their losses must agree with a
single-process run's, step by step.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from helpers import SMALL_DATA

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "recipes/tiny_stage1.yaml"
STEPS = 3

pytestmark = pytest.mark.slow


def _common(workdir: Path, run: str) -> list[str]:
    return [f"run_name={run}", f"output_root={workdir}", f"data.path={workdir / 'data'}", *SMALL_DATA,
            f"train.max_steps={STEPS}", "train.global_batch_size=4", "logging.progress_bar=false",
            "logging.log_samples=true", "checkpoint.every_steps=null"]


def _launch(cmd: list[str], workdir: Path) -> None:
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-6000:]}")


def _deepspeed(workdir: Path, *args: str) -> None:
    port = str(random.randint(20000, 40000))
    _launch([shutil.which("deepspeed") or "deepspeed", "--num_gpus", "2", "--master_port", port, "--module",
             "acre_train.train", str(RECIPE), *args], workdir)


def _metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _samples(run_dir: Path, rank: int) -> dict[int, list[int]]:
    path = run_dir / f"samples_rank{rank}.jsonl"
    out: dict[int, list[int]] = {}
    for line in path.read_text().splitlines():
        row = json.loads(line)
        out[row["step"]] = row["sample_index"]
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    from acre_train.train import load_recipe
    from acre_train.train.distributed import setup
    from acre_train.train.trainer import Trainer

    workdir = tmp_path_factory.mktemp("dist")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the in-process reference run; launched ranks get OMP_NUM_THREADS=1
    # Reference: one process, micro-batch 1 x accumulation 4 (also prepares the shared dataset).
    reference = load_recipe(RECIPE, [*_common(workdir, "single"), "train.micro_batch_size=1"])
    Trainer(reference, setup(use_deepspeed=False), log=lambda *_: None).run()
    _launch([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "-m",
             "acre_train.train", str(RECIPE), *_common(workdir, "ddp"), "train.micro_batch_size=1"], workdir)
    _deepspeed(workdir, *_common(workdir, "zero1"), "train.micro_batch_size=1",
               "train.deepspeed=recipes/deepspeed/zero1.json")
    # ZeRO-2 with micro-batch 2 x accumulation 1, interrupted after step 2 and resumed.
    zero2 = [*_common(workdir, "zero2"), "train.micro_batch_size=2", "train.deepspeed=recipes/deepspeed/zero2.json"]
    _deepspeed(workdir, *zero2, "checkpoint.stop_after_step=2")
    _deepspeed(workdir, *zero2, "checkpoint.resume_from_checkpoint=latest")
    torch.set_num_threads(threads)
    return workdir


@pytest.mark.parametrize("run", ["ddp", "zero1", "zero2"])
def test_losses_agree_with_one_process(runs, run):
    expected = [m["loss"] for m in _metrics(runs / "single")]
    got = [m["loss"] for m in _metrics(runs / run)]
    assert len(got) == STEPS
    np.testing.assert_allclose(got, expected, rtol=0, atol=2e-5)
    grads = [m["grad_norm"] for m in _metrics(runs / run)]
    np.testing.assert_allclose(grads, [m["grad_norm"] for m in _metrics(runs / "single")], rtol=1e-3)


@pytest.mark.parametrize("run", ["ddp", "zero1", "zero2"])
def test_ranks_see_disjoint_samples_of_the_same_global_batch(runs, run):
    single = _samples(runs / "single", 0)
    rank0, rank1 = _samples(runs / run, 0), _samples(runs / run, 1)
    assert sorted(rank0) == sorted(rank1) == list(range(1, STEPS + 1))
    for step in range(1, STEPS + 1):
        assert set(rank0[step]).isdisjoint(rank1[step]), (step, rank0[step], rank1[step])
        assert sorted(rank0[step] + rank1[step]) == sorted(single[step])


def test_zero2_resume_matches_and_checkpoint_is_l1_only(runs):
    run_dir = runs / "zero2"
    checkpoint = run_dir / f"checkpoint-{STEPS}"
    meta = json.loads((checkpoint / "acre_checkpoint.json").read_text())
    assert meta["identity"]["engine"] == "deepspeed-zero2" and meta["world_size"] == 2
    # L1 weights agree with the uninterrupted single-process run.
    ours = load_file(str(checkpoint / "trainable.safetensors"))
    reference = load_file(str(runs / f"single/checkpoint-{STEPS}/trainable.safetensors"))
    for name in reference:
        torch.testing.assert_close(ours[name], reference[name], atol=1e-5, rtol=0)
    # The DeepSpeed shard holds only trainable tensors, and consolidates to the same weights.
    module = torch.load(checkpoint / "ds/state/mp_rank_00_model_states.pt", weights_only=True)["module"]
    assert {k for k in module if k.endswith("weight") or k.endswith("bias")} == {"model." + k for k in ours}
    from acre_train.export.checkpoint import consolidate_zero

    fp32 = consolidate_zero(checkpoint / "ds")  # weights_only=True with the DeepSpeed allow-list
    for name, tensor in ours.items():
        torch.testing.assert_close(fp32["model." + name], tensor, atol=0, rtol=0)


def test_cpu_deepspeed_ranks_skip_the_shared_memory_kernel_build(monkeypatch):
    """The patch must reach the module DeepSpeed calls it from (it once landed on ``torch`` instead, and
    every CPU launch paid a minute of C++)."""
    import importlib

    from acre_train.train.distributed import _skip_shm_kernel

    ds_torch = importlib.import_module("deepspeed.comm.torch")
    monkeypatch.setattr(ds_torch, "build_shm_op", lambda: pytest.fail("the kernel would be built"))
    monkeypatch.delenv("ACRE_TRAIN_DS_SHM", raising=False)
    _skip_shm_kernel(cuda=False)
    assert ds_torch.build_shm_op() is None
