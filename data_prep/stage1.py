"""Prepare ACRE stage1 data: same as `acre-train preprocess stage1 ...` (see data_prep/README.md)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from acre_train.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(["preprocess", "stage1", *sys.argv[1:]]))
