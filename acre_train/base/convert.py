"""``convert_gguf``: a local GGUF file -> a plain Hugging Face folder (safetensors + tokenizer).

transformers reads GGUF files itself (``from_pretrained(folder, gguf_file=...)``, which needs the
``gguf`` package) and dequantizes every tensor; but the loaded model is marked as quantized and
``save_pretrained`` refuses it. Converting once -- clear the mark, save as safetensors at the chosen
dtype -- gives a folder that loads in seconds and that every verb accepts, instead of a 50-second
dequantization on every load.

The folder is written under a hidden ``.<name>.partial-*`` sibling and renamed into place only when
complete, with ``acre_base.json`` (the provenance: source hash, GGUF metadata, dtype) written last
inside it: a folder without that file was not made by a finished conversion.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import time
from pathlib import Path
from typing import Any, Callable

from ..files import FolderLock, atomic_dir

# GGUF ``general.architecture`` values this toolkit can attach ACRE to. Mistral GGUFs written by
# llama.cpp say "llama" (same tensors); transformers maps both onto its own classes.
SUPPORTED_GGUF_ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3")
PROVENANCE_FILE = "acre_base.json"
DTYPES = ("float32", "bfloat16")


class BaseError(ValueError):
    """A bad or unsupported base file, a failed download or a hash mismatch; the message says which."""


def require_gguf() -> Any:
    """The ``gguf`` module, or an error that names the ``pip install`` that fixes it."""
    from ..errors import require

    return require("gguf", "base")


def sha256_file(path: Path, progress: Callable[[int], None] | None = None, block: int = 1 << 22) -> str:
    """Hex SHA-256 of a file, read in 4 MiB blocks (``progress(n_bytes)`` after each)."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(block):
            digest.update(chunk)
            if progress:
                progress(len(chunk))
    return digest.hexdigest()


def _field_value(field: Any) -> Any:
    """A GGUF metadata field as a Python scalar or string (arrays are not needed here)."""
    if not field.types:
        return None
    import gguf

    value = field.parts[field.data[0]]
    if field.types[0] == gguf.GGUFValueType.STRING:
        return bytes(value).decode("utf-8", errors="replace")
    return value.tolist()[0] if hasattr(value, "tolist") else value


def read_gguf_facts(path: str | os.PathLike) -> dict[str, Any]:
    """Architecture, name, file type and shape facts from a GGUF header (no tensor is read).

    Raises :class:`BaseError` for a file that is not GGUF or is cut short.
    """
    gguf = require_gguf()
    path = Path(path)
    if not path.is_file():
        raise BaseError(f"{path}: no such file")
    with open(path, "rb") as f:
        if f.read(4) != b"GGUF":
            raise BaseError(f"{path}: not a GGUF file (it does not start with the 'GGUF' magic)")
    try:
        reader = gguf.GGUFReader(str(path))
    except Exception as exc:  # numpy/struct errors of a truncated or damaged file
        raise BaseError(f"{path}: unreadable GGUF file ({type(exc).__name__}: {exc}); is it complete?") from exc
    fields = {name: _field_value(field) for name, field in reader.fields.items()
              if not name.startswith("tokenizer.ggml.") and name != "tokenizer.chat_template"}
    arch = fields.get("general.architecture")
    facts = {
        "architecture": arch,
        "name": fields.get("general.name"),
        "file_type": fields.get("general.file_type"),
        "num_layers": fields.get(f"{arch}.block_count"),
        "hidden_size": fields.get(f"{arch}.embedding_length"),
        "num_heads": fields.get(f"{arch}.attention.head_count"),
        "num_kv_heads": fields.get(f"{arch}.attention.head_count_kv"),
        "context_length": fields.get(f"{arch}.context_length"),
        "num_tensors": len(reader.tensors),
        "untied_output": any(t.name == "output.weight" for t in reader.tensors),
    }
    if arch in SUPPORTED_GGUF_ARCHITECTURES:  # (others are refused by name in check_supported)
        shapes = {t.name: tuple(int(x) for x in t.shape) for t in reader.tensors}
        facts["parameters"] = check_tensor_table(arch, fields, shapes, path)
        tokens = reader.fields.get("tokenizer.ggml.tokens")
        vocab = shapes["token_embd.weight"][1]
        if tokens is None:  # transformers would size the model from a default vocabulary and fail loading
            raise BaseError(f"{path}: the GGUF carries no tokenizer (no tokenizer.ggml.tokens); acre-train needs "
                            "the model's tokenizer inside the file: convert from a GGUF made with one")
        if len(tokens.data) != vocab:
            raise BaseError(f"{path}: the GGUF's tokenizer has {len(tokens.data)} tokens but token_embd.weight has "
                            f"{vocab} rows")
    return facts


