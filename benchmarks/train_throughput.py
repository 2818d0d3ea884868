"""Tokens/s of the tiny stage-1 recipe on 1 and 2 CPU ranks, and seconds per checkpoint save.

    python benchmarks/train_throughput.py [--steps 12] [--launcher torchrun|deepspeed] [key=value ...]

Tokens are interleaved input tokens (raw + L1) of the global batch; tokens/s is measured over the
steps after the first (warm-up) one, by each run's own step timer (metrics.jsonl). Both runs use the
same recipe and global batch; the 2-rank run goes through the named launcher.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "recipes/tiny_stage1.yaml"


def launch(nproc: int, launcher: str, overrides: list[str]) -> None:
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "PYTHONPATH": str(ROOT)}
    # One thread per rank: on the tiny model, intra-op threading costs more than it gains (measured
    # ~20x slower with 2 threads on a busy 2-core machine); override OMP_NUM_THREADS to compare.
    env.setdefault("OMP_NUM_THREADS", "1")
    if nproc == 1:
        cmd = [sys.executable, "-m", "acre_train.train", str(RECIPE), *overrides]
    elif launcher == "torchrun":
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc),
               "-m", "acre_train.train", str(RECIPE), *overrides]
    else:
        cmd = [shutil.which("deepspeed") or "deepspeed", "--num_gpus", str(nproc), "--master_port",
               str(random.randint(20000, 40000)), "--module", "acre_train.train", str(RECIPE),
               *overrides, "train.deepspeed=recipes/deepspeed/zero2.json"]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    if proc.returncode:
        sys.exit(f"{' '.join(cmd)} failed:\n{proc.stderr[-3000:]}")


def summarise(run_dir: Path) -> tuple[float, float, float]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    timed = rows[1:] or rows
    tokens = sum(r["tokens"] for r in timed)
    seconds = sum(r["step_seconds"] for r in timed)
    saves = [r["checkpoint_seconds"] for r in rows if "checkpoint_seconds" in r]
    return tokens / seconds, sum(saves) / max(len(saves), 1), rows[-1]["loss"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--launcher", choices=("torchrun", "deepspeed"), default="deepspeed")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="acre-bench-") as tmp:
        print(f"tiny stage-1 recipe, {args.steps} steps, global batch 4, fp32 CPU ({os.cpu_count()} cores, "
              f"OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', '1')} per rank)")
        for nproc in (1, 2):
            run = f"bench-{nproc}"
            launch(nproc, args.launcher, [f"run_name={run}", f"output_root={tmp}", f"train.max_steps={args.steps}",
                                          "checkpoint.every_steps=4", "logging.progress_bar=false", *args.overrides])
            tps, save_s, loss = summarise(Path(tmp) / run)
            how = "1 process" if nproc == 1 else f"2 ranks ({args.launcher}{', ZeRO-2' if args.launcher == 'deepspeed' else ''})"
            print(f"{how:<28} {tps:9.0f} tokens/s   {save_s:6.3f} s per checkpoint save   final loss {loss:.4f}")


if __name__ == "__main__":
    main()
