"""kill -9 at seeded random points of preprocess, train, export and convert (real subprocesses of the
CLI, tiny sizes), and two processes on one folder.

After every kill: nothing half-written looks complete (a folder that carries its completion marker
loads and equals a clean run's output, or the previous complete one), and the same command (resume
for training) finishes with exactly the clean run's result. The kill points are fractions of the
clean run's own duration, drawn from a fixed seed, so each run of the suite hits different phases.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from helpers import SMALL_DATA

REPO = Path(__file__).resolve().parents[1]
TINY1 = REPO / "recipes/tiny_stage1.yaml"
KILLS = 1  # per operation and test run (CI time); the seeds differ per operation, the timing per run


def _env() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}


def _cli(*argv: str) -> list[str]:
    return [sys.executable, "-m", "acre_train.cli", *argv]


def clean_run(argv: list[str], cwd: Path) -> float:
    """Run to completion; returns its wall time (the scale for the kill points)."""
    tic = time.perf_counter()
    done = subprocess.run(_cli(*argv), cwd=cwd, env=_env(), capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    return time.perf_counter() - tic


def killed_run(argv: list[str], cwd: Path, after: float) -> bool:
    """Start ``argv`` and SIGKILL it ``after`` seconds in; False if it finished first."""
    proc = subprocess.Popen(_cli(*argv), cwd=cwd, env=_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        proc.wait(timeout=after)
        return False
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        return True


def kill_points(duration: float, seed: int, kills: int = KILLS) -> list[float]:
    # Start-up (interpreter, torch import) is ~half of a tiny job: draw over its second half mostly.
    rng = random.Random(seed)
    return [duration * rng.uniform(0.35, 0.95) for _ in range(kills)]


def complete_folders(parent: Path, marker: str) -> list[Path]:
    """The folders a reader would take as finished (hidden .partial / .old folders are not read)."""
    return [p for p in parent.iterdir() if p.is_dir() and not p.name.startswith(".") and (p / marker).is_file()]


def _rows(folder: Path) -> list[list[int]]:
    from acre_train.data.output import load_prepared

    ds, _ = load_prepared(folder)
    return [list(r) for r in ds["input_ids"]]


def test_preprocess_killed_anywhere_leaves_nothing_that_looks_complete(tmp_path):
    argv = lambda out: ["preprocess", "stage1", "--builtin", "--tokenizer", "tiny", "--min-length", "96",  # noqa: E731
                        "--max-length", "160", "--first-chunk", "32", "--stride", "16", "--output", str(out)]
    duration = clean_run(argv(tmp_path / "clean"), tmp_path)
    want = _rows(tmp_path / "clean")
    work = tmp_path / "work"
    work.mkdir()
    for after in kill_points(duration, seed=11):
        killed_run(argv(work / "data"), tmp_path, after)
        for folder in complete_folders(work, "manifest.json"):
            assert folder.name == "data" and _rows(folder) == want
    clean_run(argv(work / "data"), tmp_path)
    assert _rows(work / "data") == want
    assert [p.name for p in work.iterdir() if not p.name.startswith(".data.lock")] == ["data"]  # no partials left


def _train_argv(root: Path, data: Path, run: str, *extra: str) -> list[str]:
    return ["train", str(TINY1), f"output_root={root}", f"run_name={run}", f"data.path={data}", *SMALL_DATA,
            "train.max_steps=6", "checkpoint.every_steps=1", "checkpoint.keep_last=null",
            "logging.progress_bar=false", "logging.tensorboard=false", *extra]


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> tuple[Path, Path, float]:
    """(root, prepared data, duration): a clean 6-step run ``root/clean`` (every step checkpointed)."""
    root = tmp_path_factory.mktemp("runs")
    data = root / "data"
    clean_run(_train_argv(root, data, "warm", "train.max_steps=1"), root)  # prepares the data, outside the timing
    return root, data, clean_run(_train_argv(root, data, "clean"), root)


def test_train_killed_anywhere_resumes_to_the_uninterrupted_weights(trained):
    tmp_path, data, duration = trained
    want = load_file(str(tmp_path / "clean" / "checkpoint-6" / "trainable.safetensors"))
    for after in kill_points(duration, seed=12):
        killed_run(_train_argv(tmp_path, data, "cut", "checkpoint.resume_from_checkpoint=latest"), tmp_path, after)
        for ckpt in complete_folders(tmp_path / "cut", "acre_checkpoint.json") if (tmp_path / "cut").is_dir() else []:
            step = json.loads((ckpt / "acre_checkpoint.json").read_text())["step"]
            got = load_file(str(ckpt / "trainable.safetensors"))
            ref = load_file(str(tmp_path / "clean" / f"checkpoint-{step}" / "trainable.safetensors"))
            assert all(torch.equal(got[k], ref[k]) for k in ref), ckpt
    clean_run(_train_argv(tmp_path, data, "cut", "checkpoint.resume_from_checkpoint=latest"), tmp_path)
    got = load_file(str(tmp_path / "cut" / "checkpoint-6" / "trainable.safetensors"))
    assert all(torch.equal(got[k], want[k]) for k in want)
    steps = [json.loads(x)["step"] for x in (tmp_path / "cut" / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3, 4, 5, 6]


def _export_weights(folder: Path) -> dict[str, torch.Tensor]:
    from acre_train.infer.load import load_export
    from acre_train.modeling import acre_state_dict

    model, _, _ = load_export(folder)
    return acre_state_dict(model)


def test_export_overwrite_killed_anywhere_keeps_a_complete_export(trained, tmp_path):
    old, new = trained[0] / "clean" / "checkpoint-2", trained[0] / "clean" / "checkpoint-6"
    work = tmp_path / "work"
    work.mkdir()
    clean_run(["export", str(old), str(work / "export")], tmp_path)
    duration = clean_run(["export", str(new), str(tmp_path / "want-new")], tmp_path)
    choices = [_export_weights(work / "export"), _export_weights(tmp_path / "want-new")]
    for after in kill_points(duration, seed=13, kills=1):
        killed_run(["export", str(new), str(work / "export"), "--overwrite"], tmp_path, after)
        for folder in complete_folders(work, "config.json"):
            got = _export_weights(folder)
            assert any(all(torch.equal(got[k], c[k]) for k in c) for c in choices), folder
    clean_run(["export", str(new), str(work / "export"), "--overwrite"], tmp_path)
    got = _export_weights(work / "export")
    assert all(torch.equal(got[k], choices[1][k]) for k in choices[1])
    assert [p.name for p in work.iterdir() if not p.name.endswith(".lock")] == ["export"]


def test_base_convert_overwrite_killed_anywhere_keeps_a_complete_conversion(tmp_path):
    pytest.importorskip("gguf")
    from safetensors import safe_open

    from acre_train.data.tiny_tokenizer import tiny_tokenizer
    from acre_train.tiny import tiny_model
    from test_base_convert import write_gguf

    tok = tiny_tokenizer()
    files = [write_gguf(tiny_model("qwen2", vocab_size=len(tok), eos_token_id=tok.eos_token_id, seed=s), tok,
                        tmp_path / f"m{s}.gguf", "qwen2") for s in (1, 2)]

    def embed(folder: Path) -> torch.Tensor:
        with safe_open(str(folder / "model.safetensors"), "pt") as f:
            return f.get_tensor("model.embed_tokens.weight")

    work = tmp_path / "work"
    work.mkdir()
    clean_run(["base", "convert", str(files[0]), str(work / "base")], tmp_path)
    duration = clean_run(["base", "convert", str(files[1]), str(tmp_path / "want2")], tmp_path)
    choices = [embed(work / "base"), embed(tmp_path / "want2")]
    for after in kill_points(duration, seed=14, kills=1):
        killed_run(["base", "convert", str(files[1]), str(work / "base"), "--overwrite"], tmp_path, after)
        for folder in complete_folders(work, "acre_base.json"):
            assert any(torch.equal(embed(folder), c) for c in choices), folder
    clean_run(["base", "convert", str(files[1]), str(work / "base"), "--overwrite"], tmp_path)
    assert torch.equal(embed(work / "base"), choices[1])
    assert [p.name for p in work.iterdir() if not p.name.endswith(".lock")] == ["base"]


def test_a_second_process_on_a_running_job_is_refused_at_once_naming_the_first(trained):
    tmp_path, data, _ = trained
    first = subprocess.Popen(_cli(*_train_argv(tmp_path, data, "busy", "train.max_steps=400")), cwd=tmp_path,
                             env=_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        lock = tmp_path / ".busy.lock"
        deadline = time.time() + 120
        while not (lock.is_file() and lock.read_text().strip()) and time.time() < deadline:
            time.sleep(0.2)
        assert first.poll() is None, "the first run ended before it could be contended"
        second = subprocess.run(_cli(*_train_argv(tmp_path, data, "busy", "train.learning_rate=0.5")), cwd=tmp_path,
                                env=_env(), capture_output=True, text=True, timeout=120)
        assert second.returncode == 2, second.stderr[-1000:]
        assert f"pid {first.pid}" in second.stderr and "Traceback" not in second.stderr
    finally:
        first.send_signal(signal.SIGKILL)
        first.wait()
