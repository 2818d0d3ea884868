"""Export: ACRE checkpoints (ZeRO-1/2 or plain) -> inference-ready Hugging Face folders.

Export writes; ``acre_train.infer.load`` reads (``load_export``, ``check_export_dir``).
"""

from .run import export_run
from .writer import export_model

__all__ = ["export_model", "export_run"]
