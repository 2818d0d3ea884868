"""``acre-train reproduce real|mini``: re-run a study end to end (each resumes where it stopped).

* ``real``: ACRE trained and evaluated on the real Qwen2.5-Coder-0.5B base (docs/real-base.md);
* ``mini``: the earlier from-scratch miniature (docs/miniature.md, kept as history).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("study", choices=["real", "mini"],
                        help="real: the real-base study (docs/real-base.md); mini: the miniature (docs/miniature.md)")
    parser.add_argument("--squad", default=None, help="real: the SQuAD v2 dev JSON (training/evaluation articles)")
    parser.add_argument("--smoke-base", default=None, help="real --smoke: a small base folder to run the driver on")
    parser.add_argument("--smoke", action="store_true",
                        help="tiny sizes and a few steps per stage (CI: exercises every command in about a minute)")
    parser.add_argument("--root", default=None,
                        help="output directory (default: checkpoints/<study>, or checkpoints/<study>-smoke with --smoke)")
    parser.add_argument("--steps", default=None,
                        help="comma-separated subset of the study's steps (default: all; finished ones are skipped). "
                             "real: streams,stage1,stage2,stage2-refill,stage2-refill-light,stage1-full,stage2-full,stage1-long,stage2-long,export,eval,report; "
                             "mini: tokenizer,streams,base,base2,"
                             "export-base,stage1,stage2,vanilla-sft,eval,report")
    parser.add_argument("--force", action="store_true", help="re-run the named steps even if their outputs exist (old outputs are kept as "
                             "<name>.replaced-<time>; any later step named re-runs too)")
    parser.add_argument("--adapter", action="append", default=[], metavar="MODEL=FILE",
                        help="real: kept L1 weights (an export's acre_adapter.safetensors) of a training run, used "
                             "when the run's checkpoints are not on this machine, e.g. --adapter "
                             "stage1=acre_train/resources/adapters/qwen2.5-0.5b-stage1-lora.safetensors")
    parser.add_argument("--cells", default=None,
                        help="real: evaluate only these cells, in this order: LENGTH/TASK[/MODEL],... "
                             "(e.g. 4096/squad/base,4096/squad/stage0); the report keeps earlier rows of the others")
    parser.add_argument("--nice", type=int, default=0, help="run training subprocesses under nice -n N")


def run(args: argparse.Namespace) -> int:
    if args.study == "real":
        return run_real(args)
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


def run_real(args: argparse.Namespace) -> int:
    from ..real.study import RUNS, STEPS, RealConfig, RealStudy

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

