"""``acre-train reproduce mini [--smoke] [--root DIR] [--steps a,b] [--nice N]``: the miniature study."""

from __future__ import annotations

import argparse
import sys


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("study", choices=["mini"], help="which study to reproduce (mini: docs/miniature.md)")
    parser.add_argument("--smoke", action="store_true",
                        help="tiny sizes and a few steps per stage (CI: exercises every command in about a minute)")
    parser.add_argument("--root", default=None,
                        help="output directory (default: checkpoints/mini, or checkpoints/mini-smoke with --smoke)")
    parser.add_argument("--steps", default=None,
                        help="comma-separated subset of: tokenizer,streams,base,base2,export-base,stage1,stage2,"
                             "vanilla-sft,eval,report (default: all; finished steps are skipped unless an earlier "
                             "one re-ran)")
    parser.add_argument("--force", action="store_true", help="re-run the named steps even if their outputs exist (old outputs are kept as "
                             "<name>.replaced-<time>; any later step named re-runs too)")
    parser.add_argument("--nice", type=int, default=0, help="run training subprocesses under nice -n N")


def run(args: argparse.Namespace) -> int:
    from .study import STEPS, Study, StudyConfig

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
