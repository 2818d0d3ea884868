"""The ACRE model: interleave plan, visibility rule and kernels, and the adapter.

Self-contained on purpose (relative imports; torch, transformers and numpy only): exports copy this
package next to the weights so ``trust_remote_code`` loading works without acre-train installed.
"""

from .adapter import (
    SUPPORTED_MODEL_TYPES,
    AcreOutput,
    acre_forward,
    acre_parameters,
    acre_state_dict,
    attach_acre,
    attach_from_section,
    check_supported,
    count_parameters,
    is_acre_model,
    load_acre_state_dict,
)
from .interleave import IGNORE_INDEX, InterleavePlan, chunk_bounds, interleave, num_chunks, sample_intervals
from .visibility import KERNELS, visible
from . import ranking  # noqa: E402,F401  registers the package's scorer kinds (modeling/scorer_spec.py:SCORER_KINDS)

__all__ = [
    "IGNORE_INDEX", "InterleavePlan", "chunk_bounds", "interleave", "num_chunks", "sample_intervals",
    "KERNELS", "visible", "SUPPORTED_MODEL_TYPES", "AcreOutput", "acre_forward", "acre_parameters",
    "acre_state_dict", "attach_acre", "attach_from_section", "check_supported", "count_parameters", "is_acre_model",
    "load_acre_state_dict",
]