# Per-block tensors of the supported decoder architectures, as GGUF shapes (ne order: input dim first),
# from (hidden, q width, kv width, ffn width); biases (Qwen2) and q/k norms (Qwen3) are optional.
_BLOCK = {
    "attn_norm.weight": lambda h, q, kv, ff: (h,), "ffn_norm.weight": lambda h, q, kv, ff: (h,),
    "attn_q.weight": lambda h, q, kv, ff: (h, q), "attn_k.weight": lambda h, q, kv, ff: (h, kv),
    "attn_v.weight": lambda h, q, kv, ff: (h, kv), "attn_output.weight": lambda h, q, kv, ff: (q, h),
    "ffn_gate.weight": lambda h, q, kv, ff: (h, ff), "ffn_up.weight": lambda h, q, kv, ff: (h, ff),
    "ffn_down.weight": lambda h, q, kv, ff: (ff, h),
}
_OPTIONAL = {
    "attn_q.bias": lambda h, q, kv, ff: (q,), "attn_k.bias": lambda h, q, kv, ff: (kv,),
    "attn_v.bias": lambda h, q, kv, ff: (kv,),
}


def check_tensor_table(arch: str, fields: dict[str, Any], shapes: dict[str, tuple[int, ...]], path: Path) -> int:
    """Check a GGUF's header sizes and tensor table against its architecture before anything is
    allocated; returns the parameter count the model will have.

    A file whose header lacks a size, or whose tensors are missing or shaped otherwise than the sizes
    say, would make transformers build a default-size model (gigabytes) or fail deep inside loading;
    it is refused here with what is wrong. The model's parameters are all read from the file's tensors,
    so a header promising more than the file holds is refused too.
    """
    def size(key: str, default: int | None = None) -> int:
        value = fields.get(f"{arch}.{key}", default)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise BaseError(f"{path}: the GGUF header has no valid {arch}.{key} ({value!r}); the file is damaged "
                            "or not a model")
        return value

    layers, hidden, heads = size("block_count"), size("embedding_length"), size("attention.head_count")
    kv_heads, ffn = size("attention.head_count_kv", heads), size("feed_forward_length")
    if f"{arch}.attention.key_length" not in fields and hidden % heads:
        raise BaseError(f"{path}: embedding_length {hidden} is not a multiple of head_count {heads}")
    head_dim = size("attention.key_length", hidden // heads)
    dims = (hidden, heads * head_dim, kv_heads * head_dim, ffn)
    embed = shapes.get("token_embd.weight")
    if embed is None or len(embed) != 2 or embed[0] != hidden:
        raise BaseError(f"{path}: token_embd.weight is {embed or 'missing'}, expected ({hidden}, vocab) by the header")
    want = {"token_embd.weight": embed, "output_norm.weight": (hidden,)}
    if "output.weight" in shapes:
        want["output.weight"] = embed
    for i in range(layers):
        want.update({f"blk.{i}.{name}": shape(*dims) for name, shape in _BLOCK.items()})
        want.update({f"blk.{i}.{name}": shape(*dims) for name, shape in _OPTIONAL.items() if f"blk.{i}.{name}" in shapes})
    problems = [f"{name} is missing" for name in want if name not in shapes]
    problems += [f"{name} is {shapes[name]}, expected {shape}" for name, shape in want.items()
                 if name in shapes and shapes[name] != shape]
    problems += [f"{name} is beyond block_count {layers}" for name in shapes
                 if name.startswith("blk.") and name.split(".")[1].isdigit() and int(name.split(".")[1]) >= layers]
    if problems:
        more = f" (and {len(problems) - 4} more)" if len(problems) > 4 else ""
        raise BaseError(f"{path}: the tensor table does not match the {arch} header ({layers} blocks, hidden {hidden}, "
                        f"{heads}/{kv_heads} heads, ffn {ffn}): {'; '.join(problems[:4])}{more}; refusing to build a model from it")
    return sum(math.prod(shape) for name, shape in shapes.items()
               if name in want or name.startswith("blk."))


def check_supported(facts: dict[str, Any], path: Path) -> None:
    if facts["architecture"] not in SUPPORTED_GGUF_ARCHITECTURES:
        raise BaseError(f"{path}: GGUF architecture {facts['architecture']!r} is not supported; "
                        f"acre-train attaches ACRE to {', '.join(SUPPORTED_GGUF_ARCHITECTURES)}")


def is_converted(folder: str | os.PathLike) -> bool:
    """True when ``folder`` holds a finished conversion (its provenance file exists and parses)."""
    try:
        json.loads((Path(folder) / PROVENANCE_FILE).read_text(encoding="utf-8"))
        return True
    except (OSError, ValueError):
        return False


def read_provenance(folder: str | os.PathLike) -> dict[str, Any]:
    return json.loads((Path(folder) / PROVENANCE_FILE).read_text(encoding="utf-8"))


def convert_gguf(gguf_file: str | os.PathLike, out_dir: str | os.PathLike, *, dtype: str = "float32",
                 overwrite: bool = False, sha256: str | None = None, extra_provenance: dict | None = None,
                 log: Callable[[str], None] = print) -> Path:
    """Convert ``gguf_file`` into a Hugging Face folder ``out_dir``; returns ``out_dir``.

    Re-running with the same source (by hash) and dtype does nothing. An existing ``out_dir`` from
    another source is replaced only with ``overwrite`` and only if it is a conversion (holds
    ``acre_base.json``); any other existing folder is refused.

    Example::

        convert_gguf("qwen2.5-0.5b-q4_k_m.gguf", "bases/qwen2.5-0.5b")  # then model.source: bases/qwen2.5-0.5b
    """
    if dtype not in DTYPES:
        raise BaseError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    with FolderLock(Path(out_dir), "conversion"):
        return _convert(Path(gguf_file), Path(out_dir), dtype, overwrite, sha256, extra_provenance, log)


def _convert(src: Path, out: Path, dtype: str, overwrite: bool, sha256: str | None, extra_provenance: dict | None,
             log: Callable[[str], None]) -> Path:
    facts = read_gguf_facts(src)
    check_supported(facts, src)
    digest = sha256 or sha256_file(src)
    if out.exists():
        if is_converted(out):
            old = read_provenance(out)
            if old.get("source_sha256") == digest and old.get("dtype") == dtype:
                log(f"{out}: already converted from this file ({digest[:12]}…, {dtype}); nothing to do")
                return out
            if not overwrite:
                raise BaseError(f"{out} holds a conversion of another file or dtype "
                                f"({old.get('source_sha256', '?')[:12]}…, {old.get('dtype')}); pass --overwrite")
        elif any(out.iterdir()) if out.is_dir() else True:
            raise BaseError(f"{out} exists and is not a converted base (no {PROVENANCE_FILE}); choose another folder")
    with atomic_dir(out, f"the converted base {out}") as tmp:  # clears what a killed conversion left
        started = time.time()
        _write_folder(src, tmp, dtype, log)
        provenance = {
            "format": 1,
            "source_file": src.name,
            "source_sha256": digest,
            "source_bytes": src.stat().st_size,
            "gguf": facts,
            "dtype": dtype,
            "converted_with": _versions(),
            "converted_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            **(extra_provenance or {}),
        }
        (tmp / PROVENANCE_FILE).write_text(json.dumps(provenance, indent=2) + "\n", encoding="utf-8")
    log(f"converted {src.name} -> {out} ({dtype}, {time.time() - started:.0f} s)")
    return out


def _write_folder(src: Path, folder: Path, dtype: str, log: Callable[[str], None]) -> None:
    """Load the GGUF through transformers (dequantizing), clear the quantized mark, save everything."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    log(f"loading {src.name} (dequantizing every tensor; a 0.5B model takes about a minute on 2 cores)")
    kwargs = {"gguf_file": src.name, "trust_remote_code": False}
    model = AutoModelForCausalLM.from_pretrained(str(src.parent), dtype=getattr(torch, dtype), **kwargs)
    tokenizer = AutoTokenizer.from_pretrained(str(src.parent), **kwargs)
    # The weights are plain tensors now; only the bookkeeping still says "gguf-quantized".
    model.hf_quantizer = None
    model.is_quantized = False
    for holder in (model.config, ):
        if hasattr(holder, "quantization_config"):
            delattr(holder, "quantization_config")
    model.config.name_or_path = ""
    model.config._name_or_path = ""
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(str(folder), safe_serialization=True)
    tokenizer.save_pretrained(str(folder))
    if not tokenizer.chat_template:
        log("warning: the GGUF carries no chat template; stage-2 prompts fall back to plain text")


def _versions() -> dict[str, str]:
    import transformers

    from .. import __version__

    gguf = require_gguf()
    return {"acre_train": __version__, "transformers": transformers.__version__,
            "gguf": getattr(gguf, "__version__", "?")}
