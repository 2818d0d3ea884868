"""Two "nodes" on this machine through the shipped launch scripts: torchrun with a c10d rendezvous on
127.0.0.1 and the DeepSpeed launcher in --no_ssh mode with a two-host hostfile, one process per node.

ZeRO-2 losses equal a single-process run's (the same tolerance as the single-node launchers), every
rank reads its own samples, and a killed node makes the survivor stop at once with a clear error
(a stopped, i.e. hanging, node: after ``train.dist_timeout_s``) instead of hanging.
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

import numpy as np
import pytest
import torch

from helpers import SMALL_DATA

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "recipes/tiny_stage1.yaml"
STEPS = 3

pytestmark = pytest.mark.slow


def _common(workdir: Path, run: str, steps: int = STEPS) -> list[str]:
    return [f"run_name={run}", f"output_root={workdir}", f"data.path={workdir / 'data'}", *SMALL_DATA,
            f"train.max_steps={steps}", "train.global_batch_size=4", "train.micro_batch_size=1",
            "logging.progress_bar=false", "logging.log_samples=true", "checkpoint.every_steps=null"]


def _env(**extra: str) -> dict[str, str]:
    path = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"
    return {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), "PATH": path,
            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(random.randint(20000, 40000)), **extra}


def _nodes(script: str, args: list[str], workdir: Path, name: str, **env: str) -> list[subprocess.Popen]:
    """Start node 0 and node 1 of ``launch/<script>`` (each its own session, so a node can be killed whole)."""
    shared = _env(**env)
    procs = []
    for rank in (0, 1):
        log = open(workdir / f"{name}-node{rank}.log", "w")
        procs.append(subprocess.Popen(["bash", str(ROOT / "launch" / script), *args], cwd=ROOT,
                                      env={**shared, "NODE_RANK": str(rank), "NNODES": "2", "RDZV_ID": name},
                                      stdout=log, stderr=subprocess.STDOUT, start_new_session=True))
    return procs


def _wait(procs: list[subprocess.Popen], workdir: Path, name: str, timeout: float = 300) -> None:
    for rank, proc in enumerate(procs):
        code = proc.wait(timeout=timeout)
        assert code == 0, f"node {rank} exited {code}:\n" + (workdir / f"{name}-node{rank}.log").read_text()[-4000:]


def _losses(run_dir: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _samples(run_dir: Path, rank: int) -> dict[int, list[int]]:
    rows = [json.loads(line) for line in (run_dir / f"samples_rank{rank}.jsonl").read_text().splitlines()]
    return {r["step"]: r["sample_index"] for r in rows}


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    from acre_train.train import load_recipe
    from acre_train.train.distributed import setup
    from acre_train.train.trainer import Trainer

    workdir = tmp_path_factory.mktemp("nodes")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    # The single-process reference (it also prepares the dataset every node then reuses).
    Trainer(load_recipe(RECIPE, _common(workdir, "single")), setup(use_deepspeed=False), log=lambda *_: None).run()
    torch.set_num_threads(threads)
    return workdir


@pytest.mark.parametrize("script", ["torchrun_multi_node.sh", "multi_node.sh"])
def test_two_nodes_train_zero2_like_one_process(workdir, script):
    name = script.split(".")[0]
    args = [str(RECIPE), *_common(workdir, name), "train.deepspeed=recipes/deepspeed/zero2.json"]
    if script == "multi_node.sh":  # DeepSpeed --no_ssh: a hostfile of two hosts, one slot each
        hostfile = workdir / "hostfile"
        hostfile.write_text("node-a slots=1\nnode-b slots=1\n")
        args = [str(hostfile), *args]
    _wait(_nodes(script, args, workdir, name), workdir, name)
    run_dir = workdir / name
    np.testing.assert_allclose(_losses(run_dir), _losses(workdir / "single"), rtol=0, atol=2e-5)
    single = _samples(workdir / "single", 0)
    rank0, rank1 = _samples(run_dir, 0), _samples(run_dir, 1)
    for step in range(1, STEPS + 1):
        assert set(rank0[step]).isdisjoint(rank1[step])
        assert sorted(rank0[step] + rank1[step]) == sorted(single[step])
    meta = json.loads((run_dir / f"checkpoint-{STEPS}" / "acre_checkpoint.json").read_text())
    assert meta["world_size"] == 2 and meta["identity"]["engine"] == "deepspeed-zero2"


def _descendants(pid: int) -> list[int]:
    """``pid`` and every process below it (torchrun starts its workers in sessions of their own)."""
    parents: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            parents.setdefault(ppid, []).append(int(entry.name))
    out, todo = [], [pid]
    while todo:
        current = todo.pop()
        out.append(current)
        todo += parents.get(current, [])
    return out


def _kill_node(proc: subprocess.Popen, sig: int) -> None:
    """Signal the launcher and its workers: the whole "node"."""
    for pid in _descendants(proc.pid):
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


@pytest.mark.skipif(not Path("/proc/self/stat").is_file(), reason="finds a node's processes through /proc")
@pytest.mark.parametrize("how", ["killed", "hanging"])
def test_a_lost_node_stops_the_other_with_a_clear_error(workdir, how):
    name = f"lost-{how}"
    timeout_s = 12
    args = [str(RECIPE), *_common(workdir, name, steps=100_000), "checkpoint.every_steps=10",
            f"train.dist_timeout_s={timeout_s}"]
    node0, node1 = _nodes("torchrun_multi_node.sh", args, workdir, name)
    metrics = workdir / name / "metrics.jsonl"
    try:
        deadline = time.time() + 120
        while not (metrics.is_file() and len(metrics.read_text().splitlines()) >= 12):
            assert time.time() < deadline and node0.poll() is None, (workdir / f"{name}-node0.log").read_text()[-3000:]
            time.sleep(0.2)
        _kill_node(node1, signal.SIGKILL if how == "killed" else signal.SIGSTOP)
        began = time.time()
        code = node0.wait(timeout=timeout_s + 60)
        waited = time.time() - began
    finally:
        for proc in (node0, node1):
            if proc.poll() is None:
                _kill_node(proc, signal.SIGKILL)
                proc.wait()
    log = (workdir / f"{name}-node0.log").read_text()
    assert code != 0
    assert "lost contact with the other ranks" in log and "resume_from_checkpoint=latest" in log
    assert "checkpoint-" in log.split("Last complete checkpoint:")[1].split(";")[0]
    # Killed: the closed connection is noticed at once. Hanging: the collective times out.
    assert waited < 15 if how == "killed" else timeout_s - 2 < waited < timeout_s + 30, waited
