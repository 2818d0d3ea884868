"""An installed wheel stands alone: recipes and configs ship inside it; the quickstart runs from
another folder without the checkout on the path."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_the_wheel_runs_the_quickstart_from_another_folder(tmp_path):
    wheels, site, elsewhere = tmp_path / "wheels", tmp_path / "site", tmp_path / "elsewhere"
    elsewhere.mkdir()
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]
    # Built from a copy of the package's own files: a stale build/ of the checkout (setuptools reuses it)
    # would put removed modules into the wheel.
    import shutil

    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, src / name)
    shutil.copytree(REPO / "acre_train", src / "acre_train", ignore=shutil.ignore_patterns("__pycache__"))
    subprocess.run([*pip, "wheel", str(src), "--no-deps", "--no-build-isolation", "-w", str(wheels)],
                   check=True, cwd=tmp_path)
    (wheel,) = wheels.glob("acre_train-*.whl")
    subprocess.run([*pip, "install", "--no-deps", "--target", str(site), str(wheel)], check=True, cwd=tmp_path)
    env = {**os.environ, "PYTHONPATH": str(site), "ACRE_TRAIN_CACHE": str(tmp_path / "cache"), "OMP_NUM_THREADS": "1"}
    where = subprocess.run([sys.executable, "-c", "import acre_train; print(acre_train.__file__)"], cwd=elsewhere,
                           env=env, capture_output=True, text=True, check=True).stdout
    assert where.startswith(str(site)), where  # the wheel, not the checkout
    listed = subprocess.run([sys.executable, "-m", "acre_train.cli", "recipes", "ls"], cwd=elsewhere, env=env,
                            capture_output=True, text=True, check=True).stdout
    assert "qwen2.5-0.5b/stage1" in listed and "deepspeed/zero2.json" in listed and "mini/" not in listed
    # The studies are not in the wheel: reproduce says so in one line instead of failing on an import.
    studies = subprocess.run([sys.executable, "-m", "acre_train.cli", "reproduce", "real", "--squad", "x.json"],
                             cwd=elsewhere, env=env, capture_output=True, text=True)
    assert studies.returncode == 2 and "runs the studies of a source checkout" in studies.stderr, studies.stderr
    assert "Traceback" not in studies.stderr
    run = subprocess.run([sys.executable, "-m", "acre_train.cli", "quickstart", "--tiny", "--steps", "2", "--output", "qs"],
                         cwd=elsewhere, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    assert "== done" in run.stdout and (elsewhere / "qs" / "export" / "config.json").is_file()
