"""Export: ACRE checkpoints (ZeRO-1/2 or plain) -> inference-ready Hugging Face folders, and loading them."""

from .load import NotAnAcreExport, check_export_dir, load_export, settings_from_export
from .writer import export_model

__all__ = ["NotAnAcreExport", "check_export_dir", "export_model", "load_export", "settings_from_export"]
