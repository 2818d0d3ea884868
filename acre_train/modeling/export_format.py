"""Is this folder an ACRE export? The check every reader of an export runs first (train's
``init_from``, ``chat``/``generate``/``eval``, ``calibrate``), so that a wrong folder gets one clear
error before any weight is read.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


class NotAnAcreExport(ValueError):
    """The folder is not something ``acre-train export`` wrote."""


def check_export_dir(path: str | Path) -> dict[str, Any]:
    """The export's ``config.json`` as a dict, or a clear error naming what is wrong."""
    folder = Path(path)
    if not folder.is_dir():
        raise NotAnAcreExport(f"{folder} is not a directory (expected a folder written by 'acre-train export')")
    config = folder / "config.json"
    if not config.is_file():
        raise NotAnAcreExport(f"{folder} is not an ACRE export: it has no config.json")
    data = json.loads(config.read_text(encoding="utf-8"))
    if data.get("model_type") != "acre":
        hint = (" (a plain base model; export an ACRE checkpoint with 'acre-train export')"
                if data.get("model_type") else "")
        raise NotAnAcreExport(f"{folder} is not an ACRE export: config.json has model_type "
                              f"{data.get('model_type')!r}, expected 'acre'{hint}")
    return data
