"""``acre-train reproduce real|mini``: re-run a study of a source checkout end to end.

The studies are not part of the installed package: they live in ``studies/`` of a checkout (``git
clone`` the repository), with their drivers, recipes and tests. This verb finds that folder next to the
``acre_train`` it runs from and hands over to ``studies/reproduce.py``; from a wheel it says so.

* ``real``: ACRE trained and evaluated on the real Qwen2.5-Coder-0.5B base (docs/real-base.md);
* ``mini``: the earlier from-scratch miniature (docs/miniature.md, kept as history).
"""

from __future__ import annotations

import argparse
import importlib
import sys
from pathlib import Path

CHECKOUT = Path(__file__).resolve().parents[1]


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
                             "real: streams,corpus,stage1,stage2,stage2-refill,stage2-refill-light,stage1-full,stage2-full,stage1-long,stage2-long,stage2-sim-long,stage1-distill,stage2-sim-distill,stage1-corpus,export,eval,report; "
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


def find_studies() -> Path:
    """The checkout's ``studies/`` folder (importable as ``studies``); a clear error from a wheel."""
    if not (CHECKOUT / "studies" / "reproduce.py").is_file():
        raise FileNotFoundError("acre-train reproduce runs the studies of a source checkout, and this acre-train "
                                f"is installed without them ({CHECKOUT} has no studies/): git clone the repository, "
                                "pip install -e it, and run the command there")
    if str(CHECKOUT) not in sys.path:
        sys.path.insert(0, str(CHECKOUT))
    return CHECKOUT / "studies"


def run(args: argparse.Namespace) -> int:
    find_studies()
    return importlib.import_module("studies.reproduce").run(args)
