"""What ``acre-train reproduce real|mini`` runs (acre_train/reproduce.py finds this checkout's studies)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def run(args: argparse.Namespace) -> int:
    if args.study == "real":
        return run_real(args)
    from .mini.study import STEPS, Study, StudyConfig

    config = StudyConfig.smoke() if args.smoke else StudyConfig.full()
    root = args.root or ("checkpoints/mini-smoke" if args.smoke else "checkpoints/mini")
    steps = tuple(s.strip() for s in args.steps.split(",") if s.strip()) if args.steps else STEPS
    study = Study(root, config, nice=args.nice, log=lambda m: print(m, flush=True))
    try:
        timings = study.run(steps, force=args.force)
    except (RuntimeError, ValueError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print("step times (s): " + ", ".join(f"{k}={v}" for k, v in timings.items()))
    return 0


def run_real(args: argparse.Namespace) -> int:
    from .real.study import RUNS, STEPS, RealConfig, RealStudy

    unsupported = [flag for flag, on in (("--force", args.force), ("--nice", args.nice)) if on]
    if unsupported:  # said plainly rather than ignored
        raise ValueError(f"reproduce real does not take {' or '.join(unsupported)}: each step resumes from its "
                         "own outputs (delete a step's folder under --root to redo it; run the command under "
                         "`nice -n N` to lower its priority); these flags apply to `reproduce mini`")
    config = RealConfig.smoke(args.smoke_base) if args.smoke else RealConfig()
    for pair in args.adapter:
        model, sep, path = pair.partition("=")
        if not sep or model not in RUNS:
            raise ValueError(f"--adapter {pair!r}: expected MODEL=FILE with MODEL one of {', '.join(RUNS)}")
        if not Path(path).is_file():
            raise FileNotFoundError(f"--adapter {pair!r}: no such file {path}")
        config.adapters[model] = path
    if args.cells:
        config.cells = tuple(c.strip() for c in args.cells.split(",") if c.strip())
    root = args.root or ("checkpoints/real-smoke" if args.smoke else "checkpoints/real")
    steps = tuple(s.strip() for s in args.steps.split(",") if s.strip()) if args.steps else STEPS
    timings = RealStudy(root, args.squad, config, log=lambda m: print(m, flush=True)).run(steps)
    print("step times (s): " + ", ".join(f"{k}={v}" for k, v in timings.items()))
    return 0

