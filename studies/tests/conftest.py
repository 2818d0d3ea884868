"""The studies' tests (run by CI with the product's: pyproject testpaths). They import ``studies`` from
this checkout, which is not installed."""

from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
